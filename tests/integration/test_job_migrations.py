"""The jobs' own migrations (``jobs/migrations/NNNN_name.sql``): applied by ``infrai-jobs migrate``
after the ledger's, recorded apart, under the same lock, once however many run at once.

``infrai-jobs`` runs in child processes against a real PostgreSQL.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest
from child_process import run_captured

from infrai_jobs.errors import ConfigurationError
from infrai_local.migrations import (
    LEDGER_MIGRATIONS,
    apply_migrations,
    read_migrations,
)

INFRAI_JOBS = str(Path(sys.executable).parent / "infrai-jobs")
ROOT = Path(__file__).resolve().parents[2]

# Deliberately not idempotent: applied twice, the CREATE fails and the INSERT adds a second row.
# The sleep holds the migrate lock long enough for a second migrate to arrive and wait on it.
LEDGERS_OF_SHIPMENTS = """
CREATE TABLE shipments (id text PRIMARY KEY, state text NOT NULL DEFAULT 'new');
INSERT INTO shipments (id) VALUES ('seed');
SELECT pg_sleep(1);
"""
SHIPMENT_NOTES = "ALTER TABLE shipments ADD COLUMN note text;"


def code_root(folder: Path, migrations: dict[str, str]) -> Path:
    """A code root laid out like functions/: a jobs package with these migration files."""
    (folder / "jobs" / "migrations").mkdir(parents=True)
    (folder / "jobs" / "__init__.py").write_text(
        "from infrai_jobs.jobs.registry import JobRegistry\n"
        "def build_registry():\n"
        "    return JobRegistry()\n"
    )
    for name, sql in migrations.items():
        (folder / "jobs" / "migrations" / name).write_text(sql)
    return folder


def cli_env(database_url: str) -> dict[str, str]:
    environment = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("INFRAI_", "DATABASE_", "PROVIDER_"))
    }
    return {**environment, "DATABASE_URL": database_url}


def migrate(database_url: str, *argv: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return run_captured(
        [INFRAI_JOBS, "migrate", *argv], env=cli_env(database_url), cwd=cwd, timeout=120
    )


def rows(database_url: str, query: str) -> list[tuple[object, ...]]:
    with psycopg.connect(database_url) as conn:
        return conn.execute(query.encode()).fetchall()


def test_two_migrates_at_once_apply_each_jobs_migration_exactly_once(
    database_url: str, tmp_path: Path
) -> None:
    # Given jobs whose migrations would fail, or double a row, if applied twice
    root = code_root(
        tmp_path / "functions",
        {"0001_shipments.sql": LEDGERS_OF_SHIPMENTS, "0002_shipment_notes.sql": SHIPMENT_NOTES},
    )
    # When two `infrai-jobs migrate` processes start at the same moment
    command = [INFRAI_JOBS, "migrate", "--jobs-path", str(root)]
    children = [
        subprocess.Popen(
            command,
            env=cli_env(database_url),
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [child.communicate(timeout=120) for child in children]
    # Then both succeed
    for child, (out, err) in zip(children, outputs, strict=True):
        assert child.returncode == 0, out + err
    # And each migration was applied by exactly one of them, the ledger's and the jobs' alike
    printed = [line for out, _ in outputs for line in out.splitlines() if line.startswith("app")]
    assert sorted(line for line in printed if " jobs " in line) == [
        "applied jobs 0001: shipments",
        "applied jobs 0002: shipment_notes",
    ]
    assert len([line for line in printed if " ledger " in line]) == len(LEDGER_MIGRATIONS)
    assert rows(database_url, "SELECT id, note FROM shipments") == [("seed", None)]
    assert rows(database_url, "SELECT version FROM infrai_jobs_job_schema ORDER BY 1") == [
        (1,),
        (2,),
    ]


def test_a_new_jobs_migration_is_applied_after_the_ones_already_recorded(
    database_url: str, tmp_path: Path
) -> None:
    # Given a database migrated with the jobs' first migration
    first = read_migrations(
        code_root(tmp_path / "a", {"0001_shipments.sql": LEDGERS_OF_SHIPMENTS})
        / "jobs"
        / "migrations"
    )
    with psycopg.connect(database_url, autocommit=True) as conn:
        apply_migrations(conn, first)
    # When a later release adds a second one and migrate runs
    both = read_migrations(
        code_root(
            tmp_path / "b",
            {"0001_shipments.sql": LEDGERS_OF_SHIPMENTS, "0002_shipment_notes.sql": SHIPMENT_NOTES},
        )
        / "jobs"
        / "migrations"
    )
    with psycopg.connect(database_url, autocommit=True) as conn:
        applied = apply_migrations(conn, both)
    # Then only the new one ran (the first, not idempotent, would have failed)
    assert [(m.owner, m.version) for m in applied] == [("jobs", 2)]
    assert rows(database_url, "SELECT note FROM shipments") == [(None,)]


def test_a_jobs_version_reused_under_another_name_is_refused_and_nothing_is_applied(
    database_url: str, tmp_path: Path
) -> None:
    # Given a database where the jobs' version 1 is "shipments"
    migrate(
        database_url,
        "--jobs-path",
        str(
            code_root(
                tmp_path / "a",
                {
                    "0001_shipments.sql": LEDGERS_OF_SHIPMENTS,
                },
            )
        ),
    )
    # When a jobs package whose version 1 is something else is migrated
    other = code_root(
        tmp_path / "b",
        {"0001_parcels.sql": "CREATE TABLE parcels (id text);", "0002_x.sql": "SELECT 1;"},
    )
    refused = migrate(database_url, "--jobs-path", str(other))
    # Then it is a configuration error that names both, and neither migration ran
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "'parcels'" in refused.stderr
    assert "'shipments'" in refused.stderr
    assert rows(database_url, "SELECT to_regclass('parcels') IS NULL") == [(True,)]
    assert rows(database_url, "SELECT version FROM infrai_jobs_job_schema") == [(1,)]


@pytest.mark.parametrize(
    ("files", "problem"),
    [
        ({"1_short.sql": "SELECT 1;"}, "NNNN_name.sql"),
        ({"0001_Upper.sql": "SELECT 1;"}, "NNNN_name.sql"),
        ({"0001_a.sql": "SELECT 1;", "0001_b.sql": "SELECT 1;"}, "version 0001 is also"),
    ],
)
def test_a_misnamed_or_duplicate_migration_file_is_refused(
    tmp_path: Path, files: dict[str, str], problem: str
) -> None:
    folder = code_root(tmp_path, files) / "jobs" / "migrations"
    with pytest.raises(ConfigurationError, match=problem):
        read_migrations(folder)


def test_example_data_without_the_jobs_tables_says_to_migrate(database_url: str) -> None:
    # Given a database nobody migrated
    # When example-data is asked for draft invoices
    finished = run_captured(
        [INFRAI_JOBS, "example-data"], env=cli_env(database_url), cwd=ROOT, timeout=60
    )
    # Then it names the command that creates the table, and created nothing itself
    assert finished.returncode == 2, finished.stdout + finished.stderr
    assert "infrai-jobs migrate" in finished.stderr
    assert rows(database_url, "SELECT to_regclass('invoices') IS NULL") == [(True,)]
