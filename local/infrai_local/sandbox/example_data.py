"""``infrai-jobs example-data``: draft invoices for the example ``invoice.finalize`` to finalize.

``invoice.finalize`` (a ``database`` job) updates a row of ``invoices`` in the ledger's own
database. The table is the job's own migration (``functions/jobs/migrations``), created by
``infrai-jobs migrate``; this command only adds the draft rows a local run finalizes.
``receipt.send`` and ``digest.build`` call their provider and need no rows.

The example jobs are the framework repository's: a team's project (``infrai-jobs init``) has its
own jobs and none of them, so there this command and ``infrai-jobs demo`` refuse up front,
pointing at the project's own ``make demo`` (a missing ``invoices`` table would otherwise read
as a database left unmigrated).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import TYPE_CHECKING, LiteralString

import psycopg

from infrai_jobs.config.settings import CommonSettings
from infrai_jobs.errors import ConfigurationError
from infrai_jobs.ledger.postgres import connect_to_ledger
from infrai_local.jobs_package import load_registry

if TYPE_CHECKING:
    from infrai_jobs.jobs.registry import JobRegistry

_DRAFT: LiteralString = "INSERT INTO invoices (id) VALUES (%(id)s) ON CONFLICT (id) DO NOTHING"


def refuse_without_example_jobs(registry: JobRegistry, jobs: Sequence[str], doing: str) -> None:
    """Refuse, in one line, a command that ``doing`` the framework's example ``jobs`` when the
    jobs package lacks one of them."""
    if all(registry.get(job) is not None for job in jobs):
        return
    raise ConfigurationError(
        f"{doing} the framework's example jobs ({', '.join(jobs)}), which this project's jobs "
        "package does not have: `make demo` runs this project's own jobs on the local stand-ins"
    )


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
    try:
        registry = load_registry()
    except ConfigurationError:
        registry = None  # no jobs package to ask: the table tells, as below
    if registry is not None:
        refuse_without_example_jobs(
            registry, ("invoice.finalize",), "infrai-jobs example-data adds draft invoices for"
        )
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
