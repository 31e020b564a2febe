"""The ``dead_letters`` table's shared statements, and the dead letters the ledger holds: work
it owns (a deferred job out of attempts) has no message in any DLQ, so its dead letter is recorded
in the transaction that fails it, the same row an operator lists, discards and redrives."""

from __future__ import annotations

from typing import Any, Final, LiteralString

import psycopg
from psycopg.types.json import Jsonb

from infrai_jobs.ledger.claims import ClaimRow

# The ``dlq`` of a dead letter the ledger holds: no DLQ ever had it.
LEDGER_HELD_DLQ: Final = "(ledger)"

RECORD_DEAD_LETTER: LiteralString = """
INSERT INTO dead_letters (
    message_id, queue, dlq, unreadable, payload, raw_text, size_bytes, job, idem_key, state,
    claim_state, reason, main_deliveries, dlq_deliveries, published_at
) VALUES (
    %(message_id)s, %(queue)s, %(dlq)s, %(unreadable)s, %(payload)s, %(raw_text)s,
    %(size_bytes)s, %(job)s, %(idem_key)s, %(state)s, %(claim_state)s, %(reason)s,
    %(main_deliveries)s, %(dlq_deliveries)s, %(published_at)s
)
ON CONFLICT (message_id) DO NOTHING
"""

UNRESOLVED_DEAD_LETTERS: LiteralString = """
SELECT count(*) FROM dead_letters WHERE queue = %(queue)s AND resolution IS NULL
"""


def hold_dead_letter(
    conn: psycopg.Connection[Any], work: ClaimRow, *, queue: str, reason: str
) -> bool:
    """Record an unresolved dead letter for failed ``work`` whose message was acked long ago, in
    the caller's transaction; a redrive publishes its payload again and reopens its ``failed``
    claim. False when a dead letter with this message id is recorded already."""
    unknown = ("raw_text", "size_bytes", "main_deliveries", "dlq_deliveries", "published_at")
    values = dict.fromkeys(unknown) | {
        "message_id": work.message_id,
        "queue": queue,
        "dlq": LEDGER_HELD_DLQ,
        "unreadable": False,
        "payload": Jsonb(work.payload),
        "job": work.job or "",
        "idem_key": work.idem_key,
        "state": "failed",
        "claim_state": "failed",
        "reason": reason,
    }
    return conn.execute(RECORD_DEAD_LETTER, values).rowcount == 1
