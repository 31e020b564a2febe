"""The ledger changes the functions make outside the drain: reconcile a stuck claim, reopen a
redriven job's failed claims, prune old rows; and the reads they need for it.

Each change is fenced by the claim's state and token as it was read, and recorded in
``claim_history`` in the same transaction, with the actor its caller names (a function its own
name, the command line the operator): who is acting is never looked up here. The command
line's own reads and changes (list, show, resolve, release, deferred work) extend this class in
``infrai_local.operator``, outside the layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, LiteralString

import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from infrai_jobs.flow import ledger as flow
from infrai_jobs.flow.ledger import DEFERRED_BY_KEY, STUCK_DEFERRED, DeferredJob
from infrai_jobs.ledger.claims import ClaimRow
from infrai_jobs.ledger.postgres import CLAIM_BY_KEY as _SHOW
from infrai_jobs.ledger.postgres import CLAIM_BY_KEY_FOR_UPDATE as _FOR_UPDATE
from infrai_jobs.ledger.postgres import FAILED_CLAIMS_OF_WORK as _FAILED_OF_WORK
from infrai_jobs.ledger.postgres import STUCK_CLAIMS as _STUCK
from infrai_jobs.ledger.postgres import LedgerAdapter, record_history
from infrai_jobs.operations.claim_json import claim_as_dict, storable_json
from infrai_jobs.operations.dead_letters import DeadLetterStore
from infrai_jobs.outbox.status import prune_settled


@dataclass(frozen=True, slots=True)
class PruneResult:
    deleted: int
    batches: int
    # Published (and dead) outbox rows past the same retention.
    outbox_deleted: int = 0


_DELETE_FAILED: LiteralString = """
DELETE FROM job_claims WHERE idem_key = %(key)s AND state = 'failed'
"""

# A reconcile pass settles or releases only the attempt its probe was asked about: the same
# claim token, still running, and its lease over: a delivery under a live lease may be making
# the call right now, and only it settles its own run.
_RECONCILE_DONE: LiteralString = """
UPDATE job_claims
SET state = 'done', result = %(result)s, error = NULL, updated_at = now()
WHERE idem_key = %(key)s AND state = 'running'
  AND claim_token IS NOT DISTINCT FROM %(expected_token)s
  AND (lease_until IS NULL OR lease_until < clock_timestamp())
"""

_RECONCILE_RELEASE: LiteralString = """
DELETE FROM job_claims
WHERE idem_key = %(key)s AND state = 'running'
  AND claim_token IS NOT DISTINCT FROM %(expected_token)s
  AND (lease_until IS NULL OR lease_until < clock_timestamp())
"""

_LAST_HISTORY: LiteralString = """
SELECT action, note FROM claim_history WHERE idem_key = %(key)s ORDER BY id DESC LIMIT 1
"""

_PRUNE_BATCH: LiteralString = """
DELETE FROM job_claims WHERE idem_key IN (
    SELECT idem_key FROM job_claims
    WHERE state IN ('done', 'failed')
      AND coalesce(updated_at, claimed_at) < now() - make_interval(days => %(days)s)
    LIMIT %(batch)s
    FOR UPDATE SKIP LOCKED
)
"""


class ReconcileWrite(StrEnum):
    """What a reconcile pass's write did to a claim."""

    SETTLED = "settled_done"
    RELEASED = "released"
    UNCHANGED = "unchanged"  # an unknown answer: nothing to change
    CHANGED = "changed"  # the claim moved on since it was probed: fenced out
    LEASE_LIVE = "lease_live"  # not done, but a delivery may be making the call right now


class ClaimsAdmin(LedgerAdapter):
    """Changes to claims outside the drain; one short connection per call. The functions build
    it with ``factory.make_claims_admin``, whose ``refresh`` picks up a rotated secret."""

    APPLICATION_NAME = "infrai-jobs-admin"

    def dead_letters(self) -> DeadLetterStore:
        """The ledger's dead letters, on this admin's connection settings."""
        return DeadLetterStore(self._connector)

    def find(self, key: str) -> ClaimRow | None:
        """The claim with this key, or None (released, reopened, pruned, or never claimed)."""
        rows = self._rows(_SHOW, {"key": key})
        return rows[0] if rows else None

    def stuck(
        self,
        jobs: Sequence[str] | None = None,
        *,
        threshold_seconds: int = 900,
        limit: int = 100,
    ) -> list[ClaimRow]:
        """Stuck claims (``STUCK_CLAIM``), oldest first; only those of ``jobs`` when given."""
        params = {
            "jobs": None if jobs is None else list(jobs),
            "threshold": threshold_seconds,
            "limit": limit,
        }
        return self._rows(_STUCK, params)

    def find_deferred(self, key: str) -> DeferredJob | None:
        """The deferred work with this key, in whatever state, or None."""
        found = self._deferred(DEFERRED_BY_KEY, {"key": key})
        return found[0] if found else None

    def stuck_deferred(
        self, jobs: Sequence[str] | None = None, *, limit: int = 100
    ) -> list[DeferredJob]:
        """Deferred runs left for a human (``STUCK_DEFERRED``); only those of ``jobs`` when
        given."""
        return self._deferred(
            STUCK_DEFERRED, {"jobs": None if jobs is None else list(jobs), "limit": limit}
        )

    def apply_probe_answer_to_deferred(
        self,
        probed: DeferredJob,
        answer: str,
        *,
        result: Any = None,
        actor: str,
        note: str,
    ) -> ReconcileWrite:
        """``apply_probe_answer`` for a deferred run left for a human, fenced by its lease
        token: ``done`` settles it and its claim (``flow.ledger.finish``), ``not_done`` makes it
        wait again, due now (``flow.ledger.release``), anything else changes nothing."""
        key, token = probed.idem_key, probed.lease_token
        if token is None:
            return ReconcileWrite.CHANGED
        with self._connector.session(f"cannot reconcile {key!r}") as conn:
            if answer in ("done", "not_done") and flow.lease_live(conn, key, token):
                return ReconcileWrite.LEASE_LIVE
            if answer == "done":
                changed = flow.finish(
                    conn, key, token, result, actor=actor, note=note, holder=False
                )
                return ReconcileWrite.SETTLED if changed else ReconcileWrite.CHANGED
            if answer == "not_done":
                changed = flow.release(conn, key, token, actor=actor, note=note)
                return ReconcileWrite.RELEASED if changed else ReconcileWrite.CHANGED
            with conn.transaction():
                with conn.cursor(row_factory=dict_row) as cur:
                    row = cur.execute(flow.DEFERRED_FOR_UPDATE, {"key": key}).fetchone()
                if row is None or row["lease_token"] != token or row["state"] != "running":
                    return ReconcileWrite.CHANGED
                last = conn.execute(_LAST_HISTORY, {"key": key}).fetchone()
                if last is None or tuple(last) != ("reconcile", note):
                    flow.record_deferred_change(
                        conn, "reconcile", probed, probed, actor=actor, note=note
                    )
            return ReconcileWrite.UNCHANGED

    def apply_probe_answer(
        self,
        probed: ClaimRow,
        answer: str,
        *,
        result: Any = None,
        actor: str,
        note: str,
    ) -> ReconcileWrite:
        """Act on a probe's answer about ``probed`` (the claim as it was when asked), fenced by
        its state and claim token, and record it in ``claim_history`` as ``reconcile``:
        ``done`` settles the claim with ``result``, ``not_done`` releases it, anything else
        changes nothing (and is recorded unless the last record already says the same)."""
        key = probed.idem_key
        with (
            self._connector.session(f"cannot reconcile {key!r}") as conn,
            conn.transaction(),
        ):
            with conn.cursor(row_factory=dict_row) as cur:
                row = cur.execute(_FOR_UPDATE, {"key": key}).fetchone()
            before = ClaimRow(**row) if row is not None else None
            if (
                before is None
                or before.state != "running"
                or before.claim_token != probed.claim_token
            ):
                return ReconcileWrite.CHANGED
            fence = {"key": key, "expected_token": probed.claim_token}
            if answer == "done":
                params = {**fence, "result": Jsonb(storable_json(result))}
                if conn.execute(_RECONCILE_DONE, params).rowcount != 1:
                    return ReconcileWrite.LEASE_LIVE  # the row lock holds state and token
                with conn.cursor(row_factory=dict_row) as cur:
                    after_row = cur.execute(_SHOW, {"key": key}).fetchone()
                after = ClaimRow(**after_row) if after_row else None
                record_claim_change(conn, "reconcile", before, after, actor=actor, note=note)
                return ReconcileWrite.SETTLED
            if answer == "not_done":
                if conn.execute(_RECONCILE_RELEASE, fence).rowcount != 1:
                    return ReconcileWrite.LEASE_LIVE
                record_claim_change(conn, "reconcile", before, None, actor=actor, note=note)
                return ReconcileWrite.RELEASED
            last = conn.execute(_LAST_HISTORY, {"key": key}).fetchone()
            if last is None or tuple(last) != ("reconcile", note):
                # An unchanged answer every few minutes would bury the history in repeats.
                record_claim_change(conn, "reconcile", before, before, actor=actor, note=note)
            return ReconcileWrite.UNCHANGED

    def reopen_failed(self, *, message_id: str, fingerprint: str | None, actor: str) -> list[str]:
        """Delete the ``failed`` claims of one piece of work (its message id, or its payload
        fingerprint) so its redriven copy runs again; each is recorded as ``reopen``."""
        params = {"message_id": message_id, "fingerprint": fingerprint}
        with (
            self._connector.session("cannot reopen failed claims") as conn,
            conn.transaction(),
        ):
            with conn.cursor(row_factory=dict_row) as cur:
                failed = [ClaimRow(**row) for row in cur.execute(_FAILED_OF_WORK, params)]
            for claim in failed:
                conn.execute(_DELETE_FAILED, {"key": claim.idem_key})
                record_claim_change(
                    conn, "reopen", claim, None, actor=actor, note="redrive --reopen-failed"
                )
        return [claim.idem_key for claim in failed]

    def prune(self, *, older_than_days: int, batch_size: int = 1000) -> PruneResult:
        """Delete ``done``/``failed`` rows older than the retention, a short transaction per
        batch, skipping rows someone holds a lock on; ``running`` rows are never touched."""
        deleted = batches = 0
        with self._connector.session("cannot prune claims") as conn:
            while True:
                cursor = conn.execute(_PRUNE_BATCH, {"days": older_than_days, "batch": batch_size})
                batches += 1
                deleted += cursor.rowcount
                if cursor.rowcount < batch_size:
                    break
            outbox = prune_settled(conn, older_than_days=older_than_days, batch_size=batch_size)
        return PruneResult(deleted, batches, outbox)

    def _deferred(self, statement: LiteralString, params: dict[str, Any]) -> list[DeferredJob]:
        with (
            self._connector.session("cannot read deferred jobs") as conn,
            conn.cursor(row_factory=dict_row) as cur,
        ):
            return [DeferredJob(**row) for row in cur.execute(statement, params).fetchall()]

    def _rows(self, statement: LiteralString, params: dict[str, Any]) -> list[ClaimRow]:
        with (
            self._connector.session("cannot read claims") as conn,
            conn.cursor(row_factory=dict_row) as cur,
        ):
            return [ClaimRow(**row) for row in cur.execute(statement, params).fetchall()]


def record_claim_change(
    conn: psycopg.Connection[Any],
    action: str,
    before: ClaimRow,
    after: ClaimRow | None,
    *,
    actor: str,
    note: str,
) -> None:
    """A change to a claim in ``claim_history``: the claim before and after it, each as
    ``claim_as_dict`` spells it."""
    record_history(
        conn,
        before.idem_key,
        action,
        actor=actor,
        before=claim_as_dict(before),
        after=claim_as_dict(after) if after else None,
        note=note,
    )
