"""One warm DrainFunction execution environment, as a process the soak can SIGKILL.

It runs the deployed handler (``infrai_jobs.handlers.drain``: Powertools Logger and Metrics, the
cached ``DrainService``) invocation after invocation, each with a Lambda-like context whose
remaining time counts down, the way EventBridge ticks reach a warm function. The only addition is
the soak's ``soak.db`` job in the function's registry.

Settings come from the function's own environment variables (``INFRAI_BASE_URL``,
``INFRAI_API_KEY``, ``DATABASE_URL``, the jobs' settings such as ``MAIL_PROVIDER_URL``,
``DRAIN_BATCH_BUDGET_MS``, ``LEASE_GRACE_SECONDS``, ``POWERTOOLS_*``) plus:

* ``SOAK_INVOCATION_SECONDS``: the context's time budget per invocation;
* ``SOAK_KILL_AT_ACK``: SIGKILL this process just before its N-th ack, that is after the ledger
  committed and before Infrai heard about it (0: never); not before the file named by
  ``SOAK_KILL_GATE`` exists (then just before the first ack after it appeared): the soak
  creates it when its chaos begins;
* ``SOAK_IDLE_SECONDS``: the pause after an invocation that received nothing (the queue was
  empty, or the drains alive were at the cap);
* ``SOAK_DIE_IN_CALL``: when ``1``, an external job whose payload carries ``soak_die``
  (``after_call``: once the provider has the request; ``before_call``: before it is sent) kills
  this process inside its downstream call, the way a crash or a timeout cuts a call off.

A ``digest.build`` payload carrying ``soak_refuse`` meets a provider that refuses it (see
``soak_jobs.provider_refuses``): the call answers as the digest provider does when it is down,
a transient failure with nothing built, so its retry policy (``JOB_POLICIES``) defers it.

``drain_worker.py --once EVENT_FILE`` is an invocation a backlog fan-out started (the soak's
loopback Lambda runs it): one invocation with that event, then the process ends, as a cold
environment Lambda starts for an async invoke.

Each invocation ends with one JSON line on stdout, ``{"soak_event": "invocation", ...}``, which
the soak adds up; an invocation that raised prints what Lambda's runtime would log. Each consume
that received messages prints ``{"soak_event": "received", "asked": n, "got": k}`` (a batch, or
one message at a time after a lost answer).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from soak_jobs import provider_refuses, register_soak_jobs

import jobs  # the fixture code root's jobs package (first on the path: soak.py)
from infrai_jobs.jobs.registry import (
    Effect,
    Handler,
    JobContext,
    JobDefinition,
    JobRegistry,
    Payload,
)
from infrai_jobs.queue.models import Pending

ROOT = Path(__file__).resolve().parents[2]
SCHEDULE_EVENT = ROOT / "events" / "drain-schedule.json"


class CountdownContext:
    """The part of Lambda's context the handler and Powertools read."""

    function_name = "infrai-jobs-drain"
    function_version = "$LATEST"
    invoked_function_arn = "arn:aws:lambda:us-east-1:123456789012:function:infrai-jobs-drain"
    memory_limit_in_mb = 512
    log_group_name = "/aws/lambda/infrai-jobs-drain"
    log_stream_name = "soak"

    def __init__(self, seconds: float) -> None:
        self.aws_request_id = str(uuid.uuid4())
        self._deadline = time.time() + seconds

    def get_remaining_time_in_millis(self) -> int:
        return max(0, int((self._deadline - time.time()) * 1000))


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"soak_event": event, "pid": os.getpid(), **fields}), flush=True)


def arm_kill_at_ack(service: Any, ack_number: int, gate: Path | None = None) -> None:
    """Replace the client's ack so the process dies just before sending its ``ack_number``-th,
    or the first one once ``gate`` exists if that comes later."""
    original: Callable[[str, str], Pending[None]] = service.queue.send_ack
    lock = threading.Lock()
    count = [0]

    def send_ack(queue: str, receipt_handle: str) -> Pending[None]:
        with lock:
            count[0] += 1
            reached = count[0] >= ack_number and (gate is None or gate.exists())
        if reached:
            emit("self_kill", ack_number=ack_number)
            os.kill(os.getpid(), signal.SIGKILL)
        return original(queue, receipt_handle)

    service.queue.send_ack = send_ack


def invoke_once(app: Any, event: Any, seconds: float) -> int:
    emit("ready", kill_at_ack=0, fan_out=True)
    try:
        summary = app.lambda_handler(event, CountdownContext(seconds))
    except Exception as exc:
        print(f"[ERROR] {type(exc).__name__}: {exc}", file=sys.stderr)
        traceback.print_exc(file=sys.stderr)
        emit("invocation_error", error_type=type(exc).__name__, error=str(exc))
        return 0
    emit("invocation", summary=summary, fan_out=True)
    return 0


def trace_receives(service: Any) -> None:
    """Wrap the client's consumes so each one that received messages says how many it asked for
    and got: the soak counts how much of the run was received in batches."""
    queue = service.queue
    consume = queue.consume
    send_consume = queue.send_consume

    def received(asked: int, messages: list[Any]) -> list[Any]:
        if messages:
            emit("received", asked=asked, got=len(messages))
        return messages

    def traced_consume(name: str, max_messages: int = 10) -> list[Any]:
        return received(max_messages, consume(name, max_messages))

    def traced_send_consume(name: str, max_messages: int = 10) -> Pending[list[Any]]:
        pending = send_consume(name, max_messages)
        return Pending(
            lambda: received(max_messages, pending.wait()),
            lambda: received(max_messages, pending.wait(retry=False)),
        )

    queue.consume = traced_consume
    queue.send_consume = traced_send_consume


def refusing_digests(registry: JobRegistry) -> JobRegistry:
    """The same jobs, except that the digest provider refuses the calls a ``soak_refuse``
    payload asks it to (an outage for those jobs; every other call reaches the sink)."""
    refusing = JobRegistry()
    for definition in registry:
        if definition.name == "digest.build":
            refusing.register(dataclasses.replace(definition, handler=_refuses(definition)))
        else:
            refusing.register(definition)
    return refusing


def _refuses(definition: JobDefinition) -> Handler:
    call = definition.handler

    def handler(payload: Payload, ctx: JobContext) -> Any:
        if provider_refuses(payload, ctx.delivery_count):
            emit("provider_refused", job=definition.name, idem_key=ctx.idem_key)
            raise RuntimeError("digest provider answered HTTP 503; will retry")
        return call(payload, ctx)

    return handler


def dying_in_calls(registry: JobRegistry) -> JobRegistry:
    """The same jobs, except that an external job whose payload says ``soak_die`` SIGKILLs this
    process inside its call: its claim stays ``running`` behind an owner that is gone."""
    dying = JobRegistry()
    for definition in registry:
        if definition.effect is Effect.DATABASE:
            dying.register(definition)
        else:
            dying.register(dataclasses.replace(definition, handler=_dies(definition)))
    return dying


def _dies(definition: JobDefinition) -> Handler:
    call = definition.handler

    def handler(payload: Payload, ctx: JobContext) -> Any:
        where = payload.get("soak_die")
        if where not in ("before_call", "after_call"):
            return call(payload, ctx)
        if where == "after_call":
            call(payload, ctx)  # the provider has it; the answer is never read
        emit(
            "die_in_call",
            job=definition.name,
            idem_key=ctx.idem_key,
            where=where,
            delivery=ctx.delivery_count,
        )
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("unreachable: SIGKILL cannot be caught")

    return handler


def main() -> int:
    deployed_registry = jobs.build_registry
    die_in_calls = os.environ.get("SOAK_DIE_IN_CALL", "") == "1"

    def build_registry() -> Any:
        registry = refusing_digests(register_soak_jobs(deployed_registry()))
        return dying_in_calls(registry) if die_in_calls else registry

    # Before app is imported: the handler module binds jobs.build_registry at import.
    jobs.build_registry = build_registry
    from infrai_jobs.handlers import drain as app  # noqa: PLC0415 - only now: it binds jobs.build_registry when imported

    invocation_seconds = float(os.environ["SOAK_INVOCATION_SECONDS"])
    idle_seconds = float(os.environ.get("SOAK_IDLE_SECONDS", "0.2"))
    kill_at_ack = int(os.environ.get("SOAK_KILL_AT_ACK", "0"))
    trace_receives(app.service())
    if sys.argv[1:2] == ["--once"]:
        return invoke_once(app, json.loads(Path(sys.argv[2]).read_text()), invocation_seconds)
    event = json.loads(SCHEDULE_EVENT.read_text())
    if kill_at_ack:
        gate = os.environ.get("SOAK_KILL_GATE")
        arm_kill_at_ack(app.service(), kill_at_ack, Path(gate) if gate else None)
    emit("ready", kill_at_ack=kill_at_ack)
    parent = os.getppid()
    # An orphan (the soak itself was killed) stops instead of polling a dead emulator forever.
    while os.getppid() == parent:
        context = CountdownContext(invocation_seconds)
        try:
            summary = app.lambda_handler(event, context)
        except Exception as exc:
            # What Lambda's runtime logs for a failed invocation: type, message, stack.
            print(f"[ERROR] {type(exc).__name__}: {exc}", file=sys.stderr)
            traceback.print_exc(file=sys.stderr)
            emit("invocation_error", error_type=type(exc).__name__, error=str(exc))
            time.sleep(idle_seconds)
            continue
        emit("invocation", summary=summary)
        # An empty queue, or a fleet at its cap: the next tick comes a little later.
        if summary.get("consumed", 0) == 0:
            time.sleep(idle_seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
