"""Every row of docs/design.md's outcome table, against real PostgreSQL and the emulator over
HTTP."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import timedelta

import psycopg
import pytest
import urllib3
from drainkit import DLQ, QUEUE, Harness, harness
from notes_example import NOTES_PAYLOAD

from infrai_jobs.drain.batch import process_batch
from infrai_jobs.drain.model import DrainConfig
from infrai_jobs.errors import PermanentJobError
from infrai_jobs.jobs.registry import Effect, JobContext, JsonValue, Payload
from infrai_jobs.queue.models import QueueMessage
from infrai_jobs.work.outcomes import Outcome

NOTES_KEY = "invoice.finalize:inv_8812"


def seed_running_claim(
    kit: Harness, payload: Payload, *, message_id: str, effect: str, lease_from_now: timedelta
) -> None:
    """Write the ``running`` claim another delivery of ``payload`` would hold: a fresh claim
    token, the payload's own fingerprint, and a lease ending ``lease_from_now`` after the
    database's clock (negative for a lease already over)."""
    derived = kit.registry.derive(payload)
    kit.sql(
        "INSERT INTO job_claims (idem_key, state, message_id, effect, claim_token, lease_until,"
        " payload_sha256) VALUES (%s, 'running', %s, %s, gen_random_uuid(), now() + %s, %s)",
        (derived.idem_key, message_id, effect, lease_from_now, derived.fingerprint),
    )


@pytest.fixture
def kit(database_url: str) -> Iterator[Harness]:
    with harness(database_url) as h:
        h.sql("INSERT INTO invoices (id) VALUES ('inv_8812'), ('inv_1'), ('inv_2')")
        yield h


def test_ran_now_and_succeeded_is_done_with_its_result_and_acked(kit: Harness) -> None:
    # Given the notes' invoice job
    kit.publish(NOTES_PAYLOAD)
    # When the drain runs
    summary = kit.drain()
    # Then the invoice is final, the claim done with the result, the message acked
    assert kit.sql("SELECT status, total_cents FROM invoices WHERE id = 'inv_8812'") == [
        ("final", 4900)
    ]
    row = kit.row(NOTES_KEY)
    assert row is not None
    assert row.state == "done"
    assert row.result == {"id": "inv_8812", "status": "final", "total_cents": 4900}
    assert row.effect == "database"
    assert row.payload_sha256 is not None
    assert (summary.consumed, summary.done, summary.acked) == (1, 1, 1)
    assert kit.client.stats(QUEUE).message_count == 0


def test_producer_retry_duplicate_of_done_is_acked_and_changes_nothing(kit: Harness) -> None:
    # Given the job done once
    kit.publish({"job": "test.db", "id": "a"})
    kit.drain()
    before = kit.row("test.db:a")
    # When a producer retry delivers it again
    kit.publish({"job": "test.db", "id": "a"})
    summary = kit.drain()
    # Then the effect did not repeat, the row is unchanged, and the copy is acked
    assert kit.effects("test.db:a") == 1
    assert kit.row("test.db:a") == before
    assert summary.outcomes == {"duplicate_done": 1}
    assert summary.acked == 1
    assert kit.client.stats(QUEUE).message_count == 0


def test_two_copies_in_one_batch_run_once_and_both_are_acked(kit: Harness) -> None:
    kit.publish(NOTES_PAYLOAD, times=2)
    summary = kit.drain()
    assert summary.consumed == 2
    assert summary.done == 1
    assert summary.acked == 2
    assert summary.batches == 1
    assert kit.client.stats(QUEUE).message_count == 0


def test_duplicate_while_another_holds_a_live_claim_is_acked(kit: Harness) -> None:
    # Given another delivery holds a live claim on the receipt (its lease ends in an hour)
    payload = {"job": "receipt.send", "invoice_id": "inv_1", "email": "a@example.com"}
    seed_running_claim(
        kit, payload, message_id="qmsg_other", effect="external", lease_from_now=timedelta(hours=1)
    )
    # When a copy arrives
    kit.publish(payload)
    summary = kit.drain()
    # Then it is acked (the owner's message drives retries), and nothing ran or changed
    assert summary.outcomes == {"duplicate_in_flight": 1}
    assert summary.acked == 1
    assert kit.sink.state.snapshot()["mail_effects"] == 0
    row = kit.row("receipt.send:inv_1")
    assert row is not None
    assert (row.state, row.message_id) == ("running", "qmsg_other")


def test_external_claim_with_expired_lease_stays_running_flagged_and_unacked(
    kit: Harness,
) -> None:
    # Given an external claim whose holder died long ago
    payload = {"job": "receipt.send", "invoice_id": "inv_2", "email": "b@example.com"}
    seed_running_claim(
        kit, payload, message_id="qmsg_dead", effect="external", lease_from_now=-timedelta(hours=1)
    )
    # When a copy arrives
    kit.publish(payload)
    summary = kit.drain()
    # Then the claim stays running, is flagged with the reason, and the copy is not acked
    row = kit.assert_settled(
        summary, "receipt.send:inv_2", outcome="stuck", acked=0, state="running"
    )
    assert "lease expired" in (row.error or "")
    assert kit.sink.state.snapshot()["mail_effects"] == 0
    assert kit.client.stats(QUEUE).in_flight_count == 1


def test_transient_failure_releases_the_claim_and_walks_to_the_dlq(kit: Harness) -> None:
    # Given a job that fails every time
    kit.publish({"job": "test.db", "id": "poison", "mode": "transient"})
    # When it is delivered three times
    for delivery in range(3):
        summary = kit.drain()
        assert summary.outcomes == {"retry": 1}, f"delivery {delivery + 1}"
        # Then after each failure no claim and no effect remain, and the message is not acked
        assert kit.row("test.db:poison") is None
        assert kit.effects("test.db:poison") == 0
        kit.advance()
    # And the third unacked delivery dead-letters it
    stats = kit.client.stats(QUEUE)
    assert (stats.message_count, stats.dlq_count) == (0, 1)
    (dead,) = kit.client.consume(DLQ)
    assert dead.payload["id"] == "poison"


def test_permanent_failure_is_recorded_failed_and_not_acked(kit: Harness) -> None:
    kit.publish({"job": "test.db", "id": "bad", "mode": "permanent"})
    summary = kit.drain()
    row = kit.assert_settled(summary, "test.db:bad", outcome="failed", acked=0, state="failed")
    assert row.error == "PermanentJobError: simulated permanent failure"
    # The database effect was rolled back with the job's savepoint
    assert kit.effects("test.db:bad") == 0


def test_duplicate_of_failed_is_left_for_the_dlq(kit: Harness) -> None:
    kit.publish({"job": "test.db", "id": "bad", "mode": "permanent"})
    kit.drain()
    before = kit.row("test.db:bad")
    kit.publish({"job": "test.db", "id": "bad", "mode": "permanent"})
    kit.advance()
    summary = kit.drain()
    assert summary.outcomes == {"duplicate_failed": 1, "batch_duplicate": 1}
    assert summary.acked == 0
    assert kit.row("test.db:bad") == before


def test_effect_uncertain_stays_running_flagged_and_unacked(kit: Harness) -> None:
    # Given an external job whose call times out after it may have happened
    kit.publish({"job": "test.ext", "id": "x", "mode": "uncertain"})
    summary = kit.drain()
    # Then the claim stays running, flagged, unacked
    row = kit.assert_settled(summary, "test.ext:x", outcome="stuck", acked=0, state="running")
    assert (row.error or "").startswith("effect uncertain")
    # And its own redelivery does not run it again
    kit.advance()
    summary = kit.drain()
    row = kit.assert_settled(summary, "test.ext:x", outcome="stuck", acked=0, state="running")
    assert kit.external_effects("test.ext:x") == 1
    assert (row.error or "").startswith("effect uncertain")  # the first reason is kept


def test_own_redelivery_of_a_running_external_claim_is_flagged_not_rerun(kit: Harness) -> None:
    # Given a delivery that claimed a receipt and died mid-call (its lease not yet over)
    payload = {"job": "receipt.send", "invoice_id": "inv_1", "email": "a@example.com"}
    kit.publish(payload)
    (message,) = kit.client.consume(QUEUE)
    seed_running_claim(
        kit,
        payload,
        message_id=message.message_id,
        effect="external",
        lease_from_now=timedelta(hours=1),
    )
    # When the same message is redelivered
    kit.advance()
    summary = kit.drain()
    # Then it is not sent, not acked, and flagged with the reason
    row = kit.assert_settled(
        summary, "receipt.send:inv_1", outcome="stuck", acked=0, state="running"
    )
    assert kit.sink.state.snapshot()["mail_effects"] == 0
    assert "redelivered while its own claim is still running" in (row.error or "")


def test_same_key_different_work_is_a_conflict_left_unacked(kit: Harness) -> None:
    kit.publish(NOTES_PAYLOAD)
    kit.drain()
    before = kit.row(NOTES_KEY)
    kit.publish({**NOTES_PAYLOAD, "amount_cents": 9999})
    summary = kit.drain()
    assert summary.outcomes == {"conflict": 1}
    assert summary.acked == 0
    assert kit.row(NOTES_KEY) == before
    assert kit.sql("SELECT total_cents FROM invoices WHERE id = 'inv_8812'") == [(4900,)]


def test_messages_without_a_derivable_key_are_left_while_the_batch_goes_on(
    kit: Harness,
) -> None:
    # Given a batch mixing garbage with one good job
    kit.publish({"job": "no.such.job", "x": 1})
    kit.publish({"job": "invoice.finalize", "amount_cents": 1})  # no invoice_id
    kit.publish({"not_a_job": True})
    kit.publish({"job": "test.db", "id": "fine"})
    kit.publish({"job": "test.db", "id": "big", "blob": "x" * 1_000_000})
    # When drained
    summary = kit.drain()
    # Then the three rejects are unacked with no ledger rows; the good jobs ran
    assert summary.outcomes == {"rejected": 3, "done": 2}
    assert summary.acked == 2
    assert kit.sql("SELECT count(*) FROM job_claims") == [(2,)]
    assert kit.client.stats(QUEUE).in_flight_count == 3


def test_payloads_that_are_not_objects_are_rejected(kit: Harness) -> None:
    # The emulator only accepts objects as bodies, so odd payloads come from the API side;
    # the drain must survive them whatever they are.

    odd = [
        QueueMessage(f"qmsg_{i}", QUEUE, payload, 1, None, f"qmsg_{i}")
        for i, payload in enumerate([None, [1, 2], "text", 42, {"job": 7}])
    ]
    results = process_batch(odd, kit.ledger, kit.registry, 2e9, DrainConfig(queue=QUEUE))
    assert [r.outcome for r in results] == [Outcome.REJECTED] * 5
    assert "not a JSON object (got null)" in results[0].detail
    assert "got array" in results[1].detail


def test_a_lost_claim_is_not_acked(kit: Harness) -> None:
    # Given an external job during which an operator re-assigns the claim (new token)
    def hijacking_handler(payload: Payload, ctx: JobContext) -> JsonValue:
        kit.sql(
            "UPDATE job_claims SET claim_token = %s WHERE idem_key = %s",
            (uuid.uuid4(), ctx.idem_key),
        )
        return {"sent": True}

    kit.registry.job("test.hijacked", effect=Effect.EXTERNAL, identity=("id",))(hijacking_handler)
    kit.publish({"job": "test.hijacked", "id": "1"})
    # When the drain settles it, the fenced update matches nothing
    summary = kit.drain()
    # Then it is not acked, and the row is left as the other party made it
    kit.assert_settled(summary, "test.hijacked:1", outcome="claim_lost", acked=0, state="running")


def test_ack_answered_not_found_counts_as_ack_lost(kit: Harness) -> None:
    # Given acks that are applied but whose answers are dropped
    kit.publish({"job": "test.db", "id": "a"})
    kit.faults(drop_response_rate=1.0, routes=["ack"])
    # When drained: the retry of the ack finds the message gone
    summary = kit.drain()
    # Then it is counted as harmless
    assert summary.done == 1
    assert summary.ack_lost == 1
    assert summary.acked == 0
    kit.faults()
    assert kit.client.stats(QUEUE).message_count == 0


def test_external_idempotent_claim_is_taken_over_after_its_lease(kit: Harness) -> None:
    # Given a digest whose first attempt called the provider, then died before settling
    payload = {"job": "digest.build", "tenant_id": "tenant_42", "period": "2026-07-25"}
    key = "digest.build:tenant_42:2026-07-25"
    kit.publish(payload)
    (message,) = kit.client.consume(QUEUE)
    urllib3.request(
        "POST", f"{kit.sink.url}/v1/digests", json=payload, headers={"Idempotency-Key": key}
    )
    seed_running_claim(
        kit,
        payload,
        message_id=message.message_id,
        effect="external_idempotent",
        lease_from_now=-timedelta(minutes=1),
    )
    # When its redelivery arrives
    kit.advance()
    summary = kit.drain()
    # Then it takes the claim over, calls again with the same key, and the provider does not
    # repeat the effect
    row = kit.assert_settled(summary, key, outcome="done", acked=1, state="done")
    assert row.attempts == 2
    assert isinstance(row.result, dict)
    assert row.result["replayed"] is True
    assert kit.sink.state.snapshot()["digest_effects"] == 1


def test_the_time_budget_stops_before_a_batch_it_cannot_finish(kit: Harness) -> None:
    kit.publish({"job": "test.db", "id": "a"})
    summary = kit.drain(time_left_ms=lambda: 5_000, batch_budget_ms=20_000)
    assert summary.consumed == 0
    assert summary.stopped == "time_budget"
    assert kit.client.stats(QUEUE).available_count == 1


def test_drain_loops_over_batches_of_ten(kit: Harness) -> None:
    for n in range(25):
        kit.publish({"job": "test.db", "id": str(n)})
    summary = kit.drain()
    assert (summary.batches, summary.done, summary.acked) == (3, 25, 25)
    assert summary.stopped == "empty"


def test_ledger_reconnects_after_the_server_drops_the_connection(kit: Harness) -> None:
    kit.publish({"job": "test.db", "id": "before"})
    kit.drain()
    # Given the server terminates every other backend of this database
    kit.sql(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
        " WHERE datname = current_database() AND pid <> pg_backend_pid()"
    )
    kit.publish({"job": "test.db", "id": "after"})
    # When the next drain runs on the same ledger object
    first = kit.drain()
    # Then the broken connection failed that batch without acking, and the next one reconnects
    if first.outcomes.get("ledger_unavailable"):
        assert first.acked == 0
        kit.advance()
        first = kit.drain()
    assert first.outcomes == {"done": 1}
    assert kit.effects("test.db:after") == 1


def test_notes_sql_still_runs_and_its_rows_are_honoured(kit: Harness) -> None:
    # Given rows written by the field notes' own worker SQL
    with psycopg.connect(kit.database_url, autocommit=True) as conn:
        claimed = conn.execute(
            "INSERT INTO job_claims (idem_key, state, message_id) VALUES (%s, 'running', %s)"
            " ON CONFLICT (idem_key) DO NOTHING RETURNING idem_key",
            (NOTES_KEY, "qmsg_3M3oXV26427PU29QW1sHEAXn"),
        ).fetchall()
        conn.execute(
            "UPDATE job_claims SET state = 'done', result = %s WHERE idem_key = %s",
            ('{"id": "inv_8812", "status": "final"}', NOTES_KEY),
        )
        conn.execute(
            "INSERT INTO job_claims (idem_key, state, message_id) VALUES (%s, 'running', %s)",
            ("receipt.send:inv_1", "qmsg_node_worker"),
        )
    assert claimed == [(NOTES_KEY,)]
    # When this drain sees the same work
    kit.publish(NOTES_PAYLOAD)
    kit.publish({"job": "receipt.send", "invoice_id": "inv_1", "email": "c@example.com"})
    summary = kit.drain()
    # Then the notes' done row is a duplicate and its live running row is respected
    assert summary.outcomes == {"duplicate_done": 1, "duplicate_in_flight": 1}
    assert kit.sql("SELECT status FROM invoices WHERE id = 'inv_8812'") == [("draft",)]
    assert kit.sink.state.snapshot()["mail_effects"] == 0


def test_results_and_errors_postgres_cannot_store_are_described_not_fatal(kit: Harness) -> None:
    # Given handlers whose result or error carries a NUL character (echoed from a payload)
    def echo(payload: Payload, ctx: JobContext) -> JsonValue:
        assert ctx.db is not None
        ctx.db.execute("INSERT INTO test_effects VALUES (%s, %s)", (ctx.idem_key, ctx.message_id))
        return {"echo": payload["text"]}

    def refuse(payload: Payload, ctx: JobContext) -> JsonValue:
        raise PermanentJobError(f"refused {payload['text']}")

    kit.registry.job("test.echo", effect=Effect.DATABASE, identity=("id",))(echo)
    kit.registry.job("test.refuse", effect=Effect.EXTERNAL, identity=("id",))(refuse)
    kit.publish({"job": "test.echo", "id": "nul", "text": "a\x00b"})
    kit.publish({"job": "test.db", "id": "innocent"})
    kit.publish({"job": "test.refuse", "id": "nul", "text": "a\x00b"})
    # When drained against real PostgreSQL
    summary = kit.drain()
    # Then the batch settles normally: the result is described, the error cleaned
    assert summary.outcomes == {"done": 2, "failed": 1}
    echoed = kit.row("test.echo:nul")
    assert echoed is not None
    assert isinstance(echoed.result, dict)
    assert "unserializable_result" in echoed.result
    refused = kit.row("test.refuse:nul")
    assert refused is not None
    assert refused.state == "failed"
    assert refused.error == "PermanentJobError: refused a\ufffdb"
