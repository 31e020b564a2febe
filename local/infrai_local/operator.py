"""The operator's side of the ledger: who is at the command line, the reads and changes only an
operator makes (list, show, history, resolve, release, and steering deferred work), and how a
refused change is worded.

The functions never make these changes, so they live here, outside the deployed layer, on the
layer's own adapter (``ClaimsAdmin``: its connection, error translation and redaction) and its
one writer of ``claim_history``. Resolve and release are fenced: they change a claim only if its
state and claim token are still what the operator looked at, so a human never overwrites a row
that moved on in the meantime, and each change is recorded in the same transaction.
"""

from __future__ import annotations

import getpass
import os
import uuid
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Final, LiteralString

import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from infrai_jobs.errors import ClaimChanged, ClaimNotFound
from infrai_jobs.flow import ledger as flow
from infrai_jobs.flow.ledger import (
    DEFERRED_BY_KEY,
    DEFERRED_COLUMNS,
    DEFERRED_FOR_UPDATE,
    DeferredJob,
    record_deferred_change,
)
from infrai_jobs.ledger.claims import ClaimRow
from infrai_jobs.ledger.postgres import CLAIM_BY_KEY, CLAIM_BY_KEY_FOR_UPDATE, CLAIM_COLUMNS
from infrai_jobs.operations.claims_admin import ClaimsAdmin, record_claim_change


def default_actor() -> str:
    """Who is acting: OPERATOR if set, else the login name (recorded, never trusted)."""
    return os.environ.get("OPERATOR") or getpass.getuser()


# The command an operator types for each change recorded in claim_history: what error texts name.
COMMANDS: Final = {
    "resolve_done": "claims resolve --done",
    "resolve_failed": "claims resolve --failed",
    "release": "claims release",
}

# The states each operator change applies to.
RESOLVABLE: Final = ("running",)
RELEASABLE: Final = ("running", "failed")


class Refusal(StrEnum):
    """Why a fenced change may not go ahead on a claim as it stands."""

    STATE = "state"  # the claim is not in a state the change applies to
    LEASE_LIVE = "lease_live"  # running under a live lease: only the run holding it may act
    MOVED = "moved"  # another claim token holds it: it changed since it was read


def refusal(
    state: str,
    lease_until: datetime | None,
    holder: uuid.UUID | None,
    *,
    allowed_states: tuple[str, ...],
    token: uuid.UUID | None,
) -> Refusal | None:
    """Why a change fenced by ``allowed_states`` and ``token`` is refused for a row in
    ``state`` whose lease (``lease_until``) ``holder`` holds, or None when it may go ahead."""
    if state not in allowed_states:
        return Refusal.STATE
    live = lease_until is not None and lease_until > datetime.now(UTC)
    if state == "running" and live:
        # Its run may be inside the effect right now: releasing it would let another run
        # repeat an irreversible effect, and settling it would race the run's own settle.
        # The ledger's statements hold the same rule on the database's clock.
        return Refusal.LEASE_LIVE
    if token is not None and holder != token:
        return Refusal.MOVED
    return None


def change_refused(
    row: ClaimRow | DeferredJob,
    *,
    command: str,
    allowed_states: tuple[str, ...],
    token: uuid.UUID | None,
) -> str:
    """Why ``infrai-jobs COMMAND`` is refused for a claim or a deferred run, or "" when it may
    go ahead."""
    if isinstance(row, DeferredJob):
        holder, what = row.lease_token, "deferred job"
        if row.state == "deferred":
            return (
                f"deferred job {row.idem_key!r} is waiting to run (due "
                f"{row.run_after.isoformat()}): `infrai-jobs claims run-now {row.idem_key}` or "
                f"`infrai-jobs claims cancel {row.idem_key}` act on it"
            )
    else:
        holder, what = row.claim_token, "claim"
    key = row.idem_key
    why = refusal(row.state, row.lease_until, holder, allowed_states=allowed_states, token=token)
    if why is None:
        return ""
    if why is Refusal.STATE:
        return (
            f"{what} {key!r} is {row.state}; `infrai-jobs {command}` needs a "
            f"{' or '.join(allowed_states)} {what}"
        )
    if why is Refusal.LEASE_LIVE:
        until = row.lease_until.isoformat() if row.lease_until is not None else "?"
        return (
            f"{what} {key!r} is running under a live lease until {until}: its run may be "
            f"inside the call right now; wait for the lease to end, then run "
            f"`infrai-jobs {command} {key}` again"
        )
    return (
        f"{what} {key!r} is now held by token {holder}, not {token}: it changed "
        f"since you looked; run `infrai-jobs claims show {key}` again"
    )


# ``claims list``: newest first, filtered by state, job and age when given.
_LIST: LiteralString = (
    "SELECT "
    + CLAIM_COLUMNS
    + """
FROM job_claims
WHERE (%(state)s::text IS NULL OR state = %(state)s)
  AND (%(job)s::text IS NULL OR job = %(job)s)
  AND (%(older_than)s::float8 IS NULL
       OR claimed_at < now() - make_interval(secs => %(older_than)s))
ORDER BY claimed_at DESC
LIMIT %(limit)s
"""
)

# An operator never changes a running claim whose lease is live (on the database's clock).
_RESOLVE: LiteralString = """
UPDATE job_claims
SET state = %(new_state)s, result = %(result)s, error = %(error)s, updated_at = now()
WHERE idem_key = %(key)s AND state = %(state)s AND claim_token IS NOT DISTINCT FROM %(token)s
  AND (state <> 'running' OR lease_until IS NULL OR lease_until < clock_timestamp())
"""

_RELEASE: LiteralString = """
DELETE FROM job_claims
WHERE idem_key = %(key)s AND state = %(state)s AND claim_token IS NOT DISTINCT FROM %(token)s
  AND (state <> 'running' OR lease_until IS NULL OR lease_until < clock_timestamp())
"""

_HISTORY_OF: LiteralString = """
SELECT id, idem_key, action, actor, at, before, after, note
FROM claim_history WHERE idem_key = %(key)s ORDER BY id
"""

# ``claims list --state deferred``: the work deferred jobs hold (waiting or running), the next
# due first.
_DEFERRED_LIST: LiteralString = (
    "SELECT "
    + DEFERRED_COLUMNS
    + """
FROM deferred_jobs
WHERE state IN ('deferred', 'running')
  AND (%(job)s::text IS NULL OR job = %(job)s)
  AND (%(older_than)s::float8 IS NULL
       OR created_at < now() - make_interval(secs => %(older_than)s))
ORDER BY run_after, created_at, idem_key
LIMIT %(limit)s
"""
)

# ``claims cancel`` ends waiting work; ``claims run-now`` makes it due at once.
_STEER_DEFERRED: LiteralString = (
    """
UPDATE deferred_jobs
SET state = %(state)s,
    run_after = CASE WHEN %(state)s = 'deferred' THEN least(run_after, now()) ELSE run_after END,
    updated_at = now()
WHERE idem_key = %(key)s AND state = 'deferred'
RETURNING """
    + DEFERRED_COLUMNS
)


# The states a resolve or a release applies to, on a claim and on a deferred run.
_ALLOWED: Final = {
    "resolve_done": (RESOLVABLE, ("running",)),
    "resolve_failed": (RESOLVABLE, ("running",)),
    "release": (RELEASABLE, ("running",)),
}


class OperatorLedger(ClaimsAdmin):
    """The command line's reads and changes on the ledger; one short connection per call."""

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
        found = self.find(key)
        if found is None:
            raise ClaimNotFound(f"no claim with key {key!r}")
        return found

    def history(self, key: str) -> list[dict[str, Any]]:
        """Every change recorded for this key, oldest first (kept after a release)."""
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
    ) -> ClaimRow | DeferredJob:
        """A human's verdict on a running claim, or on a deferred run left ``running`` for a
        human: ``done`` (with the provider's reference) or ``failed`` (with the reason)."""
        failure = None if done else (error or "resolved as failed by an operator")
        return self._fenced_change(
            key,
            action="resolve_done" if done else "resolve_failed",
            result=result,
            error=failure,
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
    ) -> ClaimRow | DeferredJob:
        """Delete a running or failed claim so the next delivery runs the job again; a
        deferred run left ``running`` waits again instead, due now, for the next drain."""
        return self._fenced_change(
            key, action="release", expected_token=expected_token, actor=actor, note=note
        )

    def change_refused(self, key: str, action: str, *, token: uuid.UUID | None) -> str:
        """Why ``action`` would be refused for ``key`` as it stands now, or "" (the change is
        fenced again when it is made); ``ClaimNotFound`` when neither a claim nor deferred
        work has the key."""
        found: ClaimRow | DeferredJob | None = self.find(key) or self.find_deferred(key)
        if found is None:
            raise ClaimNotFound(f"no claim with key {key!r}, and no deferred job")
        return _refusal(found, action, token)

    def _fenced_change(
        self,
        key: str,
        *,
        action: str,
        result: Any = None,
        error: str | None = None,
        expected_token: uuid.UUID | None,
        actor: str,
        note: str,
    ) -> ClaimRow | DeferredJob:
        with (
            self._connector.session(f"cannot {action.replace('_', ' ')} {key!r}") as conn,
            conn.transaction(),
        ):
            with conn.cursor(row_factory=dict_row) as cur:
                row = cur.execute(CLAIM_BY_KEY_FOR_UPDATE, {"key": key}).fetchone()
                deferred_row = None
                if row is None:
                    deferred_row = cur.execute(DEFERRED_FOR_UPDATE, {"key": key}).fetchone()
            target = _target(row, deferred_row)
            if target is None:
                raise ClaimNotFound(f"no claim with key {key!r}, and no deferred job")
            refused = _refusal(target, action, expected_token)
            if refused:
                raise ClaimChanged(refused)
            if isinstance(target, DeferredJob):
                return _change_deferred(
                    conn, target, action, result=result, error=error, actor=actor, note=note
                )
            before = target
            fence = {"key": key, "state": before.state, "token": before.claim_token}
            if action == "release":
                cursor = conn.execute(_RELEASE, fence)
            else:
                done = action == "resolve_done"
                changes = {
                    "new_state": "done" if done else "failed",
                    "result": Jsonb(result) if done else None,
                    "error": error,
                }
                cursor = conn.execute(_RESOLVE, {**fence, **changes})
            if cursor.rowcount != 1:  # pragma: no cover - the row lock makes this unreachable
                raise ClaimChanged(f"claim {key!r} changed while it was being updated")
            after = self._claim(conn, key)
            record_claim_change(conn, action, before, after, actor=actor, note=note)
        return after or before

    @staticmethod
    def _claim(conn: psycopg.Connection[Any], key: str) -> ClaimRow | None:
        with conn.cursor(row_factory=dict_row) as cur:
            row = cur.execute(CLAIM_BY_KEY, {"key": key}).fetchone()
        return ClaimRow(**row) if row else None

    def list_deferred(
        self, *, job: str | None = None, older_than_seconds: float | None = None, limit: int = 100
    ) -> list[DeferredJob]:
        """Deferred work the ledger holds (waiting or running), the next due first."""
        params = {"job": job, "older_than": older_than_seconds, "limit": limit}
        return self._deferred(_DEFERRED_LIST, params)

    def run_deferred_now(self, key: str, *, actor: str, note: str = "") -> DeferredJob:
        """Waiting deferred work made due at once, for the next drain; recorded as
        ``run_now``."""
        return self._steer_deferred(key, "deferred", "run_now", actor=actor, note=note)

    def cancel_deferred(self, key: str, *, actor: str, note: str = "") -> DeferredJob:
        """Waiting deferred work cancelled: it never runs (a running one may be inside its
        effect, so it is refused). Recorded as ``cancel``."""
        return self._steer_deferred(key, "cancelled", "cancel", actor=actor, note=note)

    def _steer_deferred(
        self, key: str, state: str, action: str, *, actor: str, note: str
    ) -> DeferredJob:
        with (
            self._connector.session(f"cannot {action.replace('_', ' ')} {key!r}") as conn,
            conn.transaction(),
            conn.cursor(row_factory=dict_row) as cur,
        ):
            before_row = cur.execute(DEFERRED_FOR_UPDATE, {"key": key}).fetchone()
            if before_row is None:
                raise ClaimNotFound(f"no deferred job with key {key!r}")
            before = DeferredJob(**before_row)
            if before.state != "deferred":
                raise ClaimChanged(
                    f"deferred job {key!r} is {before.state}; only a waiting ('deferred') job "
                    f"can be {'cancelled' if action == 'cancel' else 'run now'}"
                )
            after_row = cur.execute(_STEER_DEFERRED, {"key": key, "state": state}).fetchone()
            if after_row is None:  # pragma: no cover - the row lock makes this unreachable
                raise ClaimChanged(f"deferred job {key!r} changed while it was being updated")
            after = DeferredJob(**after_row)
            record_deferred_change(conn, action, before, after, actor=actor, note=note)
        return after


def _target(
    claim: dict[str, Any] | None, deferred: dict[str, Any] | None
) -> ClaimRow | DeferredJob | None:
    """What a resolve or a release acts on: the claim, else the deferred work with the key."""
    if claim is not None:
        return ClaimRow(**claim)
    return DeferredJob(**deferred) if deferred is not None else None


def _refusal(target: ClaimRow | DeferredJob, action: str, token: uuid.UUID | None) -> str:
    """Why ``action`` is refused for ``target``, in the words of its command, or ""."""
    claim_states, deferred_states = _ALLOWED[action]
    states = deferred_states if isinstance(target, DeferredJob) else claim_states
    return change_refused(target, command=COMMANDS[action], allowed_states=states, token=token)


def _change_deferred(
    conn: psycopg.Connection[Any],
    job: DeferredJob,
    action: str,
    *,
    result: Any,
    error: str | None,
    actor: str,
    note: str,
) -> DeferredJob:
    """A resolve or a release of a deferred run left ``running`` (fenced by its lease token,
    inside the caller's transaction, which holds its row): done settles it and its claim as a
    drain's success would, failed as its last attempt would (a dead letter the ledger holds),
    and a release makes it wait again, due now."""
    key, token = job.idem_key, job.lease_token
    assert token is not None  # a running deferred job always holds a lease token
    if action == "resolve_done":
        changed = flow.finish(conn, key, token, result, actor=actor, note=note, holder=False)
    elif action == "resolve_failed":
        changed = flow.fail(conn, key, token, error or "", actor=actor, note=note, holder=False)
    else:
        changed = flow.release(conn, key, token, actor=actor, note=note)
    with conn.cursor(row_factory=dict_row) as cur:
        row = cur.execute(DEFERRED_BY_KEY, {"key": key}).fetchone()
    if not changed or row is None:  # pragma: no cover - the row lock makes this unreachable
        raise ClaimChanged(f"deferred job {key!r} changed while it was being updated")
    return DeferredJob(**row)
