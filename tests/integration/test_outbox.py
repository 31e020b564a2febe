"""The producers' outbox on a real PostgreSQL and the emulator over HTTP: what a producer's
transaction enqueues is published once it commits, at least once whatever the relay and Infrai
do, and its effect happens once; what rolls back is never published."""

from __future__ import annotations

import json
import signal
import time
from typing import Any

import psycopg
import pytest
from drainkit import QUEUE, Harness, RecordingAlerter, run_cli, run_concurrently, start_cli
from drainkit import run_until_killed as run_child_until_killed

from infrai_jobs.errors import (
    InfraiError,
    InvalidPayload,
    KeyDerivationError,
    OutboxError,
    OutboxKeyConflict,
)
from infrai_jobs.ledger.postgres import LedgerConnector
from infrai_jobs.operations.alerting import AlertCheck, AlertThresholds
from infrai_jobs.outbox import enqueue
from infrai_jobs.outbox.relay import OutboxRelay, RelayConfig
from infrai_jobs.outbox.status import read_status
from infrai_jobs.work.admin import WorkStore
from infrai_local.cli import EXIT_INTERRUPTED

# A pass never short of time: the relay's own budget check is not what these tests are about.
PLENTY = 120_000


def relay_for(kit: Harness, *, batch_size: int = 10) -> OutboxRelay:
    return OutboxRelay(
        LedgerConnector(kit.database_url, application_name="test-outbox"),
        kit.client,
        RelayConfig(default_queue=QUEUE, batch_size=batch_size, base_delay_seconds=0),
    )


def job(n: int | str) -> dict[str, Any]:
    return {"job": "test.db", "id": str(n)}


def enqueue_committed(kit: Harness, payload: dict[str, Any], **options: Any) -> None:
    with psycopg.connect(kit.database_url) as conn, conn.transaction():
        enqueue(conn, payload, registry=kit.registry, **options)


def committed_rows(kit: Harness, count: int) -> None:
    """``count`` intents of the test job (``job(0)`` ...), enqueued in one committed transaction."""
    with psycopg.connect(kit.database_url) as conn, conn.transaction():
        for n in range(count):
            enqueue(conn, job(n), registry=kit.registry)


def publish_faults(kit: Harness, *, seed: int, error: float, throttle: float, drop: float) -> None:
    """Infrai failing, throttling (asking for no wait) and dropping the answer of that share of
    publishes each, drawn from ``seed``."""
    kit.faults(
        error_rate=error,
        rate_limit_rate=throttle,
        drop_response_rate=drop,
        retry_after_seconds=0,
        seed=seed,
        routes=["publish"],
    )


def queued(kit: Harness) -> int:
    stats = kit.client.stats(QUEUE)
    return stats.available_count + stats.in_flight_count


def drain_all(kit: Harness) -> None:
    for _ in range(50):
        if queued(kit) == 0:
            return
        kit.drain()
    raise AssertionError("the queue did not empty")


def relay_until_empty(relay: OutboxRelay) -> None:
    for _ in range(100):
        relay.run(lambda: PLENTY)
        if relay.status().pending == 0:
            return
    raise AssertionError("the outbox did not empty")


def injected_faults(kit: Harness) -> dict[str, int]:
    state = kit.control.request("GET", f"{kit.server.url}/_emulator/state")
    injected: dict[str, int] = json.loads(state.data)["data"]["faults_injected"]
    return injected


def outbox_states(kit: Harness) -> dict[str, int]:
    return dict(kit.sql("SELECT state, count(*) FROM outbox GROUP BY state"))  # type: ignore[arg-type]


def test_a_rolled_back_enqueue_publishes_nothing_and_a_committed_one_runs_once(
    kit: Harness,
) -> None:
    # Given one transaction that enqueues and rolls back, and one that enqueues and commits
    with psycopg.connect(kit.database_url) as conn:
        with conn.transaction(force_rollback=True):
            enqueue(conn, job("rolled-back"), registry=kit.registry)
        with conn.transaction():
            row = enqueue(conn, job("committed"), registry=kit.registry)
    assert row.idem_key == "test.db:committed"
    assert row.created
    # When the relay runs, then the drain
    report = relay_for(kit).run(lambda: PLENTY)
    # Then only the committed row was published, with Infrai's message id recorded
    assert report.published == 1
    assert queued(kit) == 1
    (message_id,) = kit.sql("SELECT message_id FROM outbox WHERE state = 'published'")[0]
    assert message_id == report.message_ids[0]
    assert kit.sql("SELECT count(*) FROM outbox WHERE idem_key = 'test.db:rolled-back'") == [(0,)]
    drain_all(kit)
    assert kit.effects("test.db:committed") == 1
    assert kit.effects("test.db:rolled-back") == 0


def test_the_same_intent_from_three_transactions_is_one_publish(kit: Harness) -> None:
    # Given a producer that enqueues one intent three times (its retries), each committed
    rows = []
    for attempt in range(3):
        with psycopg.connect(kit.database_url) as conn, conn.transaction():
            rows.append(
                enqueue(conn, job("inv_8812"), registry=kit.registry, correlation_id=f"c{attempt}")
            )
    # Then the first wrote the row and the others returned it
    assert [r.created for r in rows] == [True, False, False]
    assert len({r.seq for r in rows}) == 1
    # And the relay, run three times, published it once
    relay = relay_for(kit)
    published = sum(relay.run(lambda: PLENTY).published for _ in range(3))
    assert published == 1
    assert queued(kit) == 1
    # And a retry after the publish (within the retention) is still the same row
    with psycopg.connect(kit.database_url) as conn, conn.transaction():
        again = enqueue(conn, job("inv_8812"), registry=kit.registry)
    assert (again.created, again.state) == (False, "published")
    assert relay.run(lambda: PLENTY).published == 0


def write_and_enqueue(kit: Harness, conn: psycopg.Connection[Any], payload: Any) -> None:
    with conn.transaction():
        conn.execute("INSERT INTO business VALUES ('b1')")
        enqueue(conn, payload, registry=kit.registry)


def test_a_payload_the_schema_refuses_raises_inside_the_transaction(kit: Harness) -> None:
    # Given a business write and a payload the job's schema refuses (its id is missing)
    kit.sql("CREATE TABLE business (id text)")
    with psycopg.connect(kit.database_url) as conn:
        # When both are in one transaction, Then enqueue raises and the transaction rolls back
        with pytest.raises(KeyDerivationError):
            write_and_enqueue(kit, conn, {"job": "test.db"})
        # And an unknown job without a key is refused, naming the registered ones
        with pytest.raises(KeyDerivationError, match="unknown job"), conn.transaction():
            enqueue(conn, {"job": "test.dbb", "id": "1"}, registry=kit.registry)
        # And a NUL character is refused before the database sees it
        with pytest.raises(InvalidPayload, match="NUL"), conn.transaction():
            enqueue(conn, {**job(1), "note": "a\x00b"}, registry=kit.registry)
    assert kit.sql("SELECT count(*) FROM business") == [(0,)]
    assert kit.sql("SELECT count(*) FROM outbox") == [(0,)]


def test_enqueue_refuses_what_it_cannot_do_safely(kit: Harness) -> None:
    with psycopg.connect(kit.database_url, autocommit=True) as conn:
        # An autocommit connection outside a transaction would commit the row on its own
        with pytest.raises(OutboxError, match="transaction"):
            enqueue(conn, job(1), registry=kit.registry)
        with conn.transaction():
            enqueue(conn, job(1), registry=kit.registry)
        # The same key with different work is a conflict, not a retry
        with pytest.raises(OutboxKeyConflict), conn.transaction():
            enqueue(conn, {**job(1), "extra": True}, registry=kit.registry)
        # An unknown job is keyed by key= (sent as _idempotency_key, so the drain agrees)
        with conn.transaction():
            row = enqueue(conn, {"job": "elsewhere.job", "n": 1}, key="k-1")
        assert (row.idem_key, row.body["_idempotency_key"]) == ("k-1", "k-1")
        with pytest.raises(OutboxError, match="differs"), conn.transaction():
            enqueue(conn, {"job": "x", "_idempotency_key": "a"}, key="b")
        with pytest.raises(KeyDerivationError, match="registry="), conn.transaction():
            enqueue(conn, {"job": "elsewhere.job", "n": 2})
    assert outbox_states(kit) == {"pending": 2}


def test_two_relays_at_once_never_publish_the_same_row(kit: Harness) -> None:
    # Given sixty committed rows
    committed_rows(kit, 60)
    # When two relays run at the same time, in small batches
    first, second = relay_for(kit, batch_size=3), relay_for(kit, batch_size=3)
    reports = run_concurrently(
        lambda: first.run(lambda: PLENTY), lambda: second.run(lambda: PLENTY)
    )
    # Then every row was published exactly once between them
    assert sum(r.published for r in reports) == 60
    assert queued(kit) == 60
    assert outbox_states(kit) == {"published": 60}
    ids = [i for r in reports for i in r.message_ids]
    assert len(set(ids)) == 60


def test_infrai_5xx_429_and_lost_answers_lose_nothing_and_run_each_effect_once(
    kit: Harness,
) -> None:
    # Given forty committed rows and an Infrai that fails, throttles and drops answers
    committed_rows(kit, 40)
    publish_faults(kit, seed=38, error=0.25, throttle=0.15, drop=0.2)
    # When relays run until the outbox is empty
    relay_until_empty(relay_for(kit, batch_size=7))
    kit.faults()
    # Then every row is published, some more than once (a dropped answer is published again)
    assert outbox_states(kit) == {"published": 40}
    assert queued(kit) >= 40
    injected = injected_faults(kit)
    assert injected["error"] > 0
    assert injected["rate_limited"] > 0
    assert injected["drop_response"] > 0
    # And once drained, every effect happened once
    drain_all(kit)
    counts = kit.sql("SELECT idem_key, count(*) FROM test_effects GROUP BY idem_key")
    assert len(counts) == 40
    assert {c for _, c in counts} == {1}


KILL_AFTER_PUBLISHES = """
import os, signal, sys
from infrai_jobs.ledger.postgres import LedgerConnector
from infrai_jobs.outbox.relay import OutboxRelay, RelayConfig
from infrai_jobs.queue.client import InfraiClient, HttpRetryPolicy
from infrai_jobs.queue.ports import ForwardingQueue

url, database_url, kill_after = sys.argv[1], sys.argv[2], int(sys.argv[3])
published = 0


class KilledAfterPublishing(ForwardingQueue):
    def publish(self, queue, body, *, delay_seconds=None, retry=None):
        global published
        message_id = super().publish(queue, body, delay_seconds=delay_seconds, retry=retry)
        published += 1
        if published >= kill_after:
            os.kill(os.getpid(), signal.SIGKILL)  # after Infrai took it, before the mark
        return message_id


client = InfraiClient(url, "test-key", retry=HttpRetryPolicy(base_delay=0.01))
relay = OutboxRelay(
    LedgerConnector(database_url, application_name="killed-relay"),
    KilledAfterPublishing(client),
    RelayConfig(default_queue="billing-jobs", batch_size=6, base_delay_seconds=0),
)
relay.run(lambda: 120_000)
"""


def test_relays_killed_mid_batch_again_and_again_publish_every_row_and_run_it_once(
    kit: Harness,
) -> None:
    # Given thirty committed rows and an Infrai that fails now and then
    committed_rows(kit, 30)
    publish_faults(kit, seed=7, error=0.1, throttle=0.1, drop=0.1)
    # When relays are SIGKILLed after a publish Infrai took, at a different point each time
    for kill_after in (4, 1, 9, 2):
        run_child_until_killed(
            KILL_AFTER_PUBLISHES, kit.server.url, kit.database_url, str(kill_after)
        )
        # Then the row in flight was never marked: the kill rolled the batch back
        assert outbox_states(kit).get("pending", 0) > 0
    # And a relay that lives finishes the outbox
    relay_until_empty(relay_for(kit))
    kit.faults()
    # Then every committed row is published, at least once
    assert outbox_states(kit) == {"published": 30}
    assert queued(kit) > 30
    # And every effect happened once
    drain_all(kit)
    counts = kit.sql("SELECT idem_key, count(*) FROM test_effects GROUP BY idem_key")
    assert len(counts) == 30
    assert {c for _, c in counts} == {1}


def test_a_payload_infrai_refuses_for_good_is_an_outbox_dead_letter_that_pages(
    kit: Harness,
) -> None:
    # Given a row Infrai will refuse (nested deeper than it serves), beside a good one
    deep: Any = "leaf"
    for _ in range(900):
        deep = [deep]
    with psycopg.connect(kit.database_url) as conn, conn.transaction():
        enqueue(conn, {"job": "elsewhere.job", "deep": deep}, key="too-deep")
        enqueue(conn, job("fine"), registry=kit.registry)
    # When the relay runs
    report = relay_for(kit).run(lambda: PLENTY)
    # Then the good one is published and the refused one is dead, with one dead letter
    assert (report.published, report.dead) == (1, 1)
    assert outbox_states(kit) == {"published": 1, "dead": 1}
    (reason,) = kit.sql("SELECT reason FROM dead_letters WHERE idem_key = 'too-deep'")[0]
    assert "VALIDATION_ERROR" in reason
    # And the DLQ view lists it, and the watcher counts it
    shown = run_cli(kit, "dlq", "--json")
    assert shown.returncode == 0, shown.stderr
    listed = json.loads(shown.stdout)
    assert [m["idem_key"] for m in listed["messages"]] == ["too-deep"]
    alerter = RecordingAlerter()
    alert = AlertCheck(kit.client, kit.database_url, alerter, AlertThresholds()).run([QUEUE])
    assert alert.ledger_dead_letters[QUEUE] == 1
    assert alerter.sent
    # And running the relay again neither publishes it nor records a second letter
    assert relay_for(kit).run(lambda: PLENTY).dead == 0
    assert kit.sql("SELECT count(*) FROM dead_letters") == [(1,)]


def test_a_wrong_setting_stops_the_pass_and_keeps_the_row(kit: Harness) -> None:
    # Given two rows for the relay's own queue, and a relay whose queue Infrai does not have
    committed_rows(kit, 2)
    relay = OutboxRelay(
        LedgerConnector(kit.database_url, application_name="test-outbox"),
        kit.client,
        RelayConfig(default_queue="no-such-queue", base_delay_seconds=0),
    )
    # When the relay runs, Then it raises Infrai's refusal at the first row and stops
    with pytest.raises(InfraiError, match="QUEUE_NOT_FOUND"):
        relay.run(lambda: PLENTY)
    # And that row waits with the error; the one behind it was not tried
    rows = kit.sql("SELECT state, attempts, last_error FROM outbox ORDER BY seq")
    assert [(state, attempts) for state, attempts, _ in rows] == [("pending", 1), ("pending", 0)]
    assert "QUEUE_NOT_FOUND" in rows[0][2]


def test_outbox_status_json_agrees_with_the_database(kit: Harness) -> None:
    # Given pending, published and dead rows, one of them published over an hour ago
    committed_rows(kit, 5)
    relay_for(kit, batch_size=2).run(lambda: PLENTY, max_batches=1)
    kit.sql("UPDATE outbox SET settled_at = now() - interval '2 hours' WHERE seq = 1")
    kit.sql("UPDATE outbox SET enqueued_at = now() - interval '90 seconds' WHERE seq = 3")
    # When the operator asks
    shown = run_cli(kit, "outbox", "status", "--json")
    # Then the command's figures are the database's
    assert shown.returncode == 0, shown.stderr
    status = json.loads(shown.stdout)
    assert status["pending"] == kit.sql("SELECT count(*) FROM outbox WHERE state = 'pending'")[0][0]
    assert status["pending"] == 3
    assert status["published_last_hour"] == 1
    assert status["dead"] == 0
    assert 90 <= status["oldest_pending_age_seconds"] < 3600
    # And the human form says the same
    human = run_cli(kit, "outbox", "status")
    assert human.returncode == 0, human.stderr
    assert "pending" in human.stdout
    assert "3" in human.stdout.split("pending", 1)[1].splitlines()[0]


def test_outbox_relay_from_the_command_line_publishes_and_reports(kit: Harness) -> None:
    # Given two committed rows
    for n in range(2):
        enqueue_committed(kit, job(n))
    # When the operator runs one pass
    relayed = run_cli(kit, "outbox", "relay", "--json")
    # Then both went out, and the report says so with the outbox after it
    assert relayed.returncode == 0, relayed.stderr
    document = json.loads(relayed.stdout)
    assert document["published"] == 2
    assert document["outbox"]["pending"] == 0
    assert queued(kit) == 2
    # And without Infrai's URL the command refuses in one line, publishing nothing
    enqueue_committed(kit, job(3))
    refused = run_cli(kit, "outbox", "relay", INFRAI_BASE_URL="")
    assert refused.returncode == 2
    assert "INFRAI_BASE_URL" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert read_pending(kit) == 1


def read_pending(kit: Harness) -> int:
    with psycopg.connect(kit.database_url) as conn:
        return read_status(conn).pending


def test_published_rows_are_pruned_with_the_ledgers_retention(kit: Harness) -> None:
    # Given a published row past the retention, a recent one, and a pending old one
    for n in range(3):
        enqueue_committed(kit, job(n))
    relay_for(kit, batch_size=2).run(lambda: PLENTY, max_batches=1)
    kit.sql("UPDATE outbox SET settled_at = now() - interval '31 days' WHERE seq = 1")
    kit.sql("UPDATE outbox SET enqueued_at = now() - interval '40 days' WHERE seq = 3")
    # When the prune runs with a 30-day retention
    result = WorkStore(kit.database_url).prune(older_than_days=30)
    # Then only the old published row is gone; the pending one is never pruned
    assert result.outbox_deleted == 1
    assert sorted(r[0] for r in kit.sql("SELECT seq FROM outbox")) == [2, 3]
    # And its key may be enqueued again
    with psycopg.connect(kit.database_url) as conn, conn.transaction():
        assert enqueue(conn, job(0), registry=kit.registry).created


def test_a_following_relay_is_woken_by_the_commit_and_stops_cleanly_on_ctrl_c(
    kit: Harness,
) -> None:
    # Given `outbox relay --follow` polling only every 60 s, listening for commits
    relay = start_cli(kit, "outbox", "relay", "--follow", "--poll-seconds", "60", "--json")
    try:
        assert relay.stderr is not None
        assert relay.stderr.readline().startswith("relaying; listening on")
        # When a producer commits a row with notify=True
        enqueue_committed(kit, job("followed"), notify=True)
        # Then it is published long before the next poll: the commit's NOTIFY woke the relay
        deadline = time.monotonic() + 30
        while queued(kit) == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert queued(kit) == 1
        assert read_pending(kit) == 0
    finally:
        # And Ctrl-C stops it in one line, with no traceback
        relay.send_signal(signal.SIGINT)
        out, err = relay.communicate(timeout=30)
    assert relay.returncode == EXIT_INTERRUPTED, err
    assert json.loads(out.splitlines()[0])["published"] == 1
    assert "Traceback" not in err
    assert err.strip().endswith("error: interrupted")
