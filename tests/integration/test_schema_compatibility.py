"""Schema compatibility across a rolling deploy, on real PostgreSQL and the emulator over HTTP.

The schema records its floor, the oldest infrai-jobs version that may run on it: code below the
floor refuses before it consumes anything (exit 2), while code above it keeps running on a schema
ahead of it (migrations only add). ``migrate --status`` shows what is applied and pending, and the
SQL of ``migrate --emit-sql``, applied by a tool of a team's own, leaves the database as
``migrate`` does.
"""

from __future__ import annotations

import json
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fixture_jobs
import psycopg
import pytest
from child_process import clean_env, run_captured
from drainkit import (
    DLQ,
    INFRAI_JOBS,
    QUEUE,
    TEST_JOBS_CODE,
    Harness,
    harness,
    migrate_by_hand,
    run_cli,
)

from infrai_jobs import __version__
from infrai_jobs.config.settings import DrainSettings
from infrai_jobs.errors import SchemaNotMigrated, SchemaTooNew
from infrai_jobs.ledger.job_schema import release_numbers
from infrai_jobs.ledger.postgres import SCHEMA_VERSION
from infrai_jobs.runtime.drain_service import DrainService
from infrai_local.jobs_package import JOBS_PATH_ENV
from infrai_local.migrations import LEDGER_MIGRATIONS, SCHEMA_FLOOR, jobs_migrations_folder
from infrai_local.migrations import read_migrations as read_migration_files
from infrai_local.sandbox.embedded_db import scratch_database

ROOT = Path(__file__).resolve().parents[2]
FIXTURE_JOBS_MIGRATIONS = read_migration_files(jobs_migrations_folder(TEST_JOBS_CODE))
EVERY_MIGRATION = [
    *[("ledger", m.version, m.name) for m in LEDGER_MIGRATIONS],
    *[("jobs", m.version, m.name) for m in FIXTURE_JOBS_MIGRATIONS],
]
major, _, _ = release_numbers(__version__)
# A fixture job the CLI's drain runs: it finalises a row of invoices (the fixture migration's).
INVOICE = {"job": "invoice.finalize", "invoice_id": "inv_ahead", "amount_cents": 4200}
# A floor no version of this code reaches: a database a newer major version migrated.
FLOOR_ABOVE = f"{major + 1}.0.0"

# The database's shape as a migration leaves it: columns, constraints, indexes, functions and
# triggers of the public schema, each as PostgreSQL describes it.
SHAPE = """
SELECT 'column', table_name || '.' || column_name,
       concat_ws(' ', data_type, is_nullable, column_default)
FROM information_schema.columns WHERE table_schema = 'public'
UNION ALL
SELECT 'constraint', conrelid::regclass::text || '.' || conname, pg_get_constraintdef(oid)
FROM pg_constraint WHERE connamespace = 'public'::regnamespace
UNION ALL
SELECT 'index', indexname, indexdef FROM pg_indexes WHERE schemaname = 'public'
UNION ALL
SELECT 'function', proname, pg_get_functiondef(oid)
FROM pg_proc WHERE pronamespace = 'public'::regnamespace
UNION ALL
SELECT 'trigger', tgrelid::regclass::text || '.' || tgname, pg_get_triggerdef(oid)
FROM pg_trigger WHERE NOT tgisinternal
ORDER BY 1, 2, 3
"""


def cli(*args: str, database_url: str) -> subprocess.CompletedProcess[str]:
    """``infrai-jobs ARGS`` in a clean environment naming only the database and the fixture
    jobs."""
    env = clean_env(DATABASE_URL=database_url, **{JOBS_PATH_ENV: str(TEST_JOBS_CODE)})
    return run_captured([INFRAI_JOBS, *args], env=env, cwd=ROOT)


def status_of(database_url: str) -> dict[str, Any]:
    finished = cli("migrate", "--status", "--json", database_url=database_url)
    assert finished.returncode == 0, finished.stderr
    status: dict[str, Any] = json.loads(finished.stdout)
    return status


def listed(status: dict[str, Any], state: str) -> list[tuple[str, int, str]]:
    return [
        (m["owner"], m["version"], m["name"]) for m in status["migrations"] if m["state"] == state
    ]


def sql(database_url: str, query: str, params: Any = None) -> list[tuple[Any, ...]]:
    with psycopg.connect(database_url, autocommit=True) as conn:
        cursor = conn.execute(query, params)
        return cursor.fetchall() if cursor.description else []


def schema_state(database_url: str) -> dict[str, Any]:
    """What ``migrate`` leaves: the shape, the version rows and the floor (not their times)."""
    return {
        "shape": sql(database_url, SHAPE),
        "ledger": sql(database_url, "SELECT version, name FROM infrai_jobs_schema ORDER BY 1"),
        "jobs": sql(database_url, "SELECT version, name FROM infrai_jobs_job_schema ORDER BY 1"),
        "floor": sql(database_url, "SELECT floor, recorded_by FROM infrai_jobs_schema_floor"),
    }


def apply_as_a_migration_tool(database_url: str, script: str) -> None:
    """The script run as one text, statement after statement, as ``psql -f`` or a team's
    migration tool sends it: nothing of infrai-jobs takes part."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(script.encode())


def public_tables(database_url: str) -> int:
    rows = sql(database_url, "SELECT count(*) FROM pg_tables WHERE schemaname = 'public'")
    return int(rows[0][0])


@pytest.fixture
def second_database_url(pg_server_url: str) -> Iterator[str]:
    with scratch_database(pg_server_url) as url:
        yield url


@pytest.fixture
def kit(database_url: str) -> Iterator[Harness]:
    with harness(database_url) as h:
        yield h


def set_floor(database_url: str, floor: str) -> None:
    sql(database_url, "UPDATE infrai_jobs_schema_floor SET floor = %s", (floor,))


def nothing_consumed(kit: Harness, queue: str = QUEUE) -> None:
    stats = kit.client.stats(queue)
    assert (stats.available_count, stats.in_flight_count) == (1, 0)


# --- migrate --status ---------------------------------------------------------------------------


def test_status_lists_every_migration_pending_then_applied_with_the_floor(
    database_url: str,
) -> None:
    # Given a database never migrated
    # When the operator asks for the status
    before = status_of(database_url)
    # Then every migration, the ledger's then the jobs', is pending, no floor is recorded, and
    # this code says it would refuse the database
    assert listed(before, "pending") == EVERY_MIGRATION
    assert before["pending"] == len(EVERY_MIGRATION)
    assert before["floor"] is None
    assert (before["code_version"], before["code_floor"]) == (__version__, SCHEMA_FLOOR)
    assert before["code_runs_on_it"] is False
    assert "not migrated" in before["refusal"]
    # And asking created nothing
    assert public_tables(database_url) == 0

    # When migrate runs, then the status again
    migrated = cli("migrate", database_url=database_url)
    assert migrated.returncode == 0, migrated.stderr
    after = status_of(database_url)
    # Then each is applied, with when, and the floor is this version's, recorded by it
    assert listed(after, "applied") == EVERY_MIGRATION
    assert all(m["applied_at"] and m["in_this_version"] for m in after["migrations"])
    assert after["pending"] == 0
    assert after["floor"]["version"] == SCHEMA_FLOOR
    assert after["floor"]["recorded_by"] == __version__
    assert (after["code_runs_on_it"], after["refusal"]) == (True, None)


def test_status_in_words_names_what_is_pending_and_what_to_run(database_url: str) -> None:
    # Given a ledger at version 10, as the previous version's migrate left it
    with psycopg.connect(database_url, autocommit=True) as conn, conn.transaction():
        migrate_by_hand(conn, up_to=10)
    # When the operator asks for the status
    finished = cli("migrate", "--status", database_url=database_url)
    # Then the floor's migration and the jobs' are pending, and the command to run is named
    assert finished.returncode == 0, finished.stderr
    lines = finished.stdout.splitlines()
    assert (
        lines[0] == f"this code: infrai-jobs {__version__} (its migrations' floor: {SCHEMA_FLOOR})"
    )
    assert "ledger 0010 one state machine: applied " in finished.stdout
    assert "ledger 0011 schema floor: pending" in lines
    pending_jobs = [f"jobs   {m.version:04d} {m.name}: pending" for m in FIXTURE_JOBS_MIGRATIONS]
    assert [line for line in lines if line.startswith("jobs ")] == pending_jobs
    pending_ledger = len(LEDGER_MIGRATIONS) - 10  # the floor's and those after it
    assert f"{pending_ledger + len(pending_jobs)} pending: run `infrai-jobs migrate`" in (
        finished.stdout
    )
    assert lines[-1].startswith("this code may not run on it: the ledger schema is at version 10")


@pytest.mark.parametrize(
    "args", [["--status"], ["--status", "--json"], ["--emit-sql"]], ids=" ".join
)
def test_an_unreachable_database_is_one_line_without_the_password(args: list[str]) -> None:
    # Given a URL with a password, at a port where nothing listens
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"postgresql://jobs:Sup3rSecretPw@127.0.0.1:{port}/jobs"
    # When the status or the pending SQL is asked for
    finished = cli("migrate", *args, database_url=url)
    # Then it fails in one line, names the database without the password, and exits 1
    assert finished.returncode == 1, finished.stderr
    assert "Traceback" not in finished.stderr
    errors = [line for line in finished.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, finished.stderr
    assert f"cannot connect to the ledger database at jobs@127.0.0.1:{port}/jobs" in errors[0]
    assert "Sup3rSecretPw" not in finished.stderr + finished.stdout
    # And stdout holds no SQL and no status: with --json, only the error object
    if "--json" in args:
        error = json.loads(finished.stdout)["error"]
        assert (error["type"], error["exit_code"]) == ("LedgerUnavailable", 1)
    else:
        assert finished.stdout == ""


# --- migrate --emit-sql -------------------------------------------------------------------------


def test_the_emitted_sql_leaves_the_database_as_migrate_does(
    database_url: str, second_database_url: str
) -> None:
    # Given two databases at version 9, each with a claim, as the previous versions left them
    for url in (database_url, second_database_url):
        with psycopg.connect(url, autocommit=True) as conn, conn.transaction():
            migrate_by_hand(conn, up_to=9)
            conn.execute(
                "INSERT INTO job_claims (idem_key, state, message_id) VALUES ('k1', 'done', 'q1')"
            )
    # When one is migrated, and the other gets the SQL of what is pending
    assert cli("migrate", database_url=database_url).returncode == 0
    emitted = cli("migrate", "--emit-sql", database_url=second_database_url)
    assert emitted.returncode == 0, emitted.stderr
    # Then printing it applied nothing
    assert status_of(second_database_url)["pending"] == 1 + len(EVERY_MIGRATION) - 10
    # And the pending migrations are in it, in order, and no applied one
    titles = [line for line in emitted.stdout.splitlines() if line.startswith("-- ledger ")]
    assert titles == [f"-- ledger {m.version:04d}: {m.name}" for m in LEDGER_MIGRATIONS[9:]]
    # When the team's tool applies it
    apply_as_a_migration_tool(second_database_url, emitted.stdout)
    # Then both databases have the same shape, version rows and floor, and their claims
    assert schema_state(second_database_url) == schema_state(database_url)
    for url in (database_url, second_database_url):
        assert sql(url, "SELECT idem_key, state FROM job_claims") == [("k1", "done")]
    # And the status agrees: nothing pending, and migrate finds nothing to do
    assert status_of(second_database_url)["pending"] == 0
    again = cli("migrate", database_url=second_database_url)
    assert "nothing to do" in again.stdout


def test_the_sql_of_every_migration_builds_an_empty_database_as_migrate_does(
    database_url: str, second_database_url: str
) -> None:
    # Given two empty databases; one migrated
    assert cli("migrate", database_url=database_url).returncode == 0
    # When the SQL of every migration is printed (no database read) and applied to the other
    emitted = cli("migrate", "--emit-sql", "--all", database_url="")
    assert emitted.returncode == 0, emitted.stderr
    apply_as_a_migration_tool(second_database_url, emitted.stdout)
    # Then the two are alike, and the status says everything is applied
    assert schema_state(second_database_url) == schema_state(database_url)
    assert listed(status_of(second_database_url), "applied") == EVERY_MIGRATION


def test_emitted_sql_applied_after_another_migrate_rolls_back_whole(
    database_url: str,
) -> None:
    # Given the SQL of what an empty database lacks, and then a migrate that applied it all
    emitted = cli("migrate", "--emit-sql", database_url=database_url)
    assert emitted.returncode == 0, emitted.stderr
    assert cli("migrate", database_url=database_url).returncode == 0
    before = schema_state(database_url)
    # When the stale script is applied
    with pytest.raises(psycopg.errors.UniqueViolation):
        apply_as_a_migration_tool(database_url, emitted.stdout)
    # Then it stopped at the first version row already recorded, and changed nothing
    assert schema_state(database_url) == before


# --- The floor ------------------------------------------------------------------------------------


def test_a_floor_above_this_version_makes_the_drain_refuse_before_consuming(kit: Harness) -> None:
    # Given a job waiting, and a schema whose floor a newer version raised above this one
    kit.publish(INVOICE)
    set_floor(kit.database_url, FLOOR_ABOVE)
    # When the operator drains
    finished = run_cli(kit, "drain", "--max-batches", "1")
    # Then it exits 2 in one line naming both versions and what to do, and consumed nothing
    assert finished.returncode == 2, finished.stderr
    assert "Traceback" not in finished.stderr
    errors = [line for line in finished.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, finished.stderr
    assert f"lets infrai-jobs {FLOOR_ABOVE} or newer run on it" in errors[0]
    assert f"this code is {__version__}: deploy {FLOOR_ABOVE} or newer" in errors[0]
    nothing_consumed(kit)
    assert kit.sql("SELECT count(*) FROM job_claims") == [(0,)]


def test_drain_functions_service_refuses_a_floor_above_this_version_too(kit: Harness) -> None:
    # Given DrainFunction's service, a job waiting, and a floor above this version
    kit.publish(INVOICE)
    set_floor(kit.database_url, FLOOR_ABOVE)
    settings = DrainSettings.from_env(
        {**kit.services, **fixture_jobs.provider_settings(kit.sink.url), "INFRAI_QUEUE": QUEUE},
        job_settings=kit.registry.declared_settings(),
    )
    service = DrainService.from_settings(settings, kit.registry)
    # When it runs
    try:
        with pytest.raises(SchemaTooNew) as refused:
            service.run(lambda: 120_000, max_batches=1)
    finally:
        service.close()
    # Then it raised the refusal the other refusals are (the function's error names both
    # versions), and nothing was consumed
    assert isinstance(refused.value, SchemaNotMigrated)
    assert FLOOR_ABOVE in str(refused.value)
    assert __version__ in str(refused.value)
    nothing_consumed(kit)


def test_a_floor_above_this_version_stops_a_dead_letters_read_before_it_consumes(
    kit: Harness,
) -> None:
    # Given a dead letter in the DLQ, and a floor above this version
    kit.client.publish(DLQ, {"job": "test.db", "id": "floor-dead"})
    set_floor(kit.database_url, FLOOR_ABOVE)
    # When the operator lists the dead letters (which moves new ones into the ledger first)
    finished = run_cli(kit, "dlq")
    # Then it refuses with exit 2, and the dead letter is still in the DLQ, unread
    assert finished.returncode == 2, finished.stderr
    assert FLOOR_ABOVE in finished.stderr
    nothing_consumed(kit, DLQ)


def test_code_runs_on_a_schema_ahead_of_it_while_the_floor_lets_it(kit: Harness) -> None:
    # Given a schema a newer version migrated: one more migration (a table and a column it
    # added), and a floor at this very version
    with psycopg.connect(kit.database_url, autocommit=True) as conn, conn.transaction():
        conn.execute("CREATE TABLE newer_feature (id int PRIMARY KEY)")
        conn.execute("ALTER TABLE job_claims ADD COLUMN newer_note text")
        conn.execute(
            "INSERT INTO infrai_jobs_schema (version, name) VALUES (%s, 'newer feature')",
            (SCHEMA_VERSION + 1,),
        )
        conn.execute(
            "UPDATE infrai_jobs_schema_floor SET floor = %s, recorded_by = %s",
            (".".join(map(str, release_numbers(__version__))), FLOOR_ABOVE),
        )
    kit.sql("INSERT INTO invoices (id) VALUES ('inv_ahead')")
    kit.publish(INVOICE)
    # When this version drains
    finished = run_cli(kit, "drain", "--max-batches", "1")
    # Then it runs the job as on its own schema
    assert finished.returncode == 0, finished.stderr
    assert json.loads(finished.stdout)["done"] == 1, finished.stderr
    assert kit.sql("SELECT status, total_cents FROM invoices") == [("final", 4200)]
    # And the status shows the newer migration as one this version has no file for
    status = status_of_kit(kit)
    newer = [m for m in status["migrations"] if not m["in_this_version"]]
    assert [(m["owner"], m["version"], m["name"]) for m in newer] == [
        ("ledger", SCHEMA_VERSION + 1, "newer feature")
    ]
    assert (status["pending"], status["code_runs_on_it"]) == (0, True)


def status_of_kit(kit: Harness) -> dict[str, Any]:
    finished = run_cli(kit, "migrate", "--status", "--json")
    assert finished.returncode == 0, finished.stderr
    status: dict[str, Any] = json.loads(finished.stdout)
    return status


def test_migrate_raises_a_lower_floor_and_never_lowers_a_higher_one(database_url: str) -> None:
    # Given a migrated database whose floor is below this version's
    assert cli("migrate", database_url=database_url).returncode == 0
    set_floor(database_url, "0.0.1")
    # When migrate runs, Then the floor is raised to this version's
    assert cli("migrate", database_url=database_url).returncode == 0
    assert status_of(database_url)["floor"]["version"] == SCHEMA_FLOOR
    # Given a floor a newer version raised above this one
    set_floor(database_url, FLOOR_ABOVE)
    # When this version's migrate runs (say, for a jobs' migration)
    assert cli("migrate", database_url=database_url).returncode == 0
    # Then the floor stays where the newer version put it, and this code says it may not run
    status = status_of(database_url)
    assert status["floor"]["version"] == FLOOR_ABOVE
    assert status["code_runs_on_it"] is False
    assert FLOOR_ABOVE in status["refusal"]


def test_the_database_refuses_a_floor_that_is_not_a_release_version(database_url: str) -> None:
    assert cli("migrate", database_url=database_url).returncode == 0
    for floor in ("0.3", "0.3.0rc1", "v1.0.0", "latest"):
        with pytest.raises(psycopg.errors.CheckViolation):
            set_floor(database_url, floor)
