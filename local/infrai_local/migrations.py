"""Versioned, idempotent schema migrations: the claim ledger's, then the jobs' own tables.

Both are SQL files named ``NNNN_name.sql``: the ledger's in the layer, ``work/migrations/`` of
``infrai_jobs`` (beside the one writer of ``job_claims``), the jobs' in ``migrations/`` inside the
jobs package. The number is the version (``0001``, ``0002``, ...), the rest of the file name is
the name recorded with it. A file is SQL as PostgreSQL takes it, one or more statements, and runs
inside the migrate transaction (so no ``CREATE INDEX CONCURRENTLY``). Only the tools here apply
them (``infrai-jobs migrate``, the demo, local invoke, the test kit); the layer only reads the
version a database is at (``infrai_jobs.ledger.postgres.current_version``) and refuses one behind
its ``SCHEMA_VERSION``.

``apply_migrations`` takes a transaction-scoped advisory lock, so two ``infrai-jobs migrate`` runs
started at once apply each migration exactly once: the second waits, then finds nothing to do.
The jobs' migrations run after the ledger's, in the same transaction under the same lock, and are
recorded apart (``infrai_jobs_job_schema``): the two version sequences never collide.
Every statement is also written to be harmless when repeated (``IF NOT EXISTS``), and the first
migration adopts a ``job_claims`` table created by the field notes' own DDL: every column it adds
is nullable or defaulted, so the notes' ``INSERT (idem_key, state, message_id)`` keeps working.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal, LiteralString

import psycopg

from infrai_jobs.errors import ConfigurationError
from infrai_jobs.ledger.job_schema import MIGRATION_FILE_NAME
from infrai_jobs.ledger.postgres import LEDGER_MIGRATIONS_FOLDER
from infrai_local.jobs_package import import_jobs

# An arbitrary constant that names "infrai-jobs schema changes" among advisory locks.
MIGRATION_LOCK_ID = 0x1F0A_7C3B

Owner = Literal["ledger", "jobs"]


@dataclass(frozen=True, slots=True)
class Migration:
    version: int
    name: str
    # The file's text, as it was written.
    sql: bytes
    owner: Owner = "ledger"


# Read from the installed layer package: the same files a deployed function ships with.
LEDGER_FOLDER: Final = LEDGER_MIGRATIONS_FOLDER
MIGRATIONS_FOLDER: Final = "migrations"
# The layer's schema check reads the jobs' file names by the same rule.
_FILE_NAME: Final = MIGRATION_FILE_NAME


def read_migrations(folder: Path, owner: Owner = "jobs") -> tuple[Migration, ...]:
    """Every ``NNNN_name.sql`` in ``folder``, by version; none when there is no folder. Any
    other ``.sql`` file, or two files with one version, is a ``ConfigurationError``.

    The name recorded is the file's after the number: as written for the jobs'
    (``0001_invoice_invoices.sql`` is "invoice_invoices"), with each ``_`` read as a space for
    the ledger's (``0001_claim_ledger.sql`` is "claim ledger", the name databases recorded)."""
    if not folder.is_dir():
        return ()
    found: dict[int, Migration] = {}
    files: dict[int, str] = {}
    for path in sorted(folder.glob("*.sql")):
        match = _FILE_NAME.match(path.name)
        if match is None:
            raise ConfigurationError(
                f"{path}: a {owner} migration is named NNNN_name.sql (four digits, then "
                "lower-case letters, digits and underscores), e.g. 0002_invoice_due_dates.sql"
            )
        version = int(match["version"])
        if version in found:
            raise ConfigurationError(f"{path}: version {version:04d} is also {files[version]}")
        files[version] = path.name
        name = match["name"].replace("_", " ") if owner == "ledger" else match["name"]
        found[version] = Migration(version, name, path.read_bytes(), owner=owner)
    return tuple(found[version] for version in sorted(found))


LEDGER_MIGRATIONS: Final = read_migrations(LEDGER_FOLDER, "ledger")
if not LEDGER_MIGRATIONS:  # pragma: no cover - only an install that lost its data files
    raise ImportError(f"no ledger migrations in {LEDGER_FOLDER}: reinstall infrai-jobs")
LATEST_VERSION: Final = LEDGER_MIGRATIONS[-1].version

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
        for migration in LEDGER_MIGRATIONS:
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


def jobs_migrations_folder(code_root: Path) -> Path:
    """Where a code root's jobs package keeps its migrations."""
    return code_root / "jobs" / MIGRATIONS_FOLDER


def installed_job_migrations(jobs_path: str | None = None) -> tuple[Migration, ...]:
    """The migrations of the jobs package the CLI imports (see ``jobs_package``)."""
    package_file = import_jobs(jobs_path).__file__
    return read_migrations(Path(str(package_file)).parent / MIGRATIONS_FOLDER)


def migrate_all(
    conn: psycopg.Connection[Any], jobs: tuple[Migration, ...] | None = None
) -> list[Migration]:
    """The ledger's migrations, then the jobs' (the installed package's unless given)."""
    return apply_migrations(conn, installed_job_migrations() if jobs is None else jobs)
