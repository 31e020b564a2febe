"""The "Try it locally" block of docs/development.md, run as written, in bash, from the project
root (the README points there).

Only what a shared machine forces is changed: the ports (another run may hold 8765 and 8766,
so events/env.json is copied with the port moved too) and the URL file's place.
"""

from __future__ import annotations

import re
import socket
from pathlib import Path

from child_process import clean_env, run_captured

from infrai_local.sandbox.provider_sink import sink_settings

ROOT = Path(__file__).resolve().parents[2]
WALKTHROUGH_DOC = ROOT / "docs" / "development.md"


def walkthrough() -> str:
    section = WALKTHROUGH_DOC.read_text().split("\n## Try it locally\n", 1)[1]
    return section.split("```sh\n", 1)[1].split("```", 1)[0]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def test_every_command_of_the_walkthrough_uses_the_virtualenv() -> None:
    # Given the walkthrough's command lines
    commands = [
        line.strip()
        for line in walkthrough().splitlines()
        if "infrai-jobs" in line and not line.lstrip().startswith("#")
    ]
    # Then each runs the virtualenv's CLI, so it works without activating anything
    assert commands
    assert all(re.match(r"^\.venv/bin/infrai-jobs ", command) for command in commands), commands


def test_the_readme_walkthrough_runs_as_written(tmp_path: Path) -> None:
    # Given the walkthrough with its ports and URL file moved apart
    emulator_port, sink_port = free_port(), free_port()
    env_vars = tmp_path / "env.json"
    env_vars.write_text(
        (ROOT / "events" / "env.json").read_text().replace("8765", str(emulator_port))
    )
    script = (
        walkthrough()
        .replace("8765", str(emulator_port))
        .replace("8766", str(sink_port))
        .replace(".local/pg-url", str(tmp_path / "pg-url"))
        .replace("events/env.json", str(env_vars))
    )
    # And every setting the team's jobs declare pointed at the walkthrough's provider sink, as
    # the walkthrough does for the example jobs' (a job the team added must not turn it red)
    env = {**clean_env(), **sink_settings(f"http://127.0.0.1:{sink_port}")}
    # When bash runs it, stopping the background stand-ins at the end
    stop_stand_ins = "set -euo pipefail\ntrap 'kill $(jobs -p) 2>/dev/null; wait' EXIT\n"
    finished = run_captured(["bash", "-c", stop_stand_ins + script], env=env, cwd=ROOT, timeout=280)
    output = finished.stdout + finished.stderr
    # Then every command succeeded, with no traceback
    assert finished.returncode == 0, output
    assert "Traceback" not in output
    # And the story happened: migrate made the invoice job's table, the retry finalized once, one
    # e-mail went to the sink, the poison message walked to the DLQ and, after the fix and the
    # redrive, is done
    assert "applied jobs 0001: invoice_invoices" in finished.stdout
    assert "invoices: draft invoice(s) inv_8812" in finished.stdout
    assert "1 done, 1 duplicate(s)" in finished.stderr
    assert '"mail_effects": 1' in finished.stdout
    assert re.search(r"dlq_count\s+1", finished.stdout)
    assert re.search(r"idem_key\s+invoice\.finalize:inv_9999", finished.stdout)
    assert re.search(r"state\s+done", finished.stdout.rsplit("idem_key", 1)[1])
