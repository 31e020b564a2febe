"""The drains of a queue alive now, leases in the ledger's ``drain_leases`` table. Counting and
reserving happen under an advisory lock per queue, so two drains deciding at once never both
start the missing ones; leases run on the database's clock, which all drains agree on."""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, LiteralString

import psycopg

from infrai_jobs.ledger.postgres import LedgerAdapter, array_literal

# Names "infrai-jobs drain leases" among advisory locks; the queue's hash is the second key.
FLEET_LOCK_CLASS = 0x1F0A_7C3C

_LOCK: LiteralString = "SELECT pg_advisory_xact_lock(%(lock_class)s, hashtext(%(queue)s))"
_FORGET_EXPIRED: LiteralString = (
    "DELETE FROM drain_leases WHERE queue = %(queue)s AND lease_until < now()"
)
_LIVE: LiteralString = "SELECT count(*) FROM drain_leases WHERE queue = %(queue)s"
_ADOPT: LiteralString = """
UPDATE drain_leases SET lease_until = now() + make_interval(secs => %(seconds)s)
WHERE queue = %(queue)s AND drain_id = %(drain_id)s
RETURNING drain_id
"""
_INSERT: LiteralString = """
INSERT INTO drain_leases (queue, drain_id, origin, lease_until)
SELECT %(queue)s, id, %(origin)s, now() + make_interval(secs => %(seconds)s)
FROM unnest(%(ids)s::uuid[]) AS t(id)
ON CONFLICT (queue, drain_id) DO UPDATE SET lease_until = EXCLUDED.lease_until
"""
# A renewal is never refused: the drain is running already. It counts the live drains in the
# same round trip, expired leases left out.
_RENEW: LiteralString = """
WITH renewed AS (
    INSERT INTO drain_leases (queue, drain_id, origin, lease_until)
    VALUES (%(queue)s, %(drain_id)s, 'schedule', now() + make_interval(secs => %(seconds)s))
    ON CONFLICT (queue, drain_id) DO UPDATE SET lease_until = EXCLUDED.lease_until
    RETURNING drain_id
)
SELECT 1 + count(*) FROM drain_leases
WHERE queue = %(queue)s AND lease_until >= now() AND drain_id <> %(drain_id)s
"""
_LEAVE: LiteralString = (
    "DELETE FROM drain_leases WHERE queue = %(queue)s AND drain_id = ANY(%(ids)s::uuid[])"
)


class PostgresDrainFleet(LedgerAdapter):
    """``DrainFleetPort`` on one reusable connection of its own (the lanes hold theirs)."""

    APPLICATION_NAME = "infrai-jobs-fleet"
    # A missing drain_leases table is SchemaNotMigrated, naming the command to run.
    DOING = "a drain-lease statement"

    def join(
        self, queue: str, drain_id: str, *, origin: str, lease_seconds: float, cap: int
    ) -> bool:
        params = {"queue": queue, "drain_id": drain_id, "seconds": lease_seconds}
        with self._locked(queue) as conn:
            if conn.execute(_ADOPT, params).fetchone() is not None:
                return True
            if _count(conn, queue) >= cap:
                return False
            _insert(conn, queue, [drain_id], origin, lease_seconds)
            return True

    def renew(self, queue: str, drain_id: str, *, lease_seconds: float) -> int:
        with self._translated() as conn:
            row = conn.execute(
                _RENEW, {"queue": queue, "drain_id": drain_id, "seconds": lease_seconds}
            ).fetchone()
        return int(row[0]) if row else 1

    def reserve(self, queue: str, *, wanted: int, cap: int, lease_seconds: float) -> list[str]:
        with self._locked(queue) as conn:
            missing = min(wanted, cap) - _count(conn, queue)
            if missing <= 0:
                return []
            ids = [str(uuid.uuid4()) for _ in range(missing)]
            _insert(conn, queue, ids, "fan_out", lease_seconds)
            return ids

    def leave(self, queue: str, drain_ids: Sequence[str]) -> None:
        if not drain_ids:
            return
        ids = array_literal(map(uuid.UUID, drain_ids))
        with self._translated() as conn:
            conn.execute(_LEAVE, {"queue": queue, "ids": ids})

    @contextmanager
    def _locked(self, queue: str) -> Iterator[psycopg.Connection[Any]]:
        """One transaction holding the queue's fleet lock, expired leases already forgotten."""
        with self._translated() as conn, conn.transaction():
            conn.execute(_LOCK, {"lock_class": FLEET_LOCK_CLASS, "queue": queue})
            conn.execute(_FORGET_EXPIRED, {"queue": queue})
            yield conn


def _count(conn: psycopg.Connection[Any], queue: str) -> int:
    row = conn.execute(_LIVE, {"queue": queue}).fetchone()
    return int(row[0]) if row else 0


def _insert(
    conn: psycopg.Connection[Any], queue: str, ids: Sequence[str], origin: str, seconds: float
) -> None:
    ids_array = array_literal(map(uuid.UUID, ids))
    conn.execute(_INSERT, {"queue": queue, "origin": origin, "seconds": seconds, "ids": ids_array})
