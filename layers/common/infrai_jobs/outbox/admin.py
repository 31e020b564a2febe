"""The operator's outbox (``OutboxAdmin``): list the rows that wait (pending, or dead), publish
one again (``retry``) or give it up (``discard``), each change recorded in ``claim_history``
under the row's key with the operator's name, the row before it (payload included) and after.
The command line (``infrai-jobs outbox list|retry|discard``) only words what it answers.

``retry`` makes a pending or dead row due now with its attempts back at 0 (a dead row pending
again); ``discard`` deletes a pending or dead row, its body kept in the history's record. Either
resolves the row's unresolved outbox dead letter (``outbox:<seq>``) as redriven or discarded. A
published row is neither: it went out. A row a relay holds at that moment is refused, to be
asked again.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Final, Literal, LiteralString

import psycopg
from psycopg.rows import class_row

from infrai_jobs.errors import OutboxError
from infrai_jobs.ledger.dead_letter_rows import RESOLVE_DEAD_LETTER
from infrai_jobs.ledger.postgres import LedgerConnector, record_history
from infrai_jobs.outbox.rows import OUTBOX_COLUMNS, OutboxRow

# What ``rows`` lists when no state is asked for: what still waits for a relay or a human.
WAITING: Final = ("pending", "dead")
RETRY: Final = "outbox_retry"
DISCARD: Final = "outbox_discard"

_LIST: LiteralString = (
    "SELECT "
    + OUTBOX_COLUMNS
    + """
FROM outbox
WHERE state = ANY(%(states)s::text[])
  AND (%(job)s::text IS NULL OR job = %(job)s)
  AND (%(queue)s::text IS NULL OR queue = %(queue)s)
  AND (NOT %(failing)s OR attempts > 0)
ORDER BY seq
LIMIT %(limit)s
"""
)

_LOCK: LiteralString = (
    "SELECT "
    + OUTBOX_COLUMNS
    + """
FROM outbox WHERE seq = %(seq)s
FOR UPDATE SKIP LOCKED
"""
)
_STATE: LiteralString = "SELECT state FROM outbox WHERE seq = %(seq)s"
_DEAD_SEQS: LiteralString = "SELECT seq FROM outbox WHERE state = 'dead' ORDER BY seq"

_RETRY: LiteralString = (
    """
UPDATE outbox
SET state = 'pending', settled_at = NULL, attempts = 0, next_attempt_at = now()
WHERE seq = %(seq)s AND state IN ('pending', 'dead')
RETURNING """
    + OUTBOX_COLUMNS
)

_DISCARD: LiteralString = "DELETE FROM outbox WHERE seq = %(seq)s AND state IN ('pending', 'dead')"


@dataclass(frozen=True, slots=True)
class OutboxChange:
    """One operator change: the row before it, the row after it (None: discarded), and
    whether it resolved the row's outbox dead letter."""

    before: OutboxRow
    after: OutboxRow | None
    letter_resolved: bool

    def as_dict(self) -> dict[str, Any]:
        return {
            "seq": self.before.seq,
            "idem_key": self.before.idem_key,
            "before": self.before.as_dict(),
            "after": None if self.after is None else self.after.as_dict(),
            "dead_letter_resolved": self.letter_resolved,
        }


class OutboxAdmin:
    """The outbox at ``outbox``; its records go to the ledger's ``claim_history`` and
    ``dead_letters`` at ``ledger`` (the same transaction when both are one database)."""

    def __init__(self, outbox: LedgerConnector, ledger: LedgerConnector) -> None:
        self._outbox = outbox
        self._ledger = ledger

    def rows(
        self,
        *,
        states: tuple[str, ...] = WAITING,
        job: str | None = None,
        queue: str | None = None,
        failing: bool = False,
        limit: int = 100,
    ) -> list[OutboxRow]:
        """Rows in ``states``, oldest first; ``failing`` only those that met an error."""
        params = {"states": list(states), "job": job, "queue": queue, "failing": failing}
        with (
            self._outbox.session("cannot read the outbox") as conn,
            conn.cursor(row_factory=class_row(OutboxRow)) as cur,
        ):
            return cur.execute(_LIST, {**params, "limit": limit}).fetchall()

    def dead_seqs(self) -> list[int]:
        with self._outbox.session("cannot read the outbox") as conn:
            return [int(seq) for (seq,) in conn.execute(_DEAD_SEQS).fetchall()]

    def retry(self, seq: int, *, actor: str, note: str = "") -> OutboxChange:
        """Make row ``seq`` due now, its attempts at 0 (``OutboxError`` when it is published,
        absent, held by a relay, or pending without an error: due already)."""
        with self._locked(seq, "retry") as (conn, row):
            if row.state == "pending" and row.attempts == 0:
                raise OutboxError(
                    f"outbox row {seq} is pending and has met no error: the next relay pass "
                    "publishes it already"
                )
            with conn.cursor(row_factory=class_row(OutboxRow)) as cur:
                after = cur.execute(_RETRY, {"seq": seq}).fetchone()
            assert after is not None  # locked, pending or dead
            with self._recording(conn) as ledger:
                resolved = _record_in(ledger, row, after, RETRY, actor=actor, note=note)
        return OutboxChange(row, after, resolved)

    def discard(self, seq: int, *, actor: str, reason: str) -> OutboxChange:
        """Delete pending or dead row ``seq`` for good, recorded with ``reason`` (its body is
        in the record); ``OutboxError`` when it is published, absent or held by a relay."""
        if not reason.strip():
            raise OutboxError("a discard needs a reason (--reason), for the record")
        with self._locked(seq, "discard") as (conn, row):
            conn.execute(_DISCARD, {"seq": seq})
            with self._recording(conn) as ledger:
                resolved = _record_in(ledger, row, None, DISCARD, actor=actor, note=reason)
        return OutboxChange(row, None, resolved)

    @contextmanager
    def _locked(self, seq: int, doing: str) -> Iterator[tuple[psycopg.Connection[Any], OutboxRow]]:
        """Row ``seq`` locked in a transaction on the outbox, if it may be changed."""
        with self._outbox.session(f"cannot {doing} an outbox row") as conn, conn.transaction():
            with conn.cursor(row_factory=class_row(OutboxRow)) as cur:
                row = cur.execute(_LOCK, {"seq": seq}).fetchone()
            if row is None:
                found = conn.execute(_STATE, {"seq": seq}).fetchone()
                if found is None:
                    raise OutboxError(
                        f"no outbox row has seq {seq} (`infrai-jobs outbox list` shows them)"
                    )
                raise OutboxError(
                    f"a relay is publishing outbox row {seq} right now: ask again in a moment"
                )
            if row.state == "published":
                raise OutboxError(
                    f"outbox row {seq} was published already (message {row.message_id}): "
                    f"there is nothing to {doing}"
                )
            yield conn, row

    @contextmanager
    def _recording(self, conn: psycopg.Connection[Any]) -> Iterator[psycopg.Connection[Any]]:
        """Where a change is recorded: the outbox's own transaction when the ledger is the same
        database, else a ledger transaction committed just before it."""
        if self._ledger.url == self._outbox.url:
            yield conn
            return
        with self._ledger.session("cannot record an outbox change") as ledger, ledger.transaction():
            yield ledger


def _record_in(
    conn: psycopg.Connection[Any],
    row: OutboxRow,
    after: OutboxRow | None,
    action: str,
    *,
    actor: str,
    note: str,
) -> bool:
    before = row.as_dict()
    later = None if after is None else after.as_dict()
    record_history(conn, row.idem_key, action, actor=actor, before=before, after=later, note=note)
    resolution: Literal["redriven", "discarded"] = "redriven" if action == RETRY else "discarded"
    params = {"message_id": f"outbox:{row.seq}", "resolution": resolution, "actor": actor}
    resolved = conn.execute(RESOLVE_DEAD_LETTER, {**params, "note": note or None})
    return resolved.rowcount == 1
