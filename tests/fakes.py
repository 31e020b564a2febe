"""In-memory fakes of the layer's ports, for the framework's unit tests: they live with the tests,
never in the layer (which ships only what the functions import) nor in the package a team
installs.

``InMemoryQueue`` stands in for Infrai's queue (``QueuePort``) and ``InMemoryLedger`` for the
Postgres claim ledger (``LedgerPort``); both run on a ``FakeClock`` that tests move by hand, so
a visibility timeout or an expired lease costs no waiting. No sockets, no threads of their own;
every method takes a lock, so several lanes (threads) may share one.

    clock = FakeClock()
    queue = InMemoryQueue(clock)
    queue.ensure_queue("billing-jobs", dlq="billing-jobs-dlq")
    ledger = InMemoryLedger(clock)
    drain(queue, ledger, registry, DrainConfig(queue="billing-jobs"), lambda: 60_000, clock=clock)

Pass the same clock to ``drain(..., clock=clock)``: the drain computes claim leases from it.

The queue is the emulator's own model (``infrai_local.sandbox.queue_model``). The ledger classifies
claims with the very function ``PostgresLedger`` uses (``ledger.claims.decide``) and copies in
Python what the ledger says in SQL (the takeover rule, the lease bound, fencing, release, batch
atomicity), including what Postgres refuses to store. The ledger contract suite
(tests/contract/test_ledger_contract.py) runs the same claim scenarios against this fake and
against ``PostgresLedger`` on a real server; where they disagree, the SQL is right.
Differences that remain are listed on each class.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import TYPE_CHECKING, Any, Final, Literal, Protocol, TypeVar, Unpack

import psycopg

from infrai_jobs.errors import (
    FanOutError,
    FanOutThrottled,
    InfraiError,
    InfraiUnavailable,
    LedgerError,
    LedgerUnavailable,
    QueueMessageNotFound,
)
from infrai_jobs.jobs.registry import Effect, JsonValue
from infrai_jobs.queue.models import Pending, PublishPrice, QueueMessage, QueueStats
from infrai_jobs.queue_contract import (
    CONSUME_CAP,
    DEFAULT_VISIBILITY_TIMEOUT_SECONDS,
)
from infrai_jobs.work import states
from infrai_jobs.work.ledger import DatabaseRunner
from infrai_local.sandbox.queue_model import (
    DEFAULT_PUBLISH_PRICE_USD,
    ApiError,
    QueueModel,
    counted_message_id,
    invalid,
)

if TYPE_CHECKING:
    from infrai_jobs.drain.ports import DrainFleetPort, DrainStarterPort
    from infrai_jobs.queue.ports import PublishOptions, QueuePort
    from infrai_jobs.work.ports import LedgerPort

__all__ = [
    "FakeClock",
    "InMemoryDrainFleet",
    "InMemoryLedger",
    "InMemoryQueue",
    "LedgerCall",
    "RecordingDrainStarter",
]

PUBLISH_PRICE_USD: Final = Decimal(DEFAULT_PUBLISH_PRICE_USD)
# 2026-07-26T00:00:00Z, the day of the field notes: a fixed start keeps test output stable.
FAKE_EPOCH: Final = 1_785_024_000.0

_QUEUE_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,79}")
_BASE62: Final = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_CLAIM_STATES: Final = frozenset(states.WORK_STATES)


class Clock(Protocol):
    """Wall-clock seconds since the epoch; a fake moves by hand in tests."""

    def now(self) -> float: ...


class FakeClock:
    """Epoch seconds that move only when a test says so.

    Satisfies ``Clock`` (``now()``) and is itself callable, so it can be passed wherever a
    ``Callable[[], float]`` clock is expected, such as ``drain(..., clock=...)``.
    """

    def __init__(self, start: float = FAKE_EPOCH) -> None:
        self._now = float(start)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"FakeClock({self.now()!r})"

    def now(self) -> float:
        with self._lock:
            return self._now

    def __call__(self) -> float:
        return self.now()

    def utcnow(self) -> datetime:
        return datetime.fromtimestamp(self.now(), tz=UTC)

    def advance(self, seconds: float) -> float:
        """Move forward (never back, like the emulator's clock); answers the new time."""
        if not math.isfinite(seconds) or seconds < 0:
            raise ValueError("a fake clock only moves forward by a finite number of seconds")
        with self._lock:
            self._now += seconds
            return self._now


# --- The queue --------------------------------------------------------------------------------


class InMemoryQueue:
    """Infrai's queue in memory, no HTTP: the emulator's own model
    (``infrai_local.sandbox.queue_model``) behind the ``QueuePort`` the drain uses, so the two
    cannot drift apart (the contract suite, tests/contract, runs the same scenarios against both).

    Differences from the emulator: ids count up (``qmsg_0000...1``) instead of being random, so
    test output is stable; the clock is a ``FakeClock``; ``retry`` on publish is accepted and
    ignored (there is no transport to retry); ``publish_raw`` can hand out payloads that are not
    objects, which the emulator's publish refuses but a consumer must survive anyway; and two
    knobs lose or fail acks. Errors are what ``InfraiClient`` raises (codes, not HTTP),
    including its ``ValueError`` for a ``max_messages`` below 1 and for a body JSON cannot carry.
    """

    def __init__(
        self,
        clock: Clock | None = None,
        *,
        visibility_timeout: float = DEFAULT_VISIBILITY_TIMEOUT_SECONDS,
        publish_price_usd: Decimal = PUBLISH_PRICE_USD,
    ) -> None:
        self.clock: Clock = clock if clock is not None else FakeClock()
        ids = itertools.count(1)
        self._model = QueueModel(
            visibility_timeout=visibility_timeout,
            monotonic=self.clock.now,
            wall=self.clock.now,
            new_id=lambda: counted_message_id(next(ids)),
        )
        self.visibility_timeout = self._model.visibility_timeout
        self._price = publish_price_usd
        self._lock = threading.Lock()
        self._acked: list[str] = []
        self._lost_ack_answers = 0
        self._failing_acks = 0

    def __repr__(self) -> str:
        return f"InMemoryQueue(queues={self._model.names()!r})"

    # --- QueuePort ----------------------------------------------------------------------------

    def ensure_queue(self, name: str, *, dlq: str | None = None, type_: str = "standard") -> bool:
        """Create ``name`` (and its DLQ, unless it exists); False when ``name`` already existed."""
        try:
            self._model.create(name, type_, dlq)
        except ApiError as error:
            if error.code == "QUEUE_ALREADY_EXISTS":
                return False
            raise _client_error(error, "create") from None
        return True

    def publish(
        self, queue: str, body: Mapping[str, Any], **options: Unpack[PublishOptions]
    ) -> str:
        if not isinstance(body, Mapping):
            raise _client_error(invalid("body must be a JSON object"), "publish")
        return self.publish_raw(queue, dict(body), delay_seconds=options.get("delay_seconds"))

    def publish_raw(
        self, queue: str, payload: JsonValue, *, delay_seconds: int | None = None
    ) -> str:
        """Publish any JSON value as a payload, to test how consumers treat odd bodies."""
        # Like the HTTP client, a body JSON cannot carry fails before anything is sent.
        json.dumps(payload, allow_nan=False)
        try:
            return self._model.publish(
                queue, payload, 0 if delay_seconds is None else delay_seconds
            )
        except ApiError as error:
            raise _client_error(error, "publish") from None

    def consume(self, queue: str, max_messages: int = CONSUME_CAP) -> list[QueueMessage]:
        if isinstance(max_messages, bool) or not isinstance(max_messages, int) or max_messages < 1:
            raise ValueError(f"max_messages must be an integer >= 1, got {max_messages!r}")
        try:
            items = self._model.consume(queue, max_messages)
        except ApiError as error:
            raise _client_error(error, "consume") from None
        return [QueueMessage.from_api(item, queue=queue) for item in items]

    def send_consume(
        self, queue: str, max_messages: int = CONSUME_CAP
    ) -> Pending[list[QueueMessage]]:
        return _settled(lambda: self.consume(queue, max_messages))

    def send_ack(self, queue: str, receipt_handle: str) -> Pending[None]:
        return _settled(lambda: self.ack(queue, receipt_handle))

    def ack(self, queue: str, receipt_handle: str) -> None:
        with self._lock:
            if self._failing_acks > 0:
                self._model.stats(queue)  # an unknown queue is still QUEUE_NOT_FOUND
                self._failing_acks -= 1
                raise InfraiUnavailable(
                    "INTERNAL", "injected fault: ack not applied", 500, call="ack"
                )
            try:
                acked = self._model.ack(queue, receipt_handle)
            except ApiError as error:
                raise _client_error(error, "ack") from None
            self._acked.append(acked["message_id"])
            if self._lost_ack_answers > 0:
                self._lost_ack_answers -= 1
                # What the client reports when the answer was dropped and its retry found the
                # message gone.
                raise QueueMessageNotFound(
                    "QUEUE_MESSAGE_NOT_FOUND",
                    "injected fault: the ack was applied, its answer lost, and the retry found "
                    "the message gone",
                    404,
                    call="ack",
                )

    def stats(self, queue: str) -> QueueStats:
        try:
            return QueueStats.from_api(self._model.stats(queue), queue=queue)
        except ApiError as error:
            raise _client_error(error, "stats") from None

    def publish_price(self) -> PublishPrice:
        price = format(self._price, "f")
        billing = {
            "unit": "message",
            "price_usd": price,
            "currency": "USD",
            "free": False,
            "rate_limited": False,
        }
        return PublishPrice(Decimal(price), billing)

    # --- test knobs and inspection ----------------------------------------------------------

    def lose_ack_answers(self, times: int = 1) -> None:
        """The next ``times`` acks are applied, then raise ``QueueMessageNotFound``.

        That is what the HTTP client reports when an ack's answer is dropped on the way back
        and its retry finds the message already gone: the drain's ``ack_lost``.
        """
        with self._lock:
            self._lost_ack_answers = times

    def fail_acks(self, times: int = 1) -> None:
        """The next ``times`` acks are not applied and raise ``InfraiUnavailable`` (5xx)."""
        with self._lock:
            self._failing_acks = times

    @property
    def acked(self) -> list[str]:
        """Ids of the messages acks removed, in order (including those whose answer was lost)."""
        with self._lock:
            return list(self._acked)


T = TypeVar("T")


def _settled(call: Callable[[], T]) -> Pending[T]:
    """Make the call now (an in-memory queue has nothing to wait for); ``wait()`` gives back its
    result or raises its error."""
    try:
        result = call()
    except Exception as exc:
        error = exc
    else:
        return Pending(lambda: result)

    def fail() -> T:
        raise error

    return Pending(fail)


def _client_error(error: ApiError, call: str) -> InfraiError:
    """The model's error as ``InfraiClient`` raises it."""
    if error.code == "QUEUE_MESSAGE_NOT_FOUND":
        return QueueMessageNotFound(error.code, error.message, error.status, call=call)
    return InfraiError(error.code, error.message, error.status, call=call)


# --- The ledger -------------------------------------------------------------------------------

LedgerCall = Literal[
    "claim", "run_database_batch", "settle", "flag_stuck", "ping", "consume_isolation"
]


@dataclass(frozen=True, slots=True)
class _InjectedFailure:
    call: LedgerCall
    times: int


# The columns a ClaimRow needs that seed() leaves NULL unless told.
_REQUIRED_COLUMNS: Final = (
    "job",
    "effect",
    "payload_sha256",
    "error",
    "result",
    "lease_until",
    "updated_at",
    "claim_token",
)


class InMemoryLedger:
    """``job_claims`` in a dict, with ``PostgresLedger``'s semantics.

    * ``claim`` commits at once: a new key is won ``running``; an ``external_idempotent`` claim
      still running for the same work and not flagged for a human (``error`` unset) is taken
      over (``attempts`` + 1) once its lease expired or when the claimant is the holder's own
      message; anything else is decided by the same ``claims.decide`` rules (done, failed, live,
      stuck, conflict).
    * ``flag_stuck`` writes a reason only on a running claim without one; an uncertain external
      settle records its error and ends the claim's lease now.
    * ``run_database_batch`` claims, runs each won job with ``runner(request, None)`` and settles
      as one transaction: nothing of it survives an exception. An uncertain database job is
      released, as its effect rolled back with its savepoint.
    * Every settle is fenced by the claim token and the ``running`` state; a mismatch is
      ``SettleStatus.LOST``.
    * What Postgres refuses, this refuses the same way: a result holding ``\\u0000`` or an
      unpaired surrogate (jsonb) or an error text holding NUL raises ``LedgerError``; an error
      text that is not valid Unicode raises ``UnicodeEncodeError``, as psycopg does.

    Differences: handlers of database jobs get ``ctx.db = None`` and their own side effects are
    not rolled back; ``now()`` is the clock at each call rather than a transaction's start; and
    concurrent callers are serialised by one lock instead of row locks.
    """

    def __init__(
        self,
        clock: Clock | None = None,
        *,
        visibility_timeout: int = DEFAULT_VISIBILITY_TIMEOUT_SECONDS,
    ) -> None:
        self.clock: Clock = clock if clock is not None else FakeClock()
        self.visibility_timeout = visibility_timeout
        self._rows: dict[str, states.ClaimRow] = {}
        # Re-entrant: a handler run inside run_database_batch may inspect or change rows.
        self._lock = threading.RLock()
        self._failures: list[_InjectedFailure] = []
        self._calls: Counter[str] = Counter()
        # Per queue: when its one-message-at-a-time window ends (clock seconds).
        self._single_until: dict[str, float] = {}

    def __repr__(self) -> str:
        return f"InMemoryLedger(rows={len(self._rows)})"

    # --- LedgerPort ---------------------------------------------------------------------------

    def claim(self, requests: Sequence[states.ClaimRequest]) -> list[states.ClaimDecision]:
        if not requests:
            return []
        with self._lock:
            self._enter("claim")
            return self._claim(requests, self._now())

    def run_database_batch(
        self, requests: Sequence[states.ClaimRequest], runner: DatabaseRunner
    ) -> tuple[list[states.ClaimDecision], list[states.Settlement]]:
        if not requests:
            return [], []
        with self._lock:
            self._enter("run_database_batch")
            before = dict(self._rows)
            try:
                now = self._now()
                decisions = self._claim(requests, now)
                runs = [
                    (decision.request, runner(decision.request, None))
                    for decision in decisions
                    if decision.status is states.ClaimStatus.WON
                ]
                settlements = self._settle(runs, now, uncertain_is_stuck=False)
            except BaseException:
                self._rows = before
                raise
            return decisions, settlements

    def settle(self, request: states.ClaimRequest, run: states.JobRun) -> states.Settlement:
        with self._lock:
            self._enter("settle")
            (settlement,) = self._settle([(request, run)], self._now(), uncertain_is_stuck=True)
            return settlement

    def ping(self) -> None:
        with self._lock:
            self._enter("ping")

    def consume_isolation(self, queue: str) -> float:
        with self._lock:
            self._enter("consume_isolation")
            return max(self._single_until.get(queue, 0.0) - self.clock.now(), 0.0)

    def isolate_consumes(self, queue: str, seconds: float, reason: str) -> float:
        with self._lock:
            self._enter("consume_isolation")
            now = self.clock.now()
            until = max(self._single_until.get(queue, 0.0), now + seconds)
            self._single_until[queue] = until
            return until - now

    def connection(self) -> psycopg.Connection[Any]:
        raise LedgerUnavailable(
            "the in-memory ledger has no database: flow control's limits need PostgreSQL"
        )

    def flag_stuck(self, reasons: dict[str, str]) -> None:
        if not reasons:
            return
        with self._lock:
            self._enter("flag_stuck")
            for reason in reasons.values():
                _check_text(reason)
            now = self._now()
            for key, reason in reasons.items():
                row = self._rows.get(key)
                # The first reason stands: it says what went wrong, later copies only repeat it.
                if row is not None and row.state == "running" and row.error is None:
                    self._rows[key] = replace(row, error=reason, updated_at=now)

    # --- inspection and set-up ----------------------------------------------------------------

    def get(self, idem_key: str) -> states.ClaimRow | None:
        with self._lock:
            return self._rows.get(idem_key)

    @property
    def rows(self) -> dict[str, states.ClaimRow]:
        """A copy of every row by key (rows are frozen, so the copy is a snapshot)."""
        with self._lock:
            return dict(self._rows)

    @property
    def calls(self) -> Counter[str]:
        """How often each port method reached the ledger (a round trip each in Postgres)."""
        with self._lock:
            return Counter(self._calls)

    def seed(self, idem_key: str, **columns: Any) -> states.ClaimRow:
        """Write a row as another worker, an operator or the notes' SQL would have left it.

        Replaces any row under the key. ``columns`` are ``ClaimRow``'s fields (``fingerprint``
        for ``payload_sha256``); an unset one is what the table defaults to, so
        ``seed(key, state="running", message_id=...)`` is exactly the notes' own INSERT.
        ``run_after`` (with its ``payload``) makes it work the ledger owns: deferred.
        """
        if "fingerprint" in columns:
            columns["payload_sha256"] = columns.pop("fingerprint")
        if columns.get("effect") is not None:
            columns["effect"] = str(columns["effect"])
        state = columns.setdefault("state", "running")
        if state not in _CLAIM_STATES:
            raise ValueError(f"state must be one of {sorted(_CLAIM_STATES)}, not {state!r}")
        with self._lock:
            defaults: dict[str, Any] = dict.fromkeys(_REQUIRED_COLUMNS)
            defaults |= {"message_id": "qmsg_seeded", "attempts": 1, "claimed_at": self._now()}
            if columns.get("run_after") is not None:
                defaults["deferred_at"] = self._now()
            row = states.ClaimRow(idem_key=idem_key, **(defaults | columns))
            self._rows[idem_key] = row
            return row

    def reassign(self, idem_key: str) -> uuid.UUID:
        """Give a claim a new token, as a takeover or an operator would: its holder loses it."""
        with self._lock:
            token = uuid.uuid4()
            row = self._rows[idem_key]
            self._rows[idem_key] = replace(row, claim_token=token, updated_at=self._now())
            return token

    def fail_next(self, call: LedgerCall, times: int = 1) -> None:
        """The next ``times`` calls of ``call`` raise ``LedgerUnavailable`` and change nothing."""
        with self._lock:
            self._failures.append(_InjectedFailure(call, times))

    # --- internals (lock held) ----------------------------------------------------------------

    def _now(self) -> datetime:
        return datetime.fromtimestamp(self.clock.now(), tz=UTC)

    def _enter(self, call: LedgerCall) -> None:
        self._calls[call] += 1
        for index, failure in enumerate(self._failures):
            if failure.call == call:
                if failure.times > 1:
                    self._failures[index] = replace(failure, times=failure.times - 1)
                else:
                    del self._failures[index]
                raise LedgerUnavailable(f"injected fault: the ledger failed during {call}")

    def _claim(
        self, requests: Sequence[states.ClaimRequest], now: datetime
    ) -> list[states.ClaimDecision]:
        keys = [r.idem_key for r in requests]
        if len(set(keys)) != len(keys):
            # Postgres refuses an ON CONFLICT DO UPDATE that touches one row twice.
            raise LedgerError(
                "the ledger rejected a statement: ON CONFLICT DO UPDATE command cannot affect "
                "row a second time"
            )
        decisions: list[states.ClaimDecision] = []
        for request in sorted(requests, key=lambda r: r.idem_key):
            before = self._rows.get(request.idem_key)
            won = before is None or _may_take_over(before, request, now, self.visibility_timeout)
            if won:
                self._rows[request.idem_key] = _claimed_row(
                    before, request, now, self.visibility_timeout
                )
            decisions.append(states.decide(request, self._answer(before, request, won, now)))
        return decisions

    def _answer(
        self, row: states.ClaimRow | None, request: states.ClaimRequest, won: bool, now: datetime
    ) -> dict[str, Any]:
        # The claim statement's answer: the row as it was before, as its final SELECT sees it.
        won_token = request.claim_token if won else None
        won_attempts = None
        if won:
            fresh = row is None or row.state == "cancelled"
            won_attempts = 1 if fresh or row is None else (row.attempts or 1) + 1
        if row is None:
            return {
                "won_token": won_token,
                "won_attempts": won_attempts,
                "state": None,
                "message_id": None,
                "effect": None,
                "payload_sha256": None,
                "error": None,
                "result": None,
                "lease_expired": None,
                "held_seconds": None,
                "owned": None,
            }
        lease_end = _lease_end(row, self.visibility_timeout)
        return {
            "won_token": won_token,
            "won_attempts": won_attempts,
            "state": row.state,
            "message_id": row.message_id,
            "effect": row.effect,
            "payload_sha256": row.payload_sha256,
            "error": row.error,
            "result": row.result,
            "lease_expired": lease_end < now,
            "held_seconds": (now - (row.updated_at or row.claimed_at)).total_seconds(),
            "owned": row.owned,
        }

    def _settle(
        self,
        runs: Sequence[tuple[states.ClaimRequest, states.JobRun]],
        now: datetime,
        *,
        uncertain_is_stuck: bool,
    ) -> list[states.Settlement]:
        kinds = [states.settled_kind(run.kind, uncertain_is_stuck) for _, run in runs]
        # Every value is checked before any row changes: one refused statement changes nothing.
        stored = [_storable(run, kind) for (_, run), kind in zip(runs, kinds, strict=True)]
        settlements: list[states.Settlement] = []
        for (request, run), kind, value in zip(runs, kinds, stored, strict=True):
            row = self._rows.get(request.idem_key)
            if row is None or row.claim_token != request.claim_token or row.state != "running":
                # A deferred run's claim may have been released by its deferral already.
                lost = (
                    states.SettleStatus.DEFERRED
                    if kind is states.RunKind.DEFERRED
                    else states.SettleStatus.LOST
                )
                settlements.append(states.Settlement(request, lost, run))
                continue
            if kind is states.RunKind.SUCCEEDED:
                self._rows[request.idem_key] = replace(
                    row, state="done", result=value, error=None, updated_at=now
                )
            elif kind is states.RunKind.PERMANENT:
                self._rows[request.idem_key] = replace(
                    row, state="failed", error=run.error, updated_at=now
                )
            elif kind is states.RunKind.UNCERTAIN:
                # _MARK_UNCERTAIN's least(lease_until, now()); least() ignores a NULL.
                lease = now if row.lease_until is None else min(row.lease_until, now)
                self._rows[request.idem_key] = replace(
                    row, error=f"effect uncertain: {run.error}", lease_until=lease, updated_at=now
                )
            else:
                del self._rows[request.idem_key]
            settlements.append(states.Settlement(request, states.SETTLE_STATUS[kind], run))
        return settlements


def _may_take_over(
    row: states.ClaimRow, request: states.ClaimRequest, now: datetime, visibility: float
) -> bool:
    """The claim statement's ``ON CONFLICT ... DO UPDATE ... WHERE``, row by row: only a
    key-passing effect, only the same work, never a claim flagged for a human, never work the
    ledger owns, and only once the lease is over (a lease-less row's at its claim time plus the
    visibility timeout) or when the holder is this very message; or work an operator cancelled
    (free: new work)."""
    idempotent = Effect.EXTERNAL_IDEMPOTENT.value
    lease_over = _lease_end(row, visibility) < now
    return row.state == "cancelled" or (
        row.state == "running"
        and not row.owned
        and row.effect == idempotent
        and request.effect.value == idempotent
        and row.payload_sha256 is not None
        and row.payload_sha256 == request.fingerprint
        and row.error is None
        and (lease_over or row.message_id == request.message_id)
    )


def _lease_end(row: states.ClaimRow, visibility: float) -> datetime:
    """``work.statements.lease_end``, row by row."""
    if row.lease_until is not None:
        return row.lease_until
    return row.claimed_at + timedelta(seconds=visibility)


def _bounded_lease(
    request: states.ClaimRequest, now: datetime, visibility: float
) -> datetime | None:
    """The lease the claim statement stores: the requested one, but never past the message's
    visibility window (what it has left, never more than the whole timeout)."""
    if request.lease_seconds is None:
        return None
    left = visibility if request.visibility_left is None else request.visibility_left
    return now + timedelta(seconds=min(request.lease_seconds, max(left, 0.0), visibility))


def _claimed_row(
    before: states.ClaimRow | None, request: states.ClaimRequest, now: datetime, visibility: float
) -> states.ClaimRow:
    if before is not None and before.state != "cancelled":
        # A takeover keeps the row's history, as the UPDATE does.
        return replace(
            before,
            message_id=request.message_id,
            claim_token=request.claim_token,
            lease_until=_bounded_lease(request, now, visibility),
            attempts=(before.attempts or 1) + 1,
            error=None,
            updated_at=now,
        )
    return states.ClaimRow(
        idem_key=request.idem_key,
        state="running",
        message_id=request.message_id,
        job=request.job,
        effect=request.effect.value,
        attempts=1,
        payload_sha256=request.fingerprint,
        error=None,
        result=None,
        claimed_at=now,
        lease_until=_bounded_lease(request, now, visibility),
        updated_at=now,
        claim_token=request.claim_token,
    )


def _storable(run: states.JobRun, kind: states.RunKind) -> JsonValue:
    """The value a settle stores, or the error Postgres would raise for it."""
    if kind is states.RunKind.SUCCEEDED:
        # The same serialisation PostgresLedger sends; jsonb then holds the decoded form.
        value = json.loads(json.dumps(run.result, allow_nan=False))
        _check_jsonb(value)
        return value
    if kind in (states.RunKind.PERMANENT, states.RunKind.UNCERTAIN):
        _check_text(run.error)
    return None


def _check_text(text: str) -> None:
    if "\x00" in text:
        raise LedgerError(
            "the ledger rejected a statement: PostgreSQL text fields cannot contain NUL "
            "(0x00) bytes"
        )
    text.encode("utf-8")  # psycopg's own UnicodeEncodeError for a lone surrogate


def _check_jsonb(value: JsonValue) -> None:
    if isinstance(value, str):
        if "\x00" in value:
            raise LedgerError(
                "the ledger rejected a statement: unsupported Unicode escape sequence "
                "(\\u0000 cannot be converted to text)"
            )
        if any("\ud800" <= char <= "\udfff" for char in value):
            raise LedgerError(
                "the ledger rejected a statement: invalid input syntax for type json "
                "(an unpaired Unicode surrogate)"
            )
    elif isinstance(value, dict):
        for name, item in value.items():
            _check_jsonb(name)
            _check_jsonb(item)
    elif isinstance(value, list):
        for item in value:
            _check_jsonb(item)


if TYPE_CHECKING:
    # mypy holds the fakes to the ports: a Protocol change they miss fails type-checking.
    _QUEUE_CONFORMS: QueuePort = InMemoryQueue()
    _LEDGER_CONFORMS: LedgerPort = InMemoryLedger()
    _CLOCK_CONFORMS: Clock = FakeClock()


# --- The drain fleet --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DrainLease:
    drain_id: str
    origin: str
    lease_until: float


class InMemoryDrainFleet:
    """``drain_leases`` in a dict, with ``PostgresDrainFleet``'s semantics on a ``FakeClock``.

    ``join`` adopts a reserved slot or takes a free one below the cap; ``reserve`` adds slots up
    to ``min(wanted, cap)``; ``renew`` is never refused; expired leases are forgotten before
    anything is counted. One lock stands in for the advisory lock.
    """

    def __init__(self, clock: Clock | None = None) -> None:
        self.clock: Clock = clock if clock is not None else FakeClock()
        self._leases: dict[str, dict[str, DrainLease]] = {}
        self._lock = threading.Lock()
        # The most drains ever alive at once, per queue: what the cap must bound.
        self.peak: Counter[str] = Counter()

    def join(
        self, queue: str, drain_id: str, *, origin: str, lease_seconds: float, cap: int
    ) -> bool:
        with self._lock:
            leases = self._live(queue)
            if drain_id not in leases and len(leases) >= cap:
                return False
            previous = leases.get(drain_id)
            leases[drain_id] = DrainLease(
                drain_id, previous.origin if previous else origin, self.clock.now() + lease_seconds
            )
            self._note_peak(queue)
            return True

    def renew(self, queue: str, drain_id: str, *, lease_seconds: float) -> int:
        with self._lock:
            leases = self._live(queue)
            previous = leases.get(drain_id)
            origin = previous.origin if previous else "schedule"
            leases[drain_id] = DrainLease(drain_id, origin, self.clock.now() + lease_seconds)
            self._note_peak(queue)
            return len(leases)

    def reserve(self, queue: str, *, wanted: int, cap: int, lease_seconds: float) -> list[str]:
        with self._lock:
            leases = self._live(queue)
            ids = [str(uuid.uuid4()) for _ in range(min(wanted, cap) - len(leases))]
            for drain_id in ids:
                leases[drain_id] = DrainLease(drain_id, "fan_out", self.clock.now() + lease_seconds)
            self._note_peak(queue)
            return ids

    def leave(self, queue: str, drain_ids: Sequence[str]) -> None:
        with self._lock:
            leases = self._leases.get(queue, {})
            for drain_id in drain_ids:
                leases.pop(drain_id, None)

    def live(self, queue: str) -> int:
        with self._lock:
            return len(self._live(queue))

    def leases(self, queue: str) -> dict[str, DrainLease]:
        with self._lock:
            return dict(self._live(queue))

    def _live(self, queue: str) -> dict[str, DrainLease]:
        leases = self._leases.setdefault(queue, {})
        now = self.clock.now()
        for drain_id in [d for d, lease in leases.items() if lease.lease_until < now]:
            del leases[drain_id]
        return leases

    def _note_peak(self, queue: str) -> None:
        self.peak[queue] = max(self.peak[queue], len(self._leases.get(queue, {})))


class RecordingDrainStarter:
    """A ``DrainStarterPort`` that records the events it was asked to start.

    ``throttle_next(n)`` makes the next ``n`` starts raise ``FanOutThrottled``, as Lambda does
    when the reserved concurrency is full; ``fail_next(n)`` raises ``FanOutError``. ``on_start``
    runs for each accepted event (a test may start a drain there).
    """

    def __init__(self, on_start: Callable[[Mapping[str, Any]], None] | None = None) -> None:
        self.events: list[Mapping[str, Any]] = []
        self.on_start = on_start
        self._throttles = 0
        self._failures = 0
        self._lock = threading.Lock()

    def throttle_next(self, times: int = 1) -> None:
        self._throttles += times

    def fail_next(self, times: int = 1) -> None:
        self._failures += times

    def start(self, event: Mapping[str, Any]) -> None:
        with self._lock:
            if self._throttles:
                self._throttles -= 1
                raise FanOutThrottled("Lambda throttled the invoke (TooManyRequestsException)")
            if self._failures:
                self._failures -= 1
                raise FanOutError("Lambda refused the invoke (AccessDeniedException)")
            self.events.append(event)
        if self.on_start is not None:
            self.on_start(event)


if TYPE_CHECKING:
    _FLEET_CONFORMS: DrainFleetPort = InMemoryDrainFleet()
    _STARTER_CONFORMS: DrainStarterPort = RecordingDrainStarter()
