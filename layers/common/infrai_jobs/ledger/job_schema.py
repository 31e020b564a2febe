"""Which of a jobs package's ``migrations/NNNN_name.sql`` a database has applied (``infrai-jobs
migrate`` records each in ``infrai_jobs_job_schema``; nothing here applies SQL). The drain checks
up front: else a handler finds a missing one, its message retried until it is a dead letter."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, LiteralString

import psycopg

from infrai_jobs.ledger.postgres import RUN_MIGRATE, table_exists

# NNNN_name.sql: the version, then the name recorded with it (infrai_local.migrations applies
# files named so, and refuses any other .sql file).
MIGRATION_FILE_NAME: Final = re.compile(r"^(?P<version>\d{4})_(?P<name>[a-z0-9_]+)\.sql$")
MIGRATIONS_FOLDER: Final = "migrations"

_JOB_SCHEMA_APPLIED: LiteralString = "SELECT version, name FROM infrai_jobs_job_schema"


@dataclass(frozen=True, slots=True, order=True)
class JobMigrationName:
    version: int
    name: str

    @property
    def file_name(self) -> str:
        return f"{self.version:04d}_{self.name}.sql"


def job_migrations_in(package_folder: Path) -> tuple[JobMigrationName, ...]:
    """The migrations in a jobs package's ``migrations/``, by version. Files not named
    ``NNNN_name.sql`` are left to ``infrai-jobs migrate``, which refuses them."""
    folder = package_folder / MIGRATIONS_FOLDER
    if not folder.is_dir():
        return ()
    found = []
    for path in folder.glob("*.sql"):
        match = MIGRATION_FILE_NAME.match(path.name)
        if match is not None:
            found.append(JobMigrationName(int(match["version"]), match["name"]))
    return tuple(sorted(found))


def missing_job_migrations(
    conn: psycopg.Connection[Any], declared: Sequence[JobMigrationName]
) -> list[JobMigrationName]:
    """Those of ``declared`` the database has not applied (under that version and name)."""
    if not declared:
        return []
    has_table = table_exists(conn, "infrai_jobs_job_schema")
    rows = conn.execute(_JOB_SCHEMA_APPLIED).fetchall() if has_table else []
    applied = {JobMigrationName(int(version), str(name)) for version, name in rows}
    return [migration for migration in declared if migration not in applied]


def jobs_schema_behind(missing: Sequence[JobMigrationName]) -> str:
    """What ``SchemaNotMigrated`` says about a database that lacks ``missing``."""
    names = ", ".join(migration.file_name for migration in missing)
    return f"the jobs' migration(s) {names} are not applied to the ledger database: {RUN_MIGRATE}"
