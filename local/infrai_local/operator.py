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

from infrai_jobs.errors import ClaimChanged, ClaimNotFound
from infrai_jobs.flow import ledger as flow
from infrai_jobs.ledger.claims import ClaimRow
from infrai_jobs.ledger.postgres import CLAIM_BY_KEY, CLAIM_BY_KEY_FOR_UPDATE, CLAIM_COLUMNS
from infrai_jobs.operations.claims_admin import ClaimsAdmin, ReconcileWrite
from infrai_jobs.operations.dead_letters import storable_json
from infrai_jobs.operations.reconcile import ProbeOutcome, Reconciler, ReconcileReport


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
    row: ClaimRow,
    *,
    command: str,
    allowed_states: tuple[str, ...],
    token: uuid.UUID | None,
) -> str:
    """Why ``infrai-jobs COMMAND`` is refused for a claim (a delivery's, or deferred work),
    or "" when it may go ahead."""
    holder, what = row.claim_token, "deferred job" if row.owned else "claim"
    if row.state == "deferred" and row.run_after is not None:
        return (
            f"deferred job {row.idem_key!r} is waiting to run (due "
            f"{row.run_after.isoformat()}): `infrai-jobs claims run-now {row.idem_key}` or "
            f"`infrai-jobs claims cancel {row.idem_key}` act on it"
        )
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

_HISTORY_OF: LiteralString = """
SELECT id, idem_key, action, actor, at, before, after, note
FROM claim_history WHERE idem_key = %(key)s ORDER BY id
"""

# ``claims list --state deferred``: the work the ledger owns, waiting or running, the next due
# first.
_DEFERRED_LIST: LiteralString = (
    "SELECT "
    + CLAIM_COLUMNS
    + """
FROM job_claims
WHERE run_after IS NOT NULL AND state IN ('deferred', 'running')
  AND (%(job)s::text IS NULL OR job = %(job)s)
  AND (%(older_than)s::float8 IS NULL
       OR deferred_at < now() - make_interval(secs => %(older_than)s))
ORDER BY run_after, deferred_at, idem_key
LIMIT %(limit)s
"""
)

# ``claims cancel`` ends waiting work; ``claims run-now`` makes it due at once.
_STEER_DEFERRED: LiteralString = (
    """
UPDATE job_claims
SET state = %(state)s,
    run_after = CASE WHEN %(state)s = 'deferred' THEN least(run_after, now()) ELSE run_after END,
    updated_at = now()
WHERE idem_key = %(key)s AND state = 'deferred'
RETURNING """
    + CLAIM_COLUMNS
)


# The states a resolve or a release applies to.
_ALLOWED: Final = {
    "resolve_done": RESOLVABLE,
    "resolve_failed": RESOLVABLE,
    "release": RELEASABLE,
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
    ) -> ClaimRow:
        """A human's verdict on a running claim, or on a deferred run left ``running`` for a
        human: ``done`` (with the provider's reference) or ``failed`` (with the reason; work
        the ledger owns also gets a dead letter, as its last attempt's failure would)."""
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
    ) -> ClaimRow:
        """Delete a running or failed claim so the next delivery runs the job again; a
        deferred run left ``running`` waits again instead, due now, for the next drain."""
        return self._fenced_change(
            key, action="release", expected_token=expected_token, actor=actor, note=note
        )

    def change_refused(self, key: str, action: str, *, token: uuid.UUID | None) -> str:
        """Why ``action`` would be refused for ``key`` as it stands now, or "" (the change is
        fenced again when it is made); ``ClaimNotFound`` when no claim has the key."""
        found = self.find(key)
        if found is None:
            raise ClaimNotFound(f"no claim with key {key!r}")
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
    ) -> ClaimRow:
        """One operator change, through the state machine's own transitions (``flow.ledger``):
        refused, in the command's words, unless the row is in a state the change applies to,
        its lease is over and (when given) ``expected_token`` still holds it."""
        with (
            self._connector.session(f"cannot {action.replace('_', ' ')} {key!r}") as conn,
            conn.transaction(),
        ):
            before = self._claim(conn, key, lock=True)
            if before is None:
                raise ClaimNotFound(f"no claim with key {key!r}")
            refused = _refusal(before, action, expected_token)
            if refused:
                raise ClaimChanged(refused)
            token = before.claim_token
            changed: ClaimRow | None
            if action == "release":
                changed = flow.release(conn, key, token, actor=actor, note=note)
            else:
                done = action == "resolve_done"
                changed = flow.settle(
                    conn,
                    key,
                    token,
                    "done" if done else "failed",
                    result=storable_json(result) if done else None,
                    error=error,
                    actor=actor,
                    action=action,
                    note=note,
                    holder=False,
                )
            if changed is None:  # pragma: no cover - the row lock makes this unreachable
                raise ClaimChanged(f"claim {key!r} changed while it was being updated")
            after = self._claim(conn, key)
        return after or before

    @staticmethod
    def _claim(conn: psycopg.Connection[Any], key: str, *, lock: bool = False) -> ClaimRow | None:
        with conn.cursor(row_factory=dict_row) as cur:
            statement = CLAIM_BY_KEY_FOR_UPDATE if lock else CLAIM_BY_KEY
            row = cur.execute(statement, {"key": key}).fetchone()
        return ClaimRow(**row) if row else None

    def list_deferred(
        self, *, job: str | None = None, older_than_seconds: float | None = None, limit: int = 100
    ) -> list[ClaimRow]:
        """Deferred work the ledger holds (waiting or running), the next due first."""
        params = {"job": job, "older_than": older_than_seconds, "limit": limit}
        return self._rows(_DEFERRED_LIST, params)

    def run_deferred_now(self, key: str, *, actor: str, note: str = "") -> ClaimRow:
        """Waiting deferred work made due at once, for the next drain; recorded as
        ``run_now``."""
        return self._steer_deferred(key, "deferred", "run_now", actor=actor, note=note)

    def cancel_deferred(self, key: str, *, actor: str, note: str = "") -> ClaimRow:
        """Waiting deferred work cancelled: it never runs (a running one may be inside its
        effect, so it is refused). Recorded as ``cancel``."""
        return self._steer_deferred(key, "cancelled", "cancel", actor=actor, note=note)

    def _steer_deferred(
        self, key: str, state: str, action: str, *, actor: str, note: str
    ) -> ClaimRow:
        with (
            self._connector.session(f"cannot {action.replace('_', ' ')} {key!r}") as conn,
            conn.transaction(),
            conn.cursor(row_factory=dict_row) as cur,
        ):
            before = self._claim(conn, key, lock=True)
            if before is None or not before.owned:
                raise ClaimNotFound(f"no deferred job with key {key!r}")
            if before.state != "deferred":
                raise ClaimChanged(
                    f"deferred job {key!r} is {before.state}; only a waiting ('deferred') job "
                    f"can be {'cancelled' if action == 'cancel' else 'run now'}"
                )
            after_row = cur.execute(_STEER_DEFERRED, {"key": key, "state": state}).fetchone()
            if after_row is None:  # pragma: no cover - the row lock makes this unreachable
                raise ClaimChanged(f"deferred job {key!r} changed while it was being updated")
            after = ClaimRow(**after_row)
            flow.record_change(conn, action, before, after, actor=actor, note=note)
        return after


def _refusal(target: ClaimRow, action: str, token: uuid.UUID | None) -> str:
    """Why ``action`` is refused for ``target``, in the words of its command, or ""."""
    return change_refused(
        target, command=COMMANDS[action], allowed_states=_ALLOWED[action], token=token
    )


def reconcile_one(reconciler: Reconciler, key: str, *, dry_run: bool = False) -> ReconcileReport:
    """Probe one claim, named by its key: a running claim of a job with a probe."""
    claim = reconciler.admin.find(key)
    if claim is None:
        raise ClaimNotFound(f"no claim with key {key!r}")
    if claim.state != "running":
        raise ClaimChanged(f"claim {key!r} is {claim.state}: only a running claim is reconciled")
    return ReconcileReport([reconciler.reconcile(claim, dry_run=dry_run)], dry_run=dry_run)


def still_stuck(report: ReconcileReport) -> list[ProbeOutcome]:
    """The probed claims a pass left stuck: unknown, fenced out, or under a live lease."""
    resolved = (ReconcileWrite.SETTLED.value, ReconcileWrite.RELEASED.value)
    return [outcome for outcome in report.outcomes if outcome.action not in resolved]
