"""A producer's correlation id follows its message through the drain: every log line about the
message, the handler's context, the tracing span; ``publish`` sets one and prints it."""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from child_process import run_captured
from drainkit import QUEUE, Harness, child_env, harness, run_cli
from notes_example import NOTES_PAYLOAD

from infrai_jobs.errors import InvalidPayload
from infrai_jobs.jobs.correlation import CORRELATION_FIELD, TRACEPARENT_FIELD
from infrai_jobs.jobs.registry import Effect, JobContext, JsonValue, Payload
from infrai_jobs.queue.producer import publish_checked
from infrai_jobs.runtime.observability import MessageTracing

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


@pytest.fixture
def kit(database_url: str) -> Iterator[Harness]:
    with harness(database_url) as h:
        seen: dict[str, tuple[str | None, str | None]] = {}

        @h.registry.job("test.corr", effect=Effect.EXTERNAL_IDEMPOTENT, identity=("id",))
        def remember(payload: Payload, ctx: JobContext) -> JsonValue:
            seen[payload["id"]] = (ctx.correlation_id, ctx.traceparent)
            if payload.get("mode") == "transient":
                raise RuntimeError("simulated transient failure")
            return {"id": payload["id"]}

        h.seen = seen  # type: ignore[attr-defined]
        yield h


def seen(kit: Harness) -> dict[str, tuple[str | None, str | None]]:
    return kit.seen  # type: ignore[attr-defined,no-any-return]


def lines_about(caplog: pytest.LogCaptureFixture, message_id: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "message_id", None) == message_id]


def test_every_line_about_a_message_carries_its_producers_correlation_id(
    kit: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    # Given one work published twice with a correlation id (a producer's retry), one without,
    # and one that fails transiently
    first, second = kit.publish({"job": "test.corr", "id": "a", CORRELATION_FIELD: "order-7431"}, 2)
    (plain,) = kit.publish({"job": "test.corr", "id": "b"})
    (failing,) = kit.publish(
        {"job": "test.corr", "id": "c", "mode": "transient", CORRELATION_FIELD: "order-9"}
    )
    # When the drain runs
    with caplog.at_level(logging.INFO, logger="infrai_jobs"):
        summary = kit.drain()
    # Then each message's outcome line, and its copy's, carries the producer's id
    assert summary.outcomes == {"done": 2, "duplicate_in_flight": 1, "retry": 1}
    for message_id, expected in (
        (first, "order-7431"),
        (second, "order-7431"),
        (failing, "order-9"),
    ):
        lines = lines_about(caplog, message_id)
        assert lines, message_id
        assert {getattr(r, "message_correlation_id", None) for r in lines} == {expected}
    assert {r.action for r in lines_about(caplog, failing)} == {"retry"}  # type: ignore[attr-defined]
    # And the message without one has no such field
    assert lines_about(caplog, plain)
    assert all(not hasattr(r, "message_correlation_id") for r in lines_about(caplog, plain))
    # And the handler was handed it, to pass downstream
    assert seen(kit) == {"a": ("order-7431", None), "b": (None, None), "c": ("order-9", None)}


def test_a_traceparent_gives_the_lines_its_trace_id(
    kit: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a message carrying a W3C traceparent only
    (message_id,) = kit.publish({"job": "test.corr", "id": "t", TRACEPARENT_FIELD: TRACEPARENT})
    # When the drain runs
    with caplog.at_level(logging.INFO, logger="infrai_jobs"):
        summary = kit.drain()
    # Then its lines carry the trace id as its correlation id and as its trace id
    assert summary.outcomes == {"done": 1}
    (done,) = lines_about(caplog, message_id)
    assert done.message_correlation_id == TRACE_ID  # type: ignore[attr-defined]
    assert done.message_trace_id == TRACE_ID  # type: ignore[attr-defined]
    assert seen(kit) == {"t": (TRACE_ID, TRACEPARENT)}


HOSTILE: list[tuple[str, Any]] = [
    (CORRELATION_FIELD, "x" * 100_000),
    (CORRELATION_FIELD, ""),
    (CORRELATION_FIELD, "two\nlines"),
    (CORRELATION_FIELD, "nul\x00"),
    (CORRELATION_FIELD, "'; DROP TABLE job_claims; --\u202e"),
    (CORRELATION_FIELD, 12345),
    (CORRELATION_FIELD, None),
    (CORRELATION_FIELD, {"nested": ["deep"]}),
    (TRACEPARENT_FIELD, "00-zz"),
    (TRACEPARENT_FIELD, f"ff-{TRACE_ID}-00f067aa0ba902b7-01"),
    (TRACEPARENT_FIELD, f"00-{'0' * 32}-00f067aa0ba902b7-01"),
    (TRACEPARENT_FIELD, ["a"] * 1000),
]


def test_hostile_envelope_values_are_ignored_with_a_warning_and_every_message_still_runs(
    kit: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    # Given one batch of messages whose correlation id or traceparent does not fit
    fields: dict[str, str] = {}
    for i, (field, value) in enumerate(HOSTILE):
        (message_id,) = kit.publish({"job": "test.corr", "id": f"h{i}", field: value})
        fields[message_id] = field
    # When the drain runs
    with caplog.at_level(logging.INFO, logger="infrai_jobs"):
        summary = kit.drain()
    # Then every one of them ran and is done, its handler told of no correlation
    assert summary.outcomes == {"done": len(HOSTILE)}
    assert summary.acked == len(HOSTILE)
    assert sorted(seen(kit)) == sorted(f"h{i}" for i in range(len(HOSTILE)))
    assert set(seen(kit).values()) == {(None, None)}
    # And each got one WARNING naming it and the field, without the value itself
    warnings = [r for r in caplog.records if getattr(r, "action", "") == "correlation_ignored"]
    assert sorted(r.message_id for r in warnings) == sorted(fields)  # type: ignore[attr-defined]
    for record in warnings:
        assert record.levelno == logging.WARNING
        assert fields[record.message_id] in record.getMessage()  # type: ignore[attr-defined]
    assert all("x" * 200 not in r.getMessage() for r in caplog.records)
    assert all(not hasattr(r, "message_correlation_id") for r in caplog.records)


def test_the_span_around_each_handler_run_sees_the_producers_ids(
    kit: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a drain configured with a span around each handler run, as tracing does
    spans: list[tuple[str, str | None, str | None]] = []

    @contextmanager
    def span(ctx: JobContext) -> Iterator[None]:
        spans.append((ctx.message_id, ctx.correlation_id, ctx.traceparent))
        yield

    (traced,) = kit.publish({"job": "test.corr", "id": "s1", TRACEPARENT_FIELD: TRACEPARENT})
    (database,) = kit.publish({**NOTES_PAYLOAD, CORRELATION_FIELD: "invoice-run-1"})
    kit.sql("INSERT INTO invoices VALUES ('inv_8812', 'draft', NULL) ON CONFLICT DO NOTHING")
    # When the drain runs
    summary = kit.drain(features=[MessageTracing(span)])
    # Then every handler run, database and external, was inside its span
    assert summary.outcomes == {"done": 2}
    assert sorted(spans) == sorted(
        [(traced, TRACE_ID, TRACEPARENT), (database, "invoice-run-1", None)]
    )


# --- The X-Ray subsegment, through the real SDK, sent to a local UDP "daemon" ----------------

SEGMENT_SCRIPT = """
import os
from infrai_jobs.jobs.registry import JobContext
from infrai_jobs.runtime.observability import message_tracing
span = message_tracing()
ctx = JobContext(idem_key="k", job="receipt.send", message_id="m-1", delivery_count=1,
                 deadline=0.0, correlation_id="order-7431", traceparent=os.environ["TP"])
with span(ctx):
    pass
"""


def test_with_tracing_on_each_run_is_an_annotated_subsegment_of_the_invocations_trace() -> None:
    # Given Lambda's trace header, tracing turned on and a UDP socket standing for the daemon
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as daemon:
        daemon.bind(("127.0.0.1", 0))
        daemon.settimeout(30)
        env = {
            **child_env(),
            "POWERTOOLS_SERVICE_NAME": "drain",
            "POWERTOOLS_TRACE_DISABLED": "false",
            "LAMBDA_TASK_ROOT": os.getcwd(),
            "_X_AMZN_TRACE_ID": "Root=1-5759e988-bd862e3fe1be46a994272793;"
            "Parent=53995c3f42cd8ad8;Sampled=1",
            "AWS_XRAY_DAEMON_ADDRESS": f"127.0.0.1:{daemon.getsockname()[1]}",
            "TP": TRACEPARENT,
        }
        # When a handler runs inside the drain's span
        finished = run_captured([sys.executable, "-c", SEGMENT_SCRIPT], env=env, timeout=60)
        assert finished.returncode == 0, finished.stderr
        datagram = daemon.recv(65536).decode()
    # Then X-Ray received a subsegment of the invocation's trace, annotated with the ids
    header, document = datagram.split("\n", 1)
    assert json.loads(header)["format"] == "json"
    subsegment = json.loads(document)
    assert subsegment["type"] == "subsegment"
    assert subsegment["name"] == "## job receipt.send"
    assert subsegment["trace_id"] == "1-5759e988-bd862e3fe1be46a994272793"
    assert subsegment["parent_id"] == "53995c3f42cd8ad8"
    assert subsegment["annotations"] == {
        "job": "receipt.send",
        "message_id": "m-1",
        "correlation_id": "order-7431",
        "trace_id": TRACE_ID,
        "xray_trace_id": "1-4bf92f35-77b34da6a3ce929d0e0e4736",
    }


# --- publish and publish_checked --------------------------------------------------------------


def consumed_bodies(kit: Harness) -> dict[str, Any]:
    return {m.message_id: m.payload for m in kit.client.consume(QUEUE, max_messages=10)}


def correlation_line(stderr: str) -> str:
    (line,) = [line for line in stderr.splitlines() if line.startswith("correlation_id ")]
    return line.removeprefix("correlation_id ")


def test_publish_sets_one_correlation_id_for_all_copies_and_prints_it(kit: Harness) -> None:
    # When the operator publishes the same work three times
    finished = run_cli(kit, "publish", "--count", "3", json.dumps(NOTES_PAYLOAD))
    # Then stdout is still one message id per line, and stderr says the correlation id
    assert finished.returncode == 0, finished.stderr
    message_ids = finished.stdout.split()
    assert len(message_ids) == 3
    correlation_id = correlation_line(finished.stderr)
    assert len(correlation_id) == 32
    int(correlation_id, 16)
    # And all three copies carry that one id, the work otherwise unchanged
    bodies = consumed_bodies(kit)
    assert sorted(bodies) == sorted(message_ids)
    for body in bodies.values():
        assert body == {**NOTES_PAYLOAD, CORRELATION_FIELD: correlation_id}


def test_publish_keeps_the_bodys_id_or_takes_the_one_given(kit: Harness) -> None:
    own = run_cli(kit, "publish", json.dumps({**NOTES_PAYLOAD, CORRELATION_FIELD: "order-1"}))
    given = run_cli(kit, "publish", "--correlation-id", "order-2", json.dumps(NOTES_PAYLOAD))
    traced = run_cli(kit, "publish", json.dumps({**NOTES_PAYLOAD, TRACEPARENT_FIELD: TRACEPARENT}))
    assert [correlation_line(f.stderr) for f in (own, given, traced)] == [
        "order-1",
        "order-2",
        TRACE_ID,
    ]
    bodies = consumed_bodies(kit)
    assert bodies[own.stdout.strip()][CORRELATION_FIELD] == "order-1"
    assert bodies[given.stdout.strip()][CORRELATION_FIELD] == "order-2"
    assert bodies[traced.stdout.strip()][CORRELATION_FIELD] == TRACE_ID


@pytest.mark.parametrize(
    "args",
    [
        ("--correlation-id", "two\nlines", json.dumps(NOTES_PAYLOAD)),
        ("--correlation-id", "x" * 129, json.dumps(NOTES_PAYLOAD)),
        (json.dumps({**NOTES_PAYLOAD, TRACEPARENT_FIELD: "00-nope"}),),
    ],
)
def test_publish_refuses_a_correlation_the_drain_would_ignore(
    kit: Harness, args: tuple[str, ...]
) -> None:
    before = kit.client.stats(QUEUE).message_count
    finished = run_cli(kit, "publish", *args)
    assert finished.returncode == 2
    (line,) = finished.stderr.splitlines()
    assert line.startswith("error: not published: ")
    assert "Traceback" not in finished.stderr
    assert kit.client.stats(QUEUE).message_count == before


def test_publish_unchecked_sends_an_unusable_correlation_as_it_is_with_a_warning(
    kit: Harness,
) -> None:
    body = {**NOTES_PAYLOAD, CORRELATION_FIELD: "x" * 129}
    finished = run_cli(kit, "publish", "--unchecked", json.dumps(body))
    assert finished.returncode == 0, finished.stderr
    (message_id,) = finished.stdout.split()
    assert not [x for x in finished.stderr.splitlines() if x.startswith("correlation_id ")]
    assert any(CORRELATION_FIELD in x for x in finished.stderr.splitlines() if "warning" in x)
    assert consumed_bodies(kit)[message_id] == body


def test_publish_checked_returns_the_correlation_id_the_body_carries(kit: Harness) -> None:
    fresh = publish_checked(kit.client, kit.registry, QUEUE, NOTES_PAYLOAD)
    given = publish_checked(kit.client, kit.registry, QUEUE, NOTES_PAYLOAD, correlation_id="o-3")
    bodies = consumed_bodies(kit)
    assert bodies[fresh.message_id][CORRELATION_FIELD] == fresh.correlation_id
    assert len(fresh.correlation_id) == 32
    assert bodies[given.message_id][CORRELATION_FIELD] == given.correlation_id == "o-3"
    # The key is the work's, whatever the correlation id
    assert fresh.idem_key == given.idem_key == "invoice.finalize:inv_8812"
    with pytest.raises(InvalidPayload, match="_correlation_id"):
        publish_checked(
            kit.client, kit.registry, QUEUE, {**NOTES_PAYLOAD, CORRELATION_FIELD: "x" * 129}
        )
