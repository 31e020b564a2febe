"""The jobs' own migrations: ``migrations/NNNN_name.sql`` inside the jobs package.

``infrai-jobs migrate`` applies them after the ledger's (``infrai_jobs.ledger.migrations``): same
transaction, same advisory lock, recorded apart in ``infrai_jobs_job_schema``. The number is the
version (``0001``, ``0002``, ...), the rest of the file name is the name recorded with it. A file
is SQL as PostgreSQL takes it, one or more statements; like the ledger's, it runs inside the
migrate transaction (so no ``CREATE INDEX CONCURRENTLY``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Final

import psycopg

from infrai_jobs.errors import ConfigurationError
from infrai_jobs.ledger.migrations import Migration, apply_migrations
from infrai_local.jobs_package import import_jobs

MIGRATIONS_FOLDER: Final = "migrations"
_FILE_NAME: Final = re.compile(r"^(?P<version>\d{4})_(?P<name>[a-z0-9_]+)\.sql$")


def read_job_migrations(folder: Path) -> tuple[Migration, ...]:
    """Every ``NNNN_name.sql`` in ``folder``, by version; none when there is no folder. Any
    other ``.sql`` file, or two files with one version, is a ``ConfigurationError``."""
    if not folder.is_dir():
        return ()
    found: dict[int, Migration] = {}
    for path in sorted(folder.glob("*.sql")):
        match = _FILE_NAME.match(path.name)
        if match is None:
            raise ConfigurationError(
                f"{path}: a jobs migration is named NNNN_name.sql (four digits, then lower-case "
                "letters, digits and underscores), e.g. 0002_invoice_due_dates.sql"
            )
        version = int(match["version"])
        if version in found:
            raise ConfigurationError(
                f"{path}: version {version:04d} is also {found[version].name}.sql"
            )
        found[version] = Migration(version, match["name"], path.read_bytes(), owner="jobs")
    return tuple(found[version] for version in sorted(found))


def jobs_migrations_folder(code_root: Path) -> Path:
    """Where a code root's jobs package keeps its migrations."""
    return code_root / "jobs" / MIGRATIONS_FOLDER


def installed_job_migrations(jobs_path: str | None = None) -> tuple[Migration, ...]:
    """The migrations of the jobs package the CLI imports (see ``jobs_package``)."""
    package_file = import_jobs(jobs_path).__file__
    return read_job_migrations(Path(str(package_file)).parent / MIGRATIONS_FOLDER)


def migrate_all(
    conn: psycopg.Connection[Any], jobs: tuple[Migration, ...] | None = None
) -> list[Migration]:
    """The ledger's migrations, then the jobs' (the installed package's unless given)."""
    return apply_migrations(conn, installed_job_migrations() if jobs is None else jobs)
