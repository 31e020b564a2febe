"""The operator's words for the store's changes: who is at the command line, and why a refused
change was refused. The changes themselves (fenced, refused under a live lease as the database
judges it, recorded in ``claim_history``) are ``infrai_jobs.work.admin.WorkStore``'s.
"""

from __future__ import annotations

import getpass
import os
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Final, LiteralString

from psycopg.rows import dict_row

from infrai_jobs.errors import ClaimChanged, ClaimNotFound
from infrai_jobs.jobs.probes import DONE, NOT_DONE, UNKNOWN
from infrai_jobs.operations.reconcile import ProbeOutcome, Reconciler, ReconcileReport
from infrai_jobs.work.admin import ALLOWED, ReconcileWrite, Refusal, WorkStore, refusal
from infrai_jobs.work.statements import CLAIMS
from infrai_jobs.work.states import ClaimRow
from infrai_jobs.work.store import Why, claim_rows


def default_actor() -> str:
    """Who is acting: OPERATOR if set, else the login name (recorded, never trusted)."""
    return os.environ.get("OPERATOR") or getpass.getuser()


# ``claims list``: newest first, filtered by state, job and age when given.
_LIST_CLAIMS: LiteralString = (
    CLAIMS
    + """
WHERE (%(state)s::text IS NULL OR state = %(state)s)
  AND (%(job)s::text IS NULL OR job = %(job)s)
  AND (%(older_than)s::float8 IS NULL
       OR claimed_at < now() - make_interval(secs => %(older_than)s))
ORDER BY claimed_at DESC
LIMIT %(limit)s
"""
)

# ``claims list --state deferred``: the work the ledger owns, waiting or running, next due first.
_LIST_DEFERRED: LiteralString = (
    CLAIMS
    + """
WHERE run_after IS NOT NULL AND state IN ('deferred', 'running')
  AND (%(job)s::text IS NULL OR job = %(job)s)
  AND (%(older_than)s::float8 IS NULL
       OR deferred_at < now() - make_interval(secs => %(older_than)s))
ORDER BY run_after, deferred_at, idem_key
LIMIT %(limit)s
"""
)

_HISTORY_OF: LiteralString = """
SELECT id, idem_key, action, actor, at, before, after, note
FROM claim_history WHERE idem_key = %(key)s ORDER BY id
"""


# The command an operator types for each change recorded in claim_history: what error texts name.
COMMANDS: Final = {
    "resolve_done": "claims resolve --done",
    "resolve_failed": "claims resolve --failed",
    "release": "claims release",
    "run_now": "claims run-now",
    "cancel": "claims cancel",
}


def change_refused(row: ClaimRow, action: str, *, token: uuid.UUID | None) -> str:
    """Why ``action`` is refused for a claim (a delivery's, or deferred work) as the store read
    it, in the words of its command, or "" when it may go ahead."""
    command, allowed = COMMANDS[action], ALLOWED[action]
    holder, what, key = row.claim_token, "deferred job" if row.owned else "claim", row.idem_key
    if row.state == "deferred" and row.run_after is not None:
        return (
            f"deferred job {key!r} is waiting to run (due {row.run_after.isoformat()}): "
            f"`infrai-jobs claims run-now {key}` or `infrai-jobs claims cancel {key}` act on it"
        )
    why = refusal(row, allowed_states=allowed, token=token)
    if why is None:
        return ""
    if why is Refusal.STATE:
        return (
            f"{what} {key!r} is {row.state}; `infrai-jobs {command}` needs a "
            f"{' or '.join(allowed)} {what}"
        )
    if why is Refusal.LEASE_LIVE:
        return live_lease_refused(row, command)
    return (
        f"{what} {key!r} is now held by token {holder}, not {token}: it changed "
        f"since you looked; run `infrai-jobs claims show {key}` again"
    )


def live_lease_refused(row: ClaimRow, command: str) -> str:
    """Why ``command`` is refused for a claim a run holds under a live lease: until when, and
    what to do (the same words for every verb)."""
    what, key = "deferred job" if row.owned else "claim", row.idem_key
    until = row.lease_end.isoformat() if row.lease_end is not None else "?"
    implied = "" if row.lease_until is not None else " (no lease stored: claim time + visibility)"
    return (
        f"{what} {key!r} is running under a live lease until {until}{implied}: its run may "
        f"be inside the call right now; wait for the lease to end, then run "
        f"`infrai-jobs {command} {key}` again"
    )


class OperatorLedger(WorkStore):
    """The store's changes with the command line's arguments and words: who acts, and why a
    refused change was refused. Every change itself is the store's."""

    def _read(self, statement: LiteralString, params: dict[str, Any]) -> list[ClaimRow]:
        with self.connector.session("cannot read claims") as conn:
            return claim_rows(conn, statement, params, visibility=self.visibility)

    def show(self, key: str) -> ClaimRow:
        found = self.find(key)
        if found is None:
            raise ClaimNotFound(f"no claim with key {key!r}")
        return found

    def list_claims(
        self,
        *,
        state: str | None = None,
        job: str | None = None,
        older_than_seconds: float | None = None,
        limit: int = 100,
    ) -> list[ClaimRow]:
        params = {"state": state, "job": job, "older_than": older_than_seconds, "limit": limit}
        return self._read(_LIST_CLAIMS, params)

    def list_deferred(
        self, *, job: str | None = None, older_than_seconds: float | None = None, limit: int = 100
    ) -> list[ClaimRow]:
        """Deferred work the ledger holds (waiting or running), the next due first."""
        params = {"job": job, "older_than": older_than_seconds, "limit": limit}
        return self._read(_LIST_DEFERRED, params)

    def history(self, key: str) -> list[dict[str, Any]]:
        """Every change recorded for this key, oldest first (kept after a release)."""
        with (
            self._connector.session("cannot read the claim history") as conn,
            conn.cursor(row_factory=dict_row) as cur,
        ):
            return list(cur.execute(_HISTORY_OF, {"key": key}).fetchall())

    def change_refused(self, key: str, action: str, *, token: uuid.UUID | None) -> str:
        """Why ``action`` would be refused for ``key`` as it stands now, or "" (the change is
        fenced again when it is made); ``ClaimNotFound`` when no claim has the key."""
        return change_refused(self.show(key), action, token=token)

    def resolve(  # type: ignore[override]
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
        why = Why("resolve_done" if done else "resolve_failed", actor, note)
        with _worded(why.action, expected_token):
            return super().resolve(
                key, done=done, why=why, result=result, error=error, expected_token=expected_token
            )

    def release(  # type: ignore[override]
        self, key: str, *, expected_token: uuid.UUID | None = None, actor: str, note: str = ""
    ) -> ClaimRow:
        with _worded("release", expected_token):
            return super().release(
                key, why=Why("release", actor, note), expected_token=expected_token
            )

    def run_deferred_now(self, key: str, *, actor: str, note: str = "") -> ClaimRow:
        with _worded("run_now", None):
            return self.run_now(key, Why("run_now", actor, note))

    def cancel_deferred(self, key: str, *, actor: str, note: str = "") -> ClaimRow:
        with _worded("cancel", None):
            return self.cancel(key, Why("cancel", actor, note))


@contextmanager
def _worded(action: str, token: uuid.UUID | None) -> Iterator[None]:
    """A refusal in the words of ``action``'s command; run-now's and cancel's keep the store's
    words unless a live lease refused them."""
    try:
        yield
    except ClaimChanged as refused:
        row = refused.row
        if not isinstance(row, ClaimRow):
            raise
        if refused.refusal == Refusal.LEASE_LIVE:
            raise ClaimChanged(live_lease_refused(row, COMMANDS[action])) from None
        if action not in ALLOWED:
            raise
        raise ClaimChanged(change_refused(row, action, token=token)) from None


def reconcile_one(reconciler: Reconciler, key: str, *, dry_run: bool = False) -> ReconcileReport:
    """Probe one claim, named by its key: a running claim of a job with a probe."""
    claim = reconciler.admin.find(key)
    if claim is None:
        raise ClaimNotFound(f"no claim with key {key!r}")
    if claim.state != "running":
        raise ClaimChanged(f"claim {key!r} is {claim.state}: only a running claim is reconciled")
    if dry_run:
        return probe_only(reconciler, [claim])
    return ReconcileReport([reconciler.reconcile(claim)])


# What a dry run reports each answer would do.
_WOULD: Final = {DONE: "would settle done", NOT_DONE: "would release", UNKNOWN: "would leave stuck"}


def probe_only(reconciler: Reconciler, claims: Iterable[ClaimRow]) -> ReconcileReport:
    """A dry run: each claim's probe asked, and what its answer would do; nothing changed or
    recorded."""
    report = ReconcileReport(dry_run=True)
    for claim in claims:
        answer, detail = reconciler.probe(claim)
        # As ``Reconciler.reconcile`` would: under a live lease, no answer changes anything.
        would = ReconcileWrite.LEASE_LIVE.value if claim.lease_live else _WOULD[answer.answer]
        report.outcomes.append(
            ProbeOutcome(claim.idem_key, claim.job or "", answer.answer, detail, would)
        )
    return report


def stuck_probed(reconciler: Reconciler, *, threshold_seconds: int, limit: int) -> list[ClaimRow]:
    """The stuck claims a reconcile pass would probe: those of jobs with a probe, oldest first."""
    jobs = reconciler.probed_jobs()
    return (
        reconciler.admin.stuck(jobs, threshold_seconds=threshold_seconds, limit=limit)
        if jobs
        else []
    )


def live_lease_ends(admin: WorkStore, outcomes: Iterable[ProbeOutcome]) -> dict[str, str]:
    """Which of the probed claims run under a live lease now, with when it ends, as the database
    reads it: nothing but the run holding it may act on one before then (`claims reconcile`
    changes nothing, `claims resolve` and `claims release` are refused)."""
    ends: dict[str, str] = {}
    for outcome in outcomes:
        claim = admin.find(outcome.idem_key)
        if claim is not None and claim.lease_live and claim.lease_end is not None:
            ends[outcome.idem_key] = claim.lease_end.isoformat()
    return ends


def still_stuck(report: ReconcileReport) -> list[ProbeOutcome]:
    """The probed claims a pass left stuck: unknown, fenced out, or under a live lease."""
    resolved = (ReconcileWrite.SETTLED.value, ReconcileWrite.RELEASED.value)
    return [outcome for outcome in report.outcomes if outcome.action not in resolved]
