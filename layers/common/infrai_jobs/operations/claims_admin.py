"""The ledger changes the functions make outside the drain (reconcile, reopen, prune), each
fenced by the claim's state and token as read and recorded in ``claim_history`` in its
transaction, as the actor the caller names. ``infrai_local.operator`` extends it for the CLI.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final, LiteralString

from infrai_jobs.flow import ledger as flow
from infrai_jobs.ledger.claims import ClaimRow
from infrai_jobs.ledger.postgres import CLAIM_BY_KEY as _SHOW
from infrai_jobs.ledger.postgres import CLAIM_BY_KEY_FOR_UPDATE as _FOR_UPDATE
from infrai_jobs.ledger.postgres import DELETE_FAILED_CLAIMS_OF_WORK as _DELETE_FAILED_OF_WORK
from infrai_jobs.ledger.postgres import STUCK_CLAIMS as _STUCK
from infrai_jobs.ledger.postgres import LedgerAdapter
from infrai_jobs.operations.dead_letters import DeadLetterStore, claim_of, claim_rows, storable_json
from infrai_jobs.outbox.status import prune_settled


@dataclass(frozen=True, slots=True)
class PruneResult:
    deleted: int
    batches: int
    # Published (and dead) outbox rows past the same retention.
    outbox_deleted: int


# What a probe's answer is recorded as in claim_history.
RECONCILE: Final = "reconcile"

_LAST_HISTORY: LiteralString = """
SELECT action, note FROM claim_history WHERE idem_key = %(key)s ORDER BY id DESC LIMIT 1
"""

_PRUNE_BATCH: LiteralString = """
DELETE FROM job_claims WHERE idem_key IN (
    SELECT idem_key FROM job_claims
    WHERE state IN ('done', 'failed', 'cancelled')
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
    """Changes to claims outside the drain; one short connection per call."""

    APPLICATION_NAME = "infrai-jobs-admin"

    def dead_letters(self) -> DeadLetterStore:
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
        params = {"jobs": None if jobs is None else list(jobs), "threshold": threshold_seconds}
        return self._rows(_STUCK, {**params, "limit": limit})

    def apply_probe_answer(
        self,
        probed: ClaimRow,
        answer: str,
        *,
        result: Any = None,
        actor: str,
        note: str,
    ) -> ReconcileWrite:
        """Act on a probe's answer about ``probed`` (as asked), fenced by its state and token:
        ``done`` settles it with ``result``, ``not_done`` releases it (owned work waits again,
        due now), anything else changes nothing (recorded unless the last record says so).
        Under a live lease nothing changes: only the run holding it settles its own work."""
        key, token = probed.idem_key, probed.claim_token
        with self._connector.transaction(f"cannot reconcile {key!r}") as conn:
            before = claim_of(conn, key, _FOR_UPDATE)
            if before is None or before.state != "running" or before.claim_token != token:
                return ReconcileWrite.CHANGED
            # The row lock holds state and token: a change that matches nothing met a live lease.
            why = {"actor": actor, "action": RECONCILE, "note": note}
            if answer == "done":
                stored = storable_json(result)
                done = flow.settle(conn, key, token, "done", result=stored, holder=False, **why)
                return ReconcileWrite.SETTLED if done else ReconcileWrite.LEASE_LIVE
            if answer == "not_done":
                released = flow.release(conn, key, token, **why)
                return ReconcileWrite.RELEASED if released else ReconcileWrite.LEASE_LIVE
            last = conn.execute(_LAST_HISTORY, {"key": key}).fetchone()
            if last is None or tuple(last) != (RECONCILE, note):
                # An unchanged answer every few minutes would bury the history in repeats.
                flow.record_change(conn, RECONCILE, before, before, actor=actor, note=note)
            return ReconcileWrite.UNCHANGED

    def reopen_failed(self, *, message_id: str, fingerprint: str | None, actor: str) -> list[str]:
        """Delete the ``failed`` claims of one piece of work (its message id, or its payload
        fingerprint) so its redriven copy runs again; each is recorded as ``reopen``."""
        params = {"message_id": message_id, "fingerprint": fingerprint}
        with self._connector.transaction("cannot reopen failed claims") as conn:
            failed = claim_rows(conn, _DELETE_FAILED_OF_WORK, params)
            for claim in failed:
                flow.record_change(
                    conn, "reopen", claim, None, actor=actor, note="redrive --reopen-failed"
                )
        return [claim.idem_key for claim in failed]

    def prune(self, *, older_than_days: int, batch_size: int = 1000) -> PruneResult:
        """Delete settled rows past the retention, a batch per transaction, skipping locked rows."""
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

    def _rows(self, statement: LiteralString, params: dict[str, Any]) -> list[ClaimRow]:
        with self._connector.session("cannot read claims") as conn:
            return claim_rows(conn, statement, params)
