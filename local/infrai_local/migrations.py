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

Each run also records the schema's floor, ``SCHEMA_FLOOR``: the oldest infrai-jobs version that
may run on the schema these migrations leave (never lowering one a newer version recorded); the
layer refuses a database whose floor is above its own version. ``schema_status`` reads what a
database has applied, and ``migration_script`` writes what ``apply_migrations`` would run as one
SQL script, version rows included, for a team that applies SQL with a tool of its own.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final, Literal, LiteralString

import psycopg
from psycopg import sql
from psycopg.abc import Query

from infrai_jobs import __version__
from infrai_jobs.errors import ConfigurationError, SchemaNotMigrated
from infrai_jobs.ledger.job_schema import MIGRATION_FILE_NAME, JobMigrationName, check_schema
from infrai_jobs.ledger.postgres import LEDGER_MIGRATIONS_FOLDER, table_exists
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

# The oldest infrai-jobs version that runs on the schema LEDGER_MIGRATIONS leave: what migrate
# records as the schema's floor. Every migration so far only adds, so 0.1.0 runs on it. A release
# whose migration contracts (drops or renames what an older version reads) raises it to the first
# version that no longer reads it, and ships only after that version did: expand in one release,
# contract in a later one (docs/operations.md, "Upgrading"). A release version, MAJOR.MINOR.PATCH.
SCHEMA_FLOOR: Final = "0.1.0"

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
_VERSION_TABLES: Final[dict[Owner, str]] = {
    "ledger": "infrai_jobs_schema",
    "jobs": "infrai_jobs_job_schema",
}
_LOCK: Final = sql.SQL("SELECT pg_advisory_xact_lock({lock_id})").format(
    lock_id=sql.Literal(MIGRATION_LOCK_ID)
)
_RECORD: Final = sql.SQL("INSERT INTO {table} (version, name) VALUES ({version}, {name})")
_APPLIED: Final = sql.SQL("SELECT version, name, applied_at FROM {table} ORDER BY version")
# Raised, never lowered: a version older than the one that recorded the floor may still run
# migrate (its jobs' migrations), and must not let itself back in. Compared number by number.
_RECORD_FLOOR: Final = sql.SQL(
    """INSERT INTO infrai_jobs_schema_floor AS f (floor, recorded_by)
VALUES ({floor}, {recorded_by})
ON CONFLICT (one_row) DO UPDATE
    SET floor = EXCLUDED.floor, recorded_by = EXCLUDED.recorded_by, recorded_at = now()
    WHERE string_to_array(f.floor, '.')::int[] < string_to_array(EXCLUDED.floor, '.')::int[]"""
).format(floor=sql.Literal(SCHEMA_FLOOR), recorded_by=sql.Literal(__version__))
_FLOOR: LiteralString = "SELECT floor, recorded_by, recorded_at FROM infrai_jobs_schema_floor"

# (owner, version) -> (name, applied_at): what a database records as applied.
Recorded = dict[tuple[Owner, int], tuple[str, datetime]]


def apply_migrations(
    conn: psycopg.Connection[Any], jobs: Sequence[Migration] = ()
) -> list[Migration]:
    """Apply what is missing, the ledger's then the jobs', in order, in one transaction, and
    record the schema's floor; return what was applied.

    A jobs' version already recorded under another name is a ``ConfigurationError`` and
    nothing is applied: an applied migration is never edited or renumbered, only followed."""
    _check_sequence(jobs)
    with conn.transaction():
        # The lock first, so a concurrent first run cannot race on CREATE TABLE IF NOT EXISTS.
        for statement in _preamble(with_jobs=bool(jobs)):
            conn.execute(statement)
        pending = pending_migrations(recorded_migrations(conn), jobs)
        for _, step in _steps(pending):
            conn.execute(step)
    return pending


def _preamble(*, with_jobs: bool) -> list[Query]:
    """What runs before any migration: the lock, then the version tables."""
    return [_LOCK, _CREATE_VERSIONS, *([_CREATE_JOB_VERSIONS] if with_jobs else [])]


def _steps(pending: Sequence[Migration]) -> Iterator[tuple[str, Query]]:
    """Each pending migration and its version row, then the floor: (what it is, its SQL)."""
    for migration in pending:
        yield f"{migration.owner} {migration.version:04d}: {migration.name}", migration.sql
        table = sql.Identifier(_VERSION_TABLES[migration.owner])
        version, name = sql.Literal(migration.version), sql.Literal(migration.name)
        yield "", _RECORD.format(table=table, version=version, name=name)
    yield f"the schema's floor: infrai-jobs {SCHEMA_FLOOR} or newer (never lowered)", _RECORD_FLOOR


def recorded_migrations(conn: psycopg.Connection[Any]) -> Recorded:
    """What ``conn``'s database records as applied, the ledger's and the jobs'. It reads only:
    a database without the version tables has applied nothing."""
    recorded: Recorded = {}
    for owner, table in _VERSION_TABLES.items():
        if not table_exists(conn, table):
            continue
        rows = conn.execute(_APPLIED.format(table=sql.Identifier(table))).fetchall()
        recorded.update(((owner, int(v)), (str(name), at)) for v, name, at in rows)
    return recorded


def pending_migrations(recorded: Recorded, jobs: Sequence[Migration] = ()) -> list[Migration]:
    """The ledger's migrations, then the jobs', that ``recorded`` lacks, in order. A jobs'
    version recorded under another name is a ``ConfigurationError``."""
    pending = [m for m in LEDGER_MIGRATIONS if ("ledger", m.version) not in recorded]
    for migration in jobs:
        applied = recorded.get(("jobs", migration.version))
        if applied is None:
            pending.append(migration)
        elif applied[0] != migration.name:
            raise ConfigurationError(
                f"jobs migration {migration.version:04d} is {migration.name!r} here but was "
                f"applied as {applied[0]!r}: an applied migration is never renamed or reused; "
                "add a new version"
            )
    return pending


def migration_script(pending: Sequence[Migration], *, with_jobs: bool) -> str:
    """``pending`` as one SQL script that does what ``apply_migrations`` does: one transaction,
    under migrate's advisory lock, each migration followed by its version row, then the floor.
    Applied after another migrate ran one of them, it stops at that version row's primary key
    and rolls back whole."""
    lines = [
        f"-- infrai-jobs {__version__} `migrate --emit-sql`: {len(pending)} migration(s) in order,",
        "-- each with the version row `infrai-jobs migrate --status` reads, then the schema's",
        "-- floor. One transaction: run it whole (psql -v ON_ERROR_STOP=1 -f FILE), or drop",
        "-- BEGIN and COMMIT where your tool runs each script in a transaction of its own.",
        "BEGIN;",
        *(_statement_text(statement) for statement in _preamble(with_jobs=with_jobs)),
    ]
    for title, step in _steps(pending):
        lines.extend([f"-- {title}"] if title else [])
        lines.append(_statement_text(step))
    lines.append("COMMIT;")
    return "\n".join(lines) + "\n"


def _statement_text(statement: Query) -> str:
    if isinstance(statement, bytes):
        text = statement.decode("utf-8")
    elif isinstance(statement, sql.Composable):
        text = statement.as_string()
    else:
        text = str(statement)
    # As written (a migration's text is never re-indented: a string literal may span lines).
    text = text.strip()
    # A file's last statement may end without ';', or be followed by a comment line (where a
    # ';' would be part of the comment).
    if text.rsplit("\n", 1)[-1].lstrip().startswith("--"):
        return f"{text}\n;"
    return text if text.endswith(";") else f"{text};"


@dataclass(frozen=True, slots=True)
class MigrationState:
    """One migration as a database holds it: applied (``applied_at``) or pending. One this
    version has no file for (``in_this_version`` False) was applied by a newer version."""

    owner: Owner
    version: int
    name: str
    applied_at: datetime | None = None
    in_this_version: bool = True

    @property
    def state(self) -> str:
        return "pending" if self.applied_at is None else "applied"

    def as_dict(self) -> dict[str, Any]:
        return {
            "owner": self.owner,
            "version": self.version,
            "name": self.name,
            "state": self.state,
            "applied_at": _utc(self.applied_at),
            "in_this_version": self.in_this_version,
        }


@dataclass(frozen=True, slots=True)
class SchemaFloor:
    version: str
    recorded_by: str
    recorded_at: datetime


@dataclass(frozen=True, slots=True)
class SchemaStatus:
    """What ``migrate --status`` shows: every migration, the floor (None before one is
    recorded) and why this code's functions refuse the database ("" when they run on it)."""

    migrations: tuple[MigrationState, ...]
    floor: SchemaFloor | None
    refusal: str

    @property
    def pending(self) -> tuple[MigrationState, ...]:
        return tuple(m for m in self.migrations if m.applied_at is None)

    def as_dict(self) -> dict[str, Any]:
        floor = self.floor
        return {
            "code_version": __version__,
            "code_floor": SCHEMA_FLOOR,
            "floor": None
            if floor is None
            else {
                "version": floor.version,
                "recorded_by": floor.recorded_by,
                "recorded_at": _utc(floor.recorded_at),
            },
            "migrations": [migration.as_dict() for migration in self.migrations],
            "pending": len(self.pending),
            "code_runs_on_it": not self.refusal,
            "refusal": self.refusal or None,
        }

    def lines(self) -> list[str]:
        floor = self.floor
        recorded = (
            "none recorded yet (migrate records it)"
            if floor is None
            else f"{floor.version} (recorded by infrai-jobs {floor.recorded_by} at "
            f"{_utc(floor.recorded_at)})"
        )
        lines = [
            f"this code: infrai-jobs {__version__} (its migrations' floor: {SCHEMA_FLOOR})",
            f"schema floor: {recorded}",
        ]
        for m in self.migrations:
            when = "pending" if m.applied_at is None else f"applied {_utc(m.applied_at)}"
            newer = "" if m.in_this_version else " (by a newer version: this code has no such file)"
            lines.append(f"{m.owner:<6} {m.version:04d} {m.name}: {when}{newer}")
        pending = len(self.pending)
        if pending:
            lines.append(
                f"{pending} pending: run `infrai-jobs migrate`, or apply the SQL of "
                "`infrai-jobs migrate --emit-sql`"
            )
        lines.append(
            f"this code may not run on it: {self.refusal}"
            if self.refusal
            else "this code runs on it"
        )
        return lines


def schema_status(conn: psycopg.Connection[Any], jobs: Sequence[Migration] = ()) -> SchemaStatus:
    """``conn``'s database as ``migrate --status`` shows it, with ``jobs`` (the jobs package's
    migrations); it reads only."""
    recorded = recorded_migrations(conn)
    states: list[MigrationState] = []
    for migration in (*LEDGER_MIGRATIONS, *jobs):
        applied = recorded.pop((migration.owner, migration.version), None)
        if applied is not None and applied[0] != migration.name:
            # Recorded under another name: that row is listed below, and this file waits.
            recorded[(migration.owner, migration.version)] = applied
            applied = None
        states.append(MigrationState(migration.owner, migration.version, migration.name))
        if applied is not None:
            states[-1] = replace(states[-1], applied_at=applied[1])
    states.extend(
        MigrationState(owner, version, name, applied_at, in_this_version=False)
        for (owner, version), (name, applied_at) in recorded.items()
    )
    states.sort(key=lambda m: (m.owner != "ledger", m.version, not m.in_this_version))
    floor = None
    if table_exists(conn, "infrai_jobs_schema_floor"):
        row = conn.execute(_FLOOR).fetchone()
        floor = None if row is None else SchemaFloor(str(row[0]), str(row[1]), row[2])
    return SchemaStatus(tuple(states), floor, _refusal(conn, jobs))


def _refusal(conn: psycopg.Connection[Any], jobs: Sequence[Migration]) -> str:
    """What this code's functions would say about the database (the layer's own check)."""
    names = [JobMigrationName(m.version, m.name) for m in jobs]
    try:
        check_schema(conn, names)
    except SchemaNotMigrated as exc:
        return str(exc)
    return ""


def _utc(moment: datetime | None) -> str | None:
    return None if moment is None else moment.astimezone(UTC).isoformat(timespec="seconds")


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
