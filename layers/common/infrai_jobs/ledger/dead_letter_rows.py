"""The ``dead_letters`` table's shared statements, and the dead letters the ledger holds: work
it owns (a deferred job out of attempts) has no message in any DLQ, so its dead letter is recorded
in the transaction that fails it, the same row an operator lists, discards and redrives."""

from __future__ import annotations

from typing import Final, LiteralString

# The ``dlq`` of a dead letter the ledger holds: no DLQ ever had it. A drain's (out of attempts)
# is redriven with its failed claim reopened; an operator's (``claims resolve --failed``) is a
# human's verdict, reopened only by an explicit ``redrive --reopen-failed``.
LEDGER_HELD_DLQ: Final = "(ledger)"
RESOLVED_FAILED_DLQ: Final = "(resolved failed)"

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

RESOLVE_DEAD_LETTER: LiteralString = """
UPDATE dead_letters
SET resolution = %(resolution)s, resolved_at = now(), resolved_by = %(actor)s,
    resolution_note = %(note)s
WHERE message_id = %(message_id)s AND resolution IS NULL
"""

UNRESOLVED_DEAD_LETTERS: LiteralString = """
SELECT count(*) FROM dead_letters WHERE queue = %(queue)s AND resolution IS NULL
"""
