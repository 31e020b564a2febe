"""The ledger's migrations (SQL files in the layer, beside the one writer of job_claims, applied
only by the tools) and the schema version the layer needs agree, every file still records the name
databases already hold for it, and the package ships them."""

from __future__ import annotations

import tomllib
from fnmatch import fnmatch
from pathlib import Path

from infrai_jobs.ledger.postgres import SCHEMA_VERSION
from infrai_local.migrations import LATEST_VERSION, LEDGER_FOLDER, LEDGER_MIGRATIONS

ROOT = Path(__file__).resolve().parents[2]
LAYER_PACKAGE = ROOT / "layers" / "common" / "infrai_jobs"

# The names infrai_jobs_schema holds for versions 1 to 9 in every database migrated so far: the
# contract with them. A file is never renamed; a new version only adds a name.
RECORDED_NAMES = [
    "claim ledger",
    "alert state",
    "operator history",
    "consume isolation",
    "drain leases",
    "dead letters",
    "flow control",
    "deferred run begun",
    "outbox",
]


def test_the_layer_needs_the_newest_ledger_migration() -> None:
    assert LEDGER_MIGRATIONS[-1].version == LATEST_VERSION == SCHEMA_VERSION


def test_the_ledger_versions_run_from_1_with_no_gap() -> None:
    versions = [migration.version for migration in LEDGER_MIGRATIONS]
    assert versions == list(range(1, len(versions) + 1))
    # Every .sql file in the folder is one of them (the reader refuses any other name)
    assert len(list(LEDGER_FOLDER.glob("*.sql"))) == len(versions)
    assert {migration.owner for migration in LEDGER_MIGRATIONS} == {"ledger"}


def test_each_ledger_file_records_the_name_databases_already_hold() -> None:
    names = [migration.name for migration in LEDGER_MIGRATIONS]
    assert names[: len(RECORDED_NAMES)] == RECORDED_NAMES
    # Read from the file's name: NNNN_claim_ledger.sql is "claim ledger"
    first = sorted(LEDGER_FOLDER.glob("*.sql"))[0]
    assert first.name == "0001_claim_ledger.sql"


def test_migrate_reads_the_layers_own_files() -> None:
    # The files the layer ships, and no second copy kept with the tools
    assert LEDGER_FOLDER.resolve() == (LAYER_PACKAGE / "work" / "migrations").resolve()
    assert list((ROOT / "local").rglob("*.sql")) == []


def test_the_ledger_migrations_are_installed_with_the_layer_package() -> None:
    # A non-editable install (a wheel) has the files only if they are declared as package data
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = setuptools["package-data"]["infrai_jobs"]
    files = [path.relative_to(LAYER_PACKAGE).as_posix() for path in LEDGER_FOLDER.glob("*.sql")]
    assert files
    assert [name for name in files if not any(fnmatch(name, p) for p in patterns)] == []
    # And the package that holds the folder is one the wheel lists
    assert "infrai_jobs.work" in setuptools["packages"]
