"""The operator's view of the ledger: list, show, find stuck, resolve, release, reconcile, prune.

Resolve and release are fenced: they change a claim only if its state and claim token are still
what the operator looked at, so a human never overwrites a row that moved on in the meantime.
Every operator action is recorded in ``claim_history`` (append-only: the database refuses
updates and deletes there) in the same transaction as the change, with the actor its caller
names: who is acting is the caller's to say (the command line names the operator, a function
its own name), never looked up here.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, LiteralString

import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from infrai_jobs.errors import ClaimChanged, ClaimNotFound
from infrai_jobs.flow import ledger as flow
from infrai_jobs.flow.ledger import DeferredJob
from infrai_jobs.ledger.claims import ClaimRow
from infrai_jobs.ledger.postgres import CLAIM_BY_KEY as _SHOW
from infrai_jobs.ledger.postgres import CLAIM_BY_KEY_FOR_UPDATE as _FOR_UPDATE
from infrai_jobs.ledger.postgres import CLAIMS_LIST as _LIST
from infrai_jobs.ledger.postgres import FAILED_CLAIMS_OF_WORK as _FAILED_OF_WORK
from infrai_jobs.ledger.postgres import STUCK_CLAIMS as _STUCK
from infrai_jobs.ledger.postgres import STUCK_CLAIMS_OF_JOBS as _STUCK_OF_JOBS
from infrai_jobs.ledger.postgres import LedgerAdapter
from infrai_jobs.operations.claim_json import claim_as_dict, storable_json
from infrai_jobs.operations.dead_letters import DeadLetterStore


@dataclass(frozen=True, slots=True)
class PruneResult:
    deleted: int
    batches: int


_RESOLVE: LiteralString = """
UPDATE job_claims
SET state = %(state)s, result = %(result)s, error = %(error)s, updated_at = now()
WHERE idem_key = %(key)s AND state = %(expected_state)s
  AND claim_token IS NOT DISTINCT FROM %(expected_token)s
"""

_RELEASE: LiteralString = """
DELETE FROM job_claims
WHERE idem_key = %(key)s AND state = %(expected_state)s
  AND claim_token IS NOT DISTINCT FROM %(expected_token)s
"""

_DELETE_FAILED: LiteralString = """
DELETE FROM job_claims WHERE idem_key = %(key)s AND state = 'failed'
"""

# A reconcile pass settles or releases only the attempt its probe was asked about: the same
# claim token, still running. A release also waits for the lease to end, since a delivery
# under a live lease may be making the call right now.
_RECONCILE_DONE: LiteralString = """
UPDATE job_claims
SET state = 'done', result = %(result)s, error = NULL, updated_at = now()
WHERE idem_key = %(key)s AND state = 'running'
  AND claim_token IS NOT DISTINCT FROM %(expected_token)s
"""

_RECONCILE_RELEASE: LiteralString = """
DELETE FROM job_claims
WHERE idem_key = %(key)s AND state = 'running'
  AND claim_token IS NOT DISTINCT FROM %(expected_token)s
  AND (lease_until IS NULL OR lease_until < now())
"""

_LAST_HISTORY: LiteralString = """
SELECT action, note FROM claim_history WHERE idem_key = %(key)s ORDER BY id DESC LIMIT 1
"""

_HISTORY: LiteralString = """
INSERT INTO claim_history (idem_key, action, actor, before, after, note)
VALUES (%(key)s, %(action)s, %(actor)s, %(before)s, %(after)s, %(note)s)
"""

_HISTORY_OF: LiteralString = """
SELECT id, idem_key, action, actor, at, before, after, note
FROM claim_history WHERE idem_key = %(key)s ORDER BY id
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

# ``claims list --state deferred``: the work deferred jobs hold (waiting or running), the
# next due first.
_DEFERRED_LIST: LiteralString = """
SELECT idem_key, job, effect, payload, payload_sha256, message_id, queue, state, attempts,
       last_error, result, run_after, created_at, updated_at, lease_token, lease_until
FROM deferred_jobs
WHERE state IN ('deferred', 'running')
  AND (%(job)s::text IS NULL OR job = %(job)s)
  AND (%(older_than)s::float8 IS NULL
       OR created_at < now() - make_interval(secs => %(older_than)s))
ORDER BY run_after, created_at, idem_key
LIMIT %(limit)s
"""

# The states each operator change applies to.
RESOLVABLE: tuple[str, ...] = ("running",)
RELEASABLE: tuple[str, ...] = ("running", "failed")


class Refusal(StrEnum):
    """Why a fenced change may not go ahead on a claim as it stands."""

    STATE = "state"  # the claim is not in a state the change applies to
    LEASE_LIVE = "lease_live"  # running under a live lease, and no claim token was given
    MOVED = "moved"  # another claim token holds it: it changed since it was read


def refusal(
    row: ClaimRow, *, allowed_states: tuple[str, ...], token: uuid.UUID | None
) -> Refusal | None:
    """Why a change fenced by ``allowed_states`` and ``token`` is refused for ``row``, or None
    when it may go ahead. A caller words the refusal in its own terms."""
    if row.state not in allowed_states:
        return Refusal.STATE
    if (
        token is None
        and row.state == "running"
        and row.lease_until is not None
        and row.lease_until > datetime.now(UTC)
    ):
        # Its delivery may be inside the effect right now: acting on it unseen could let a
        # duplicate repeat an irreversible effect.
        return Refusal.LEASE_LIVE
    if token is not None and row.claim_token != token:
        return Refusal.MOVED
    return None


# What each change recorded in claim_history is, in a refusal's words.
_CHANGES = {
    "resolve_done": "resolving it as done",
    "resolve_failed": "resolving it as failed",
    "release": "releasing it",
}


def _refused(
    row: ClaimRow,
    why: Refusal,
    *,
    action: str,
    allowed_states: tuple[str, ...],
    token: uuid.UUID | None,
) -> str:
    """The layer's own words for a refusal: the change, never a command to type."""
    key = row.idem_key
    if why is Refusal.STATE:
        needed = " or ".join(allowed_states)
        return f"claim {key!r} is {row.state}; {_CHANGES[action]} needs a {needed} claim"
    if why is Refusal.LEASE_LIVE:
        until = row.lease_until.isoformat() if row.lease_until is not None else "?"
        return (
            f"claim {key!r} is running under a live lease until {until}; wait for it to end, "
            f"or give its claim token {row.claim_token} to act on it anyway"
        )
    return (
        f"claim {key!r} is now held by token {row.claim_token}, not {token}: it changed "
        "since it was read"
    )


class ReconcileWrite(StrEnum):
    """What a reconcile pass's write did to a claim."""

    SETTLED = "settled_done"
    RELEASED = "released"
    UNCHANGED = "unchanged"  # an unknown answer: nothing to change
    CHANGED = "changed"  # the claim moved on since it was probed: fenced out
    LEASE_LIVE = "lease_live"  # not done, but a delivery may be making the call right now


class ClaimsAdmin(LedgerAdapter):
    """Operator actions on the ledger; one short connection per call. The functions build it
    with ``factory.make_claims_admin``, whose ``refresh`` picks up a rotated secret."""

    APPLICATION_NAME = "infrai-jobs-admin"

    def dead_letters(self) -> DeadLetterStore:
        """The ledger's dead letters, on this admin's connection settings."""
        return DeadLetterStore(self._connector)

    def list_claims(
        self,
        *,
        state: str | None = None,
        job: str | None = None,
        older_than_seconds: float | None = None,
        limit: int = 100,
    ) -> list[ClaimRow]:
        params = {"state": state, "job": job, "older_than": older_than_seconds, "limit": limit}
        return self._rows(_LIST, params)

    def show(self, key: str) -> ClaimRow:
        rows = self._rows(_SHOW, {"key": key})
        if not rows:
            raise ClaimNotFound(f"no claim with key {key!r}")
        return rows[0]

    def find(self, key: str) -> ClaimRow | None:
        """The claim with this key, or None (released, reopened, pruned, or never claimed)."""
        rows = self._rows(_SHOW, {"key": key})
        return rows[0] if rows else None

    def stuck(self, *, threshold_seconds: int = 900, limit: int = 100) -> list[ClaimRow]:
        return self._rows(_STUCK, {"threshold": threshold_seconds, "limit": limit})

    def stuck_of_jobs(
        self, jobs: Sequence[str], *, threshold_seconds: int = 900, limit: int = 100
    ) -> list[ClaimRow]:
        """Stuck claims of ``jobs`` only (those with a reconcile probe), oldest first."""
        params = {"jobs": list(jobs), "threshold": threshold_seconds, "limit": limit}
        return self._rows(_STUCK_OF_JOBS, params)

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
                if conn.execute(_RECONCILE_DONE, params).rowcount != 1:  # pragma: no cover
                    return ReconcileWrite.CHANGED  # the row lock makes this unreachable
                with conn.cursor(row_factory=dict_row) as cur:
                    after_row = cur.execute(_SHOW, {"key": key}).fetchone()
                after = ClaimRow(**after_row) if after_row else None
                _record(conn, "reconcile", before, after, actor=actor, note=note)
                return ReconcileWrite.SETTLED
            if answer == "not_done":
                if conn.execute(_RECONCILE_RELEASE, fence).rowcount != 1:
                    return ReconcileWrite.LEASE_LIVE
                _record(conn, "reconcile", before, None, actor=actor, note=note)
                return ReconcileWrite.RELEASED
            last = conn.execute(_LAST_HISTORY, {"key": key}).fetchone()
            if last is None or tuple(last) != ("reconcile", note):
                # An unchanged answer every few minutes would bury the history in repeats.
                _record(conn, "reconcile", before, before, actor=actor, note=note)
            return ReconcileWrite.UNCHANGED

    def list_deferred(
        self, *, job: str | None = None, older_than_seconds: float | None = None, limit: int = 100
    ) -> list[DeferredJob]:
        """Deferred work the ledger holds (waiting or running), the next due first."""
        params = {"job": job, "older_than": older_than_seconds, "limit": limit}
        with (
            self._connector.session("cannot read deferred jobs") as conn,
            conn.cursor(row_factory=dict_row) as cur,
        ):
            return [DeferredJob(**row) for row in cur.execute(_DEFERRED_LIST, params).fetchall()]

    def run_deferred_now(self, key: str, *, actor: str, note: str = "") -> DeferredJob:
        """Make waiting deferred work due at once (``flow.ledger.run_now``, recorded)."""
        with self._connector.session(f"cannot run {key!r} now") as conn:
            return flow.run_now(conn, key, actor=actor, note=note)

    def cancel_deferred(self, key: str, *, actor: str, note: str = "") -> DeferredJob:
        """Cancel waiting deferred work (``flow.ledger.cancel``, recorded)."""
        with self._connector.session(f"cannot cancel {key!r}") as conn:
            return flow.cancel(conn, key, actor=actor, note=note)

    def history(self, key: str) -> list[dict[str, Any]]:
        """Every operator action recorded for this key, oldest first (kept after a release)."""
        with (
            self._connector.session("cannot read the claim history") as conn,
            conn.cursor(row_factory=dict_row) as cur,
        ):
            return list(cur.execute(_HISTORY_OF, {"key": key}).fetchall())

    def resolve(
        self,
        key: str,
        *,
        done: bool,
        result: Any = None,
        error: str | None = None,
        expected_token: uuid.UUID | None = None,
        actor: str,
        note: str = "",
    ) -> ClaimRow:
        """A human's verdict on a running claim: ``done`` (with the provider's reference) or
        ``failed`` (with the reason). Only a ``running`` claim can be resolved."""
        state = "done" if done else "failed"
        return self._fenced_change(
            key,
            action=f"resolve_{state}",
            statement=_RESOLVE,
            changes={
                "state": state,
                "result": Jsonb(result) if done else None,
                "error": None if done else (error or "resolved as failed by an operator"),
            },
            allowed_states=RESOLVABLE,
            expected_token=expected_token,
            actor=actor,
            note=note,
        )

    def release(
        self,
        key: str,
        *,
        expected_token: uuid.UUID | None = None,
        actor: str,
        note: str = "",
    ) -> ClaimRow:
        """Delete a running or failed claim so the next delivery runs the job again."""
        return self._fenced_change(
            key,
            action="release",
            statement=_RELEASE,
            changes={},
            allowed_states=RELEASABLE,
            expected_token=expected_token,
            actor=actor,
            note=note,
        )

    def _fenced_change(
        self,
        key: str,
        *,
        action: str,
        statement: LiteralString,
        changes: dict[str, Any],
        allowed_states: tuple[str, ...],
        expected_token: uuid.UUID | None,
        actor: str,
        note: str,
    ) -> ClaimRow:
        with (
            self._connector.session(f"cannot {action.replace('_', ' ')} {key!r}") as conn,
            conn.transaction(),
        ):
            with conn.cursor(row_factory=dict_row) as cur:
                row = cur.execute(_FOR_UPDATE, {"key": key}).fetchone()
            if row is None:
                raise ClaimNotFound(f"no claim with key {key!r}")
            before = ClaimRow(**row)
            why = refusal(before, allowed_states=allowed_states, token=expected_token)
            if why is not None:
                raise ClaimChanged(
                    _refused(
                        before,
                        why,
                        action=action,
                        allowed_states=allowed_states,
                        token=expected_token,
                    )
                )
            cursor = conn.execute(
                statement,
                {
                    "key": key,
                    "expected_state": before.state,
                    "expected_token": before.claim_token,
                    **changes,
                },
            )
            if cursor.rowcount != 1:  # pragma: no cover - the row lock makes this unreachable
                raise ClaimChanged(f"claim {key!r} changed while it was being updated")
            with conn.cursor(row_factory=dict_row) as cur:
                after_row = cur.execute(_SHOW, {"key": key}).fetchone()
            after = ClaimRow(**after_row) if after_row else None
            _record(conn, action, before, after, actor=actor, note=note)
        return after or before

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
                _record(conn, "reopen", claim, None, actor=actor, note="redrive --reopen-failed")
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
        return PruneResult(deleted, batches)

    def _rows(self, statement: LiteralString, params: dict[str, Any]) -> list[ClaimRow]:
        with (
            self._connector.session("cannot read claims") as conn,
            conn.cursor(row_factory=dict_row) as cur,
        ):
            return [ClaimRow(**row) for row in cur.execute(statement, params).fetchall()]


def _record(
    conn: psycopg.Connection[Any],
    action: str,
    before: ClaimRow,
    after: ClaimRow | None,
    *,
    actor: str,
    note: str,
) -> None:
    """The one writer of a claim change in ``claim_history``: the claim before and after it,
    each as ``claim_as_dict`` spells it."""
    conn.execute(
        _HISTORY,
        {
            "key": before.idem_key,
            "action": action,
            "actor": actor,
            "before": Jsonb(claim_as_dict(before)),
            "after": Jsonb(claim_as_dict(after)) if after else None,
            "note": note or None,
        },
    )
