"""What the queue refuses never holds back what it takes: on a real PostgreSQL and the emulator
over HTTP, an outbox row whose own queue Infrai does not have backs off alone and the rows
behind it are published; after its last attempt it is dead, never deleted; the operator lists,
retries and discards rows with `infrai-jobs outbox`, each change recorded. `enqueue` refuses
what the queue would (a bad queue name, a body too large, nesting too deep, another job's key)
before anything is written."""

from __future__ import annotations

import json
import re
from typing import Any

import psycopg
import pytest
from drainkit import QUEUE, Harness, run_cli

from infrai_jobs.errors import InvalidPayload, KeyDerivationError, OutboxError
from infrai_jobs.ledger.postgres import LedgerConnector
from infrai_jobs.outbox import enqueue
from infrai_jobs.outbox.relay import OutboxRelay, RelayConfig
from infrai_jobs.queue_contract import CONSUME_CAP
from infrai_local.sandbox.queues import ensure_queue

PLENTY = 120_000
# The documented limit on a body (docs/producers.md), as compact UTF-8 JSON.
MAX_BODY_BYTES = 1024 * 1024
MISSING_QUEUES = ("billing-jobs-typo", "deleted-queue", "not-yet-created")


def relay_for(kit: Harness, **config: Any) -> OutboxRelay:
    return OutboxRelay(
        LedgerConnector(kit.database_url, application_name="test-outbox"),
        kit.client,
        RelayConfig(default_queue=QUEUE, **config),
    )


def job(n: int | str) -> dict[str, Any]:
    return {"job": "test.db", "id": str(n)}


def enqueue_rows(kit: Harness, *payloads: dict[str, Any], queue: str | None = None) -> None:
    with psycopg.connect(kit.database_url) as conn, conn.transaction():
        for payload in payloads:
            enqueue(conn, payload, registry=kit.registry, queue=queue)


def queued(kit: Harness, queue: str = QUEUE) -> int:
    stats = kit.client.stats(queue)
    return int(stats.available_count + stats.in_flight_count)


def cli_json(kit: Harness, *args: str) -> Any:
    done = run_cli(kit, *args, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def history(kit: Harness) -> list[tuple[Any, ...]]:
    return kit.sql(
        "SELECT idem_key, action, actor, before, after, note FROM claim_history ORDER BY id"
    )


def test_rows_for_missing_queues_hold_back_none_of_the_200_behind_them(kit: Harness) -> None:
    # Given three rows for queues Infrai does not have, enqueued first, then 200 ordinary rows
    for n, queue in enumerate(MISSING_QUEUES):
        enqueue_rows(kit, job(f"lost-{n}"), queue=queue)
    enqueue_rows(kit, *(job(n) for n in range(200)))
    # When one relay pass runs (the production back-off: a refused row is not due again in it)
    report = relay_for(kit, batch_size=25).run(lambda: PLENTY)
    # Then the 200 are published, and the 3 were refused and back off
    assert (report.published, report.refused, report.dead) == (200, 3, 0)
    assert queued(kit) == 200
    # And the operator's list shows the 3, each with its reason
    listed = cli_json(kit, "outbox", "list")
    assert listed["count"] == 3
    assert [row["queue"] for row in listed["rows"]] == list(MISSING_QUEUES)
    for row in listed["rows"]:
        assert (row["state"], row["attempts"]) == ("pending", 1)
        assert "QUEUE_NOT_FOUND" in row["last_error"]
    assert cli_json(kit, "outbox", "list", "--failing", "--queue", "deleted-queue")["count"] == 1
    # And its human form says the same, a row per line with its last error under it
    human = run_cli(kit, "outbox", "list")
    assert human.returncode == 0, human.stderr
    lines = human.stdout.splitlines()
    assert [line.split()[:2] for line in lines[::2]] == [
        [str(row["seq"]), "pending"] for row in listed["rows"]
    ]
    assert all("QUEUE_NOT_FOUND" in line for line in lines[1::2])
    # When the operator discards one with a reason
    seq = listed["rows"][1]["seq"]
    done = run_cli(
        kit, "outbox", "discard", str(seq), "--reason", "queue deleted", OPERATOR="ops-ann"
    )
    # Then it is gone from the outbox, and recorded with its body: nothing is lost
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert f"discard outbox row {seq}" in done.stdout
    assert kit.sql("SELECT count(*) FROM outbox WHERE seq = %s", (seq,)) == [(0,)]
    ((key, action, actor, before, after, note),) = history(kit)
    assert (key, action, actor, after, note) == (
        "test.db:lost-1",
        "outbox_discard",
        "ops-ann",
        None,
        "queue deleted",
    )
    assert (before["queue"], before["body"]["id"]) == ("deleted-queue", "lost-1")
    assert cli_json(kit, "outbox", "list")["count"] == 2
    assert kit.sql("SELECT count(*) FROM outbox") == [(202,)]


def test_a_row_refused_at_its_last_attempt_is_dead_and_published_once_retried(
    kit: Harness,
) -> None:
    # Given a row for a queue that does not exist yet, and a relay whose back-off is nil
    enqueue_rows(kit, job("early"), queue="created-later")
    relay = relay_for(kit, batch_size=10, base_delay_seconds=0)
    # When nine passes meet Infrai's refusal
    for attempt in range(1, 10):
        report = relay.run(lambda: PLENTY)
        assert (report.refused, report.retried, report.dead) == (1, 1, 0), attempt
    # Then the row still waits; and the tenth refusal is its last: it is dead, not deleted
    assert kit.sql("SELECT state, attempts FROM outbox") == [("pending", 9)]
    last = relay.run(lambda: PLENTY)
    assert (last.refused, last.dead, last.retried) == (1, 1, 0)
    ((seq, state, attempts, error),) = kit.sql(
        "SELECT seq, state, attempts, last_error FROM outbox"
    )
    assert (state, attempts) == ("dead", 10)
    assert "QUEUE_NOT_FOUND" in error
    # And its dead letter says why, and further passes leave it alone
    ((letter_id, reason),) = kit.sql("SELECT message_id, reason FROM dead_letters")
    assert letter_id == f"outbox:{seq}"
    assert "'created-later' at its attempt 10, the last" in reason
    assert relay.run(lambda: PLENTY).refused == 0
    listed = cli_json(kit, "outbox", "list", "--state", "dead")
    assert [row["seq"] for row in listed["rows"]] == [seq]
    # When the queue is created and the operator retries the row
    ensure_queue(kit.client, "created-later")
    retried = run_cli(kit, "outbox", "retry", str(seq), "--note", "queue created", OPERATOR="bo")
    assert retried.returncode == 0, retried.stderr
    assert "its dead letter resolved" in retried.stdout
    # Then it is pending and due, its dead letter resolved, the change recorded
    assert kit.sql("SELECT state, attempts FROM outbox") == [("pending", 0)]
    assert kit.sql("SELECT resolution, resolved_by FROM dead_letters") == [("redriven", "bo")]
    ((key, action, actor, before, after, note),) = history(kit)
    assert (key, action, actor, note) == ("test.db:early", "outbox_retry", "bo", "queue created")
    assert (before["state"], after["state"]) == ("dead", "pending")
    # And the next pass publishes it to its queue
    assert relay.run(lambda: PLENTY).published == 1
    assert queued(kit, "created-later") == 1


def test_retry_all_dead_makes_every_dead_row_due_and_records_each(kit: Harness) -> None:
    # Given two rows given up at their first refusal, and one published
    enqueue_rows(kit, job(1), job(2), queue="nowhere")
    enqueue_rows(kit, job(3))
    relay_for(kit, max_queue_refusals=1).run(lambda: PLENTY)
    assert dict(kit.sql("SELECT state, count(*) FROM outbox GROUP BY state")) == {
        "dead": 2,
        "published": 1,
    }
    # When the operator retries every dead row
    document = cli_json(kit, "outbox", "retry", "--all-dead")
    # Then both are pending again, and each change is recorded
    assert len(document["retry"]) == 2
    assert all(change["dead_letter_resolved"] for change in document["retry"])
    assert dict(kit.sql("SELECT state, count(*) FROM outbox GROUP BY state")) == {
        "pending": 2,
        "published": 1,
    }
    assert [row[1] for row in history(kit)] == ["outbox_retry", "outbox_retry"]
    # And with no dead row left, the command says so and changes nothing
    nothing = run_cli(kit, "outbox", "retry", "--all-dead")
    assert nothing.returncode == 0, nothing.stderr
    assert "nothing to retry" in nothing.stdout
    assert len(history(kit)) == 2


@pytest.mark.parametrize(
    ("args", "code", "says"),
    [
        (("retry",), 2, "SEQ or --all-dead"),
        (("retry", "1", "--all-dead"), 2, "SEQ or --all-dead"),
        (("retry", "one"), 2, "invalid int value"),
        (("retry", "999"), 1, "no outbox row has seq 999"),
        (("discard", "1"), 2, "--reason"),
        (("discard", "1", "--reason", "  "), 2, "needs a --reason"),
        (("discard", "999", "--reason", "typo"), 1, "no outbox row has seq 999"),
        (("list", "--limit", "0"), 2, "--limit must be at least 1"),
        (("list", "--state", "published"), 2, "argument --state: invalid choice"),
    ],
)
def test_outbox_row_commands_refuse_bad_input_in_one_line(
    kit: Harness, args: tuple[str, ...], code: int, says: str
) -> None:
    # Given one pending row
    enqueue_rows(kit, job(1))
    # When the operator asks for something wrong
    refused = run_cli(kit, "outbox", *args)
    # Then the command refuses in one line, with no traceback, and nothing changed
    assert refused.returncode == code, refused.stderr
    assert says in refused.stderr
    assert "Traceback" not in refused.stderr
    assert kit.sql("SELECT seq, state, attempts FROM outbox") == [(1, "pending", 0)]
    assert history(kit) == []


def test_a_published_row_and_a_due_one_are_neither_retried_nor_discarded(kit: Harness) -> None:
    # Given a published row and a pending one that never failed
    enqueue_rows(kit, job(1))
    relay_for(kit).run(lambda: PLENTY)
    enqueue_rows(kit, job(2))
    for args, says in (
        (("retry", "1"), "published already"),
        (("discard", "1", "--reason", "oops"), "published already"),
        (("retry", "2"), "has met no error"),
    ):
        # When the operator asks, Then the command refuses, saying why
        refused = run_cli(kit, "outbox", *args)
        assert refused.returncode == 1, refused.stderr
        assert says in refused.stderr
        assert "Traceback" not in refused.stderr
    assert kit.sql("SELECT state FROM outbox ORDER BY seq") == [("published",), ("pending",)]
    assert history(kit) == []


def deeply_nested(depth: int) -> Any:
    value: Any = "leaf"
    for _ in range(depth):
        value = [value]
    return value


def refused(
    conn: psycopg.Connection[Any], error: type[Exception], says: str, payload: Any, **options: Any
) -> None:
    """``enqueue`` raises ``error`` saying ``says``, in a transaction that rolls back."""
    with pytest.raises(error, match=re.escape(says)), conn.transaction():
        enqueue(conn, payload, **options)


def test_enqueue_refuses_what_the_queue_would_before_anything_is_written(kit: Harness) -> None:
    registry = kit.registry
    with psycopg.connect(kit.database_url) as conn:
        # A queue name Infrai does not take: the review's, empty, too long, a leading dot
        for queue in ("q'); DROP TABLE outbox;--", "", "q" * 81, ".hidden", "a b"):
            says = "not a queue name Infrai takes"
            refused(conn, OutboxError, says, job(1), registry=registry, queue=queue)
        # A body above the limit, or above a lower limit the producer sets
        big = {**job(2), "blob": "x" * MAX_BODY_BYTES}
        refused(conn, InvalidPayload, "above the outbox's limit", big, registry=registry)
        small = {**job(3), "blob": "x" * 100}
        says = "above the outbox's limit of 100"
        refused(conn, InvalidPayload, says, small, registry=registry, max_body_bytes=100)
        too_high = MAX_BODY_BYTES + 1
        refused(conn, OutboxError, "max_body_bytes", job(4), max_body_bytes=too_high)
        # Nesting too deep to encode is the same clear refusal as any other bad payload
        deep = {"job": "elsewhere.job", "deep": deeply_nested(5000)}
        refused(conn, InvalidPayload, "nested too deeply", deep, key="deep-1")
        # Another job's key space is not the producer's to take
        hijack = {"job": "receipt.send", "_idempotency_key": "test.db:victim"}
        refused(conn, KeyDerivationError, "key space of job 'test.db'", hijack, registry=registry)
    assert kit.sql("SELECT count(*) FROM outbox") == [(0,)]
    # And the victim's own job is then enqueued under its natural key
    enqueue_rows(kit, job("victim"))
    assert kit.sql("SELECT idem_key FROM outbox") == [("test.db:victim",)]


def test_the_relay_publishes_no_row_enqueue_would_refuse_now_and_goes_on(kit: Harness) -> None:
    # Given rows older code wrote (by hand here): one above the body limit, one taking another
    # job's key, then an ordinary one
    oversized = {"job": "elsewhere.job", "_idempotency_key": "big-1", "blob": "x" * MAX_BODY_BYTES}
    hijack = {"job": "receipt.send", "_idempotency_key": "test.db:victim"}
    for key, body in (("big-1", oversized), ("test.db:victim", hijack)):
        kit.sql(
            "INSERT INTO outbox (idem_key, job, body, payload_sha256) VALUES (%s, %s, %s, 'x')",
            (key, body["job"], json.dumps(body)),
        )
    enqueue_rows(kit, job("fine"))
    # When the relay runs
    report = relay_for(kit).run(lambda: PLENTY)
    # Then only the ordinary row is published; the other two are dead with their dead letters
    assert (report.published, report.dead) == (1, 2)
    assert queued(kit) == 1
    letters = dict(kit.sql("SELECT idem_key, reason FROM dead_letters"))
    assert "above the outbox's limit" in letters["big-1"]
    assert "key space of job 'test.db'" in letters["test.db:victim"]
    assert kit.sql("SELECT state FROM outbox ORDER BY seq") == [
        ("dead",),
        ("dead",),
        ("published",),
    ]


def test_a_consume_of_bodies_at_the_limit_stays_within_the_clients_cap(kit: Harness) -> None:
    # Given a full consume's worth of rows, each body just within the outbox's limit
    filler = MAX_BODY_BYTES - 200
    with psycopg.connect(kit.database_url) as conn, conn.transaction():
        for n in range(CONSUME_CAP):
            enqueue(conn, {**job(n), "blob": "y" * filler}, registry=kit.registry)
    # When the relay publishes them all
    assert relay_for(kit, batch_size=CONSUME_CAP).run(lambda: PLENTY).published == CONSUME_CAP
    # Then one consume by the drain's client (its default 16 MiB cap) reads every one of them
    messages = kit.client.consume(QUEUE, CONSUME_CAP)
    assert len(messages) == CONSUME_CAP
    assert all(len(m.payload["blob"]) == filler for m in messages)
