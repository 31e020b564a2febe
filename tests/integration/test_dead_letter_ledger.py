"""Dead letters live in the ledger: whatever reads Infrai's DLQ records each letter first, acks it
only after that row committed, and every view, discard and redrive works on the rows. Against the
emulator over HTTP (its clock makes dead-lettering quick), a real PostgreSQL, and the
``infrai-jobs`` command in a child process."""

from __future__ import annotations

import json
import logging
import textwrap
from typing import Any

import pytest
from drainkit import DLQ, QUEUE, Harness, RecordingAlerter, run_cli, run_until_killed

from infrai_jobs.operations.alerting import AlertCheck, AlertThresholds
from infrai_jobs.operations.dead_letters import DeadLetterStore, collect
from infrai_jobs.work.admin import WorkStore

RECEIPTS = [
    {"job": "receipt.send", "invoice_id": f"inv_{name}", "email": f"{name}@example.com"}
    for name in ("a", "b", "c")
]
# Nothing listens on port 1: the ledger cannot be reached. The password must never be shown.
UNREACHABLE = "postgresql://ops:hunter2-secret@127.0.0.1:1/ledger"


def _dead_letter(kit: Harness, payloads: list[dict[str, Any]]) -> None:
    """Publish each payload and let three deliveries of it go unacked: Infrai dead-letters it."""
    for payload in payloads:
        kit.publish(payload)
    for _ in range(3):
        assert len(kit.client.consume(QUEUE, 10)) == len(payloads)
        kit.advance()
    assert kit.client.stats(QUEUE).dlq_count == len(payloads)


def _listed(kit: Harness, **env: str) -> list[dict[str, Any]]:
    finished = run_cli(kit, "dlq", "--json", **env)
    assert finished.returncode == 0, finished.stderr
    rows: list[dict[str, Any]] = json.loads(finished.stdout)["messages"]
    return rows


def _watch(kit: Harness, alerter: RecordingAlerter) -> None:
    AlertCheck(kit.client, kit.database_url, alerter, AlertThresholds()).run([QUEUE])


def test_the_ledger_keeps_dead_letters_through_reads_failures_discards_and_a_redrive(
    kit: Harness,
) -> None:
    alerter = RecordingAlerter()
    # Given three jobs dead-lettered, and the watcher's alert about them
    _dead_letter(kit, RECEIPTS)
    _watch(kit, alerter)
    assert alerter.sent == ["[infrai-jobs] 3 new dead letter(s) on billing-jobs"]
    # When `dlq --json` runs twice in a row, Then both list the same three, with their keys
    first, second = _listed(kit), _listed(kit)
    keys = [f"receipt.send:inv_{name}" for name in ("a", "b", "c")]
    assert sorted(row["idem_key"] for row in first) == keys
    assert second == first
    assert all(row["deliveries"] == 3 for row in first)
    # When `dlq` runs with a ledger that cannot be reached
    failed = run_cli(kit, "dlq", DATABASE_URL=UNREACHABLE)
    # Then it fails in one line, shows no secret, and the next `dlq --json` still lists three
    assert failed.returncode != 0
    assert len(failed.stderr.strip().splitlines()) == 1, failed.stderr
    assert "Traceback" not in failed.stderr
    assert "hunter2" not in failed.stderr + failed.stdout
    assert sorted(row["idem_key"] for row in _listed(kit)) == keys
    # When one is discarded by its key, Then two are listed
    discarded = run_cli(kit, "dlq", "discard", "--key", keys[0], "--note", "customer left")
    assert discarded.returncode == 0, discarded.stderr
    assert sorted(row["idem_key"] for row in _listed(kit)) == keys[1:]
    # And the watcher still counts two: no resolved message yet
    _watch(kit, alerter)
    assert len(alerter.sent) == 1
    # When the rest is redriven and a drain runs
    redriven = run_cli(kit, "redrive", "--json")
    assert redriven.returncode == 0, redriven.stderr
    assert json.loads(redriven.stdout)["published"] == 2
    summary = kit.drain()
    # Then both finish exactly once, and the discarded one never runs
    assert summary.done == 2
    assert kit.sink.state.snapshot()["mails"] == {"inv_b": 1, "inv_c": 1}
    assert kit.row(keys[0]) is None
    # And `dlq` lists none, and the watcher resolves its alert
    assert _listed(kit) == []
    _watch(kit, alerter)
    assert alerter.sent[1:] == ["[infrai-jobs] RESOLVED: no dead letters left on billing-jobs"]
    # And the ledger keeps each letter's resolution
    resolutions = kit.sql(
        "SELECT idem_key, resolution, resolved_by FROM dead_letters ORDER BY idem_key"
    )
    assert [(key, how) for key, how, _ in resolutions] == [
        (keys[0], "discarded"),
        (keys[1], "redriven"),
        (keys[2], "redriven"),
    ]
    assert {who for _, _, who in resolutions} == {"on-call@example.com"}


def test_a_dead_letter_its_handler_failed_names_the_log_records_that_say_why(
    kit: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a job whose handler raises on each of its three deliveries: each releases its claim
    kit.publish({"job": "test.db", "id": "flaky", "mode": "transient"})
    with caplog.at_level(logging.WARNING, logger="infrai_jobs"):
        for _ in range(3):
            assert kit.drain().outcomes == {"retry": 1}
            kit.advance()
    # When on-call lists the dead letters
    (row,) = _listed(kit)
    # Then, with no claim to show, its reason names where the error is: the drain's log
    # records, by their action word and the letter's key
    assert (row["idem_key"], row["state"]) == ("test.db:flaky", None)
    assert "action retry" in row["reason"]
    assert "idem_key" in row["reason"]
    # And those records, one per delivery, hold the handler's exception and its traceback
    records = [
        r
        for r in caplog.records
        if getattr(r, "action", None) == "retry" and getattr(r, "idem_key", None) == "test.db:flaky"
    ]
    assert [getattr(r, "delivery_count", None) for r in records] == [1, 2, 3]
    for record in records:
        assert getattr(record, "detail", None) == "RuntimeError: simulated transient failure"
        assert record.exc_info is not None
        trace = logging.Formatter().formatException(record.exc_info)
        assert "in fail_as_asked" in trace
        assert trace.endswith("RuntimeError: simulated transient failure")


def test_a_failed_read_consumes_nothing(kit: Harness) -> None:
    # Given three dead letters
    _dead_letter(kit, RECEIPTS)
    # When dlq, discard and redrive --dry-run each run with the ledger unreachable
    for command in (
        ("dlq",),
        ("dlq", "discard", "--key", "receipt.send:inv_a"),
        ("redrive", "--dry-run"),
    ):
        failed = run_cli(kit, *command, DATABASE_URL=UNREACHABLE)
        assert failed.returncode != 0
        assert "Traceback" not in failed.stderr
    # Then every dead letter is still available in the DLQ: none was consumed or hidden
    stats = kit.client.stats(DLQ)
    assert (stats.available_count, stats.in_flight_count) == (3, 0)


# A process that moves the DLQ into the ledger and SIGKILLs itself at its first ack: after that
# dead letter's row committed, before Infrai heard about it.
KILLED_BETWEEN_COMMIT_AND_ACK = textwrap.dedent(
    """
    import os, signal, sys
    from drainkit import DLQ, QUEUE
    from infrai_jobs.operations.dead_letters import DeadLetterStore
    from infrai_jobs.work.admin import WorkStore
    from infrai_jobs.operations.dead_letters import collect
    from infrai_jobs.queue.client import InfraiClient

    client = InfraiClient(sys.argv[1], "test-key")
    client.ack = lambda queue, handle: os.kill(os.getpid(), signal.SIGKILL)
    store = DeadLetterStore(WorkStore(sys.argv[2]))
    collect(client, store, dlq=DLQ, main_queue=QUEUE, key_of=None)
    """
)


def test_a_crash_between_the_commit_and_the_ack_leaves_each_letter_recorded_once(
    kit: Harness,
) -> None:
    # Given three dead letters
    _dead_letter(kit, RECEIPTS)
    # When a reader records the first and is killed before acking it
    run_until_killed(KILLED_BETWEEN_COMMIT_AND_ACK, kit.server.url, kit.database_url)
    # Then the ledger holds that one, and it is still in the DLQ (in flight, unacked)
    assert kit.sql("SELECT count(*) FROM dead_letters") == [(1,)]
    assert kit.client.stats(QUEUE).dlq_count == 3
    # When it is visible again and the next read runs
    kit.advance()
    store = DeadLetterStore(WorkStore(kit.database_url))
    moved = collect(kit.client, store, dlq=DLQ, main_queue=QUEUE, key_of=None)
    # Then each letter is recorded once, the first found already there, and all are acked
    assert (moved.recorded, moved.already_recorded, moved.acked) == (2, 1, 3)
    rows = kit.sql("SELECT message_id, count(*) FROM dead_letters GROUP BY message_id")
    assert len(rows) == 3
    assert {count for _, count in rows} == {1}
    assert kit.client.stats(QUEUE).dlq_count == 0
    bodies = sorted((row.body for row in store.rows(QUEUE)), key=lambda body: body["invoice_id"])
    assert bodies == RECEIPTS


def test_a_redrive_racing_another_publishes_each_dead_letter_once(kit: Harness) -> None:
    # Given three dead letters already in the ledger
    _dead_letter(kit, RECEIPTS)
    store = DeadLetterStore(WorkStore(kit.database_url))
    assert collect(kit.client, store, dlq=DLQ, main_queue=QUEUE, key_of=None).recorded == 3
    published: list[str] = []
    raced: list[bool] = []

    def publish(payload: Any) -> None:
        published.append(payload["invoice_id"])
        kit.client.publish(QUEUE, payload)

    def publish_while_another_redrive_tries(row_id: str) -> Any:
        def publish_first(payload: Any) -> None:
            publish(payload)
            # Another redrive of the same row, on its own connection, while this one holds it
            raced.append(store.redrive(row_id, publish, actor="other"))

        return publish_first

    # When each row is redriven while a second redrive tries the same row
    rows = store.rows(QUEUE)
    for row in rows:
        assert store.redrive(
            row.message_id, publish_while_another_redrive_tries(row.message_id), actor="on-call"
        )
    # Then each was published once (the racing redrive skipped every locked row)
    assert raced == [False, False, False]
    assert sorted(published) == ["inv_a", "inv_b", "inv_c"]
    assert kit.client.stats(QUEUE).available_count == 3
    # And a later redrive finds nothing left to publish
    assert not any(store.redrive(row.message_id, publish, actor="on-call") for row in rows)
    assert kit.sql("SELECT DISTINCT resolved_by FROM dead_letters") == [("on-call",)]
