"""DlqAlertFunction's core: alert on rising edges, remind, resolve once, never on missing data.

Real PostgreSQL for the alert state, the emulator over HTTP for stats, and SNS through boto3
against moto.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import boto3
import psycopg
import pytest
import urllib3
from drainkit import watcher_metrics
from moto import mock_aws
from moto.sns.models import sns_backends

from infrai_jobs.errors import InfraiError
from infrai_jobs.jobs.keys import payload_fingerprint
from infrai_jobs.operations.alerting import AlertCheck, AlertThresholds, SnsAlerter
from infrai_jobs.operations.dead_letters import DeadLetterStore, collect
from infrai_jobs.queue.client import HttpRetryPolicy, InfraiClient
from infrai_jobs.work.admin import WorkStore
from infrai_local.migrations import apply_migrations
from infrai_local.sandbox import emulator as emulator_module
from infrai_local.sandbox.queues import ensure_queue

QUEUE = "billing-jobs"
DLQ = "billing-jobs-dlq"
REGION = "us-east-1"
ACCOUNT = "123456789012"
# Who the watcher's changes are recorded as.
WATCHER = "DlqAlertFunction"


class RecordingAlerter:
    def __init__(self, delay: float = 0.0) -> None:
        self.sent: list[tuple[str, str]] = []
        self.delay = delay
        self.lock = threading.Lock()

    def publish(self, subject: str, message: str) -> None:
        time.sleep(self.delay)
        with self.lock:
            self.sent.append((subject, message))


class Stage:
    def __init__(self, database_url: str) -> None:
        self.database_url = database_url
        self.server = emulator_module.start_in_thread()
        self.client = InfraiClient(
            self.server.url, "k", retry=HttpRetryPolicy(max_attempts=2, base_delay=0.01)
        )
        ensure_queue(self.client, QUEUE, dlq=DLQ)
        self.http = urllib3.PoolManager()

    def check(self, alerter: Any, **thresholds: int) -> AlertCheck:
        return AlertCheck(self.client, self.database_url, alerter, AlertThresholds(**thresholds))

    def advance(self, seconds: float) -> None:
        self.http.request(
            "POST", f"{self.server.url}/_emulator/clock", json={"advance_seconds": seconds}
        )

    def dead_letter(self, n: int = 1) -> None:
        for i in range(n):
            self.client.publish(QUEUE, {"job": "poison", "n": i})
        for _ in range(3):
            assert self.client.consume(QUEUE, 10)
            self.advance(301)

    def sql(self, query: str, params: Any = None) -> None:
        with psycopg.connect(self.database_url, autocommit=True) as conn:
            conn.execute(query, params)

    def close(self) -> None:
        self.client.close()
        self.http.clear()
        self.server.stop()


@pytest.fixture
def stage(database_url: str) -> Iterator[Stage]:
    with psycopg.connect(database_url, autocommit=True) as conn:
        apply_migrations(conn)
    s = Stage(database_url)
    yield s
    s.close()


def test_a_rising_dlq_count_alerts_once_with_the_numbers_and_next_steps(stage: Stage) -> None:
    alerter = RecordingAlerter()
    # Given a poison message dead-lettered
    stage.dead_letter()
    # When the watcher runs twice with the count unchanged
    first = stage.check(alerter).run([QUEUE])
    stage.check(alerter).run([QUEUE])  # a cold start: a new object, same state in Postgres
    # Then exactly one alert was sent, saying how much, from what, and what to run
    assert len(alerter.sent) == 1
    subject, message = alerter.sent[0]
    assert subject == "[infrai-jobs] 1 new dead letter(s) on billing-jobs"
    assert "went from 0 to 1" in message
    assert "infrai-jobs dlq --queue billing-jobs" in message
    assert first.sent[0]["verdict"] == "alert"
    # And a further rise alerts with the delta
    stage.dead_letter(2)
    stage.check(alerter).run([QUEUE])
    assert alerter.sent[-1][0] == "[infrai-jobs] 2 new dead letter(s) on billing-jobs"
    assert "went from 1 to 3" in alerter.sent[-1][1]


def test_an_unchanged_count_reminds_after_the_interval(stage: Stage) -> None:
    alerter = RecordingAlerter()
    stage.dead_letter()
    stage.check(alerter, reminder_seconds=3600).run([QUEUE])
    # Given the last alert was two hours ago
    stage.sql("UPDATE alert_state SET alerted_at = now() - interval '2 hours'")
    # When the watcher runs
    stage.check(alerter, reminder_seconds=3600).run([QUEUE])
    stage.check(alerter, reminder_seconds=3600).run([QUEUE])
    # Then one reminder went out, not one per run
    assert [s for s, _ in alerter.sent] == [
        "[infrai-jobs] 1 new dead letter(s) on billing-jobs",
        "[infrai-jobs] still 1 dead letter(s) on billing-jobs",
    ]


def test_an_emptied_dlq_sends_one_resolved_message(stage: Stage) -> None:
    alerter = RecordingAlerter()
    stage.dead_letter()
    stage.check(alerter).run([QUEUE])
    # Given the dead letter was handled
    (dead,) = stage.client.consume(DLQ)
    stage.client.ack(DLQ, dead.receipt_handle)
    # When the watcher runs twice
    stage.check(alerter).run([QUEUE])
    stage.check(alerter).run([QUEUE])
    # Then one resolved message, and quiet after it
    assert [s for s, _ in alerter.sent][1:] == [
        "[infrai-jobs] RESOLVED: no dead letters left on billing-jobs"
    ]


def test_dead_letters_moved_into_the_ledger_keep_the_alert_until_each_is_resolved(
    stage: Stage,
) -> None:
    alerter = RecordingAlerter()
    stage.dead_letter(2)
    stage.check(alerter).run([QUEUE])
    # Given both dead letters were moved from Infrai's DLQ into the ledger
    store = DeadLetterStore(WorkStore(stage.database_url))
    moved = collect(stage.client, store, dlq=DLQ, main_queue=QUEUE, key_of=None)
    assert (moved.recorded, moved.acked) == (2, 2)
    assert stage.client.stats(QUEUE).dlq_count == 0
    # When the watcher runs, Then it counts them in the ledger: no resolved message, no new one
    report = stage.check(alerter).run([QUEUE])
    assert report.as_dict()["queues"][0]["ledger_dead_letters"] == 2
    assert len(alerter.sent) == 1
    assert "0 in the dead-letter queue of billing-jobs" not in alerter.sent[0][1]
    # When one is discarded, Then it is still not resolved
    first, second = store.rows(QUEUE)
    assert store.discard(first.message_id, actor="on-call")
    stage.check(alerter).run([QUEUE])
    assert len(alerter.sent) == 1
    # When the other is discarded too, Then one resolved message
    assert store.discard(second.message_id, actor="on-call")
    stage.check(alerter).run([QUEUE])
    assert [s for s, _ in alerter.sent][1:] == [
        "[infrai-jobs] RESOLVED: no dead letters left on billing-jobs"
    ]


def test_an_alert_counts_the_dlq_and_the_ledger_together(stage: Stage) -> None:
    alerter = RecordingAlerter()
    # Given one dead letter moved into the ledger and a new one still in Infrai's DLQ
    stage.dead_letter()
    store = DeadLetterStore(WorkStore(stage.database_url))
    assert collect(stage.client, store, dlq=DLQ, main_queue=QUEUE, key_of=None).recorded == 1
    stage.dead_letter()
    # When the watcher runs
    stage.check(alerter).run([QUEUE])
    # Then it alerts on both, and says where each is
    ((subject, message),) = alerter.sent
    assert subject == "[infrai-jobs] 2 new dead letter(s) on billing-jobs"
    assert "1 in the dead-letter queue of billing-jobs (dlq_count), 1 moved into the ledger" in (
        message
    )


def test_dead_letters_of_work_the_ledger_shows_done_are_resolved_before_they_count(
    stage: Stage, capsys: pytest.CaptureFixture[str]
) -> None:
    alerter = RecordingAlerter()
    # Given three dead letters moved into the ledger, keyed by their number
    stage.dead_letter(3)
    store = DeadLetterStore(WorkStore(stage.database_url))
    moved = collect(stage.client, store, dlq=DLQ, main_queue=QUEUE, key_of=_poison_key)
    assert moved.recorded == 3
    # And the ledger shows the first one's work done, the second's key done for other work (a
    # conflict) and the third's still running under its lease
    for n, state, work in ((0, "done", {"job": "poison", "n": 0}), (1, "done", {"other": 1})):
        stage.sql(
            "INSERT INTO job_claims (idem_key, state, message_id, payload_sha256)"
            " VALUES (%s, %s, 'm', %s)",
            (f"poison:{n}", state, payload_fingerprint(work)),
        )
    stage.sql(
        "INSERT INTO job_claims (idem_key, state, message_id, lease_until)"
        " VALUES ('poison:2', 'running', 'm', now() + interval '5 minutes')"
    )
    # When the watcher runs
    report = stage.check(alerter).run([QUEUE])
    # Then the done one was resolved before counting: two are counted, and two paged
    assert report.ledger_dead_letters[QUEUE] == 2
    assert [s for s, _ in alerter.sent] == ["[infrai-jobs] 2 new dead letter(s) on billing-jobs"]
    # And the metric DlqCountAlarm pages on says two
    documents = watcher_metrics(report, capsys)
    per_queue = next(d for d in documents if d.get("queue") == QUEUE)
    assert per_queue["DeadLetters"] == [2.0]
    # And the letter says so, as the watcher's, and the key's history records it with the claim
    with psycopg.connect(stage.database_url, autocommit=True) as conn:
        letters = conn.execute(
            "SELECT idem_key, resolution, resolved_by FROM dead_letters ORDER BY idem_key"
        ).fetchall()
        history = conn.execute(
            "SELECT idem_key, action, actor, before -> 'claim' ->> 'state' FROM claim_history"
        ).fetchall()
    assert letters == [
        ("poison:0", "done", WATCHER),
        ("poison:1", None, None),
        ("poison:2", None, None),
    ]
    assert history == [("poison:0", "dead_letter_done", WATCHER, "done")]
    # And a second pass finds nothing more to resolve
    again = stage.check(alerter).run([QUEUE])
    assert again.ledger_dead_letters[QUEUE] == 2
    with psycopg.connect(stage.database_url, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM claim_history").fetchone() == (1,)


def _poison_key(payload: Any) -> str:
    return f"poison:{payload['n']}"


def _one_stuck_claim_alerted(
    stage: Stage, alerter: RecordingAlerter, *, oldest_at_least: float
) -> str:
    """Run the watcher with a 15-minute stuck threshold; assert it found one stuck claim, its
    oldest running claim at least ``oldest_at_least`` seconds old, and sent that one alert.
    Returns the alert's message."""
    report = stage.check(alerter, stuck_claim_seconds=900).run([QUEUE])
    assert report.stuck.count == 1
    assert report.stuck.oldest_running_age_seconds >= oldest_at_least
    ((subject, message),) = alerter.sent
    assert subject == "[infrai-jobs] 1 new stuck claim(s) in the ledger"
    return message


def test_stuck_claims_alert_and_name_the_command(stage: Stage) -> None:
    alerter = RecordingAlerter()
    stage.sql(
        "INSERT INTO job_claims (idem_key, state, message_id, effect, error, lease_until) VALUES"
        " ('receipt.send:inv_1', 'running', 'qmsg_a', 'external', 'effect uncertain: timeout',"
        "  now() - interval '1 second'),"
        " ('receipt.send:inv_2', 'running', 'qmsg_b', 'external', NULL, NULL)"
    )
    # Only the flagged claim is stuck; the fresh unflagged one is merely running
    message = _one_stuck_claim_alerted(stage, alerter, oldest_at_least=0)
    assert "infrai-jobs claims stuck" in message


def test_a_claim_taken_over_by_a_live_delivery_is_not_reported_stuck(stage: Stage) -> None:
    alerter = RecordingAlerter()
    # Given two old running claims, one of them taken over a minute ago by a redelivery
    # (a takeover keeps claimed_at and sets updated_at and a fresh lease)
    stage.sql(
        "INSERT INTO job_claims (idem_key, state, message_id, effect, claimed_at, updated_at,"
        " lease_until) VALUES"
        " ('digest.build:t1', 'running', 'qmsg_a', 'external_idempotent',"
        "  now() - interval '2 hours', now() - interval '1 minute', now() + interval '5 minutes'),"
        " ('digest.build:t2', 'running', 'qmsg_b', 'external_idempotent',"
        "  now() - interval '2 hours', now() - interval '2 hours', now() - interval '1 hour')"
    )
    # When the watcher runs with a 15-minute threshold
    # Then only the claim nobody has touched for two hours is stuck, and it is the oldest
    _one_stuck_claim_alerted(stage, alerter, oldest_at_least=7000)


class _HeldStats:
    """The watcher's queue, for a run that reads the stats and then stalls until released."""

    def __init__(self, client: InfraiClient) -> None:
        self.client = client
        self.read = threading.Event()
        self.go = threading.Event()

    def stats(self, name: str) -> Any:
        stats = self.client.stats(name)
        self.read.set()
        assert self.go.wait(10)
        return stats


def test_an_overlapping_run_with_older_numbers_does_not_undo_a_later_one(stage: Stage) -> None:
    alerter = RecordingAlerter()
    # Given three dead letters, already alerted
    stage.dead_letter(3)
    stage.check(alerter).run([QUEUE])
    # And a run that read dlq_count = 3 and then stalled (a repeated schedule event, say)
    held = _HeldStats(stage.client)
    slow = AlertCheck(held, stage.database_url, alerter, AlertThresholds())
    errors: list[BaseException] = []

    def run_slow() -> None:
        try:
            slow.run([QUEUE])
        except BaseException as exc:  # reported by the assertion below
            errors.append(exc)

    thread = threading.Thread(target=run_slow)
    thread.start()
    assert held.read.wait(10)
    # When the dead letters are handled and a later run sees the DLQ empty
    for dead in stage.client.consume(DLQ, 10):
        stage.client.ack(DLQ, dead.receipt_handle)
    stage.check(alerter).run([QUEUE])
    # And then the stalled run goes on with its older numbers
    held.go.set()
    thread.join(10)
    assert not errors
    # Then the last word is the later run's: resolved, and no false "3 new" after it
    assert [s for s, _ in alerter.sent] == [
        "[infrai-jobs] 3 new dead letter(s) on billing-jobs",
        "[infrai-jobs] RESOLVED: no dead letters left on billing-jobs",
    ]
    with psycopg.connect(stage.database_url) as conn:
        row = conn.execute("SELECT value FROM alert_state WHERE signal = 'dlq'").fetchone()
    assert row == (0,)


def test_an_old_backlog_alerts_that_the_drain_is_behind(stage: Stage) -> None:
    alerter = RecordingAlerter()
    stage.client.publish(QUEUE, {"job": "waiting"})
    stage.advance(1000)
    stage.check(alerter, backlog_age_seconds=900).run([QUEUE])
    ((subject, message),) = alerter.sent
    assert subject == "[infrai-jobs] billing-jobs is falling behind (oldest 1000 s)"
    assert "threshold 900 s" in message


def test_two_concurrent_runs_send_one_alert(stage: Stage) -> None:
    # Given a slow alerter, so both runs are inside the check at once
    alerter = RecordingAlerter(delay=0.3)
    stage.dead_letter()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            stage.check(alerter).run([QUEUE])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert errors == []
    assert len(alerter.sent) == 1


def test_a_failing_stats_call_raises_and_never_sends_all_clear(stage: Stage) -> None:
    alerter = RecordingAlerter()
    stage.dead_letter()
    stage.check(alerter).run([QUEUE])
    # Given Infrai answers 500 to everything
    stage.http.request("POST", f"{stage.server.url}/_emulator/faults", json={"error_rate": 1.0})
    # When the watcher runs, Then it raises, and no "resolved" went out
    with pytest.raises(InfraiError) as caught:
        stage.check(alerter).run([QUEUE])
    assert caught.value.code == "INTERNAL"
    assert len(alerter.sent) == 1


def test_one_unreadable_queue_does_not_silence_the_others(stage: Stage) -> None:
    alerter = RecordingAlerter()
    # Given a dead letter on billing-jobs, and a watched queue name Infrai does not know
    stage.dead_letter()
    # When the watcher runs over both
    with pytest.raises(InfraiError) as caught:
        stage.check(alerter).run(["no-such-queue", QUEUE])
    # Then billing-jobs was still judged and paged, and the run still failed (Errors alarm)
    assert caught.value.code == "QUEUE_NOT_FOUND"
    assert [s for s, _ in alerter.sent] == ["[infrai-jobs] 1 new dead letter(s) on billing-jobs"]


def test_alerts_go_to_sns_through_boto3(stage: Stage, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": REGION,
    }.items():
        monkeypatch.setenv(name, value)
    with mock_aws():
        topic_arn = boto3.client("sns", region_name=REGION).create_topic(Name="alerts")["TopicArn"]
        stage.dead_letter()
        stage.check(SnsAlerter(topic_arn, region=REGION)).run([QUEUE])
        sent = sns_backends[ACCOUNT][REGION].topics[topic_arn].sent_notifications
        ((_id, message, subject, _attrs, _group),) = sent
        assert subject == "[infrai-jobs] 1 new dead letter(s) on billing-jobs"
        assert "infrai-jobs dlq --queue billing-jobs" in message


def test_metrics_are_emitted_as_emf_per_queue(
    stage: Stage, capsys: pytest.CaptureFixture[str]
) -> None:
    stage.dead_letter()
    report = stage.check(RecordingAlerter()).run([QUEUE])
    documents = watcher_metrics(report, capsys)
    per_queue = next(d for d in documents if d.get("queue") == QUEUE)
    assert per_queue["DlqCount"] == [1.0]
    assert (per_queue["LedgerDeadLetters"], per_queue["DeadLetters"]) == ([0.0], [1.0])
    assert per_queue["_aws"]["CloudWatchMetrics"][0]["Dimensions"] == [["queue", "service"]]
    ledger = next(d for d in documents if "StuckClaims" in d)
    assert ledger["StuckClaims"] == [0.0]
    assert ledger["AlertsSent"] == [1.0]
    assert all("idem_key" not in json.dumps(d["_aws"]) for d in documents)
