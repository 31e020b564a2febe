"""The schema check run before anything is consumed: the ledger's version, its floor (the oldest
infrai-jobs version that may run on it) and which of a jobs package's ``migrations/NNNN_name.sql``
it applied (``migrate`` records them; nothing here applies SQL). Else a handler finds a missing
table, its message retried until it is a dead letter."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, LiteralString

import psycopg

from infrai_jobs import __version__
from infrai_jobs.errors import SchemaNotMigrated, SchemaTooNew
from infrai_jobs.ledger.postgres import RUN_MIGRATE, SCHEMA_VERSION, current_version, table_exists

# NNNN_name.sql: the version, then the name recorded with it (infrai_local.migrations applies
# files named so, and refuses any other .sql file).
MIGRATION_FILE_NAME: Final = re.compile(r"^(?P<version>\d{4})_(?P<name>[a-z0-9_]+)\.sql$")
MIGRATIONS_FOLDER: Final = "migrations"

_JOB_SCHEMA_APPLIED: LiteralString = "SELECT version, name FROM infrai_jobs_job_schema"
_FLOOR: LiteralString = "SELECT floor FROM infrai_jobs_schema_floor"


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
    names = (MIGRATION_FILE_NAME.match(path.name) for path in folder.glob("*.sql"))
    return tuple(sorted(JobMigrationName(int(m["version"]), m["name"]) for m in names if m))


def release_numbers(version: str) -> tuple[int, ...]:
    """A semantic version's ``MAJOR.MINOR.PATCH`` as numbers (0.10.0 is above 0.9.0); what
    follows them is not compared, so ``0.3.0rc1`` counts as 0.3.0."""
    found = re.match(r"(\d+)\.(\d+)\.(\d+)", version.strip())
    if found is None:
        raise ValueError(f"not a semantic version (MAJOR.MINOR.PATCH): {version!r}")
    return tuple(int(number) for number in found.groups())


def check_schema(conn: psycopg.Connection[Any], jobs: Sequence[JobMigrationName] = ()) -> None:
    """``SchemaNotMigrated`` for a database behind this code (a ledger's or ``jobs``' migration
    missing), ``SchemaTooNew`` for a floor above ``__version__``; one ahead is fine otherwise."""
    version = current_version(conn)
    if version < SCHEMA_VERSION:
        behind = f"the ledger schema is at version {version}, this code needs {SCHEMA_VERSION}"
        if version == 0:
            behind = "the ledger database is not migrated (it has no infrai-jobs tables)"
        raise SchemaNotMigrated(f"{behind}: {RUN_MIGRATE}")
    floor = conn.execute(_FLOOR).fetchone()
    if floor and release_numbers(floor[0]) > release_numbers(__version__):
        raise SchemaTooNew(
            f"the ledger schema lets infrai-jobs {floor[0]} or newer run on it, and this code is "
            f"{__version__}: deploy {floor[0]} or newer (a schema is never migrated back; "
            "`infrai-jobs migrate --status` shows what a newer version applied)"
        )
    has_table = bool(jobs) and table_exists(conn, "infrai_jobs_job_schema")
    rows = conn.execute(_JOB_SCHEMA_APPLIED).fetchall() if has_table else []
    applied = {JobMigrationName(int(version), str(name)) for version, name in rows}
    missing = ", ".join(m.file_name for m in jobs if m not in applied)
    if missing:
        raise SchemaNotMigrated(
            f"the jobs' migration(s) {missing} are not applied to the ledger database: "
            f"{RUN_MIGRATE}"
        )
