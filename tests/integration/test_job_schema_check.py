"""A job's migrations are part of the schema check: a drain whose jobs' migrations are not
applied refuses before it consumes anything, naming the migration and ``infrai-jobs migrate``.

Without it, a job's missing table was found only by its handler: the message was consumed, the
handler's ``UndefinedTable`` was retried, and three deliveries later it was a dead letter. Real
PostgreSQL, the emulator over HTTP, a jobs package of the test's own.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from drainkit import API_KEY, QUEUE, TEST_JOBS_CODE, Harness, harness, run_cli

from infrai_jobs.config.settings import DrainSettings
from infrai_jobs.errors import SchemaNotMigrated
from infrai_jobs.jobs.registry import Effect, JobContext, JobRegistry, JsonValue, Payload
from infrai_jobs.ledger.job_schema import JobMigrationName, job_migrations_in
from infrai_jobs.runtime.drain_service import DrainService
from infrai_local.migrations import apply_migrations, jobs_migrations_folder, read_migrations

PAYOUT_JOBS = """
from infrai_jobs.jobs.registry import Effect, JobRegistry


def build_registry() -> JobRegistry:
    registry = JobRegistry()

    @registry.job("schemacheck.payout", effect=Effect.DATABASE, identity=("payout_id",))
    def send(payload, ctx):
        ctx.db.execute(
            "INSERT INTO schemacheck_payout (payout_id) VALUES (%s)", (payload["payout_id"],)
        )
        return None

    return registry
"""
PAYOUT_TABLE = "CREATE TABLE schemacheck_payout (payout_id text PRIMARY KEY);"
# The harness's database holds the fixture jobs' migrations already: the payout package's comes
# after the last of them.
VERSION = (
    max((m.version for m in read_migrations(jobs_migrations_folder(TEST_JOBS_CODE))), default=0) + 1
)
MIGRATION = JobMigrationName(VERSION, "schemacheck_payout")


def payout_registry() -> JobRegistry:
    """The package's registry, built in this process (whose ``jobs`` is another package)."""
    registry = JobRegistry()

    @registry.job("schemacheck.payout", effect=Effect.DATABASE, identity=("payout_id",))
    def send(payload: Payload, ctx: JobContext) -> JsonValue:
        raise AssertionError("a drain refused for its schema must run no job")

    return registry


@pytest.fixture
def kit(database_url: str) -> Iterator[Harness]:
    with harness(database_url) as h:
        yield h


@pytest.fixture
def payout_code(tmp_path: Path) -> Path:
    """A code root whose jobs package has one job and its table's migration."""
    package = tmp_path / "code" / "jobs"
    (package / "migrations").mkdir(parents=True)
    (package / "__init__.py").write_text(PAYOUT_JOBS)
    (package / "migrations" / MIGRATION.file_name).write_text(PAYOUT_TABLE)
    return package.parent


def _nothing_consumed(kit: Harness) -> None:
    stats = kit.client.stats(QUEUE)
    assert (stats.available_count, stats.in_flight_count) == (1, 0)


def test_the_cli_drain_refuses_before_consuming_when_a_jobs_migration_is_not_applied(
    kit: Harness, payout_code: Path
) -> None:
    # Given a payout in the queue, and a ledger whose schemacheck_payout table was never migrated
    kit.publish({"job": "schemacheck.payout", "payout_id": "p1"})
    # When the operator drains with the payout jobs package
    finished = run_cli(kit, "drain", "--max-batches", "1", "--jobs-path", str(payout_code))
    # Then it exits 2 in one line naming the migration and the command, and consumed nothing
    assert finished.returncode == 2, finished.stderr
    assert MIGRATION.file_name in finished.stderr
    assert "infrai-jobs migrate" in finished.stderr
    assert "Traceback" not in finished.stderr
    _nothing_consumed(kit)


def test_after_migrate_the_same_drain_runs_the_job(kit: Harness, payout_code: Path) -> None:
    # Given the same payout, and the payout jobs' migration applied
    kit.publish({"job": "schemacheck.payout", "payout_id": "p1"})
    with psycopg.connect(kit.database_url, autocommit=True) as conn:
        apply_migrations(conn, read_migrations(payout_code / "jobs" / "migrations"))
    # When the operator drains
    finished = run_cli(kit, "drain", "--max-batches", "1", "--jobs-path", str(payout_code))
    # Then the job ran
    assert finished.returncode == 0, finished.stderr
    assert json.loads(finished.stdout)["done"] == 1
    assert kit.sql("SELECT payout_id FROM schemacheck_payout") == [("p1",)]


def test_drain_functions_service_refuses_before_consuming_too(
    kit: Harness, payout_code: Path
) -> None:
    # Given DrainFunction's service for the payout jobs package, its migration not applied
    kit.publish({"job": "schemacheck.payout", "payout_id": "p1"})
    registry = payout_registry()
    settings = DrainSettings.from_env(
        {
            "INFRAI_BASE_URL": kit.server.url,
            "INFRAI_API_KEY": API_KEY,
            "INFRAI_QUEUE": QUEUE,
            "DATABASE_URL": kit.database_url,
        },
        job_settings=registry.declared_settings(),
    )
    declared = job_migrations_in(payout_code / "jobs")
    assert declared == (MIGRATION,)
    service = DrainService.from_settings(settings, registry, job_migrations=declared)
    # When it runs
    try:
        with pytest.raises(SchemaNotMigrated) as refused:
            service.run(lambda: 120_000, max_batches=1)
    finally:
        service.close()
    # Then it names the migration and the command, and nothing was consumed
    assert MIGRATION.file_name in str(refused.value)
    assert "infrai-jobs migrate" in str(refused.value)
    _nothing_consumed(kit)
