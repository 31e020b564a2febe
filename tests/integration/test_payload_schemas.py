"""Payload schemas end to end: ``infrai-jobs publish`` refuses what the drain would reject before
anything reaches the queue, ``--unchecked`` and ``publish_checked`` behave as documented, and the
drain rejects a mistyped payload naming its field. The installed ``infrai-jobs`` in a child
process, the emulator over HTTP and a real PostgreSQL."""

from __future__ import annotations

import json
import logging
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from drainkit import QUEUE, Harness, harness, run_cli
from notes_example import NOTES_PAYLOAD

from infrai_jobs.errors import InfraiError, InvalidPayload, KeyDerivationError
from infrai_jobs.queue.producer import publish_checked

MISTYPED = {**NOTES_PAYLOAD, "amount_cents": "4900"}
MISTYPED_REASON = "job 'invoice.finalize': field 'amount_cents' must be an integer, got string"


@pytest.fixture
def kit(database_url: str) -> Iterator[Harness]:
    with harness(database_url) as h:
        h.sql("INSERT INTO invoices (id) VALUES ('inv_8812')")
        yield h


def queue_counts(kit: Harness) -> tuple[dict[str, Any], int]:
    """The queue's stats and the publishes the emulator has served: a refused publish must
    leave both as they were (a publish is what Infrai bills)."""
    stats = kit.client.stats(QUEUE)
    counters = {
        "message_count": stats.message_count,
        "available_count": stats.available_count,
        "in_flight_count": stats.in_flight_count,
        "delayed_count": stats.delayed_count,
        "dlq_count": stats.dlq_count,
    }
    response = kit.control.request("GET", f"{kit.server.url}/_emulator/state")
    assert response.status == 200, response.data
    publishes = int(json.loads(response.data)["data"]["requests"].get("publish", 0))
    return counters, publishes


def the_error_line(finished: subprocess.CompletedProcess[str]) -> str:
    """Exit 2, one ``error:`` line on stderr, no traceback, nothing on stdout."""
    assert finished.returncode == 2, (finished.returncode, finished.stdout, finished.stderr)
    assert "Traceback" not in finished.stderr
    assert finished.stdout == ""
    (line,) = [line for line in finished.stderr.splitlines() if line.startswith("error: ")]
    return line


# --- infrai-jobs publish ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        pytest.param(
            {**NOTES_PAYLOAD, "job": "invoice.finalise"},
            "unknown job 'invoice.finalise' (did you mean 'invoice.finalize'?",
            id="unknown-job",
        ),
        pytest.param(
            {"job": "invoice.finalize", "invoice_id": "inv_8812"},
            "job 'invoice.finalize' is missing field(s): amount_cents",
            id="missing-field",
        ),
        pytest.param(MISTYPED, MISTYPED_REASON, id="mistyped-field"),
        pytest.param(
            {**NOTES_PAYLOAD, "_idempotency_key": ""},
            "_idempotency_key must be a non-empty string",
            id="no-derivable-key",
        ),
        pytest.param(
            {**NOTES_PAYLOAD, "amount_cents": 2**60},
            "an integer outside +/-(2**53 - 1)",
            id="unrepresentable-work",
        ),
    ],
)
def test_publish_refuses_what_the_drain_would_reject_and_publishes_nothing(
    kit: Harness, body: dict[str, Any], reason: str
) -> None:
    # Given the queue as it is
    before = queue_counts(kit)
    # When the operator publishes a body the drain's registry cannot accept
    finished = run_cli(kit, "publish", "--count", "3", json.dumps(body))
    # Then one line names the problem, exit 2, and not one publish reached the queue
    line = the_error_line(finished)
    assert line.startswith("error: not published: ")
    assert reason in line
    assert queue_counts(kit) == before


def test_publish_checks_before_create_makes_the_queue(kit: Harness) -> None:
    # Given a queue that does not exist yet
    # When a mistyped body is published with --create
    finished = run_cli(kit, "publish", "--create", "--queue", "new-jobs", json.dumps(MISTYPED))
    # Then it is refused before the queue is touched: no queue was created
    assert MISTYPED_REASON in the_error_line(finished)
    with pytest.raises(InfraiError) as missing:
        kit.client.stats("new-jobs")
    assert missing.value.code == "QUEUE_NOT_FOUND"


def test_publish_of_a_valid_body_still_publishes_it(kit: Harness) -> None:
    # Given the queue as it is
    (counts, publishes) = queue_counts(kit)
    # When a body matching its job's schema is published twice
    finished = run_cli(kit, "publish", "--count", "2", json.dumps(NOTES_PAYLOAD))
    # Then two message ids are printed, stderr says only their one correlation id, and the queue
    # holds two more messages
    assert finished.returncode == 0, finished.stderr
    assert len(finished.stdout.split()) == 2
    (line,) = finished.stderr.splitlines()
    assert line.startswith("correlation_id ")
    after, publishes_after = queue_counts(kit)
    assert after["message_count"] == counts["message_count"] + 2
    assert publishes_after == publishes + 2


def test_unchecked_publishes_a_mistyped_body_with_a_warning_and_the_drain_rejects_it(
    kit: Harness,
) -> None:
    # Given the queue as it is
    (counts, _) = queue_counts(kit)
    # When a mistyped body is published with --unchecked
    finished = run_cli(kit, "publish", "--unchecked", json.dumps(MISTYPED))
    # Then it is published, with one warning line saying it was not checked
    assert finished.returncode == 0, finished.stderr
    (message_id,) = finished.stdout.split()
    warnings = [line for line in finished.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 1
    assert "not checked" in warnings[0]
    assert kit.client.stats(QUEUE).message_count == counts["message_count"] + 1
    # When the drain runs
    drained = run_cli(kit, "drain")
    # Then the message is rejected, its line naming the field, and no claim was written
    assert drained.returncode == 0, drained.stderr
    assert json.loads(drained.stdout)["outcomes"] == {"rejected": 1}
    (rejected,) = [line for line in drained.stderr.splitlines() if line.startswith("rejected ")]
    assert f"message_id={message_id}" in rejected
    assert MISTYPED_REASON in rejected
    assert kit.sql("SELECT count(*) FROM job_claims") == [(0,)]


def test_publish_without_a_jobs_package_refuses_unless_unchecked(
    kit: Harness, tmp_path: Path
) -> None:
    # Given a jobs path that holds no jobs package
    before = queue_counts(kit)
    # When a valid body is published with it, Then it is refused (nothing to check against)
    finished = run_cli(kit, "publish", "--jobs-path", str(tmp_path), json.dumps(NOTES_PAYLOAD))
    assert "holds no jobs package" in the_error_line(finished)
    assert queue_counts(kit) == before
    # And with --unchecked the body is published without the package
    unchecked = run_cli(
        kit, "publish", "--unchecked", "--jobs-path", str(tmp_path), json.dumps(NOTES_PAYLOAD)
    )
    assert unchecked.returncode == 0, unchecked.stderr
    assert kit.client.stats(QUEUE).message_count == before[0]["message_count"] + 1


# --- publish_checked, for Python producers ------------------------------------------------------


def test_publish_checked_sends_a_valid_payload_with_the_key_the_drain_claims(kit: Harness) -> None:
    # When a producer publishes the notes' payload through publish_checked
    published = publish_checked(kit.client, kit.registry, QUEUE, NOTES_PAYLOAD)
    # Then it is on the queue under the returned id, and the drain claims it under that key
    assert published.idem_key == "invoice.finalize:inv_8812"
    assert published.job == "invoice.finalize"
    summary = kit.drain()
    assert summary.outcomes == {"done": 1}
    row = kit.row(published.idem_key)
    assert row is not None
    assert row.message_id == published.message_id


def test_publish_checked_refuses_before_sending(kit: Harness) -> None:
    before = queue_counts(kit)
    with pytest.raises(InvalidPayload, match=r"field 'amount_cents' must be an integer"):
        publish_checked(kit.client, kit.registry, QUEUE, MISTYPED)
    with pytest.raises(KeyDerivationError, match=r"unknown job 'invoice\.finalise'"):
        publish_checked(
            kit.client, kit.registry, QUEUE, {**NOTES_PAYLOAD, "job": "invoice.finalise"}
        )
    assert queue_counts(kit) == before


# --- The drain ----------------------------------------------------------------------------------


def test_the_drain_rejects_a_mistyped_payload_before_any_claim_or_effect(
    kit: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="infrai_jobs")
    # Given a producer that skipped the check and sent amount_cents as text
    (message_id,) = kit.publish(MISTYPED)
    # When the drain runs
    summary = kit.drain()
    # Then the message is rejected, its log record naming the field and both types
    assert summary.outcomes == {"rejected": 1}
    (record,) = [r for r in caplog.records if getattr(r, "action", "") == "rejected"]
    assert (record.message_id, record.detail) == (message_id, MISTYPED_REASON)
    # And it is left unacked for the DLQ, with no claim and no effect
    assert summary.acked == 0
    assert kit.client.stats(QUEUE).in_flight_count == 1
    assert kit.sql("SELECT count(*) FROM job_claims") == [(0,)]
    assert kit.sql("SELECT status, total_cents FROM invoices WHERE id = 'inv_8812'") == [
        ("draft", None)
    ]
