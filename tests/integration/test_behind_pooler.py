"""The framework behind a transaction-pooling proxy: a real PgBouncer in ``pool_mode =
transaction`` (``pgbouncer.py``), where each transaction may meet another server connection, as
behind RDS Proxy. Every connection the framework opens must rely on nothing its session holds
(docs/configuration.md, "Behind a connection pooler"): the drain with lanes, deferred runs, the
watcher's pass, the outbox relay and the operator verbs all run through it, every job done once
and no delivery spent on the proxy."""

from __future__ import annotations

import logging

import pytest
from drainkit import QUEUE, harness
from pgbouncer import RunningPooler

from infrai_jobs.config.settings import DrainSettings
from infrai_jobs.ledger.postgres import connect_to_ledger

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
