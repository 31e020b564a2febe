"""``infrai-jobs example-data``: the example jobs' table, with draft invoices to finalize.

``invoice.finalize`` (a ``database`` job) updates a row of ``invoices`` in the ledger's own
database; a real deployment has its own table, a local one needs this. ``receipt.send`` and
``digest.build`` call PROVIDER_URL and need no table.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import LiteralString

from infrai_jobs.postgres import connect_to_ledger
from infrai_jobs.settings import Settings
from infrai_local.jobs_package import project_root

_DRAFT: LiteralString = "INSERT INTO invoices (id) VALUES (%(id)s) ON CONFLICT (id) DO NOTHING"


def example_tables_ddl(root: Path) -> str:
    """The table the example job updates, as the job itself declares it."""
    folder = str(root / "functions")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    ddl: str = importlib.import_module("jobs.invoice").INVOICES_DDL
    return ddl


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="infrai-jobs example-data",
        description="Create the example jobs' table (invoices) in DATABASE_URL's database, "
        "with draft invoices for invoice.finalize to finalize.",
    )
    parser.add_argument(
        "--invoice",
        action="append",
        metavar="ID",
        help="a draft invoice to create (repeatable; default: inv_8812)",
    )
    parser.add_argument(
        "--root",
        type=Path,
        default=None,
        help="the project folder (default: the one whose jobs package is installed)",
    )
    args = parser.parse_args(argv)
    url = Settings.from_env().require_database_url()
    invoices = args.invoice or ["inv_8812"]
    ddl = example_tables_ddl(args.root.resolve() if args.root is not None else project_root())
    with connect_to_ledger(url, application_name="infrai-jobs-example-data") as conn:
        conn.execute(ddl.encode())
        for invoice in invoices:
            conn.execute(_DRAFT, {"id": invoice})
    print(f"invoices: table ready, draft invoice(s) {', '.join(invoices)}")
    return 0
