"""Flow control in the ledger's database: deferred work, rate-limit starts, concurrency slots.

Every function takes the caller's psycopg connection and runs in ``conn.transaction()``: on an
autocommit connection that is a transaction of its own, inside the caller's transaction a
savepoint of it, so a deferral can commit with the attempt it settles. Times are the
database's (``clock_timestamp()``), never a drain's, so every drain agrees on them.

Fencing: a taken deferred job carries a ``lease_token``; every later change to it names that
token and changes nothing (returns False) when the row moved on. The end of a deferred job
(``finish``, ``fail``) is recorded in ``claim_history`` with the row before and after, in the
same transaction, as the command line's ``cancel`` and ``run_now`` are
(``record_deferred_change``).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from datetime import datetime
from enum import StrEnum
from typing import Any, Final, LiteralString, NamedTuple

import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from infrai_jobs.ledger.dead_letter_rows import hold_dead_letter
from infrai_jobs.ledger.postgres import array_literal, ledger_errors, record_history

# Who a drain's own changes are recorded as in claim_history.
DRAIN_ACTOR: Final = "drain"


@dataclass(frozen=True, slots=True)
class DeferredWork:
    """What a deferral records of the attempt it settles."""

    idem_key: str
    job: str
    effect: str
    payload: Mapping[str, Any]
    message_id: str
    fingerprint: str | None = None
    queue: str | None = None


@dataclass(frozen=True, slots=True)
class DeferredJob:
    """A row of ``deferred_jobs``."""

    idem_key: str
    job: str
    effect: str
    payload: Any
    payload_sha256: str | None
    message_id: str
    queue: str | None
    state: str
    attempts: int
    last_error: str | None
    result: Any
    run_after: datetime
    created_at: datetime
    updated_at: datetime
    lease_token: uuid.UUID | None
    lease_until: datetime | None


class DeferOutcome(StrEnum):
    DEFERRED = "deferred"  # the ledger owns the work now: ack the message
    ALREADY_DEFERRED = "already_deferred"  # deferred work held the key already: a duplicate
    CLAIM_LOST = "claim_lost"  # the fenced release of the claim matched nothing: do not ack


class DeferredStats(NamedTuple):
    backlog: int  # deferred or running
    oldest_age_seconds: float  # since the oldest of those was first deferred; 0 when none


# The columns of a DeferredJob, for every statement that reads whole rows.
DEFERRED_COLUMNS: LiteralString = """idem_key, job, effect, payload, payload_sha256, message_id,
       queue, state, attempts, last_error, result, run_after, created_at, updated_at,
       lease_token, lease_until"""

_RELEASE_CLAIM: LiteralString = """
DELETE FROM job_claims
WHERE idem_key = %(key)s AND claim_token = %(token)s AND state = 'running'
"""

# A key whose earlier deferred life ended (done, failed, cancelled) may be deferred afresh;
# one still deferred or running holds it.
_DEFER: LiteralString = """
INSERT INTO deferred_jobs AS d (idem_key, job, effect, payload, payload_sha256, message_id,
                                queue, attempts, last_error, run_after)
VALUES (%(key)s, %(job)s, %(effect)s, %(payload)s, %(fingerprint)s, %(message_id)s,
        %(queue)s, %(attempts)s, %(error)s,
        clock_timestamp() + make_interval(secs => %(delay)s))
ON CONFLICT (idem_key) DO UPDATE
SET job = EXCLUDED.job, effect = EXCLUDED.effect, payload = EXCLUDED.payload,
    payload_sha256 = EXCLUDED.payload_sha256, message_id = EXCLUDED.message_id,
    queue = EXCLUDED.queue, state = 'deferred', attempts = EXCLUDED.attempts,
    last_error = EXCLUDED.last_error, result = NULL, run_after = EXCLUDED.run_after,
    created_at = now(), updated_at = now(), lease_token = NULL, lease_until = NULL
WHERE d.state IN ('done', 'failed', 'cancelled')
RETURNING idem_key
"""

# A job a limit held back did not run: its attempt is given back and its last error kept.
_POSTPONE: LiteralString = """
UPDATE deferred_jobs
SET state = 'deferred', last_error = coalesce(%(error)s, last_error),
    attempts = attempts - CASE WHEN %(ran)s THEN 0 ELSE 1 END, lease_token = NULL,
    lease_until = NULL, run_after = clock_timestamp() + make_interval(secs => %(delay)s),
    updated_at = now()
WHERE idem_key = %(key)s AND lease_token = %(token)s AND state = 'running'
"""

# Due first (then the oldest deferral), skipping rows another drain has locked; an expired
# lease is taken over unless the job's effect is external (its outcome is unknown: a human's).
_TAKE_DUE: LiteralString = """
WITH due AS (
    SELECT idem_key FROM deferred_jobs
    WHERE ((state = 'deferred' AND run_after <= clock_timestamp())
           OR (state = 'running' AND lease_until < clock_timestamp()
               AND (effect <> 'external' OR began_at IS NULL)))
      AND (%(jobs)s::text[] IS NULL OR job = ANY(%(jobs)s::text[]))
    ORDER BY run_after, created_at, idem_key
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
UPDATE deferred_jobs AS d
SET state = 'running', attempts = d.attempts + 1, lease_token = gen_random_uuid(),
    lease_until = clock_timestamp() + make_interval(secs => %(lease)s), updated_at = now(),
    began_at = NULL
FROM due WHERE d.idem_key = due.idem_key
RETURNING d.idem_key, d.job, d.effect, d.payload, d.payload_sha256, d.message_id, d.queue,
          d.state, d.attempts, d.last_error, d.result, d.run_after, d.created_at, d.updated_at,
          d.lease_token, d.lease_until
"""

_BEGIN: LiteralString = """
UPDATE deferred_jobs SET began_at = clock_timestamp()
WHERE idem_key = %(key)s AND lease_token = %(token)s AND state = 'running'
"""

DEFERRED_BY_KEY: LiteralString = (
    """SELECT """
    + DEFERRED_COLUMNS
    + """
FROM deferred_jobs WHERE idem_key = %(key)s"""
)
DEFERRED_FOR_UPDATE: LiteralString = DEFERRED_BY_KEY + " FOR UPDATE"

# A run left for a human: an ``external`` run that began its handler and whose lease is over
# (its drain died, or its outcome was unknown). ``take_due`` never takes it again; an operator,
# or a reconcile probe, settles it or lets it run again. Of ``jobs`` only, when not NULL.
STUCK_DEFERRED: LiteralString = (
    "SELECT "
    + DEFERRED_COLUMNS
    + """
FROM deferred_jobs
WHERE state = 'running' AND effect = 'external' AND began_at IS NOT NULL
  AND lease_until < clock_timestamp()
  AND (%(jobs)s::text[] IS NULL OR job = ANY(%(jobs)s::text[]))
ORDER BY updated_at, idem_key
LIMIT %(limit)s
"""
)

# A run whose effect did not happen waits again, due now (its attempt stays counted). Only
# once its lease is over: under a live one its drain may be making the call right now.
_RELEASE: LiteralString = (
    """
UPDATE deferred_jobs
SET state = 'deferred', lease_token = NULL, lease_until = NULL, began_at = NULL,
    run_after = now(), updated_at = now()
WHERE idem_key = %(key)s AND state = 'running' AND lease_token = %(token)s
  AND lease_until < clock_timestamp()
RETURNING """
    + DEFERRED_COLUMNS
)

_SETTLE: LiteralString = (
    """
UPDATE deferred_jobs
SET state = %(state)s, result = %(result)s,
    last_error = coalesce(%(error)s, last_error),
    lease_token = NULL, lease_until = NULL, updated_at = now()
WHERE idem_key = %(key)s AND lease_token = %(token)s AND state = 'running'
  AND (%(holder)s OR lease_until < clock_timestamp())
RETURNING """
    + DEFERRED_COLUMNS
)

# Whether the run holding ``token`` still has a live lease (on the database's clock).
_LEASE_LIVE: LiteralString = """
SELECT lease_until >= clock_timestamp() FROM deferred_jobs
WHERE idem_key = %(key)s AND lease_token = %(token)s AND state = 'running'
"""

# The claim a finished deferred job leaves, so a later copy of its message meets a settled
# claim like any other. A claim already standing for the key is left as it is.
_SETTLED_CLAIM: LiteralString = """
INSERT INTO job_claims (idem_key, state, message_id, job, effect, payload_sha256, result,
                        error, attempts, claim_token, updated_at)
VALUES (%(key)s, %(state)s, %(message_id)s, %(job)s, %(effect)s, %(fingerprint)s, %(result)s,
        %(error)s, %(attempts)s, %(token)s, now())
ON CONFLICT (idem_key) DO NOTHING
"""

_HOLDING: LiteralString = """
SELECT idem_key, state FROM deferred_jobs
WHERE idem_key = ANY(%(keys)s::text[]) AND state IN ('deferred', 'running')
"""

_STATS: LiteralString = """
SELECT count(*), coalesce(extract(epoch FROM clock_timestamp() - min(created_at)), 0)
FROM deferred_jobs WHERE state IN ('deferred', 'running')
"""


# --- Deferring and running deferred work ------------------------------------------------------


def defer(
    conn: psycopg.Connection[Any],
    work: DeferredWork,
    *,
    attempts: int,
    error: str,
    delay_seconds: float,
    claim_token: uuid.UUID | None = None,
) -> DeferOutcome:
    """Record ``work`` to run again in ``delay_seconds`` (on the database's clock), after
    ``attempts`` attempts, the last failing with ``error``. With ``claim_token``, the claim
    that attempt held is released in the same transaction (fenced by the token): from here
    the ledger owns the work, and the message may be acked."""
    with ledger_errors("cannot defer a job"), conn.transaction():
        if claim_token is not None:
            released = conn.execute(_RELEASE_CLAIM, {"key": work.idem_key, "token": claim_token})
            if released.rowcount != 1:
                return DeferOutcome.CLAIM_LOST
        row = conn.execute(
            _DEFER,
            {
                "key": work.idem_key,
                "job": work.job,
                "effect": work.effect,
                "payload": Jsonb(dict(work.payload)),
                "fingerprint": work.fingerprint,
                "message_id": work.message_id,
                "queue": work.queue,
                "attempts": attempts,
                "error": error,
                "delay": max(float(delay_seconds), 0.0),
            },
        ).fetchone()
    return DeferOutcome.DEFERRED if row else DeferOutcome.ALREADY_DEFERRED


def take_due(
    conn: psycopg.Connection[Any],
    limit: int,
    *,
    lease_seconds: float,
    jobs: Sequence[str] | None = None,
) -> list[DeferredJob]:
    """Take up to ``limit`` due deferred jobs (of ``jobs``, when given), due first then oldest,
    each under a new lease of ``lease_seconds`` and token, its attempt count raised by one.
    Two drains never take the same job: a row another holds is skipped, a taken one is
    ``running`` under a live lease until finished, failed, postponed or expired."""
    params = {
        "limit": limit,
        "lease": float(lease_seconds),
        "jobs": None if jobs is None else array_literal(jobs),
    }
    with (
        ledger_errors("cannot take deferred jobs"),
        conn.transaction(),
        conn.cursor(row_factory=dict_row) as cur,
    ):
        rows = [DeferredJob(**row) for row in cur.execute(_TAKE_DUE, params).fetchall()]
    return sorted(rows, key=lambda job: (job.run_after, job.created_at, job.idem_key))


def begin(conn: psycopg.Connection[Any], key: str, token: uuid.UUID) -> bool:
    """Record that the taken run holding ``token`` is about to call its handler: from here an
    ``external`` run whose lease runs out is never taken again. False when the token no longer
    holds it (do not run)."""
    with ledger_errors("cannot begin a deferred run"), conn.transaction():
        return conn.execute(_BEGIN, {"key": key, "token": token}).rowcount == 1


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
    (``ran=False``: the attempt is not counted), and it runs again in ``delay_seconds``;
    False when the token no longer holds it."""
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
    conn: psycopg.Connection[Any],
    key: str,
    token: uuid.UUID,
    result: Any,
    *,
    actor: str = DRAIN_ACTOR,
    note: str = "",
    holder: bool = True,
) -> bool:
    """A taken job succeeded: ``done`` with ``result``, its claim settled ``done`` so later
    copies are duplicates, recorded as ``deferred_done``. False when the token no longer
    holds it (nothing changed). ``holder=False`` is anyone but the run that holds the lease
    (a reconcile probe, an operator): it changes the run only once its lease is over."""
    return _settle(
        conn, key, token, "done", result=result, error=None, actor=actor, note=note, holder=holder
    )


def fail(
    conn: psycopg.Connection[Any],
    key: str,
    token: uuid.UUID,
    error: str,
    *,
    actor: str = DRAIN_ACTOR,
    note: str = "",
    queue: str | None = None,
    holder: bool = True,
) -> bool:
    """A taken job failed for good (out of attempts, or a final error): ``failed`` with
    ``error``, its claim settled ``failed``, recorded as ``deferred_failed``, and an unresolved
    dead letter recorded in ``dead_letters`` (its message was acked long ago, so the ledger
    holds it) under its queue (``queue`` when the work recorded none). All in one
    transaction; False when the token no longer holds it (nothing changed)."""
    return _settle(
        conn,
        key,
        token,
        "failed",
        result=None,
        error=error,
        actor=actor,
        note=note,
        queue=queue,
        holder=holder,
    )


def _settle(
    conn: psycopg.Connection[Any],
    key: str,
    token: uuid.UUID,
    state: str,
    *,
    result: Any,
    error: str | None,
    actor: str,
    note: str,
    queue: str | None = None,
    holder: bool,
) -> bool:
    with (
        ledger_errors(f"cannot settle deferred job {key!r}"),
        conn.transaction(),
        conn.cursor(row_factory=dict_row) as cur,
    ):
        before_row = cur.execute(DEFERRED_FOR_UPDATE, {"key": key}).fetchone()
        params = {
            "key": key,
            "token": token,
            "state": state,
            "result": Jsonb(result) if state == "done" else None,
            "error": error,
            "holder": holder,
        }
        after_row = cur.execute(_SETTLE, params).fetchone()
        if before_row is None or after_row is None:
            return False
        after = DeferredJob(**after_row)
        cur.execute(
            _SETTLED_CLAIM,
            {
                "key": key,
                "state": state,
                "message_id": after.message_id,
                "job": after.job,
                "effect": after.effect,
                "fingerprint": after.payload_sha256,
                "result": Jsonb(result) if state == "done" else None,
                "error": error,
                "attempts": after.attempts,
                "token": token,
            },
        )
        if state == "failed":
            hold_dead_letter(
                conn,
                message_id=after.message_id,
                queue=after.queue or queue or "",
                payload=after.payload,
                job=after.job,
                idem_key=key,
                reason=f"deferred job failed after {after.attempts} attempt(s): {error}",
            )
        record_deferred_change(
            conn,
            f"deferred_{state}",
            DeferredJob(**before_row),
            after,
            actor=actor,
            note=note,
        )
    return True


def release(
    conn: psycopg.Connection[Any], key: str, token: uuid.UUID, *, actor: str, note: str = ""
) -> bool:
    """A run left for a human whose effect did not happen (an operator's ``claims release``,
    or a reconcile probe's ``not_done``): waiting again, due now, recorded as ``release``.
    False when the token no longer holds it (nothing changed)."""
    with (
        ledger_errors(f"cannot release deferred job {key!r}"),
        conn.transaction(),
        conn.cursor(row_factory=dict_row) as cur,
    ):
        before = cur.execute(DEFERRED_FOR_UPDATE, {"key": key}).fetchone()
        after = cur.execute(_RELEASE, {"key": key, "token": token}).fetchone()
        if before is None or after is None:
            return False
        record_deferred_change(
            conn, "release", DeferredJob(**before), DeferredJob(**after), actor=actor, note=note
        )
    return True


def lease_live(conn: psycopg.Connection[Any], key: str, token: uuid.UUID) -> bool:
    """Whether the run holding ``token`` is still under its lease: its drain may be making the
    call right now, so nobody but that drain may change it."""
    with ledger_errors("cannot read deferred jobs"):
        row = conn.execute(_LEASE_LIVE, {"key": key, "token": token}).fetchone()
    return bool(row and row[0])


def holding(conn: psycopg.Connection[Any], keys: Sequence[str]) -> dict[str, str]:
    """The keys among ``keys`` that deferred work holds (waiting or running), with its state:
    a message carrying one of them is a duplicate of deferred work."""
    if not keys:
        return {}
    with ledger_errors("cannot read deferred jobs"):
        rows = conn.execute(_HOLDING, {"keys": array_literal(keys)}).fetchall()
    return {str(key): str(state) for key, state in rows}


def deferred_stats(conn: psycopg.Connection[Any]) -> DeferredStats:
    """The deferred backlog (waiting or running) and its oldest entry's age, in seconds."""
    with ledger_errors("cannot read deferred jobs"):
        row = conn.execute(_STATS).fetchone()
    if row is None:  # pragma: no cover - an aggregate always answers one row
        return DeferredStats(0, 0.0)
    return DeferredStats(int(row[0]), float(row[1]))


# --- claim_history ----------------------------------------------------------------------------


def record_deferred_change(
    conn: psycopg.Connection[Any],
    action: str,
    before: DeferredJob,
    after: DeferredJob,
    *,
    actor: str,
    note: str,
) -> None:
    """A change to deferred work in ``claim_history``: the row before and after it."""
    record_history(
        conn,
        before.idem_key,
        action,
        actor=actor,
        before=deferred_as_dict(before),
        after=deferred_as_dict(after),
        note=note,
    )


def deferred_as_dict(job: DeferredJob) -> dict[str, Any]:
    """A deferred job as JSON-ready values, for the history table and ``--json`` output."""
    out: dict[str, Any] = {}
    for field in fields(job):
        value = getattr(job, field.name)
        if isinstance(value, datetime):
            value = value.isoformat()
        elif isinstance(value, uuid.UUID):
            value = str(value)
        out[field.name] = value
    json.dumps(out)  # fail here, not in a caller's output, if a value is not JSON
    return out
