"""Running a command as the tests watch one: in a child process, its output captured as text,
under a timeout, its exit code left for the test to judge. Importable from every test folder
(pytest puts ``tests/`` on the path for its ``conftest.py``)."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# The variables a child needs to run at all; nothing that names an endpoint or a credential.
_KEPT = ("PATH", "HOME", "LANG", "TMPDIR")


def clean_env(**variables: str) -> dict[str, str]:
    """An environment with only ``PATH``, ``HOME``, ``LANG`` and ``TMPDIR`` of this one, and
    ``variables``: no endpoint or key leaks in from the shell running the tests."""
    env = {name: os.environ[name] for name in _KEPT if name in os.environ}
    env.update(variables)
    return env


def run_captured(
    argv: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    cwd: Path | str | None = None,
    timeout: float = 120,
    stdin_text: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """``argv`` run to its end (or the timeout), given ``stdin_text`` on its standard input,
    stdout and stderr captured as text."""
    return subprocess.run(
        list(argv),
        cwd=cwd,
        env=env,
        input=stdin_text,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def stop_process(
    process: subprocess.Popen[Any], *, sig: signal.Signals = signal.SIGTERM, timeout: float = 10
) -> None:
    """Send ``sig`` to ``process`` if it is still running, give it ``timeout`` seconds to end,
    then kill it: no child a test started outlives it."""
    if process.poll() is None:
        process.send_signal(sig)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class LineSink:
    """A text stream that keeps what a child writes to it (``invoke``'s log lines), one
    ``write`` a line, for the test to read back."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def write(self, text: str) -> int:
        self.lines.append(text)
        return len(text)

    def flush(self) -> None:
        return
