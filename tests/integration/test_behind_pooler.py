"""The framework behind a transaction-pooling proxy: a real PgBouncer in ``pool_mode =
transaction`` (``pgbouncer.py``), where each transaction may meet another server connection, as
behind RDS Proxy. Every connection the framework opens must rely on nothing its session holds
(docs/configuration.md, "Behind a connection pooler"): the drain with lanes, deferred runs, the
watcher's pass, the outbox relay and the operator verbs all run through it, every job done once
and no delivery spent on the proxy."""

from __future__ import annotations

import json
import logging
import queue
import signal
import threading
from typing import IO, Any

import fixture_jobs
import psycopg
import pytest
import urllib3
from drainkit import QUEUE, Harness, RecordingAlerter, harness, prepare_database, run_cli, start_cli
from pgbouncer import RunningPooler

from infrai_jobs.config.settings import AlertSettings, DrainSettings, OutboxRelaySettings
from infrai_jobs.drain.model import DrainSummary
from infrai_jobs.ledger.postgres import connect_to_ledger
from infrai_jobs.outbox import enqueue
from infrai_jobs.runtime.drain_service import DrainService
from infrai_jobs.runtime.factory import (
    make_alert_check,
    make_claims_admin,
    make_ledger,
    make_outbox_relay,
)

# psycopg's default: a statement run this many times on one connection is prepared on the server.
PSYCOPG_PREPARE_THRESHOLD = 5
BACKEND = "SELECT pg_backend_pid()"


def test_a_statement_run_often_still_runs_when_the_pooler_hands_over_another_server(
    pooled_database_url: str,
) -> None:
    # Given a ledger connection through the pooler
    with connect_to_ledger(pooled_database_url) as conn:
        # When it runs one statement more often than psycopg's threshold for preparing it,
        # each time in a transaction of its own
        servers = [conn.execute(BACKEND).fetchone() for _ in range(PSYCOPG_PREPARE_THRESHOLD + 3)]
    # Then every run answered, though they met different server connections
    assert None not in servers
    assert len(set(servers)) > 1


def _prepared_on_the_server(conn: psycopg.Connection[Any], statement: str) -> int:
    """How many statements ``conn`` holds prepared after running ``statement`` more often than
    psycopg's threshold."""
    for _ in range(PSYCOPG_PREPARE_THRESHOLD + 2):
        conn.execute(statement)
    (count,) = conn.execute("SELECT count(*) FROM pg_prepared_statements").fetchone() or (0,)
    return int(count)


@pytest.mark.parametrize(("setting", "drain_prepares"), [("", 0), ("false", 0), ("true", 1)])
def test_only_the_drains_connections_prepare_and_only_when_the_setting_says_so(
    database_url: str, setting: str, drain_prepares: int
) -> None:
    # Given a migrated ledger reached directly, and DATABASE_PREPARED_STATEMENTS as given
    prepare_database(database_url)
    env = {"DATABASE_URL": database_url, "DATABASE_PREPARED_STATEMENTS": setting}
    settings = DrainSettings.from_env(env)
    ledger, admin = make_ledger(settings), make_claims_admin(settings)
    # When the drain's connection and an operator's run one statement often
    try:
        drains = _prepared_on_the_server(ledger.connection(), BACKEND)
        with admin.connector.session("counting") as conn:
            operators = _prepared_on_the_server(conn, BACKEND)
    finally:
        ledger.close()
    # Then only the drain's prepared it, and only with the setting on
    assert (drains, operators) == (drain_prepares, 0)


def test_a_drain_with_lanes_spends_no_delivery_on_the_pooler(
    pooled_database_url: str, pgbouncer: RunningPooler, caplog: pytest.LogCaptureFixture
) -> None:
    with harness(pooled_database_url) as kit:
        # Given 300 database jobs, a third of them published twice
        for n in range(300):
            kit.publish({"job": "test.db", "id": f"p{n}"}, times=2 if n % 3 == 0 else 1)
        service = kit.lane_service(DrainSettings(queue=QUEUE, drain_lanes=2))
        # When one invocation drains them with two lanes, every connection through the pooler
        with caplog.at_level(logging.WARNING, logger="infrai_jobs"):
            summary = service.run(lambda: 120_000)
        service.close()
        # Then every job ran once, and nothing was retried
        assert (summary.consumed, summary.acked, summary.done) == (400, 400, 300)
        assert (summary.retried, summary.stopped) == (0, "empty")
        effects = dict(kit.sql("SELECT idem_key, count(*) FROM test_effects GROUP BY idem_key"))
        assert effects == {f"test.db:p{n}": 1 for n in range(300)}
    assert not [r.getMessage() for r in caplog.records if "prepared statement" in r.getMessage()]
    assert "prepared statement" not in pgbouncer.log


JOB_POLICIES = json.dumps(
    {
        # A digest its provider refused waits an hour, unless an operator runs it now.
        "digest.build": {
            "retry": {"attempts": 5, "first_delay_seconds": 3600, "max_delay_seconds": 3600},
            "concurrency": {"key": ["tenant_id"], "max_running": 1},
        },
        # Limits that never bind: every start still takes its rate start and its slot.
        "receipt.send": {
            "rate": {"per_second": 100000},
            "concurrency": {"key": ["invoice_id"], "max_running": 1000},
        },
    }
)
DIGESTS = [{"job": "digest.build", "tenant_id": f"t{n}", "period": "2026-12"} for n in range(8)]


def sink(kit: Harness, method: str, path: str, **kwargs: Any) -> None:
    assert urllib3.request(method, f"{kit.sink.url}{path}", **kwargs).status == 200


def _environment(kit: Harness, **variables: str) -> dict[str, str]:
    """A function's environment on the harness, its ledger through the pooler."""
    return {**kit.services, **fixture_jobs.provider_settings(kit.sink.url), **variables}


def _drain_service(kit: Harness, lanes: int) -> DrainService:
    """DrainFunction's service, built by the factory as the handler builds it: flow control,
    the drains' lease (DRAIN_MAX_CONCURRENCY) and ``lanes`` lanes, each a ledger connection."""
    env = _environment(
        kit, DRAIN_LANES=str(lanes), JOB_POLICIES=JOB_POLICIES, DRAIN_MAX_CONCURRENCY="1"
    )
    settings = DrainSettings.from_env(
        env,
        job_settings=kit.registry.declared_settings(),
        job_secrets=kit.registry.declared_secrets(),
    )
    return DrainService.from_settings(settings, kit.registry)


def _run(service: DrainService) -> DrainSummary:
    try:
        return service.run(lambda: 120_000)
    finally:
        service.close()


def _no_trace_of_the_proxy(caplog: pytest.LogCaptureFixture, pooler: RunningPooler) -> None:
    told = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [line for line in told if "prepared statement" in line or "reconnect" in line]
    assert "prepared statement" not in pooler.log


def test_the_drains_flow_control_and_deferred_runs_run_every_job_once_behind_the_pooler(
    pooled_database_url: str, pgbouncer: RunningPooler, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="infrai_jobs")
    with harness(pooled_database_url) as kit:
        # Given eight digests deferred by a drain while their provider refused every call
        sink(kit, "POST", "/_sink/faults", json={"fail_rate": 1.0})
        for digest in DIGESTS:
            kit.publish(digest)
        assert _run(_drain_service(kit, lanes=1)).outcomes == {"deferred": 8}
        sink(kit, "POST", "/_sink/faults", json={"fail_rate": 0.0})
        # And made due by an operator, as `claims run-now` does, through the pooler too
        deferred = [kit.registry.derive(digest).idem_key for digest in DIGESTS]
        for key in deferred:
            assert run_cli(kit, "claims", "run-now", key).returncode == 0
        # And 300 new jobs: database jobs, and rate-limited receipts (a third published twice)
        for n in range(240):
            kit.publish({"job": "test.db", "id": f"f{n}"}, times=2 if n % 3 == 0 else 1)
        for n in range(60):
            kit.publish({"job": "receipt.send", "invoice_id": f"inv_{n}", "email": f"{n}@x.io"})
        # When DrainFunction's service drains them with four lanes, every connection pooled
        summary = _run(_drain_service(kit, lanes=4))
        # Then every message was settled and acked, none retried, and the deferred work ran
        assert (summary.consumed, summary.acked, summary.done) == (380, 380, 300)
        assert (summary.retried, summary.failed, summary.stopped) == (0, 0, "empty")
        assert (summary.counters["deferred_ran"], summary.counters["deferred_done"]) == (8, 8)
        # And every effect happened once
        effects = dict(kit.sql("SELECT idem_key, count(*) FROM test_effects GROUP BY idem_key"))
        assert effects == {f"test.db:f{n}": 1 for n in range(240)}
        sent = kit.sink.state.snapshot()
        assert sent["mails"] == {f"inv_{n}": 1 for n in range(60)}
        assert sorted(sent["digests"].values()) == [1] * 8
        states = dict(kit.sql("SELECT state, count(*) FROM job_claims GROUP BY state"))
        assert states == {"done": 308}
    _no_trace_of_the_proxy(caplog, pgbouncer)


def test_the_watchers_pass_and_the_outbox_relay_run_behind_the_pooler(
    pooled_database_url: str, pgbouncer: RunningPooler, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="infrai_jobs")
    with harness(pooled_database_url) as kit:
        # Given 60 jobs a producer enqueued in its own transactions, through the pooler (its
        # connection, as docs/configuration.md asks, prepares nothing either)
        with psycopg.connect(pooled_database_url, prepare_threshold=None) as producer:
            for n in range(60):
                with producer.transaction():
                    enqueue(producer, {"job": "test.db", "id": f"o{n}"}, registry=kit.registry)
        env = _environment(kit, OUTBOX_BATCH_SIZE="7")
        # When OutboxRelayFunction's relay runs a pass
        relay = make_outbox_relay(OutboxRelaySettings.from_env(env), kit.client)
        report = relay.run(lambda: 60_000)
        # Then each row was published once, in batches of seven
        assert (report.published, report.retried, report.dead) == (60, 0, 0)
        assert report.batches >= 9
        assert kit.client.stats(QUEUE).available_count == 60
        # And when a drain has run them and DlqAlertFunction's check (with its reconcile pass)
        # runs twice
        assert _run(_drain_service(kit, lanes=2)).done == 60
        alerter = RecordingAlerter()
        check = make_alert_check(
            AlertSettings.from_env(_environment(kit)), alerter, registry=kit.registry
        )
        reports = [check.run([QUEUE]) for _ in range(2)]
        # Then it saw a quiet queue and ledger, and paged nobody
        assert [r.stuck.count for r in reports] == [0, 0]
        assert alerter.alerts == []
    _no_trace_of_the_proxy(caplog, pgbouncer)


def test_every_operator_verb_works_behind_the_pooler(
    pooled_database_url: str, pgbouncer: RunningPooler, caplog: pytest.LogCaptureFixture
) -> None:
    with harness(pooled_database_url) as kit:
        # Given, through the pooler, a stuck claim, a failed one and a message that failed
        # three times, all three dead-lettered by Infrai after their third delivery
        kit.publish({"job": "test.ext", "id": "stuck", "mode": "uncertain"})
        kit.publish({"job": "test.ext", "id": "failed", "mode": "permanent"})
        kit.publish({"job": "test.db", "id": "poison", "mode": "transient"})
        for _ in range(3):
            kit.drain()
            kit.advance()
        stuck, failed, poison = (
            kit.registry.derive({"job": job, "id": name}).idem_key
            for job, name in (("test.ext", "stuck"), ("test.ext", "failed"), ("test.db", "poison"))
        )
        assert kit.client.stats(QUEUE).message_count == 0

        def verb(*args: str) -> Any:
            finished = run_cli(kit, *args, "--json")
            assert finished.returncode == 0, (args, finished.stderr)
            return json.loads(finished.stdout)

        # When an operator lists, inspects and repairs them with every verb, each a process
        # of its own whose every connection goes through the pooler
        listed = {row["idem_key"] for row in verb("claims", "list")}
        stuck_rows = verb("claims", "stuck")
        shown = verb("claims", "show", failed)
        verb("claims", "reconcile", "--all")
        verb("claims", "resolve", stuck, "--done")
        verb("claims", "release", failed)
        dead = verb("dlq")
        verb("redrive", "--key", poison)
        verb("claims", "prune", "--older-than", "1d")
        # Then each saw the ledger as it was, and changed it as asked
        assert {stuck, failed} <= listed
        assert [row["idem_key"] for row in stuck_rows] == [stuck]
        assert json.dumps(shown).count('"failed"') >= 1
        assert {letter["idem_key"] for letter in dead["messages"]} == {stuck, failed, poison}
        assert kit.row(stuck).state == "done"  # type: ignore[union-attr]
        assert kit.row(failed) is None
        # And the redriven job is back on the queue, once
        assert kit.client.stats(QUEUE).available_count == 1
    assert "prepared statement" not in pgbouncer.log


def _lines(stream: IO[str]) -> queue.Queue[str]:
    """``stream``'s lines as they come, read by a thread of their own."""
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        for line in stream:
            lines.put(line)

    threading.Thread(target=read, daemon=True).start()
    return lines


def test_outbox_relay_follow_listens_on_the_direct_url_and_relays_through_the_pooler(
    pooled_database_url: str, database_url: str
) -> None:
    with harness(pooled_database_url) as kit:
        producer = psycopg.connect(pooled_database_url, autocommit=True, prepare_threshold=None)
        with producer, producer.transaction():
            enqueue(producer, {"job": "test.db", "id": "before"}, registry=kit.registry)
        # Given `outbox relay --follow` through the pooler, listening on OUTBOX_LISTEN_URL (the
        # database itself), polling only once an hour
        relay = start_cli(
            kit,
            "outbox",
            "relay",
            "--follow",
            "--poll-seconds",
            "3600",
            "--json",
            OUTBOX_LISTEN_URL=database_url,
        )
        try:
            assert relay.stdout is not None
            reports = _lines(relay.stdout)
            # And its first pass done: it published the row enqueued before it started
            assert json.loads(reports.get(timeout=60))["published"] == 1
            # When a producer enqueues a job with notify, through the pooler
            producer = psycopg.connect(pooled_database_url, autocommit=True, prepare_threshold=None)
            with producer, producer.transaction():
                enqueue(
                    producer, {"job": "test.db", "id": "after"}, registry=kit.registry, notify=True
                )
            # Then the notification woke the relay at once, and it published the job
            assert json.loads(reports.get(timeout=60))["published"] == 1
            assert kit.client.stats(QUEUE).available_count == 2
        finally:
            relay.send_signal(signal.SIGINT)
            relay.communicate(timeout=30)
