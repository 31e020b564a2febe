"""The schema's floor, without a database: versions compare number by number, the floor this
version declares is one the database accepts and lets this version in, and the SQL that
``migrate --emit-sql`` prints is whole statements in one transaction, version rows included."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from infrai_jobs import __version__
from infrai_jobs.ledger.job_schema import release_numbers
from infrai_local.migrations import (
    LEDGER_FOLDER,
    LEDGER_MIGRATIONS,
    SCHEMA_FLOOR,
    migration_script,
    read_migrations,
)

# The CHECK that 0011_schema_floor.sql puts on the floor column, as PostgreSQL reads it.
FLOOR_CHECK = re.compile(r"^[0-9]+\.[0-9]+\.[0-9]+$")


@pytest.mark.parametrize(
    ("lower", "higher"),
    [
        ("0.9.0", "0.10.0"),
        ("0.1.9", "0.2.0"),
        ("1.99.99", "2.0.0"),
        ("0.2.0", "0.2.1"),
        ("9.0.0", "10.0.0"),
    ],
)
def test_versions_compare_as_numbers_not_as_text(lower: str, higher: str) -> None:
    assert release_numbers(lower) < release_numbers(higher)


def test_0_10_is_above_0_9_though_text_sorts_it_below() -> None:
    versions = ["0.10.0", "0.9.0", "0.2.0"]
    assert sorted(versions) == ["0.10.0", "0.2.0", "0.9.0"]
    assert sorted(versions, key=release_numbers) == ["0.2.0", "0.9.0", "0.10.0"]


def test_a_pre_release_or_local_label_counts_as_its_release() -> None:
    assert release_numbers("0.3.0rc1") == release_numbers("0.3.0") == (0, 3, 0)
    assert release_numbers("1.2.3+local.7") == (1, 2, 3)
    assert release_numbers(" 2.0.1\n") == (2, 0, 1)


@pytest.mark.parametrize("text", ["", "1", "1.2", "v1.2.3", "one.two.three", "1..2"])
def test_what_is_not_a_semantic_version_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="not a semantic version"):
        release_numbers(text)


def test_the_floor_this_version_declares_is_a_release_the_database_accepts() -> None:
    assert FLOOR_CHECK.match(SCHEMA_FLOOR)
    # And the migration's CHECK is the same pattern
    floor_migration = (LEDGER_FOLDER / "0011_schema_floor.sql").read_text()
    assert r"CHECK (floor ~ '^[0-9]+\.[0-9]+\.[0-9]+$')" in floor_migration


def test_a_version_never_declares_a_floor_that_shuts_itself_out() -> None:
    assert release_numbers(SCHEMA_FLOOR) <= release_numbers(__version__)


def test_the_script_of_every_migration_is_one_transaction_of_whole_statements() -> None:
    # When the script of every ledger migration is written, as `migrate --emit-sql --all` does
    script = migration_script(LEDGER_MIGRATIONS, with_jobs=False)
    lines = script.splitlines()
    statements = [line for line in lines if not line.startswith("--")]
    # Then it opens and commits one transaction, taking migrate's lock first
    assert statements[0] == "BEGIN;"
    assert statements[1].startswith("SELECT pg_advisory_xact_lock(")
    assert statements[-1] == "COMMIT;"
    # And each migration is followed by its version row, then the floor is recorded
    for migration in LEDGER_MIGRATIONS:
        row = f'INSERT INTO "infrai_jobs_schema" (version, name) VALUES ({migration.version}, '
        assert f"{row}'{migration.name}');" in script
        assert f"-- ledger {migration.version:04d}: {migration.name}" in script
    floor_row = script.index("INSERT INTO infrai_jobs_schema_floor AS f")
    assert script.index("VALUES (11, 'schema floor')") < floor_row
    assert f"VALUES ('{SCHEMA_FLOOR}', '{__version__}')" in script
    # And no line is a psql meta-command, which a migration tool would not understand
    assert not [line for line in lines if line.lstrip().startswith("\\")]


def test_a_statement_after_a_trailing_comment_still_starts_a_statement_of_its_own(
    tmp_path: Path,
) -> None:
    # Given a jobs' migration whose last statement has no ';' and one that ends in a comment
    folder = tmp_path / "migrations"
    folder.mkdir()
    (folder / "0001_plain.sql").write_text("CREATE TABLE a (id int)\n")
    (folder / "0002_commented.sql").write_text("CREATE TABLE b (id int);\n-- done; b is ready\n")
    # When its script is written
    script = migration_script(read_migrations(folder), with_jobs=True)
    # Then each statement is ended before the next begins
    assert "CREATE TABLE a (id int);\nINSERT INTO" in script
    assert "-- done; b is ready\n;\nINSERT INTO" in script
    assert "CREATE TABLE IF NOT EXISTS infrai_jobs_job_schema" in script
