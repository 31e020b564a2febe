"""Versioned, idempotent schema migrations for the claim ledger, then for the jobs' own tables.

``apply_migrations`` takes a transaction-scoped advisory lock, so two ``infrai-jobs migrate`` runs
started at once apply each migration exactly once: the second waits, then finds nothing to do.
The jobs' migrations (``functions/jobs/migrations/NNNN_name.sql``, read by the CLI and handed in
as ``jobs``) run after the ledger's, in the same transaction under the same lock, and are
recorded apart (``infrai_jobs_job_schema``): the two version sequences never collide.
Every statement is also written to be harmless when repeated (``IF NOT EXISTS``), and the first
migration adopts a ``job_claims`` table created by the field notes' own DDL: every column it adds
is nullable or defaulted, so the notes' ``INSERT (idem_key, state, message_id)`` keeps working.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, LiteralString

import psycopg

from infrai_jobs.errors import ConfigurationError

# An arbitrary constant that names "infrai-jobs schema changes" among advisory locks.
MIGRATION_LOCK_ID = 0x1F0A_7C3B


@dataclass(frozen=True, slots=True)
class Migration:
    version: int
    name: str
    # The ledger's are constants here; a job's is its file's text, as the team wrote it.
    sql: LiteralString | bytes
    owner: Literal["ledger", "jobs"] = "ledger"


MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        1,
        "claim ledger",
        """
        CREATE TABLE IF NOT EXISTS job_claims (
            idem_key   text PRIMARY KEY,
            state      text NOT NULL CHECK (state IN ('running', 'done', 'failed')),
            message_id text NOT NULL,
            result     jsonb,
            claimed_at timestamptz NOT NULL DEFAULT now()
        );
        ALTER TABLE job_claims
            ADD COLUMN IF NOT EXISTS job            text,
            ADD COLUMN IF NOT EXISTS effect         text,
            ADD COLUMN IF NOT EXISTS claim_token    uuid,
            ADD COLUMN IF NOT EXISTS lease_until    timestamptz,
            ADD COLUMN IF NOT EXISTS attempts       int DEFAULT 1,
            ADD COLUMN IF NOT EXISTS payload_sha256 text,
            ADD COLUMN IF NOT EXISTS error          text,
            ADD COLUMN IF NOT EXISTS updated_at     timestamptz;
        DO $$ BEGIN
            ALTER TABLE job_claims ADD CONSTRAINT job_claims_effect_check
                CHECK (effect IN ('database', 'external', 'external_idempotent'));
        EXCEPTION WHEN duplicate_object THEN NULL;
        END $$;
        CREATE INDEX IF NOT EXISTS job_claims_running_idx
            ON job_claims (claimed_at) WHERE state = 'running';
        CREATE INDEX IF NOT EXISTS job_claims_settled_idx
            ON job_claims ((coalesce(updated_at, claimed_at))) WHERE state IN ('done', 'failed');
        """,
    ),
    Migration(
        2,
        "alert state",
        """
        CREATE TABLE IF NOT EXISTS alert_state (
            scope      text NOT NULL,
            signal     text NOT NULL,
            value      bigint NOT NULL DEFAULT 0,
            alerted_at timestamptz,
            updated_at timestamptz NOT NULL DEFAULT now(),
            PRIMARY KEY (scope, signal)
        );
        """,
    ),
    Migration(
        3,
        "operator history",
        """
        CREATE TABLE IF NOT EXISTS claim_history (
            id       bigserial PRIMARY KEY,
            idem_key text NOT NULL,
            action   text NOT NULL,
            actor    text NOT NULL,
            at       timestamptz NOT NULL DEFAULT now(),
            before   jsonb,
            after    jsonb,
            note     text
        );
        CREATE INDEX IF NOT EXISTS claim_history_key_idx ON claim_history (idem_key, id);
        CREATE OR REPLACE FUNCTION claim_history_append_only() RETURNS trigger
        LANGUAGE plpgsql AS $$
        BEGIN
            RAISE EXCEPTION 'claim_history is append-only';
        END $$;
        DROP TRIGGER IF EXISTS claim_history_append_only ON claim_history;
        CREATE TRIGGER claim_history_append_only BEFORE UPDATE OR DELETE ON claim_history
            FOR EACH ROW EXECUTE FUNCTION claim_history_append_only();
        """,
    ),
    Migration(
        4,
        "consume isolation",
        """
        -- After a consume whose answer was lost or unreadable, every drain of that queue takes
        -- one message at a time until single_until, so a poison message walks to the DLQ alone.
        CREATE TABLE IF NOT EXISTS consume_isolation (
            queue        text PRIMARY KEY,
            single_until timestamptz NOT NULL,
            reason       text NOT NULL DEFAULT '',
            updated_at   timestamptz NOT NULL DEFAULT now()
        );
        """,
    ),
    Migration(
        5,
        "drain leases",
        """
        -- Every drain of a queue alive now, with a lease it renews while it runs, and the slots
        -- a fan-out reserved for the drains it is starting. Counted under an advisory lock, so
        -- two drains never both start the missing ones; an expired lease is a dead drain.
        CREATE TABLE IF NOT EXISTS drain_leases (
            queue       text NOT NULL,
            drain_id    uuid NOT NULL,
            origin      text NOT NULL CHECK (origin IN ('schedule', 'fan_out')),
            started_at  timestamptz NOT NULL DEFAULT now(),
            lease_until timestamptz NOT NULL,
            PRIMARY KEY (queue, drain_id)
        );
        """,
    ),
    Migration(
        6,
        "dead letters",
        """
        -- Infrai cannot peek at a queue: reading its DLQ consumes it. Whatever reads the DLQ
        -- records each dead letter here, then acks it there; the operator works on these rows.
        -- A readable one keeps its payload (what a redrive publishes again); an unreadable one
        -- keeps what could be learnt of it (raw_text, size_bytes) and is never redriven; a read
        -- one that jsonb cannot hold (a NUL character) keeps its exact JSON text in raw_text.
        -- state is what the listing shows (the claim's state, conflict, unreadable), as seen
        -- when it was recorded; claim_state is the claim's own state then.
        CREATE TABLE IF NOT EXISTS dead_letters (
            message_id      text PRIMARY KEY,
            queue           text NOT NULL,
            dlq             text NOT NULL,
            unreadable      boolean NOT NULL DEFAULT false,
            payload         jsonb,
            raw_text        text,
            size_bytes      int,
            job             text,
            idem_key        text,
            state           text,
            claim_state     text,
            reason          text NOT NULL DEFAULT '',
            main_deliveries int,
            dlq_deliveries  int,
            published_at    timestamptz,
            first_seen      timestamptz NOT NULL DEFAULT now(),
            resolution      text CHECK (resolution IN ('discarded', 'redriven')),
            resolved_at     timestamptz,
            resolved_by     text,
            resolution_note text,
            CHECK ((resolution IS NULL) = (resolved_at IS NULL))
        );
        CREATE INDEX IF NOT EXISTS dead_letters_unresolved_idx
            ON dead_letters (queue, first_seen) WHERE resolution IS NULL;
        CREATE INDEX IF NOT EXISTS dead_letters_key_idx ON dead_letters (idem_key);
        """,
    ),
    Migration(
        7,
        "flow control",
        """
        -- Work the ledger owns after its message was acked: a retry beyond the message's
        -- deliveries, or a start a rate limit or a concurrency key held back. A table of its own,
        -- not a 'deferred' state on job_claims: that state's CHECK and every rule over claims
        -- (stuck, takeover, prune, the notes' own statements, a drain of the previous version
        -- still running during a deploy) would have to learn it, while this only adds. It also
        -- holds what a claim has no place for: the payload, the next run time, 'cancelled'.
        -- A row in 'deferred' or 'running' holds its key: a copy of its message is a duplicate.
        -- A drain takes due rows (SKIP LOCKED) and runs each under a fenced lease
        -- (lease_token); an 'external' row whose lease expired is never taken again.
        CREATE TABLE IF NOT EXISTS deferred_jobs (
            idem_key       text PRIMARY KEY,
            job            text NOT NULL,
            effect         text NOT NULL
                CHECK (effect IN ('database', 'external', 'external_idempotent')),
            payload        jsonb NOT NULL,
            payload_sha256 text,
            message_id     text NOT NULL,
            queue          text,
            state          text NOT NULL DEFAULT 'deferred'
                CHECK (state IN ('deferred', 'running', 'done', 'failed', 'cancelled')),
            attempts       int NOT NULL DEFAULT 1 CHECK (attempts >= 0),
            last_error     text,
            result         jsonb,
            run_after      timestamptz NOT NULL,
            created_at     timestamptz NOT NULL DEFAULT now(),
            updated_at     timestamptz NOT NULL DEFAULT now(),
            lease_token    uuid,
            lease_until    timestamptz,
            CHECK ((state = 'running') = (lease_token IS NOT NULL AND lease_until IS NOT NULL))
        );
        CREATE INDEX IF NOT EXISTS deferred_jobs_due_idx
            ON deferred_jobs (run_after, created_at) WHERE state = 'deferred';
        CREATE INDEX IF NOT EXISTS deferred_jobs_running_idx
            ON deferred_jobs (lease_until) WHERE state = 'running';
        -- Each start a rate limit let through, on the database's clock. A job's starts are
        -- counted and written under a transaction-scoped advisory lock for that job, so every
        -- drain sees the others' starts: no window of the limit's length ever holds more.
        CREATE TABLE IF NOT EXISTS flow_rate_starts (
            id         bigserial PRIMARY KEY,
            job        text NOT NULL,
            started_at timestamptz NOT NULL
        );
        CREATE INDEX IF NOT EXISTS flow_rate_starts_job_idx
            ON flow_rate_starts (job, started_at);
        -- A run holding one of a concurrency key's slots, until it releases it or its lease
        -- (the claim's) ends: a killed drain's slot frees itself. Taken under an advisory lock
        -- per (job, key value), so two drains never both take the last one.
        CREATE TABLE IF NOT EXISTS flow_concurrency_slots (
            token       uuid PRIMARY KEY,
            job         text NOT NULL,
            key_value   text NOT NULL,
            holder      text NOT NULL,
            acquired_at timestamptz NOT NULL DEFAULT now(),
            lease_until timestamptz NOT NULL
        );
        CREATE INDEX IF NOT EXISTS flow_concurrency_slots_key_idx
            ON flow_concurrency_slots (job, key_value, lease_until);
        """,
    ),
    Migration(
        8,
        "deferred run begun",
        """
        -- When a taken deferred run began its handler (NULL: not yet). An external run whose
        -- lease ran out before it began has done nothing and may be taken again; one that began
        -- may have had its effect, and waits for a human.
        ALTER TABLE deferred_jobs ADD COLUMN IF NOT EXISTS began_at timestamptz;
        """,
    ),
)

_CREATE_VERSIONS: LiteralString = """
    CREATE TABLE IF NOT EXISTS infrai_jobs_schema (
        version    int PRIMARY KEY,
        name       text NOT NULL,
        applied_at timestamptz NOT NULL DEFAULT now()
    )
"""
_CREATE_JOB_VERSIONS: LiteralString = """
    CREATE TABLE IF NOT EXISTS infrai_jobs_job_schema (
        version    int PRIMARY KEY,
        name       text NOT NULL,
        applied_at timestamptz NOT NULL DEFAULT now()
    )
"""
_LOCK: LiteralString = "SELECT pg_advisory_xact_lock(%(lock_id)s)"
_APPLIED: LiteralString = "SELECT version, name FROM infrai_jobs_schema"
_RECORD: LiteralString = (
    "INSERT INTO infrai_jobs_schema (version, name) VALUES (%(version)s, %(name)s)"
)
_JOBS_APPLIED: LiteralString = "SELECT version, name FROM infrai_jobs_job_schema"
_JOBS_RECORD: LiteralString = (
    "INSERT INTO infrai_jobs_job_schema (version, name) VALUES (%(version)s, %(name)s)"
)
LATEST_VERSION = MIGRATIONS[-1].version


def apply_migrations(
    conn: psycopg.Connection[Any], jobs: Sequence[Migration] = ()
) -> list[Migration]:
    """Apply what is missing, the ledger's then the jobs', in order, in one transaction;
    return what was applied.

    A jobs' version already recorded under another name is a ``ConfigurationError`` and
    nothing is applied: an applied migration is never edited or renumbered, only followed."""
    _check_sequence(jobs)
    applied_now: list[Migration] = []
    with conn.transaction():
        conn.execute(_LOCK, {"lock_id": MIGRATION_LOCK_ID})
        # Under the lock, so a concurrent first run cannot race on CREATE TABLE IF NOT EXISTS.
        conn.execute(_CREATE_VERSIONS)
        done = {row[0] for row in conn.execute(_APPLIED).fetchall()}
        for migration in MIGRATIONS:
            if migration.version in done:
                continue
            conn.execute(migration.sql)
            conn.execute(_RECORD, {"version": migration.version, "name": migration.name})
            applied_now.append(migration)
        if jobs:
            conn.execute(_CREATE_JOB_VERSIONS)
            recorded = dict(conn.execute(_JOBS_APPLIED).fetchall())
            for migration in jobs:
                if migration.version in recorded:
                    if recorded[migration.version] != migration.name:
                        raise ConfigurationError(
                            f"jobs migration {migration.version:04d} is {migration.name!r} "
                            f"here but was applied as {recorded[migration.version]!r}: an "
                            "applied migration is never renamed or reused; add a new version"
                        )
                    continue
                conn.execute(migration.sql)
                conn.execute(_JOBS_RECORD, {"version": migration.version, "name": migration.name})
                applied_now.append(migration)
    return applied_now


def _check_sequence(jobs: Sequence[Migration]) -> None:
    versions = [migration.version for migration in jobs]
    if any(migration.owner != "jobs" for migration in jobs):
        raise ConfigurationError("only the jobs' own migrations may be passed as jobs")
    if versions != sorted(set(versions)) or any(version < 1 for version in versions):
        raise ConfigurationError(
            f"the jobs' migrations must have distinct versions from 1 up, in order: {versions}"
        )


def current_version(conn: psycopg.Connection[Any]) -> int:
    """The schema version in the database; 0 when never migrated."""
    row = conn.execute("SELECT to_regclass('infrai_jobs_schema') IS NOT NULL").fetchone()
    if not row or not row[0]:
        return 0
    version = conn.execute("SELECT coalesce(max(version), 0) FROM infrai_jobs_schema").fetchone()
    return int(version[0]) if version else 0
