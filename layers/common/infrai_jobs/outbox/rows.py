"""An outbox row as the code sees it, and the statements the writer, the relay and the
operator views share.

One table (``outbox``, ledger migration 0009), one lifecycle: ``pending`` until a relay
publishes it (``published``, with Infrai's ``message_id``) or Infrai refuses it for good
(``dead``, its dead letter recorded in ``dead_letters``). A retry waits in ``pending`` with
``attempts`` and ``next_attempt_at``; nothing else holds a row.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final, Literal, LiteralString

OutboxState = Literal["pending", "published", "dead"]

# The ``dlq`` of an outbox dead letter in ``dead_letters``: no Infrai DLQ ever held it.
OUTBOX_DLQ: Final = "(outbox)"


@dataclass(frozen=True, slots=True)
class OutboxRow:
    """One intent in the outbox. ``created`` is False when ``enqueue`` found the key there
    already and wrote nothing (a producer's retry)."""

    idem_key: str
    seq: int
    queue: str | None
    job: str | None
    body: dict[str, Any]
    payload_sha256: str
    state: OutboxState
    enqueued_at: datetime
    attempts: int
    next_attempt_at: datetime
    last_error: str | None
    message_id: str | None
    published_at: datetime | None
    settled_at: datetime | None
    created: bool = False

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            out[name] = value.isoformat() if isinstance(value, datetime) else value
        return out


OUTBOX_COLUMNS: LiteralString = """idem_key, seq, queue, job, body, payload_sha256, state,
       enqueued_at, attempts, next_attempt_at, last_error, message_id, published_at, settled_at"""

OUTBOX_ROW_BY_KEY: LiteralString = (
    """SELECT """
    + OUTBOX_COLUMNS
    + """
FROM outbox WHERE idem_key = %(key)s"""
)
