"""``infrai-jobs example-data``: draft invoices for the example ``invoice.finalize`` to finalize.

``invoice.finalize`` (a ``database`` job) updates a row of ``invoices`` in the ledger's own
database. The table is the job's own migration (``functions/jobs/migrations``), created by
``infrai-jobs migrate``; this command only adds the draft rows a local run finalizes.
``receipt.send`` and ``digest.build`` call their provider and need no rows.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import LiteralString

import psycopg

from infrai_jobs.config.settings import CommonSettings
from infrai_jobs.errors import ConfigurationError
from infrai_jobs.ledger.postgres import connect_to_ledger

_DRAFT: LiteralString = "INSERT INTO invoices (id) VALUES (%(id)s) ON CONFLICT (id) DO NOTHING"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="infrai-jobs example-data",
        description="Add draft invoices for invoice.finalize to finalize to DATABASE_URL's "
        "database (its invoices table comes from `infrai-jobs migrate`).",
    )
    parser.add_argument(
        "--invoice",
        action="append",
        metavar="ID",
        help="a draft invoice to create (repeatable; default: inv_8812)",
    )
    args = parser.parse_args(argv)
    url = CommonSettings.from_env().require_database_url()
    invoices = args.invoice or ["inv_8812"]
    with connect_to_ledger(url, application_name="infrai-jobs-example-data") as conn:
        try:
            for invoice in invoices:
                conn.execute(_DRAFT, {"id": invoice})
        except psycopg.errors.UndefinedTable:
            raise ConfigurationError(
                "there is no invoices table: run `infrai-jobs migrate` first (the invoice "
                "job's migration creates it)"
            ) from None
    print(f"invoices: draft invoice(s) {', '.join(invoices)}")
    return 0
