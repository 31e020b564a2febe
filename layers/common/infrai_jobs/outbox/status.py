"""What the outbox holds, for ``infrai-jobs outbox status``, the relay's metrics and its alarm;
and the prune of settled rows with the ledger's retention."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, LiteralString

import psycopg

# Each figure from its own index (outbox_pending_idx, outbox_settled_idx): no scan of the
# published rows a month of retention keeps.
_STATUS: LiteralString = """
SELECT
    (SELECT count(*) FROM outbox WHERE state = 'pending'),
    (SELECT coalesce(extract(epoch FROM now() - min(enqueued_at)), 0)
       FROM outbox WHERE state = 'pending'),
    (SELECT count(*) FROM outbox
       WHERE state = 'published' AND settled_at > now() - interval '1 hour'),
    (SELECT count(*) FROM outbox WHERE state = 'dead'),
    (SELECT count(*) FROM outbox WHERE state = 'pending' AND attempts > 0)
"""

# Settled rows (published or dead) past the retention; their keys may then be enqueued again.
_PRUNE_BATCH: LiteralString = """
DELETE FROM outbox WHERE idem_key IN (
    SELECT idem_key FROM outbox
    WHERE state <> 'pending' AND settled_at < now() - make_interval(days => %(days)s)
    LIMIT %(batch)s
    FOR UPDATE SKIP LOCKED
)
"""


@dataclass(frozen=True, slots=True)
class OutboxStatus:
    pending: int
    oldest_pending_age_seconds: float
    published_last_hour: int
    dead: int
    # Pending rows that met an error at least once (waiting for their back-off).
    retrying: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def read_status(conn: psycopg.Connection[Any]) -> OutboxStatus:
    row = conn.execute(_STATUS).fetchone()
    assert row is not None  # one row, always: scalar subqueries
    pending, age, published, dead, retrying = row
    return OutboxStatus(int(pending), float(age), int(published), int(dead), int(retrying))


def prune_settled(conn: psycopg.Connection[Any], *, older_than_days: int, batch_size: int) -> int:
    """Delete settled outbox rows older than the retention, a batch per statement; how many."""
    deleted = 0
    while True:
        cursor = conn.execute(_PRUNE_BATCH, {"days": older_than_days, "batch": batch_size})
        deleted += cursor.rowcount
        if cursor.rowcount < batch_size:
            return deleted
