"""Backlog fan-out without AWS: each started drain is a process on this machine.

Two ways in, one way out:

* ``ProcessDrainStarter`` is the ``DrainStarterPort`` of ``infrai-jobs drain``: each start runs
  ``infrai-jobs drain --fan-out-slot ID`` with the parent's endpoints, so the children drain the
  same queue into the same ledger.
* ``LocalLambda`` answers Lambda's ``Invoke`` API on loopback for ``infrai-jobs invoke`` (and the
  chaos soak): the deployed handler's own ``LambdaDrainStarter`` (boto3) calls it, pointed there
  by ``AWS_ENDPOINT_URL_LAMBDA``, and each ``Event`` invoke runs a command, such as
  ``infrai-jobs invoke DrainFunction --event <that event>``. It enforces a reserved concurrency
  the way Lambda does, with ``429 TooManyRequestsException``.

Both keep their children (``DrainProcesses``), and ``wait()`` outlives them: the emulator and the
embedded database a local parent started must not stop under its children.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import IO, Any

from infrai_jobs.errors import FanOutError

# How a child runs the CLI: this interpreter, this package, no console script needed.
CLI = [sys.executable, "-c", "import sys; from infrai_local.cli import main; sys.exit(main())"]


@dataclass
class _Child:
    process: subprocess.Popen[bytes]
    output: IO[bytes]
    label: str


class DrainProcesses:
    """Child processes started for a fan-out, waited for together.

    Each child's stdout is kept (a temporary file, or ``fan-out-NNNN.out`` in ``keep_in``, with
    its stderr beside it as ``.err``); with ``log``, its output is copied there once it ended.
    """

    def __init__(self, *, log: IO[str] | None = None, keep_in: Path | None = None) -> None:
        self._children: list[_Child] = []
        self._lock = threading.Lock()
        self._log = log
        self._keep_in = keep_in
        self.started = 0

    def running(self) -> int:
        with self._lock:
            return sum(1 for child in self._children if child.process.poll() is None)

    def start(
        self,
        command: Sequence[str],
        *,
        env: Mapping[str, str],
        cwd: Path | None = None,
        label: str = "",
    ) -> None:
        with self._lock:
            self.started += 1
            number = self.started
        errors: IO[bytes] | None = None
        if self._keep_in is not None:
            output: IO[bytes] = (self._keep_in / f"fan-out-{number:04d}.out").open("w+b")
            errors = (self._keep_in / f"fan-out-{number:04d}.err").open("wb")
        else:
            output = tempfile.TemporaryFile()  # noqa: SIM115 - closed once the child is read
        try:
            process = subprocess.Popen(  # noqa: S603 - our own interpreter and arguments
                list(command),
                env=dict(env),
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=errors or (None if self._log is None else subprocess.STDOUT),
            )
        except OSError as exc:
            output.close()
            raise FanOutError(f"could not start a drain process: {exc}") from exc
        finally:
            if errors is not None:
                errors.close()
        with self._lock:
            self._children.append(_Child(process, output, label))

    def wait(self, timeout: float | None = None) -> list[str]:
        """Wait for every child (those started meanwhile too); their stdout, in start order."""
        deadline = None if timeout is None else time.monotonic() + timeout
        outputs: list[str] = []
        done = 0
        while True:
            with self._lock:
                pending = self._children[done:]
            if not pending:
                return outputs
            for child in pending:
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    child.process.wait(timeout=remaining)
                except subprocess.TimeoutExpired:
                    child.process.kill()
                    child.process.wait()
                child.output.seek(0)
                text = child.output.read().decode("utf-8", "replace")
                child.output.close()
                if self._log is not None and text:
                    self._log.write(text)
                outputs.append(text)
                done += 1


class ProcessDrainStarter:
    """``DrainStarterPort`` of the CLI: one ``infrai-jobs drain`` process per started drain."""

    def __init__(
        self,
        env: Mapping[str, str],
        *,
        time_budget_seconds: float,
        jobs_path: str | None = None,
        cwd: Path | None = None,
    ) -> None:
        self._env = dict(env)
        self._time_budget = time_budget_seconds
        self._jobs_path = jobs_path
        self._cwd = cwd
        self._processes = DrainProcesses()

    def start(self, event: Mapping[str, Any]) -> None:
        from infrai_jobs.drain.fan_out import fan_out_slot  # noqa: PLC0415

        slot = fan_out_slot(event)
        if slot is None:
            raise FanOutError("a fan-out event without a slot")
        self._processes.start(
            [
                *CLI,
                "drain",
                "--fan-out-slot",
                slot,
                "--time-budget-seconds",
                repr(self._time_budget),
                # The parent's own jobs package: a child imports what the parent imported.
                *(["--jobs-path", self._jobs_path] if self._jobs_path else []),
            ],
            env=self._env,
            cwd=self._cwd,
            label=slot,
        )

    def wait(self) -> list[dict[str, Any]]:
        """Every child's summary (the last JSON line it printed), once all have finished."""
        summaries = []
        for text in self._processes.wait():
            summary = _last_json_line(text)
            summaries.append(summary if summary is not None else {"error": text[-2000:]})
        return summaries


def _last_json_line(text: str) -> dict[str, Any] | None:
    for line in reversed(text.splitlines()):
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return None


# --- Lambda's Invoke API on loopback ----------------------------------------------------------

Launch = Callable[[bytes], Sequence[str]]


class LocalLambda:
    """Lambda's ``Invoke`` (``InvocationType=Event``) for one function, on 127.0.0.1.

    ``launch(payload)`` gives the command that runs one invocation with that event; it runs with
    ``env``. At most ``reserved_concurrency`` run at once: one more is refused with 429
    ``TooManyRequestsException``, as Lambda refuses beyond a function's reserved concurrency.
    """

    def __init__(
        self,
        function_name: str,
        launch: Launch,
        *,
        env: Mapping[str, str],
        reserved_concurrency: int,
        cwd: Path | None = None,
        log: IO[str] | None = None,
        keep_in: Path | None = None,
    ) -> None:
        self.function_name = function_name
        self.reserved_concurrency = reserved_concurrency
        self.invocations = 0
        self.throttled = 0
        self._launch = launch
        self._given = dict(env)
        self._env = dict(env)
        self._cwd = cwd
        self._processes = DrainProcesses(log=log, keep_in=keep_in)
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._lock = threading.Lock()
        self._stopped = False
        # What an invocation starts in turn comes back here too, never to a real Lambda.
        self._env.update(self.client_env())

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> LocalLambda:
        self._thread.start()
        return self

    def client_env(self) -> dict[str, str]:
        """What a process sets so that boto3's Lambda client calls this endpoint.

        Credentials and a region only where the environment it was given has none: botocore
        signs every call and needs something to sign with, but a user's own credentials (for
        the other AWS services a function calls) are never replaced."""
        given = self._given
        stand_ins: dict[str, str] = {}
        if not (given.get("AWS_ACCESS_KEY_ID") or given.get("AWS_PROFILE")):
            stand_ins["AWS_ACCESS_KEY_ID"] = "local"
            stand_ins["AWS_SECRET_ACCESS_KEY"] = "local"  # noqa: S105 - a loopback stand-in
        if not (given.get("AWS_REGION") or given.get("AWS_DEFAULT_REGION")):
            stand_ins["AWS_REGION"] = stand_ins["AWS_DEFAULT_REGION"] = "us-east-1"
        return {"AWS_ENDPOINT_URL_LAMBDA": self.url, **stand_ins}

    def stop(self, timeout: float | None = None) -> list[str]:
        """Wait for every invocation started (and those they start), then stop serving.

        Once stopped, calling it again does nothing."""
        if self._stopped:
            return []
        try:
            return self._processes.wait(timeout)
        finally:
            self._stopped = True
            self._server.shutdown()
            self._server.server_close()

    def invoke(self, function_name: str, invocation_type: str, payload: bytes) -> tuple[int, Any]:
        """Lambda's answer to one Invoke call: (status, body)."""
        if function_name.rsplit(":", 1)[-1] != self.function_name:
            return 404, _error("ResourceNotFoundException", f"Function not found: {function_name}")
        if invocation_type != "Event":
            return 400, _error("InvalidParameterValueException", "only Event invokes are served")
        with self._lock:
            if self._processes.running() >= self.reserved_concurrency:
                self.throttled += 1
                return 429, _error("TooManyRequestsException", "Rate Exceeded.")
            self.invocations += 1
            try:
                self._processes.start(self._launch(payload), env=self._env, cwd=self._cwd)
            except FanOutError as exc:
                return 500, _error("ServiceException", str(exc))
        return 202, None


def _error(code: str, message: str) -> dict[str, str]:
    return {"__type": code, "Type": "User", "message": message}


def _handler_for(endpoint: LocalLambda) -> type[BaseHTTPRequestHandler]:
    prefix = "/2015-03-31/functions/"
    suffix = "/invocations"

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            path = self.path.split("?", 1)[0]
            if not (path.startswith(prefix) and path.endswith(suffix)):
                self._answer(404, _error("UnknownOperationException", path))
                return
            name = path[len(prefix) : -len(suffix)]
            length = int(self.headers.get("Content-Length") or 0)
            payload = self.rfile.read(length)
            kind = self.headers.get("X-Amz-Invocation-Type", "RequestResponse")
            status, body = endpoint.invoke(name, kind, payload)
            self._answer(status, body)

        def _answer(self, status: int, body: Any) -> None:
            data = b"" if body is None else json.dumps(body).encode()
            self.send_response(status)
            if isinstance(body, dict) and "__type" in body:
                self.send_header("x-amzn-ErrorType", body["__type"])
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            return

    return Handler
