"""What DrainFunction (``infrai-jobs invoke``) logs about the jobs it drains: every JSON log line
about a message published with ``infrai-jobs publish`` carries the correlation id ``publish``
printed, and every line still carries the invocation's own ``correlation_id``; the line about a
message whose handler raised carries the exception's traceback in Powertools' ``exception``
field, so on-call finds the file and line without the team's own logging."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from child_process import LineSink, clean_env, run_captured

from infrai_jobs.queue.client import InfraiClient
from infrai_local.sandbox.invoke import invoke, resolve

ROOT = Path(__file__).resolve().parents[2]
EVENTS = ROOT / "events"
INFRAI_JOBS = str(Path(sys.executable).parent / "infrai-jobs")
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


def publish(services: dict[str, str], body: dict[str, object], *args: str) -> tuple[list[str], str]:
    """``infrai-jobs publish`` in a child process: the message ids and the correlation id."""
    finished = run_captured(
        [INFRAI_JOBS, "publish", *args, json.dumps(body)],
        env=clean_env(**services, INFRAI_QUEUE="billing-jobs"),
        cwd=ROOT,
    )
    assert finished.returncode == 0, finished.stderr
    (line,) = [x for x in finished.stderr.splitlines() if x.startswith("correlation_id ")]
    return finished.stdout.split(), line.removeprefix("correlation_id ")


def drain_function_logs(
    services: dict[str, str], project: Path
) -> tuple[dict[str, object], list[dict[str, object]]]:
    """DrainFunction invoked with the schedule event: its summary and its JSON log records."""
    spec = resolve("DrainFunction", root=project, env_vars=EVENTS / "env.json")
    logs = LineSink()
    result = invoke(spec, EVENTS / "drain-schedule.json", log_stream=logs, extra_env=services)
    assert result.ok, result.payload
    return result.payload, [json.loads(line) for line in logs.lines if line.startswith("{")]


@pytest.mark.usefixtures("billing_queue")
def test_every_drain_log_line_about_a_published_job_carries_its_correlation_id(
    services: dict[str, str], project: Path
) -> None:
    # Given the notes' job published twice by `publish` (one correlation id for both), and
    # another job whose producer sent a W3C traceparent
    notes = {"job": "invoice.finalize", "invoice_id": "inv_8812", "amount_cents": 4900}
    retried, correlation_id = publish(services, notes, "--count", "2")
    traced_body = {
        "job": "invoice.finalize",
        "invoice_id": "inv_9000",
        "amount_cents": 100,
        "_traceparent": f"00-{TRACE_ID}-00f067aa0ba902b7-01",
    }
    (traced,), traced_id = publish(services, traced_body)
    assert traced_id == TRACE_ID
    # When DrainFunction is invoked with the schedule event
    summary, records = drain_function_logs(services, project)
    assert summary["done"] == 2
    log_lines = [r for r in records if "level" in r and "message" in r]
    # Then every line about the notes' messages carries publish's correlation id
    about = [r for r in log_lines if r.get("message_id") in retried]
    assert {r["action"] for r in about} >= {"done"}
    assert len(about) == 2
    assert {r.get("message_correlation_id") for r in about} == {correlation_id}
    # And the traced message's lines carry its trace id
    about_traced = [r for r in log_lines if r.get("message_id") == traced]
    assert about_traced
    for record in about_traced:
        assert record["message_correlation_id"] == TRACE_ID
        assert record["message_trace_id"] == TRACE_ID
    # And every line, these included, still carries the invocation's own correlation id
    event_id = json.loads((EVENTS / "drain-schedule.json").read_text())["id"]
    assert {r.get("correlation_id") for r in log_lines} == {event_id}


def test_the_log_line_of_a_message_whose_handler_raised_carries_its_traceback(
    services: dict[str, str], billing_queue: InfraiClient, project: Path
) -> None:
    # Given a job for an invoice nobody created: its handler raises LookupError
    missing = {"job": "invoice.finalize", "invoice_id": "inv_nowhere", "amount_cents": 100}
    message_id = billing_queue.publish("billing-jobs", missing)
    # When DrainFunction is invoked with the schedule event
    summary, records = drain_function_logs(services, project)
    assert summary["retried"] == 1
    # Then the one line about the message is its retry, its detail the exception in a line
    (line,) = [r for r in records if r.get("message_id") == message_id]
    assert line["action"] == "retry"
    assert line["idem_key"] == "invoice.finalize:inv_nowhere"
    assert line["detail"] == "LookupError: invoice inv_nowhere does not exist"
    # And it carries the traceback, down to the handler's own line
    assert line["exception_name"] == "LookupError"
    trace = str(line["exception"])
    assert trace.startswith("Traceback (most recent call last):")
    assert 'billing.py", line' in trace
    assert "in mark_final" in trace
    assert trace.rstrip().endswith("LookupError: invoice inv_nowhere does not exist")
