"""The field notes' example, the work most tests publish: the invoice the notes' worker
finalized, on the queue it read. Importable from every test folder, as ``child_process`` is.

Tests copy ``NOTES_PAYLOAD`` (``{**NOTES_PAYLOAD, ...}``) to vary it; none changes it in place.
"""

from __future__ import annotations

QUEUE = "billing-jobs"
DLQ = "billing-jobs-dlq"
NOTES_PAYLOAD = {"job": "invoice.finalize", "invoice_id": "inv_8812", "amount_cents": 4900}
