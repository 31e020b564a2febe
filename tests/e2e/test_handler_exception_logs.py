"""A handler that raises, drained by DrainFunction (``infrai-jobs invoke``): the JSON log line
about its message says why, with the exception's traceback in Powertools' ``exception`` field,
so on-call finds the file and line without the team's own logging."""

from __future__ import annotations

import json
from pathlib import Path

from child_process import LineSink

from infrai_jobs.queue.client import InfraiClient
from infrai_local.sandbox.invoke import invoke, resolve

ROOT = Path(__file__).resolve().parents[2]
EVENTS = ROOT / "events"


def test_the_log_line_of_a_message_whose_handler_raised_carries_its_traceback(
    services: dict[str, str], billing_queue: InfraiClient, project: Path
) -> None:
    # Given a job for an invoice nobody created: its handler raises LookupError
    missing = {"job": "invoice.finalize", "invoice_id": "inv_nowhere", "amount_cents": 100}
    message_id = billing_queue.publish("billing-jobs", missing)
    # When DrainFunction is invoked with the schedule event
    spec = resolve("DrainFunction", root=project, env_vars=EVENTS / "env.json")
    logs = LineSink()
    result = invoke(spec, EVENTS / "drain-schedule.json", log_stream=logs, extra_env=services)
    assert result.ok, result.payload
    assert result.payload["retried"] == 1
    records = [json.loads(line) for line in logs.lines if line.startswith("{")]
    # Then the one line about the message is its retry, its detail the exception in a line
    (line,) = [r for r in records if r.get("message_id") == message_id]
    assert line["action"] == "retry"
    assert line["idem_key"] == "invoice.finalize:inv_nowhere"
    assert line["detail"] == "LookupError: invoice inv_nowhere does not exist"
    # And it carries the traceback, down to the handler's own line
    assert line["exception_name"] == "LookupError"
    trace = line["exception"]
    assert trace.startswith("Traceback (most recent call last):")
    assert 'billing.py", line' in trace
    assert "in mark_final" in trace
    assert trace.rstrip().endswith("LookupError: invoice inv_nowhere does not exist")
