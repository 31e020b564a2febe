"""The operators' store (``WorkStore``): every change a probe, an operator, a redrive or the prune
function makes to ``job_claims``; the CLI and the console only word what it answers."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final, LiteralString

from infrai_jobs.errors import ClaimChanged, ClaimNotFound
from infrai_jobs.ledger.postgres import LedgerAdapter, LedgerConnector
from infrai_jobs.outbox.status import prune_settled
from infrai_jobs.queue_contract import DEFAULT_VISIBILITY_TIMEOUT_SECONDS as VISIBILITY
from infrai_jobs.work import statements as sql
from infrai_jobs.work.states import ClaimRow
from infrai_jobs.work.store import (
    Why,
    claim_of,
    claim_rows,
    record_change,
    release,
    settle_as_other,
)

# What a probe's answer is recorded as in claim_history.
RECONCILE: Final = "reconcile"


@dataclass(frozen=True, slots=True)
class PruneResult:
    deleted: int
    batches: int
    # Published (and dead) outbox rows past the same retention.
    outbox_deleted: int


class ReconcileWrite(StrEnum):
    SETTLED = "settled_done"
    RELEASED = "released"
    UNCHANGED = "unchanged"  # an unknown answer: nothing to change
    CHANGED = "changed"  # the claim moved on since it was probed: fenced out
    LEASE_LIVE = "lease_live"  # not done, but a run may be making the call right now


class Refusal(StrEnum):
    STATE = "state"  # the claim is not in a state the change applies to
    LEASE_LIVE = "lease_live"  # running under a live lease: only the run holding it may act
    MOVED = "moved"  # another claim token holds it: it changed since it was read


RESOLVABLE: Final = ("running",)
RELEASABLE: Final = ("running", "failed")
ALLOWED: Final = {"resolve_done": RESOLVABLE, "resolve_failed": RESOLVABLE, "release": RELEASABLE}


def refusal(
    row: ClaimRow, *, allowed_states: tuple[str, ...], token: uuid.UUID | None
) -> Refusal | None:
    """Why a change fenced by ``allowed_states`` and ``token`` is refused for ``row`` as the
    database read it, or None when it may go ahead (the change is fenced again as it is made)."""
    if row.state not in allowed_states:
        return Refusal.STATE
    if row.lease_live is not False and row.state == "running":
        # Its run may be inside the effect right now: releasing it would let another run
        # repeat an irreversible effect, and settling it would race the run's own settle.
        return Refusal.LEASE_LIVE
    if token is not None and row.claim_token != token:
        return Refusal.MOVED
    return None


# The latest record that ended a claim as failed, or gave a failed one back.
_LAST_END: LiteralString = """
SELECT action FROM claim_history
WHERE idem_key = %(key)s AND action IN ('resolve_failed', 'deferred_failed', 'reopen', 'release')
ORDER BY id DESC LIMIT 1
"""
_LAST_HISTORY: LiteralString = """
SELECT action, note FROM claim_history WHERE idem_key = %(key)s ORDER BY id DESC LIMIT 1
"""


class WorkStore(LedgerAdapter):
    """The operators' reads and changes of ``job_claims`` (the CLI, the console, the watcher's
    reconcile pass, redrive, prune); one short connection per call. Every change is fenced by
    the row as read under its lock, refused under a live lease, and recorded."""

    APPLICATION_NAME = "infrai-jobs-admin"

    def __init__(
        self, database_url: str, *, visibility_timeout: float = VISIBILITY, **options: Any
    ) -> None:
        super().__init__(database_url, **options)
        self.visibility = visibility_timeout

    @property
    def connector(self) -> LedgerConnector:
        """Its connections, for the stores of the ledger's other tables (dead letters)."""
        return self._connector

    def find(self, key: str) -> ClaimRow | None:
        """The claim with this key, or None (released, reopened, pruned, or never claimed)."""
        with self._connector.session("cannot read claims") as conn:
            return claim_of(conn, key, visibility=self.visibility)

    def stuck(
        self, jobs: Sequence[str] | None = None, *, threshold_seconds: int = 900, limit: int = 100
    ) -> list[ClaimRow]:
        """Stuck claims (``STUCK_CLAIM``), oldest first; only those of ``jobs`` when given."""
        of_jobs = None if jobs is None else list(jobs)
        params = {"jobs": of_jobs, "threshold": threshold_seconds, "limit": limit}
        with self._connector.session("cannot read claims") as conn:
            return claim_rows(conn, sql.STUCK_CLAIMS, params, visibility=self.visibility)

    def resolve(
        self,
        key: str,
        *,
        done: bool,
        why: Why,
        result: Any = None,
        error: str | None = None,
        expected_token: uuid.UUID | None = None,
    ) -> ClaimRow:
        """A human's verdict on a running claim, or on a deferred run left ``running`` for a
        human: ``done`` (with the provider's reference) or ``failed`` (with the reason; work the
        ledger owns also gets a dead letter, which only ``redrive --reopen-failed`` runs again).
        ``ClaimChanged`` when it may not go ahead, ``ClaimNotFound`` when no row has the key."""
        failure = None if done else (error or "resolved as failed by an operator")
        action = "resolve_done" if done else "resolve_failed"
        return self._change(key, action, why, expected_token, result=result, error=failure)

    def release(self, key: str, *, why: Why, expected_token: uuid.UUID | None = None) -> ClaimRow:
        """Delete a running or failed claim so the next delivery runs the job again; a
        deferred run left ``running`` waits again instead, due now, for the next drain."""
        return self._change(key, "release", why, expected_token)

    def _change(
        self,
        key: str,
        action: str,
        why: Why,
        expected_token: uuid.UUID | None,
        *,
        result: Any = None,
        error: str | None = None,
    ) -> ClaimRow:
        with self._connector.transaction(f"cannot {action.replace('_', ' ')} {key!r}") as conn:
            before = claim_of(conn, key, lock=True, visibility=self.visibility)
            if before is None:
                raise ClaimNotFound(f"no claim with key {key!r}")
            refused = refusal(before, allowed_states=ALLOWED[action], token=expected_token)
            if refused is not None:
                message = f"{action} refused for {key!r}: {refused.value}"
                raise ClaimChanged(message, row=before, refusal=refused.value)
            vis = self.visibility
            if action == "release":
                changed = release(conn, before, why, visibility=vis)
            else:
                state = "done" if action == "resolve_done" else "failed"
                changed = settle_as_other(
                    conn, before, state, why, result=result, error=error, visibility=vis
                )
            if changed is None:  # pragma: no cover - the row lock makes this unreachable
                raise ClaimChanged(f"claim {key!r} changed while it was being updated")
            return claim_of(conn, key, visibility=vis) or before

    def run_now(self, key: str, why: Why) -> ClaimRow:
        """Waiting deferred work made due at once, for the next drain."""
        return self._steer(key, "deferred", why)

    def cancel(self, key: str, why: Why) -> ClaimRow:
        """Waiting deferred work cancelled: it never runs (a running one may be inside its
        effect, so it is refused)."""
        return self._steer(key, "cancelled", why)

    def _steer(self, key: str, state: str, why: Why) -> ClaimRow:
        with self._connector.transaction(f"cannot {why.action.replace('_', ' ')} {key!r}") as conn:
            before = claim_of(conn, key, lock=True, visibility=self.visibility)
            if before is None or not before.owned:
                raise ClaimNotFound(f"no deferred job with key {key!r}")
            if before.state != "deferred":
                verb = "cancelled" if state == "cancelled" else "run now"
                live = before.state == "running" and before.lease_live is not False
                raise ClaimChanged(
                    f"deferred job {key!r} is {before.state}; only a waiting ('deferred') job "
                    f"can be {verb}",
                    row=before,
                    refusal=Refusal.LEASE_LIVE if live else Refusal.STATE,
                )
            params = {"key": key, "state": state}
            (after,) = claim_rows(conn, sql.STEER_DEFERRED, params, visibility=self.visibility)
            record_change(conn, why, before, after)
        return after

    def apply_probe_answer(
        self, probed: ClaimRow, answer: str, *, result: Any = None, actor: str, note: str
    ) -> ReconcileWrite:
        """Act on a probe's answer about ``probed`` (as asked), fenced by its state and token:
        ``done`` settles it with ``result``, ``not_done`` releases it (owned work waits again,
        due now), anything else changes nothing (recorded unless the last record says so).
        Under a live lease nothing changes: only the run holding it settles its own work."""
        key, vis = probed.idem_key, self.visibility
        why = Why(RECONCILE, actor, note)
        with self._connector.transaction(f"cannot reconcile {key!r}") as conn:
            before = claim_of(conn, key, lock=True, visibility=vis)
            # The token fences the attempt; a row the notes' worker wrote has none, so its claim
            # time and message tell a later claim of the key from the one that was probed.
            asked = (probed.claim_token, probed.claimed_at, probed.message_id)
            if before is None or before.state != "running":
                return ReconcileWrite.CHANGED
            if (before.claim_token, before.claimed_at, before.message_id) != asked:
                return ReconcileWrite.CHANGED
            if answer in ("done", "not_done") and probed.lease_live is not False:
                # Asked while a run held it: the run may have made the call since.
                return ReconcileWrite.LEASE_LIVE
            # The row lock holds state and token: a change that matches nothing met a live lease.
            if answer == "done":
                done = settle_as_other(conn, before, "done", why, result=result, visibility=vis)
                return ReconcileWrite.SETTLED if done else ReconcileWrite.LEASE_LIVE
            if answer == "not_done":
                released = release(conn, before, why, visibility=vis)
                return ReconcileWrite.RELEASED if released else ReconcileWrite.LEASE_LIVE
            last = conn.execute(_LAST_HISTORY, {"key": key}).fetchone()
            if last is None or tuple(last) != (RECONCILE, note):
                # An unchanged answer every few minutes would bury the history in repeats.
                record_change(conn, why, before, before)
            return ReconcileWrite.UNCHANGED

    def failed_by_human(self, key: str) -> bool:
        """Whether the claim's latest end as ``failed`` was a human's verdict (``claims resolve
        --failed``), not a drain's: only ``redrive --reopen-failed`` overturns one."""
        with self._connector.session("cannot read the claim history") as conn:
            row = conn.execute(_LAST_END, {"key": key}).fetchone()
        return row is not None and row[0] == "resolve_failed"

    def reopen_failed(
        self, *, message_id: str, fingerprint: str | None, actor: str, note: str = ""
    ) -> list[str]:
        """Delete the ``failed`` claims of one piece of work (its message id, or its payload
        fingerprint) so its redriven copy runs again; each is recorded as ``reopen``, with the
        caller's note (what asked for it, as given)."""
        params = {"message_id": message_id, "fingerprint": fingerprint}
        why = Why("reopen", actor, note)
        with self._connector.transaction("cannot reopen failed claims") as conn:
            failed = claim_rows(conn, sql.REOPEN_FAILED, params, visibility=self.visibility)
            for claim in failed:
                record_change(conn, why, claim, None)
        return [claim.idem_key for claim in failed]

    def prune(self, *, older_than_days: int, batch_size: int = 1000) -> PruneResult:
        """Delete settled rows past the retention, a batch per transaction, skipping locked rows."""
        deleted = batches = 0
        with self._connector.session("cannot prune claims") as conn:
            while True:
                params = {"days": older_than_days, "batch": batch_size}
                cursor = conn.execute(sql.PRUNE_BATCH, params)
                batches += 1
                deleted += cursor.rowcount
                if cursor.rowcount < batch_size:
                    break
            outbox = prune_settled(conn, older_than_days=older_than_days, batch_size=batch_size)
        return PruneResult(deleted, batches, outbox)
