"""``infrai-jobs migrate`` run from any folder applies the ledger's migrations, then those of the
installed jobs package: here the examples', whose invoice job's migration makes ``invoices``.
(``migrate`` and ``rows`` are the jobs' migrations tests' own.)"""

from __future__ import annotations

from pathlib import Path

from test_job_migrations import migrate, rows

from infrai_local.migrations import LEDGER_MIGRATIONS, installed_job_migrations


def test_migrate_creates_the_ledger_then_the_invoice_jobs_table_from_any_folder(
    database_url: str, tmp_path: Path
) -> None:
    # Given a fresh database, and an operator outside the project
    # When they run migrate, then run it again
    first = migrate(database_url, cwd=tmp_path)
    again = migrate(database_url, cwd=tmp_path)
    # Then the first applied the ledger's migrations, then the jobs' own, which made invoices
    assert first.returncode == 0, first.stderr
    lines = first.stdout.splitlines()
    assert lines[: len(LEDGER_MIGRATIONS)] == [
        f"applied ledger {m.version:04d}: {m.name}" for m in LEDGER_MIGRATIONS
    ]
    # (every migration of the installed jobs package: the invoice job's first, then any a team
    # added, e.g. with new-job)
    jobs = installed_job_migrations()
    assert jobs[0].name == "invoice_invoices"
    assert lines[len(LEDGER_MIGRATIONS) :] == [
        f"applied jobs {m.version:04d}: {m.name}" for m in jobs
    ]
    assert rows(database_url, "SELECT to_regclass('invoices') IS NOT NULL") == [(True,)]
    # And the two are recorded apart: the jobs' version 1 is not the ledger's version 1
    assert rows(
        database_url, "SELECT version, name FROM infrai_jobs_job_schema ORDER BY version"
    ) == [(m.version, m.name) for m in jobs]
    assert len(rows(database_url, "SELECT version FROM infrai_jobs_schema")) == len(
        LEDGER_MIGRATIONS
    )
    # And the second run had nothing to do
    assert again.returncode == 0, again.stderr
    assert again.stdout.splitlines() == [
        f"ledger schema already at version {LEDGER_MIGRATIONS[-1].version} and every jobs "
        "migration applied; nothing to do"
    ]
