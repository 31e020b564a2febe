"""The ledger's migrations (SQL files in the layer, beside the one writer of job_claims, applied
only by the tools) and the schema version the layer needs agree, every file still records the name
databases already hold for it, and the package ships them."""

from __future__ import annotations

import os
import shutil
import sys
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import pytest
from child_process import run_captured

from infrai_jobs.ledger.postgres import SCHEMA_VERSION, newest_migration
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


def test_the_schema_version_is_the_highest_file_number(tmp_path: Path) -> None:
    # Given a folder of migrations, out of order, and files that are not migrations
    for name in ["0002_b.sql", "0011_k.sql", "0003_c.sql", "README.md", "notes.sql", "0012.txt"]:
        (tmp_path / name).write_text("SELECT 1;\n")
    # Then the version is the highest NNNN of an NNNN_name.sql
    assert newest_migration(tmp_path) == 11


def test_a_layer_without_its_migrations_does_not_guess_a_version(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no ledger migration"):
        newest_migration(tmp_path)
    with pytest.raises(FileNotFoundError):
        newest_migration(tmp_path / "missing")


def test_a_new_migration_file_is_all_it_takes_to_raise_the_version(tmp_path: Path) -> None:
    # Given a copy of the layer package, as Lambda unpacks it, with one more migration file
    copy = tmp_path / "infrai_jobs"
    shutil.copytree(LAYER_PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "work" / "migrations" / f"{SCHEMA_VERSION + 1:04d}_next.sql").write_text("SELECT 1;\n")
    # When a fresh interpreter imports the ledger from that copy
    script = "import infrai_jobs.ledger.postgres as p\nprint(p.__file__)\nprint(p.SCHEMA_VERSION)\n"
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    finished = run_captured([sys.executable, "-c", script], env=env)
    # Then the version it needs is the new file's, with no constant edited
    assert finished.returncode == 0, finished.stderr
    module_file, version = finished.stdout.split()
    assert Path(module_file).is_relative_to(copy)
    assert int(version) == SCHEMA_VERSION + 1


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
