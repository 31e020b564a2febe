"""Deferred work: a claim that waits. The transitions of ``job_claims`` rows the ledger owns.

A claim is deferred by the run that holds it (fenced by its token): its row keeps the payload,
the attempts so far and the next run time, its message is acked, and from then on the ledger
owns the work (``ClaimRow.owned``): a copy of its message is a duplicate, and only a drain's
``take_due`` runs it, under a new token and lease on the same row. One clock (the database's)
and one rule for who may change a run: the run holding the token, or anyone else once its lease
is over. The whole machine is the table ``ledger.claims.WORK_TRANSITIONS``.

Every function runs in ``conn.transaction()`` on the caller's connection (inside the caller's
transaction a savepoint, so a deferral can commit with the attempt it settles).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final, LiteralString, NamedTuple

import psycopg
from psycopg.rows import class_row
from psycopg.types.json import Jsonb

from infrai_jobs.ledger.claims import ClaimRow
from infrai_jobs.ledger.dead_letter_rows import hold_dead_letter
from infrai_jobs.ledger.postgres import (
    CLAIM_BY_KEY_FOR_UPDATE,
    CLAIM_COLUMNS,
    array_literal,
    ledger_errors,
    record_history,
)

# Who a drain's own changes are recorded as in claim_history.
DRAIN_ACTOR: Final = "drain"


@dataclass(frozen=True, slots=True)
class DeferredWork:
    idem_key: str
    job: str
    effect: str
    payload: Mapping[str, Any]
    message_id: str
    fingerprint: str | None = None
    queue: str | None = None


class DeferOutcome(StrEnum):
    DEFERRED = "deferred"  # the ledger owns the work now: ack the message
    ALREADY_HELD = "already_held"  # a row held the key already (a dead letter taken back)
    CLAIM_LOST = "claim_lost"  # the fenced deferral matched nothing: do not ack


class DeferredStats(NamedTuple):
    backlog: int  # deferred or running
    oldest_age_seconds: float  # since the oldest of those was first deferred; 0 when none


_RETURNING: LiteralString = " RETURNING " + CLAIM_COLUMNS

# The run holding the claim defers it: the row waits, with its payload, until run_after.
_DEFER: LiteralString = (
    """
UPDATE job_claims
SET state = 'deferred', payload = %(payload)s, queue = %(queue)s, message_id = %(message_id)s,
    attempts = %(attempts)s, last_error = %(error)s, error = NULL,
    run_after = clock_timestamp() + make_interval(secs => %(delay)s),
    deferred_at = coalesce(deferred_at, now()), claim_token = NULL, lease_until = NULL,
    began_at = NULL, updated_at = now()
WHERE idem_key = %(idem_key)s AND claim_token = %(token)s AND state = 'running'"""
    + _RETURNING
)

# Work no claim holds yet (a dead letter taken back): a new row that waits.
_DEFER_NEW: LiteralString = (
    """
INSERT INTO job_claims (idem_key, state, message_id, job, effect, payload_sha256, attempts,
                        payload, queue, last_error, run_after, deferred_at, updated_at)
VALUES (%(idem_key)s, 'deferred', %(message_id)s, %(job)s, %(effect)s, %(fingerprint)s,
        %(attempts)s, %(payload)s, %(queue)s, %(error)s,
        clock_timestamp() + make_interval(secs => %(delay)s), now(), now())
ON CONFLICT (idem_key) DO NOTHING"""
    + _RETURNING
)

# Due first (then the oldest deferral), skipping rows another drain has locked. A run whose
# lease is over is taken over, unless it is flagged for a human or an ``external`` run that
# began its handler (its effect may have happened: a human's, through the stuck rule).
_DUE: LiteralString = """
WITH due AS (
    SELECT idem_key AS due_key FROM job_claims
    WHERE run_after IS NOT NULL
      AND ((state = 'deferred' AND run_after <= clock_timestamp())
           OR (state = 'running' AND lease_until < clock_timestamp() AND error IS NULL
               AND (effect <> 'external' OR began_at IS NULL)))
      AND (%(jobs)s::text[] IS NULL OR job = ANY(%(jobs)s::text[]))
    ORDER BY run_after, deferred_at, idem_key
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)"""
_TAKE_DUE: LiteralString = (
    _DUE
    + """
UPDATE job_claims
SET state = 'running', attempts = attempts + 1, claim_token = gen_random_uuid(),
    lease_until = clock_timestamp() + make_interval(secs => %(lease)s), updated_at = now(),
    began_at = NULL
FROM due WHERE idem_key = due.due_key"""
    + _RETURNING
)

_BEGIN: LiteralString = """
UPDATE job_claims SET began_at = clock_timestamp()
WHERE idem_key = %(key)s AND claim_token = %(token)s AND state = 'running'
"""

# An external run whose outcome is unknown is flagged and its lease ended, as a delivery's
# uncertain claim is: it stays running, and only a human (or a probe) settles it.
_FLAG_UNCERTAIN: LiteralString = """
UPDATE job_claims
SET error = 'effect uncertain: ' || %(error)s, lease_until = least(lease_until, now()),
    updated_at = now()
WHERE idem_key = %(key)s AND claim_token = %(token)s AND state = 'running'
"""

# A job a limit held back did not run: its attempt is given back and its last error kept.
_POSTPONE: LiteralString = """
UPDATE job_claims
SET state = 'deferred', last_error = coalesce(%(error)s, last_error),
    attempts = attempts - CASE WHEN %(ran)s THEN 0 ELSE 1 END, claim_token = NULL,
    lease_until = NULL, began_at = NULL,
    run_after = clock_timestamp() + make_interval(secs => %(delay)s), updated_at = now()
WHERE idem_key = %(key)s AND claim_token = %(token)s AND state = 'running'
  AND run_after IS NOT NULL
"""

# The one takeover rule for anyone but the run itself: the same token as read, still running,
# and its lease over (a run under a live lease may be making the call right now).
_SETTLE: LiteralString = (
    """
UPDATE job_claims
SET state = %(state)s, result = %(result)s, error = %(error)s,
    last_error = coalesce(%(error)s, last_error), updated_at = now()
WHERE idem_key = %(key)s AND claim_token = %(token)s AND state = 'running'
  AND (%(holder)s OR lease_until IS NULL OR lease_until < clock_timestamp())"""
    + _RETURNING
)

# A run whose effect did not happen: work the ledger owns waits again, due now (its attempt
# stays counted); a message's claim is deleted, so its next delivery claims it afresh.
_RELEASE_OWNED: LiteralString = (
    """
UPDATE job_claims
SET state = 'deferred', claim_token = NULL, lease_until = NULL, began_at = NULL, error = NULL,
    run_after = now(), updated_at = now()
WHERE idem_key = %(key)s AND claim_token IS NOT DISTINCT FROM %(token)s
  AND state = 'running' AND run_after IS NOT NULL
  AND (lease_until IS NULL OR lease_until < clock_timestamp())"""
    + _RETURNING
)
_RELEASE_CLAIM: LiteralString = (
    """
DELETE FROM job_claims
WHERE idem_key = %(key)s AND claim_token IS NOT DISTINCT FROM %(token)s
  AND state IN ('running', 'failed')
  AND (state <> 'running' OR lease_until IS NULL OR lease_until < clock_timestamp())"""
    + _RETURNING
)

_STATS: LiteralString = """
SELECT count(*), coalesce(extract(epoch FROM clock_timestamp() - min(deferred_at)), 0)
FROM job_claims
WHERE run_after IS NOT NULL AND state IN ('deferred', 'running')
"""


def defer(
    conn: psycopg.Connection[Any],
    work: DeferredWork,
    *,
    attempts: int,
    error: str,
    delay_seconds: float,
    claim_token: uuid.UUID | None = None,
) -> DeferOutcome:
    """Make ``work`` wait ``delay_seconds`` after ``attempts`` attempts, the last failing with
    ``error``: the claim ``claim_token`` holds, or without it a new row for a key no row holds.
    Either way the ledger owns the work from here, and its message may be acked."""
    params = {name: getattr(work, name) for name in DeferredWork.__dataclass_fields__}
    params |= {
        "payload": Jsonb(dict(work.payload)),
        "attempts": max(attempts, 0),
        "error": error,
        "delay": max(float(delay_seconds), 0.0),
        "token": claim_token,
    }
    with ledger_errors("cannot defer a job"), conn.transaction():
        if claim_token is None:
            row = conn.execute(_DEFER_NEW, params).fetchone()
            return DeferOutcome.DEFERRED if row else DeferOutcome.ALREADY_HELD
        row = conn.execute(_DEFER, params).fetchone()
    return DeferOutcome.DEFERRED if row else DeferOutcome.CLAIM_LOST


def take_due(
    conn: psycopg.Connection[Any],
    limit: int,
    *,
    lease_seconds: float,
    jobs: Sequence[str] | None = None,
) -> list[ClaimRow]:
    """Take up to ``limit`` due deferred jobs (of ``jobs``, when given), due first then oldest,
    each under a new token and lease, its attempt counted. Two drains never take the same job:
    a row another holds is skipped, a taken one runs under a live lease."""
    params = {
        "limit": limit,
        "lease": float(lease_seconds),
        "jobs": None if jobs is None else array_literal(jobs),
    }
    with ledger_errors("cannot take deferred jobs"), conn.transaction(), _rows(conn) as cur:
        rows = cur.execute(_TAKE_DUE, params).fetchall()
    return sorted(rows, key=lambda job: (job.run_after, job.deferred_at, job.idem_key))


def begin(conn: psycopg.Connection[Any], key: str, token: uuid.UUID) -> bool:
    """The taken run holding ``token`` is about to call its handler: from here an ``external``
    run whose lease runs out is never taken again. False when the token no longer holds it."""
    with ledger_errors("cannot begin a deferred run"), conn.transaction():
        return conn.execute(_BEGIN, {"key": key, "token": token}).rowcount == 1


def flag_uncertain(conn: psycopg.Connection[Any], key: str, token: uuid.UUID, error: str) -> bool:
    """The run holding ``token`` does not know whether its effect happened: flagged for a
    human, never taken again."""
    params = {"key": key, "token": token, "error": error}
    with ledger_errors("cannot flag a deferred run"), conn.transaction():
        return conn.execute(_FLAG_UNCERTAIN, params).rowcount == 1


def postpone(
    conn: psycopg.Connection[Any],
    key: str,
    token: uuid.UUID,
    *,
    error: str | None,
    delay_seconds: float,
    ran: bool = True,
) -> bool:
    """A taken job's attempt failed (``error``), or a limit held it back before it ran
    (``ran=False``: not counted); it runs again in ``delay_seconds``."""
    params = {
        "key": key,
        "token": token,
        "error": error,
        "delay": max(float(delay_seconds), 0.0),
        "ran": ran,
    }
    with ledger_errors("cannot postpone a deferred job"), conn.transaction():
        return conn.execute(_POSTPONE, params).rowcount == 1


def finish(
    conn: psycopg.Connection[Any], key: str, token: uuid.UUID, result: Any
) -> ClaimRow | None:
    """The run holding ``token`` settles ``done``; None when the token no longer holds it."""
    return settle(conn, key, token, "done", result=result, action="deferred_done")


def fail(
    conn: psycopg.Connection[Any],
    key: str,
    token: uuid.UUID,
    error: str,
    *,
    queue: str | None = None,
) -> ClaimRow | None:
    """The run holding ``token`` fails for good (out of attempts, or a final error)."""
    return settle(conn, key, token, "failed", error=error, action="deferred_failed", queue=queue)


def settle(
    conn: psycopg.Connection[Any],
    key: str,
    token: uuid.UUID | None,
    state: str,
    *,
    result: Any = None,
    error: str | None = None,
    actor: str = DRAIN_ACTOR,
    action: str,
    note: str = "",
    queue: str | None = None,
    holder: bool = True,
) -> ClaimRow | None:
    """Settle the run holding ``token`` as ``done`` or ``failed`` and record it in
    ``claim_history`` as ``action``, in one transaction; None when nothing changed.
    ``holder=False`` (a reconcile probe, an operator) changes the run only once its lease is
    over. Failed work the ledger owns also gets a dead letter (its message was acked long ago)
    under its queue (``queue`` when the work recorded none)."""
    with ledger_errors(f"cannot settle {key!r}"), conn.transaction(), _rows(conn) as cur:
        before = cur.execute(CLAIM_BY_KEY_FOR_UPDATE, {"key": key}).fetchone()
        params = {
            "key": key,
            "token": token,
            "state": state,
            "result": Jsonb(result) if state == "done" else None,
            "error": error if state == "failed" else None,
            "holder": holder,
        }
        after = cur.execute(_SETTLE, params).fetchone()
        if before is None or after is None:
            return None
        if state == "failed" and after.owned:
            reason = f"deferred job failed after {after.attempts} attempt(s): {error}"
            hold_dead_letter(conn, after, queue=after.queue or queue or "", reason=reason)
        record_change(conn, action, before, after, actor=actor, note=note)
    return after


def release(
    conn: psycopg.Connection[Any],
    key: str,
    token: uuid.UUID | None,
    *,
    actor: str,
    action: str = "release",
    note: str = "",
) -> ClaimRow | None:
    """A run whose effect did not happen (a probe's ``not_done``, ``claims release``), or a
    failed claim to run again: work the ledger owns waits again, due now; any other claim is
    deleted, so the next delivery (or a redrive) runs it. Only the row ``token`` holds, a
    running one only once its lease is over. Returns the row as it was, or None."""
    with ledger_errors(f"cannot release {key!r}"), conn.transaction(), _rows(conn) as cur:
        before = cur.execute(CLAIM_BY_KEY_FOR_UPDATE, {"key": key}).fetchone()
        if before is None:
            return None
        waits_again = before.owned and before.state == "running"
        statement = _RELEASE_OWNED if waits_again else _RELEASE_CLAIM
        after = cur.execute(statement, {"key": key, "token": token}).fetchone()
        if after is None:
            return None
        record_change(conn, action, before, after if waits_again else None, actor=actor, note=note)
    return before


def _rows(conn: psycopg.Connection[Any]) -> psycopg.Cursor[ClaimRow]:
    return conn.cursor(row_factory=class_row(ClaimRow))


def deferred_stats(conn: psycopg.Connection[Any]) -> DeferredStats:
    """The deferred backlog (waiting or running) and its oldest entry's age, in seconds."""
    with ledger_errors("cannot read deferred jobs"):
        row = conn.execute(_STATS).fetchone()
    if row is None:  # pragma: no cover - an aggregate always answers one row
        return DeferredStats(0, 0.0)
    return DeferredStats(int(row[0]), float(row[1]))


def record_change(
    conn: psycopg.Connection[Any],
    action: str,
    before: ClaimRow,
    after: ClaimRow | None,
    *,
    actor: str,
    note: str,
) -> None:
    """A change to a unit of work in ``claim_history``: the row before and after (None: gone)."""
    after_dict = None if after is None else after.as_dict()
    record_history(
        conn,
        before.idem_key,
        action,
        actor=actor,
        before=before.as_dict(),
        after=after_dict,
        note=note,
    )
