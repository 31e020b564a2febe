"""The transitions of ``job_claims`` rows outside a delivery's batch: deferred work (a claim that
waits, owned by the ledger: docs/design.md, "One state machine"), and every change a probe, an
operator, a redrive or the prune function makes. Who may change a run is one rule
(``work.statements``); each row of ``work.states.WORK_TRANSITIONS`` names its function here (or in
``work.ledger``). The functions run in ``conn.transaction()`` on the caller's connection (inside
the caller's transaction a savepoint, so a deferral can commit with the attempt it settles)."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final, LiteralString, NamedTuple

import psycopg
from psycopg.rows import class_row
from psycopg.types.json import Jsonb

from infrai_jobs.ledger.dead_letter_rows import (
    LEDGER_HELD_DLQ,
    RECORD_DEAD_LETTER,
    RESOLVED_FAILED_DLQ,
)
from infrai_jobs.ledger.postgres import array_literal, ledger_errors, record_history, storable_json
from infrai_jobs.work import statements as sql
from infrai_jobs.work.states import ClaimRow, new_token

# Who a drain's own changes are recorded as in claim_history.
DRAIN_ACTOR: Final = "drain"
# What the dead letter of failed work the ledger held cannot tell: it never was in a queue.
_NOT_KNOWN_OF_HELD: Final = (
    "raw_text", "size_bytes", "main_deliveries", "dlq_deliveries", "published_at"
)  # fmt: skip


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


def claim_rows(
    conn: psycopg.Connection[Any],
    statement: LiteralString,
    params: dict[str, Any],
    *,
    visibility: float | None,
) -> list[ClaimRow]:
    """Whole claims a statement of ``work.statements`` returns, their leases judged by it: a
    lease-less row's by ``visibility``, the queue's timeout (None where the caller holds or has
    just written every row it gets back, and a lease-less one is left unjudged)."""
    with conn.cursor(row_factory=class_row(ClaimRow)) as cur:
        return cur.execute(statement, {**params, "visibility": visibility}).fetchall()


def claim_of(
    conn: psycopg.Connection[Any], key: str, *, lock: bool = False, visibility: float | None
) -> ClaimRow | None:
    statement = sql.CLAIM_BY_KEY_FOR_UPDATE if lock else sql.CLAIM_BY_KEY
    found = claim_rows(conn, statement, {"key": key}, visibility=visibility)
    return found[0] if found else None


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
    ``error``: the claim ``claim_token`` holds, or without it a new row for a key no row holds
    (a dead letter taken back). Either way the ledger owns the work from here, and its message
    may be acked."""
    params = {name: getattr(work, name) for name in DeferredWork.__dataclass_fields__}
    params |= {"payload": Jsonb(dict(work.payload)), "attempts": max(attempts, 0), "error": error}
    params |= {"delay": max(float(delay_seconds), 0.0), "token": claim_token}
    with ledger_errors("cannot defer a job"), conn.transaction():
        if claim_token is None:
            row = claim_rows(conn, sql.DEFER_NEW, params, visibility=None)
            return DeferOutcome.DEFERRED if row else DeferOutcome.ALREADY_HELD
        row = claim_rows(conn, sql.DEFER, params, visibility=None)
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
    tokens = array_literal(new_token() for _ in range(max(limit, 0)))
    of_jobs = None if jobs is None else array_literal(jobs)
    params = {"tokens": tokens, "lease": float(lease_seconds), "jobs": of_jobs}
    with ledger_errors("cannot take deferred jobs"), conn.transaction():
        rows = claim_rows(conn, sql.TAKE_DUE, params, visibility=None)
    return sorted(rows, key=lambda job: (job.run_after, job.deferred_at, job.idem_key))


def _fenced(
    conn: psycopg.Connection[Any], statement: LiteralString, doing: str, **params: Any
) -> bool:
    with ledger_errors(doing), conn.transaction():
        return conn.execute(statement, params).rowcount == 1


def begin(conn: psycopg.Connection[Any], key: str, token: uuid.UUID) -> bool:
    """The taken run holding ``token`` is about to call its handler: from here an ``external``
    run whose lease runs out is never taken again. False when the token no longer holds it."""
    return _fenced(conn, sql.BEGIN_RUN, "cannot begin a deferred run", key=key, token=token)


def flag_uncertain(conn: psycopg.Connection[Any], key: str, token: uuid.UUID, error: str) -> bool:
    """The run holding ``token`` does not know whether its effect happened: flagged for a
    human, its lease ended, never taken again."""
    doing = "cannot flag a deferred run"
    statement = sql.freeing_slots(sql.MARK_UNCERTAIN)
    return _fenced(conn, statement, doing, keys=[key], tokens=[token], values=[error])


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
    params = {"key": key, "token": token, "error": error, "delay": max(float(delay_seconds), 0.0)}
    return _fenced(conn, sql.POSTPONE, "cannot postpone a deferred job", ran=ran, **params)


def finish(
    conn: psycopg.Connection[Any], key: str, token: uuid.UUID, result: Any
) -> ClaimRow | None:
    """The run holding ``token`` settles ``done``, whatever its lease; None when the token no
    longer holds it."""
    values = {"token": token, "state": "done", "result": result, "error": None}
    return _settle(conn, key, sql.SETTLE_AS_HOLDER, values, Why("deferred_done"), visibility=None)


def fail(
    conn: psycopg.Connection[Any],
    key: str,
    token: uuid.UUID,
    error: str,
    *,
    queue: str | None = None,
) -> ClaimRow | None:
    """The run holding ``token`` fails for good (out of attempts, or a final error), whatever its
    lease. Failed work the ledger owns also gets a dead letter (its message was acked long ago)
    under its queue (``queue`` when the work recorded none)."""
    values = {"token": token, "state": "failed", "result": None, "error": error}
    why = Why("deferred_failed")
    return _settle(conn, key, sql.SETTLE_AS_HOLDER, values, why, queue=queue, visibility=None)


@dataclass(frozen=True, slots=True)
class Why:
    """Who changes a row, recorded in ``claim_history`` with the change."""

    action: str
    actor: str = DRAIN_ACTOR
    note: str = ""


def settle_as_other(
    conn: psycopg.Connection[Any],
    read: ClaimRow,
    state: str,
    why: Why,
    *,
    result: Any = None,
    error: str | None = None,
    visibility: float,
) -> ClaimRow | None:
    """A probe or an operator settles the run that held ``read`` when they read it (its token
    None on a row the notes' worker wrote), only once its lease is over; None when nothing
    changed."""
    values = {"token": read.claim_token, "state": state, "result": storable_json(result)}
    values["error"] = error
    return _settle(conn, read.idem_key, sql.SETTLE_AS_OTHER, values, why, visibility=visibility)


def _settle(
    conn: psycopg.Connection[Any],
    key: str,
    statement: LiteralString,
    values: dict[str, Any],
    why: Why,
    *,
    queue: str | None = None,
    visibility: float | None,
) -> ClaimRow | None:
    state = values["state"]
    params = {**values, "key": key, "result": Jsonb(values["result"]) if state == "done" else None}
    params["error"] = values["error"] if state == "failed" else None
    with ledger_errors(f"cannot settle {key!r}"), conn.transaction():
        before = claim_of(conn, key, lock=True, visibility=visibility)
        after = claim_rows(conn, statement, params, visibility=visibility)
        if before is None or not after:
            return None
        work = after[0]
        if state == "failed" and work.owned:
            # Its message was acked long ago: the ledger holds its dead letter. A redrive
            # publishes it again and reopens the claim, unless a human failed it (only
            # ``--reopen-failed`` does then).
            letter: dict[str, Any] = dict.fromkeys(_NOT_KNOWN_OF_HELD)
            letter.update(message_id=work.message_id, queue=work.queue or queue or "")
            letter.update(dlq=LEDGER_HELD_DLQ if why.actor == DRAIN_ACTOR else RESOLVED_FAILED_DLQ)
            letter.update(job=work.job or "", payload=Jsonb(work.payload), idem_key=key)
            reason = f"deferred job failed after {work.attempts} attempt(s): {values['error']}"
            letter.update(unreadable=False, reason=reason, state="failed", claim_state="failed")
            conn.execute(RECORD_DEAD_LETTER, letter)
        record_change(conn, why, before, work)
    return work


def release(
    conn: psycopg.Connection[Any], read: ClaimRow, why: Why, *, visibility: float
) -> ClaimRow | None:
    """A run whose effect did not happen (a probe's ``not_done``, ``claims release``), or a
    failed claim to run again: work the ledger owns waits again, due now; any other claim is
    deleted, so the next delivery (or a redrive) runs it. Only the row as ``read`` (its token),
    a running one only once its lease is over. Returns the row as it was, or None."""
    key, params = read.idem_key, {"key": read.idem_key, "token": read.claim_token}
    with ledger_errors(f"cannot release {key!r}"), conn.transaction():
        before = claim_of(conn, key, lock=True, visibility=visibility)
        if before is None:
            return None
        waits_again = before.owned and before.state == "running"
        statement = sql.RELEASE_OWNED if waits_again else sql.RELEASE_CLAIM
        after = claim_rows(conn, statement, params, visibility=visibility)
        if not after:
            return None
        record_change(conn, why, before, after[0] if waits_again else None)
    return before


def release_for_take_back(
    conn: psycopg.Connection[Any], claim: ClaimRow, *, visibility: float
) -> bool:
    """A dead letter of a key-passing job is taken back: its own claim, if the takeover rule
    allows it, is released in the caller's transaction so the work can be deferred."""
    params = {"key": claim.idem_key, "token": claim.claim_token, "visibility": visibility}
    return conn.execute(sql.RELEASE_FOR_TAKE_BACK, params).rowcount == 1


def deferred_stats(conn: psycopg.Connection[Any]) -> DeferredStats:
    with ledger_errors("cannot read deferred jobs"):
        backlog, oldest = conn.execute(sql.DEFERRED_STATS).fetchone() or (0, 0.0)
    return DeferredStats(int(backlog), float(oldest))


def record_change(
    conn: psycopg.Connection[Any], why: Why, before: ClaimRow, after: ClaimRow | None
) -> None:
    """A change to a unit of work in ``claim_history``: the row before and after (None: gone)."""
    rows = {"before": before.as_dict(), "after": None if after is None else after.as_dict()}
    record_history(conn, before.idem_key, why.action, actor=why.actor, note=why.note, **rows)
