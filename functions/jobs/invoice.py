"""``invoice.finalize``: a ``database`` job, the field notes' example.

Its only effect is an UPDATE in the ledger's own Postgres, so it runs inside the batch
transaction that also holds its claim: claim, effect and ``done`` commit together or not at all.
Its table is its own migration, ``migrations/0001_invoice_invoices.sql`` (``infrai-jobs migrate``).
"""

from __future__ import annotations

from typing import LiteralString

from infrai_jobs.jobs.registry import Effect, JobContext, JobRegistry, JsonValue, Payload

_FINALIZE: LiteralString = """
UPDATE invoices SET status = 'final', total_cents = %(amount_cents)s
WHERE id = %(invoice_id)s
RETURNING id, status, total_cents
"""


class InvoiceNotFound(LookupError):
    """Raised as a transient failure: the producer's row may not be committed yet, so the
    redelivery retries, and after three deliveries the message waits in the DLQ for a fix."""


def finalize_invoice(payload: Payload, ctx: JobContext) -> JsonValue:
    if ctx.db is None:  # pragma: no cover - the drain always passes it for database jobs
        raise RuntimeError("invoice.finalize needs the batch transaction's connection")
    # The schema below has checked the types: amount_cents is an integer, never a boolean.
    params = {"invoice_id": str(payload["invoice_id"]), "amount_cents": payload["amount_cents"]}
    row = ctx.db.execute(_FINALIZE, params).fetchone()
    if row is None:
        raise InvoiceNotFound(f"invoice {payload['invoice_id']} does not exist")
    return {"id": row[0], "status": row[1], "total_cents": row[2]}


def register(registry: JobRegistry) -> None:
    registry.job(
        "invoice.finalize",
        effect=Effect.DATABASE,
        identity=("invoice_id",),
        # A producer may send the id as a number: it keys as its digits and is stored as text.
        fields={"invoice_id": (str, int), "amount_cents": int},
    )(finalize_invoice)
