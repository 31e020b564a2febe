"""``invoice.finalize`` of the fixture jobs: a ``database`` job.

It updates a row of ``invoices`` (the fixture code root's migration) inside the batch
transaction; a missing row is a transient failure, so its message ends in the DLQ after the
queue's deliveries.
"""

from __future__ import annotations

from typing import LiteralString

from infrai_jobs.jobs.registry import Effect, JobContext, JobRegistry, JsonValue, Payload

NAME = "invoice.finalize"

_MARK_FINAL: LiteralString = (
    "UPDATE invoices SET status = 'final', total_cents = %(total)s WHERE id = %(id)s"
    " RETURNING id, status, total_cents"
)


def mark_final(payload: Payload, ctx: JobContext) -> JsonValue:
    assert ctx.db is not None, "a database job runs in the batch transaction"
    invoice = str(payload["invoice_id"])
    found = ctx.db.execute(_MARK_FINAL, {"id": invoice, "total": payload["amount_cents"]})
    row = found.fetchone()
    if row is None:
        raise LookupError(f"invoice {invoice} does not exist")
    return dict(zip(("id", "status", "total_cents"), row, strict=True))


def register(registry: JobRegistry) -> None:
    # A producer may send the id as a number: it keys as its digits.
    schema = {"invoice_id": (str, int), "amount_cents": int}
    registry.job(NAME, identity=("invoice_id",), fields=schema, effect=Effect.DATABASE)(mark_final)
