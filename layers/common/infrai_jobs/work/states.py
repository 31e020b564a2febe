"""The work's states, pure: the row type, the one state machine as data, the one token source,
what a claim attempt means, and how a handler's run settles its claim. The Postgres ledger and the
in-memory fake (``tests/fakes.py``) both decide by these functions; the rules the statements apply
themselves are ``work.statements``', and the ledger contract suite (tests/contract) holds the
fake's copy to them."""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any, Final

from infrai_jobs.jobs.registry import Effect, JsonValue


class ClaimStatus(StrEnum):
    WON = "won"  # this delivery holds the claim and should run the job
    DONE = "done"  # the work already succeeded
    FAILED = "failed"  # the work failed permanently earlier
    LIVE = "live"  # another delivery holds an unexpired claim
    STUCK = "stuck"  # an irreversible effect's outcome is unknown: a human decides
    CONFLICT = "conflict"  # same key, different work
    DEFERRED = "deferred"  # the ledger owns this work (waiting or running): a copy to ack


def new_token() -> uuid.UUID:
    """The one source of claim tokens: a delivery's claim and a drain's take of due work."""
    return uuid.uuid4()


@dataclass(frozen=True, slots=True)
class ClaimRequest:
    idem_key: str
    message_id: str
    job: str
    effect: Effect
    fingerprint: str
    # How long the claim is held, from the claim statement on the database's clock; None for
    # database jobs (their claim is never committed).
    lease_seconds: float | None = None
    # Seconds from when the request is built until the queue may deliver this message again;
    # the stored lease ends no later. None: the whole visibility timeout.
    visibility_left: float | None = None
    claim_token: uuid.UUID = field(default_factory=new_token)


@dataclass(frozen=True, slots=True)
class ClaimDecision:
    request: ClaimRequest
    status: ClaimStatus
    detail: str = ""
    result: JsonValue = None
    # WON by taking over an expired external_idempotent claim (not a first claim).
    takeover: bool = False
    # The message that held the claim when this attempt was decided (None: no claim stood).
    holder: str | None = None
    # Seconds from its claim to this delivery, when this message came back while its own
    # claim's lease was live (the queue hid it for less time than the drain was told).
    redelivered_early_after: float | None = None


class RunKind(StrEnum):
    SUCCEEDED = "succeeded"
    PERMANENT = "permanent"  # PermanentJobError: mark failed
    UNCERTAIN = "uncertain"  # EffectUncertain: leave running, flag stuck
    TRANSIENT = "transient"  # anything else: release the claim for a retry
    DEFERRED = "deferred"  # flow control made the claim deferred work: nothing left to settle


@dataclass(frozen=True, slots=True)
class JobRun:
    """What happened when a handler ran; built by the drain, settled by the ledger."""

    kind: RunKind
    result: JsonValue = None
    error: str = ""
    held_slot: bool = False  # a concurrency slot (flow.limits), which its settle frees
    exception: BaseException | None = field(default=None, compare=False)  # logged, never stored


class SettleStatus(StrEnum):
    DONE = "done"
    FAILED = "failed"
    RELEASED = "released"
    STUCK = "stuck"
    LOST = "lost"  # the fenced update matched nothing: someone else owns the row now
    DEFERRED = "deferred"  # the claim waits as deferred work, owned by the ledger


@dataclass(frozen=True, slots=True)
class Settlement:
    request: ClaimRequest
    status: SettleStatus
    run: JobRun


@dataclass(frozen=True, slots=True)
class ClaimRow:
    """A row of ``job_claims``: the one unit of work the ledger owns (see ``WORK_STATES``)."""

    idem_key: str
    state: str
    message_id: str
    job: str | None
    effect: str | None
    attempts: int | None
    payload_sha256: str | None
    error: str | None
    result: JsonValue
    claimed_at: datetime
    lease_until: datetime | None
    updated_at: datetime | None
    claim_token: uuid.UUID | None
    # Set once the ledger took the work over (a deferral) and its message was acked.
    payload: Any = None
    queue: str | None = None
    run_after: datetime | None = None
    deferred_at: datetime | None = None
    last_error: str | None = None
    began_at: datetime | None = None
    # Read by the database's rule (``work.statements.lease_end``), never by a Python clock:
    # when the lease ends (a lease-less row's implied end), and whether a run holds it now.
    lease_end: datetime | None = field(default=None, compare=False)
    lease_live: bool | None = field(default=None, compare=False)

    @property
    def owned(self) -> bool:
        """The ledger owns this work: only ``take_due`` runs it, not a copy of its message."""
        return self.run_after is not None

    def as_dict(self) -> dict[str, Any]:
        """The row as JSON-ready values, for ``--json`` output and the history table."""
        out: dict[str, Any] = {
            name: getattr(self, name) for name in self.__dataclass_fields__ if name not in _READ_AT
        }
        for name, value in out.items():
            if isinstance(value, datetime):
                out[name] = value.isoformat()
            elif isinstance(value, uuid.UUID):
                out[name] = str(value)
        json.dumps(out)  # fail here, not in a caller's output, if a value is not JSON
        return out


# Fields read with the row at one moment, not the row's own.
_READ_AT: Final = ("lease_end", "lease_live")


# --- The one state machine ---------------------------------------------------------------------
# docs/design.md's "One state machine" shows this table (a test keeps the two equal).

WORK_STATES: Final = ("running", "deferred", "done", "failed", "cancelled")


@dataclass(frozen=True, slots=True)
class Transition:
    action: str  # what it is called (the command that makes it, where an operator does)
    source: str  # the state it starts from; "(none)" for no row
    target: str  # the state it leaves; "(none)" for a deleted row
    who: str  # who may make it
    fence: str  # what must still hold, in the same statement
    method: str  # what makes it: ``PostgresLedger.x`` (work.ledger), ``store.x`` or ``WorkStore.x``


_HOLDER = "the run holding the token"
_LIVE = "token; any lease"
_OVER = "token as read; lease over"
_LEDGER = "PostgresLedger."
WORK_TRANSITIONS: Final = (
    Transition("claim", "(none)", "running", "a delivery", "no row for the key", _LEDGER + "claim"),
    Transition("claim (new work)", "cancelled", "running", "a delivery", "none: it is free",
               _LEDGER + "claim"),
    Transition("claim (takeover)", "running", "running", "a delivery of a key-passing job",
               "same work, not ledger-owned, the takeover rule", _LEDGER + "claim"),
    Transition("flag stuck", "running", "running", "a delivery that cannot run its copy",
               "not flagged yet", _LEDGER + "flag_stuck"),
    Transition("settle done", "running", "done", _HOLDER, _LIVE, _LEDGER + "settle"),
    Transition("settle failed", "running", "failed", _HOLDER, _LIVE, _LEDGER + "settle"),
    Transition("release (transient)", "running", "(none)", _HOLDER, _LIVE, _LEDGER + "settle"),
    Transition("flag uncertain", "running", "running", _HOLDER, "token; the lease ends now",
               _LEDGER + "settle"),
    Transition("defer", "running", "deferred", _HOLDER, _LIVE, "store.defer"),
    Transition("take back a dead letter", "(none)", "deferred", "`dlq`, `redrive`",
               "no row for the key", "store.defer"),
    Transition("take back a dead letter (takeover)", "running", "(none)", "`dlq`, `redrive`",
               "token as read; a key-passing job's claim; the takeover rule",
               "store.release_for_take_back"),
    Transition("take due", "deferred", "running", "a drain", "run_after passed; row unlocked",
               "store.take_due"),
    Transition("take due (takeover)", "running", "running", "a drain",
               "ledger-owned, row unlocked, the takeover rule", "store.take_due"),
    Transition("begin", "running", "running", _HOLDER, _LIVE, "store.begin"),
    Transition("flag uncertain (deferred run)", "running", "running", _HOLDER,
               "token; the lease ends now", "store.flag_uncertain"),
    Transition("postpone", "running", "deferred", _HOLDER, _LIVE, "store.postpone"),
    Transition("finish", "running", "done", _HOLDER, _LIVE, "store.finish"),
    Transition("fail (and hold a dead letter)", "running", "failed", _HOLDER, _LIVE, "store.fail"),
    Transition("reconcile done", "running", "done", "a probe", _OVER,
               "WorkStore.apply_probe_answer"),
    Transition("claims resolve --done", "running", "done", "an operator", _OVER,
               "WorkStore.resolve"),
    Transition("claims resolve --failed", "running", "failed", "an operator", _OVER,
               "WorkStore.resolve"),
    Transition("reconcile not done", "running", "(none)", "a probe",
               _OVER + "; a delivery's claim", "WorkStore.apply_probe_answer"),
    Transition("reconcile not done", "running", "deferred", "a probe", _OVER + "; ledger-owned",
               "WorkStore.apply_probe_answer"),
    Transition("claims release", "running", "(none)", "an operator",
               _OVER + "; a delivery's claim", "WorkStore.release"),
    Transition("claims release", "running", "deferred", "an operator", _OVER + "; ledger-owned",
               "WorkStore.release"),
    Transition("claims release", "failed", "(none)", "an operator", "token as read",
               "WorkStore.release"),
    Transition("redrive --reopen-failed", "failed", "(none)", "a redrive", "state as read",
               "WorkStore.reopen_failed"),
    Transition("claims run-now", "deferred", "deferred", "an operator", "state (due now)",
               "WorkStore.run_now"),
    Transition("claims cancel", "deferred", "cancelled", "an operator", "state",
               "WorkStore.cancel"),
    Transition("prune", "done, failed, cancelled", "(none)", "the prune function",
               "older than the retention", "WorkStore.prune"),
)  # fmt: skip


# How a handler's run settles its claim (a fenced update that matches nothing is LOST instead).
SETTLE_STATUS: Final = {
    RunKind.SUCCEEDED: SettleStatus.DONE,
    RunKind.PERMANENT: SettleStatus.FAILED,
    RunKind.UNCERTAIN: SettleStatus.STUCK,
    RunKind.TRANSIENT: SettleStatus.RELEASED,
    RunKind.DEFERRED: SettleStatus.DEFERRED,
}


def settled_kind(kind: RunKind, uncertain_is_stuck: bool) -> RunKind:
    """A database job's effect rolled back with its savepoint: nothing is uncertain, so its
    claim is released for a retry."""
    return RunKind.TRANSIENT if kind is RunKind.UNCERTAIN and not uncertain_is_stuck else kind


def decide(request: ClaimRequest, row: Mapping[str, Any]) -> ClaimDecision:
    """Classify one claim attempt from the claim statement's answer (or the fake's copy of it):
    ``won_token``/``won_attempts`` when this request won, and the row as it stood before the
    statement (``state`` is None when there was none)."""
    attempts = row.get("won_attempts") or 1
    if row["won_token"] is None:
        status, detail = _not_won(request, row)
    else:
        status = ClaimStatus.WON
        detail = f"took over an expired claim (attempt {attempts})" if attempts > 1 else ""
    holder = early = None
    if row["state"] is not None:
        holder = row["message_id"]
        own = holder == request.message_id
        if own and row["state"] == "running" and not row["lease_expired"] and not row.get("owned"):
            early = float(row.get("held_seconds") or 0.0)
    result = row["result"] if status is ClaimStatus.DONE else None
    takeover = status is ClaimStatus.WON and attempts > 1
    return ClaimDecision(request, status, detail, result, takeover, holder, early)


def _not_won(request: ClaimRequest, row: Mapping[str, Any]) -> tuple[ClaimStatus, str]:
    state = row["state"]
    if state is None:
        # The row vanished between the claim and the re-read: its holder released it after a
        # failed attempt. The holder's message is unacked and carries the retry, exactly as for
        # a live claim, so this copy is treated (and acked) like one.
        return ClaimStatus.LIVE, "claim released concurrently"
    stored = row["payload_sha256"]
    if stored is not None and stored != request.fingerprint:
        return ClaimStatus.CONFLICT, (
            f"key {request.idem_key} already claimed for different work "
            f"(fingerprint {stored[:12]}..., this message {request.fingerprint[:12]}...)"
        )
    if state == "done":
        return ClaimStatus.DONE, ""
    if state == "failed":
        return ClaimStatus.FAILED, row["error"] or "failed earlier"
    if state == "deferred" or row.get("owned"):
        return ClaimStatus.DEFERRED, f"a copy of work the ledger holds ({state})"
    # Running: flagged for a human, held by someone, or abandoned.
    if row["error"]:
        return ClaimStatus.STUCK, f"claim is flagged for a human: {row['error']}"
    if row["message_id"] == request.message_id:
        return ClaimStatus.STUCK, (
            "redelivered while its own claim is still running: the earlier attempt died "
            "after claiming, and the effect may have happened"
        )
    if row["lease_expired"]:
        return ClaimStatus.STUCK, "claim lease expired while running: the effect may have happened"
    return ClaimStatus.LIVE, "another delivery holds a live claim"
