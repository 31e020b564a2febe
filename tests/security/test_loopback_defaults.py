"""The local stand-ins (the emulator, the provider sink) listen on loopback unless told otherwise.

The emulator accepts any bearer token by default and its control surface has no auth at all
(clock, faults, reset): reachable from the network, anyone could read or reset a developer's
queues.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest
from child_process import stop_process

from infrai_local.sandbox import emulator, provider_sink

BIN = Path(sys.executable).parent


def test_the_emulator_command_line_defaults_to_loopback() -> None:
    # Given the emulator's command line, with no --host
    args = emulator.build_parser().parse_args([])
    # Then it serves 127.0.0.1
    assert args.host == "127.0.0.1"
    assert emulator.DEFAULT_HOST == "127.0.0.1"


@contextmanager
def serving(command: list[str]) -> Iterator[tuple[str, int]]:
    """Start a local server with port 0; yield the URL it printed and its pid; stop it."""
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:
        assert process.stdout is not None
        yield process.stdout.readline().strip(), process.pid
    finally:
        stop_process(process)
        if process.stdout is not None:
            process.stdout.close()


def listening_addresses(pid: int) -> set[str]:
    return {
        connection.laddr.ip
        for connection in psutil.Process(pid).net_connections(kind="inet")
        if connection.status == psutil.CONN_LISTEN
    }


@pytest.mark.parametrize(
    "command",
    [
        [str(BIN / "infrai-jobs"), "emulator", "--port", "0"],
        [sys.executable, "-m", "infrai_local.sandbox.emulator", "--port", "0"],
        [sys.executable, "-m", "infrai_local.sandbox.provider_sink"],
    ],
    ids=["infrai-jobs emulator", "python -m infrai_local.sandbox.emulator", "provider sink"],
)
def test_a_local_server_started_without_a_host_listens_only_on_loopback(
    command: list[str],
) -> None:
    # Given a local server started with its defaults
    with serving(command) as (url, pid):
        # When its socket is inspected
        addresses = listening_addresses(pid)
    # Then it announced and bound 127.0.0.1, nothing wider
    assert url.startswith("http://127.0.0.1:")
    assert addresses == {"127.0.0.1"}


def test_the_in_process_servers_default_to_loopback() -> None:
    # Given the emulator and the sink started in-process with their defaults
    running = emulator.start_in_thread()
    sink = provider_sink.start_in_thread()
    try:
        # Then both are on loopback
        assert running.host == "127.0.0.1"
        assert sink.url.startswith("http://127.0.0.1:")
    finally:
        running.stop()
        sink.stop()


def _announcement(command: list[str]) -> str:
    """What an emulator started with ``command`` (port 0) says on stderr as it starts."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        assert process.stdout.readline().startswith("http://")
    finally:
        process.send_signal(signal.SIGTERM)
        _out, err = process.communicate(timeout=10)
    return err


@pytest.mark.parametrize(
    ("extra", "warned"),
    [
        (["--host", "0.0.0.0"], True),  # every interface, any token
        (["--host", "0.0.0.0", "--api-key", "one-token"], False),  # every interface, one token
        (["--host", "127.0.0.1"], False),  # loopback only
    ],
)
def test_the_emulator_warns_loudly_when_it_listens_beyond_loopback_taking_any_token(
    extra: list[str], warned: bool
) -> None:
    # Given the emulator started on a host, with or without --api-key
    # When it starts
    err = _announcement([str(BIN / "infrai-jobs"), "emulator", "--port", "0", *extra])
    # Then it warns on stderr exactly when it is reachable beyond loopback and takes any token
    warnings = [line for line in err.splitlines() if line.startswith("WARNING:")]
    if warned:
        (line,) = warnings
        assert "beyond loopback" in line
        assert "ANY bearer token" in line
        assert "--api-key" in line
    else:
        assert warnings == []
