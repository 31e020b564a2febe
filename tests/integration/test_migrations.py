"""Schema migrations: versioned, idempotent, safe when two run at once, and they adopt the
field notes' own table."""

from __future__ import annotations

import time

import psycopg
import pytest
from drainkit import migrate_by_hand, run_concurrently

from infrai_jobs.errors import LedgerError, SchemaNotMigrated
from infrai_jobs.ledger.postgres import current_version
from infrai_jobs.work.ledger import PostgresLedger
from infrai_local.migrations import LATEST_VERSION, LEDGER_MIGRATIONS, apply_migrations

NOTES_DDL = """
CREATE TABLE job_claims (
  idem_key   text PRIMARY KEY,
  state      text NOT NULL CHECK (state IN ('running', 'done', 'failed')),
  message_id text NOT NULL,
  result     jsonb,
  claimed_at timestamptz NOT NULL DEFAULT now()
)
"""


def _migrate(url: str) -> list[int]:
    with psycopg.connect(url, autocommit=True) as conn:
        return [m.version for m in apply_migrations(conn)]


def test_migrating_twice_applies_each_version_once(database_url: str) -> None:
    # Given a fresh database, When migrate runs twice
    first = _migrate(database_url)
    second = _migrate(database_url)
    # Then the first applied everything, the second nothing, and the version is recorded
    assert first == [m.version for m in LEDGER_MIGRATIONS]
    assert second == []
    with psycopg.connect(database_url) as conn:
        assert current_version(conn) == LATEST_VERSION


def test_two_migrations_started_at_once_both_succeed_and_apply_once(database_url: str) -> None:
    results = run_concurrently(*[lambda: _migrate(database_url)] * 4)
    applied = [v for result in results for v in result]
    assert sorted(applied) == [m.version for m in LEDGER_MIGRATIONS]
    with psycopg.connect(database_url) as conn:
        rows = conn.execute("SELECT version FROM infrai_jobs_schema").fetchall()
    assert rows == [(m.version,) for m in LEDGER_MIGRATIONS]


def test_migration_adopts_the_notes_table_and_keeps_its_rows(database_url: str) -> None:
    # Given the notes' table with a row written by the Node worker
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(NOTES_DDL)
        conn.execute(
            "INSERT INTO job_claims (idem_key, state, message_id) VALUES (%s, 'done', %s)",
            ("invoice.finalize:inv_8812", "qmsg_3M3oXV26427PU29QW1sHEAXn"),
        )
    # When migrated
    _migrate(database_url)
    # Then the row is kept, the new columns exist, and the notes' INSERT still works
    with psycopg.connect(database_url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT state, attempts, claim_token, payload_sha256 FROM job_claims"
        ).fetchone()
        assert row == ("done", 1, None, None)
        inserted = conn.execute(
            "INSERT INTO job_claims (idem_key, state, message_id) VALUES (%s, 'running', %s)"
            " ON CONFLICT (idem_key) DO NOTHING RETURNING idem_key",
            ("digest:tenant_42:2026-07-25", "qmsg_x"),
        ).fetchall()
        assert inserted == [("digest:tenant_42:2026-07-25",)]


def test_the_ledger_refuses_an_unmigrated_database_with_the_fix(database_url: str) -> None:
    ledger = PostgresLedger(database_url)
    with pytest.raises(SchemaNotMigrated, match="infrai-jobs migrate"):
        ledger.get("anything")


def test_a_schema_check_the_server_refuses_is_a_ledger_error_and_leaves_no_connection(
    database_url: str,
) -> None:
    # Given a database whose schema-version table cannot be read (a view that fails, standing
    # in for a revoked privilege or a broken upgrade)
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("CREATE VIEW infrai_jobs_schema AS SELECT 1 / 0 AS version")
    ledger = PostgresLedger(database_url)
    # When the ledger first connects
    # Then the failure comes out in the ledger's terms, which the drain handles
    with pytest.raises(LedgerError, match="schema version"):
        ledger.ping()
    # And the connection it opened for the check was closed, not kept or leaked
    with psycopg.connect(database_url, autocommit=True) as conn:
        for _ in range(50):
            (left,) = conn.execute(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE datname = current_database() AND application_name = 'infrai-jobs'"
            ).fetchone() or (None,)
            if left == 0:
                break
            time.sleep(0.1)
    assert left == 0


def test_the_dead_letter_migration_is_additive_on_a_ledger_in_use(database_url: str) -> None:
    # Given a ledger migrated up to the version before dead letters, holding a claim
    with psycopg.connect(database_url, autocommit=True) as conn, conn.transaction():
        migrate_by_hand(conn, up_to=5)
        conn.execute(
            "INSERT INTO job_claims (idem_key, state, message_id) VALUES ('k1', 'done', 'q1')"
        )
    # When migrated
    applied = _migrate(database_url)
    # Then only dead letters and the migrations after it were applied, the claim is kept, and
    # the notes' INSERT works
    assert [LEDGER_MIGRATIONS[v - 1].name for v in applied] == [
        m.name for m in LEDGER_MIGRATIONS[5:]
    ]
    assert applied[0] == 6
    with psycopg.connect(database_url, autocommit=True) as conn:
        assert conn.execute("SELECT idem_key, state FROM job_claims").fetchall() == [("k1", "done")]
        conn.execute(
            "INSERT INTO job_claims (idem_key, state, message_id) VALUES ('k2', 'running', 'q2')"
        )
        assert conn.execute("SELECT count(*) FROM dead_letters").fetchone() == (0,)
        # And a message id is recorded once, however often it is inserted
        for _ in range(2):
            conn.execute(
                "INSERT INTO dead_letters (message_id, queue, dlq) VALUES ('q9', 'a', 'a-dlq')"
                " ON CONFLICT (message_id) DO NOTHING"
            )
        assert conn.execute("SELECT count(*) FROM dead_letters").fetchone() == (1,)
