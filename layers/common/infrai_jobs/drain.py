"""The drain loop: consume in batches of ten, claim, run, settle, ack what is settled.

One call drains one queue lane for as long as the time budget allows another whole batch: every
receive burns one of a message's three deliveries, so the loop never consumes what it cannot
finish. Each message ends in exactly one ``Outcome``; ``ACKED_OUTCOMES`` is DESIGN.md's ack
column.

A consume whose answer is lost or unreadable (``ConsumeAnswerLost``) has spent a delivery of
every message it served, unseen. The lane then takes one message at a time: after a lost answer
for its next consume, and, when the answer was unreadable (too large, not JSON, too deep), for a
window kept in the ledger for every drain of the queue, long enough for the messages it served
to come back. So an unreadable message walks to the DLQ alone, not with nine neighbours.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg

from infrai_jobs.claims import (
    ClaimDecision,
    ClaimRequest,
    ClaimStatus,
    JobRun,
    RunKind,
    Settlement,
    utc_from_epoch,
)
from infrai_jobs.errors import (
    ConfigurationError,
    ConsumeAnswerLost,
    EffectUncertain,
    InfraiError,
    InfraiUnavailable,
    KeyDerivationError,
    LedgerError,
    PermanentJobError,
    QueueMessageNotFound,
    SchemaNotMigrated,
)
from infrai_jobs.jobs import DerivedJob, Effect, JobContext, JobRegistry, JsonValue
from infrai_jobs.outcomes import (
    ACKED_OUTCOMES,
    CLAIM_OUTCOMES,
    OUTCOME_RULES,
    SETTLE_OUTCOMES,
    Outcome,
)
from infrai_jobs.ports import EffectGuard, LedgerPort, QueuePort
from infrai_jobs.queue_contract import CONSUME_CAP, DEFAULT_VISIBILITY_TIMEOUT_SECONDS
from infrai_jobs.queue_models import Pending, QueueMessage

logger = logging.getLogger(__name__)

# Batches whose acks may still be travelling when the next batch's are sent.
ACKS_IN_FLIGHT_BATCHES = 2
# Connections one lane may hold open to Infrai at once: one per ack still travelling and the
# consume it sends ahead. The client's pool keeps this many per lane, or lanes would reconnect
# (a new TCP and TLS handshake) for every ack beyond what the pool keeps.
HTTP_CONNECTIONS_PER_LANE = ACKS_IN_FLIGHT_BATCHES * CONSUME_CAP + 1
# A lease and a handler's deadline end this long before the queue may deliver the message again.
VISIBILITY_MARGIN_SECONDS = 2.0
# Lost consume answers in a row after which a lane gives up (raising the last one), so a queue
# that loses every answer costs a few deliveries, not one per message for the whole budget.
LOST_ANSWERS_IN_A_ROW = 3
# An unreadable answer opens the queue's one-at-a-time window for this many visibility
# timeouts: the messages it served come back after one, to be consumed one by one.
ISOLATION_VISIBILITY_TIMEOUTS = 2
# How often a lane re-reads the window another drain may have opened meanwhile.
ISOLATION_REREAD_SECONDS = 60.0
# Codes of a lost answer whose cause may be a message (deterministic), not the network.
UNREADABLE_CODES = frozenset({"ANSWER_TOO_LARGE", "INVALID_RESPONSE"})


@dataclass(frozen=True, slots=True)
class DrainConfig:
    queue: str
    batch_size: int = CONSUME_CAP
    # The time one batch may need at most; a batch is consumed only when this much is left.
    batch_budget_ms: int = 20_000
    # An external claim's lease outlives the invocation's deadline by this much, but never
    # its message's visibility window.
    lease_grace_seconds: int = 60
    # The queue's visibility timeout: a consumed message is hidden this long.
    visibility_timeout_seconds: int = DEFAULT_VISIBILITY_TIMEOUT_SECONDS
    max_batches: int | None = None
    # The optional second layer around external effects (IDEMPOTENCY_BACKEND); None is off.
    effect_guard: EffectGuard | None = None
    # Idle polling: after an empty consume, wait this long and consume again (0: stop), for
    # as long as the idle window after the drain's start lasts (0: the whole time budget).
    idle_poll_ms: int = 0
    idle_window_seconds: float = 0.0


@dataclass
class DrainSummary:
    """What one drain did. Every consumed message is in exactly one of ``done``,
    ``duplicates``, ``retried``, ``failed`` and ``parked`` (see ``OUTCOME_RULES``)."""

    consumed: int = 0
    done: int = 0
    duplicates: int = 0
    # A handler raised and its claim was released: the redelivery runs it again.
    retried: int = 0
    # A handler raised PermanentJobError: the claim is failed, the message goes to the DLQ.
    failed: int = 0
    parked: int = 0
    acked: int = 0
    ack_lost: int = 0
    ack_failed: int = 0
    batches: int = 0
    takeovers: int = 0
    # Consumes whose answer was lost or unreadable, and those of them that served one message
    # only: an unreadable message isolated (it alone spent the delivery).
    answers_lost: int = 0
    unreadable: int = 0
    # Empty consumes that idle polling waited after and repeated.
    idle_polls: int = 0
    # Drains this one started for the backlog; starts Lambda throttled or refused.
    fanned_out: int = 0
    fan_out_throttled: int = 0
    fan_out_failed: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    stopped: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "consumed": self.consumed,
            "done": self.done,
            "duplicates": self.duplicates,
            "retried": self.retried,
            "failed": self.failed,
            "parked": self.parked,
            "acked": self.acked,
            "ack_lost": self.ack_lost,
            "ack_failed": self.ack_failed,
            "batches": self.batches,
            "takeovers": self.takeovers,
            "answers_lost": self.answers_lost,
            "unreadable": self.unreadable,
            "idle_polls": self.idle_polls,
            "fanned_out": self.fanned_out,
            "fan_out_throttled": self.fan_out_throttled,
            "fan_out_failed": self.fan_out_failed,
            "outcomes": dict(sorted(self.outcomes.items())),
            "stopped": self.stopped,
        }


_SUMMARY_TOTALS = (
    "consumed",
    "done",
    "duplicates",
    "retried",
    "failed",
    "parked",
    "acked",
    "ack_lost",
    "ack_failed",
    "batches",
    "takeovers",
    "answers_lost",
    "unreadable",
    "idle_polls",
    "fanned_out",
    "fan_out_throttled",
    "fan_out_failed",
)


def merge_summaries(summaries: Sequence[DrainSummary]) -> DrainSummary:
    """One summary for several lanes of the same invocation."""
    merged = DrainSummary()
    for summary in summaries:
        for name in _SUMMARY_TOTALS:
            setattr(merged, name, getattr(merged, name) + getattr(summary, name))
        merged.outcomes.update(summary.outcomes)
    reasons = {s.stopped for s in summaries}
    # The most alarming reason wins: an outage must not hide behind a lane that found no work.
    for reason in ("ledger_unavailable", "time_budget", "max_batches", "empty"):
        if reason in reasons:
            merged.stopped = reason
            break
    return merged


@dataclass(frozen=True, slots=True)
class MessageResult:
    message: QueueMessage
    outcome: Outcome
    idem_key: str | None = None
    job: str | None = None
    detail: str = ""
    # The claim was won by taking over an expired external_idempotent claim.
    takeover: bool = False

    @property
    def ack(self) -> bool:
        return self.outcome in ACKED_OUTCOMES


def drain(
    queue: QueuePort,
    ledger: LedgerPort,
    registry: JobRegistry,
    config: DrainConfig,
    time_left_ms: Callable[[], int],
    *,
    clock: Callable[[], float] = time.time,
    sleep: Callable[[float], None] = time.sleep,
) -> DrainSummary:
    """Drain ``config.queue`` until it is empty, the budget is spent, or the ledger fails.

    With idle polling, "empty" means empty for the whole idle window. ``sleep`` waits between
    idle polls (a test passes its fake clock's ``advance``)."""
    summary = DrainSummary()
    idle = _IdlePolling(config, summary, time_left_ms, clock, sleep)
    try:
        # Before anything is received: a receive spends a delivery, and a batch that cannot be
        # claimed would spend it for nothing.
        ledger.ping()
        mode = _ConsumeMode(ledger, config, summary, clock)
    except SchemaNotMigrated as exc:
        # Not an outage to wait out: the code is ahead of its database. The invocation fails
        # with the command to run, and nothing was received.
        logger.error(
            "the ledger database is not migrated; nothing was received",
            extra={"action": "schema_not_migrated", "detail": str(exc)},
        )
        raise
    except LedgerError as exc:
        summary.stopped = "ledger_unavailable"
        logger.error(
            "the ledger is unreachable; nothing was received",
            extra={"action": "ledger_unavailable", "detail": str(exc)},
        )
        return summary
    acks = _AckPipeline(queue, config.queue, summary)
    try:
        _drain_batches(
            queue,
            ledger=ledger,
            registry=registry,
            config=config,
            time_left_ms=time_left_ms,
            clock=clock,
            summary=summary,
            acks=acks,
            mode=mode,
            idle=idle,
        )
    finally:
        # Every ack sent is waited for before the invocation reports.
        acks.wait_all()
    logger.info("drain finished", extra={"action": "drain_summary", **summary.as_dict()})
    return summary


def _drain_batches(
    queue: QueuePort,
    *,
    ledger: LedgerPort,
    registry: JobRegistry,
    config: DrainConfig,
    time_left_ms: Callable[[], int],
    clock: Callable[[], float],
    summary: DrainSummary,
    acks: _AckPipeline,
    mode: _ConsumeMode,
    idle: _IdlePolling,
) -> None:
    """Process batches one after the other, receiving the next while this one runs.

    A batch is received only while the time left covers finishing it, and the one received
    ahead only while the time covers both: every receive burns one of three deliveries. If the
    receive itself ran so long (retries, a ``Retry-After``) that the time left no longer covers
    the batch, it is left unprocessed for redelivery rather than cut off half-way. How many
    messages a receive asks for is ``mode``'s decision (one at a time after a lost answer).

    One thread does it all: the consume sent ahead and the acks travel while the batch is
    processed, and their answers are read after (``Pending``), so a lane costs no threads and
    no hand-offs between them.
    """
    ahead: Pending[list[QueueMessage]] | None = None
    ahead_sent_at = 0.0
    visibility = config.visibility_timeout_seconds
    try:
        while True:
            try:
                if ahead is not None:
                    # Taken before waiting: a consume that failed is not waited for twice.
                    received, ahead = ahead, None
                    sent_at = ahead_sent_at
                    messages = received.wait()
                else:
                    stop = _stop_reason(config, summary, time_left_ms(), time_for=1)
                    if stop:
                        summary.stopped = stop
                        return
                    sent_at = clock()
                    messages = queue.consume(config.queue, mode.size())
            except ConsumeAnswerLost as exc:
                mode.lost(exc)
                continue
            mode.served()
            if not messages:
                if idle.waited():
                    continue
                summary.stopped = "empty"
                return
            remaining = time_left_ms()
            stop = _stop_reason(config, summary, remaining, time_for=1)
            if stop:
                # The receive itself ran long (retries, a Retry-After): what is left no longer
                # covers the batch. Cutting it off half-way could leave an external effect
                # uncertain; unacked, it costs one delivery instead.
                _left_for_redelivery(
                    messages,
                    "a batch received when the time left no longer covered it was left "
                    "for redelivery",
                )
                summary.stopped = stop
                return
            summary.batches += 1
            if not _stop_reason(config, summary, remaining, time_for=2):
                ahead_sent_at = clock()
                ahead = queue.send_consume(config.queue, mode.size())
            # The queue may deliver these messages again from here on: no handler deadline
            # and no lease may run past it.
            visible_until = sent_at + visibility - VISIBILITY_MARGIN_SECONDS
            deadline = min(clock() + remaining / 1000, visible_until)
            results = process_batch(
                messages,
                ledger,
                registry,
                deadline,
                config,
                visible_until=visible_until,
                clock=clock,
            )
            _count(results, summary)
            # This batch's acks travel while the next one is processed.
            acks.send(results)
            if any(r.outcome is Outcome.LEDGER_UNAVAILABLE for r in results):
                summary.stopped = "ledger_unavailable"
                return
    finally:
        if ahead is not None:
            _abandon(ahead, mode)


def _stop_reason(
    config: DrainConfig, summary: DrainSummary, remaining_ms: int, *, time_for: int
) -> str:
    """Why one more batch may not be received now, or "" when it may.

    ``time_for`` is how many batches the time left must cover: the one to receive, plus the
    one still being processed when receiving ahead.
    """
    if config.max_batches is not None and summary.batches >= config.max_batches:
        return "max_batches"
    if remaining_ms < config.batch_budget_ms * time_for:
        return "time_budget"
    return ""


class _IdlePolling:
    """After an empty consume: wait ``idle_poll_ms`` and consume again, or stop.

    Polling goes on while the idle window after the drain's start lasts and the time left
    still covers a batch after the wait (a consume that receives one must finish it). The
    window ends before the next scheduled drain starts, so on an idle queue about one poller
    is alive at a time.
    """

    def __init__(
        self,
        config: DrainConfig,
        summary: DrainSummary,
        time_left_ms: Callable[[], int],
        clock: Callable[[], float],
        sleep: Callable[[float], None],
    ) -> None:
        self._poll_ms = config.idle_poll_ms
        self._batch_budget_ms = config.batch_budget_ms
        self._summary = summary
        self._time_left_ms = time_left_ms
        self._clock = clock
        self._sleep = sleep
        window = config.idle_window_seconds
        self._until = clock() + window if window > 0 else float("inf")

    def waited(self) -> bool:
        """Wait one poll interval if another poll is due; False when the drain should stop."""
        if self._poll_ms <= 0:
            return False
        wait = self._poll_ms / 1000
        if self._clock() + wait > self._until:
            return False
        if self._time_left_ms() - self._poll_ms < self._batch_budget_ms:
            return False
        self._sleep(wait)
        self._summary.idle_polls += 1
        return True


class _ConsumeMode:
    """How many messages a lane's next consume asks for: a batch, or one at a time.

    One at a time for the consume after a lost answer (which spent a delivery of up to ten
    messages, unseen), and for as long as the queue's isolation window lasts. An unreadable
    answer (too large, not JSON, too deep: a message's doing, likely to repeat) opens that
    window in the ledger for every drain of the queue, for two visibility timeouts: the
    messages it served come back after one and are then received one by one, so only the
    unreadable one fails again. A lost answer that served one message only has isolated it.
    """

    def __init__(
        self,
        ledger: LedgerPort,
        config: DrainConfig,
        summary: DrainSummary,
        clock: Callable[[], float],
    ) -> None:
        self._ledger = ledger
        self._config = config
        self._summary = summary
        self._clock = clock
        self._checked_at = clock()
        self._single_until = self._checked_at + ledger.consume_isolation(config.queue)
        self._single_next = False
        self._lost_in_a_row = 0

    def size(self) -> int:
        now = self._clock()
        if now - self._checked_at >= ISOLATION_REREAD_SECONDS:
            self._checked_at = now
            try:
                self._single_until = now + self._ledger.consume_isolation(self._config.queue)
            except LedgerError as exc:
                # The claims will find the ledger's trouble; the window is only a precaution.
                logger.warning(
                    "could not read the queue's isolation window",
                    extra={"action": "isolation_unknown", "detail": str(exc)},
                )
        if self._single_next or now < self._single_until:
            return 1
        return self._config.batch_size

    def served(self) -> None:
        self._single_next = False
        self._lost_in_a_row = 0

    def lost(self, exc: ConsumeAnswerLost, *, final: bool = False) -> None:
        """Count and log a lost answer, and take one message at a time from here; raise it
        once ``LOST_ANSWERS_IN_A_ROW`` came in a row, so the invocation fails visibly."""
        summary = self._summary
        summary.answers_lost += 1
        unreadable = exc.code in UNREADABLE_CODES
        isolated = exc.max_messages == 1 and unreadable
        summary.unreadable += int(isolated)
        _log_lost(exc, isolated=isolated)
        self._single_next = True
        if unreadable:
            self._open_window(exc)
        self._lost_in_a_row += 1
        if self._lost_in_a_row >= LOST_ANSWERS_IN_A_ROW and not final:
            raise exc

    def _open_window(self, exc: ConsumeAnswerLost) -> None:
        seconds = float(ISOLATION_VISIBILITY_TIMEOUTS * self._config.visibility_timeout_seconds)
        now = self._clock()
        self._single_until = max(self._single_until, now + seconds)
        try:
            left = self._ledger.isolate_consumes(
                self._config.queue, seconds, storable_text(f"{exc.code}: {exc.message}")
            )
        except LedgerError as exc_ledger:
            logger.warning(
                "could not record the queue's isolation window; this lane keeps it alone",
                extra={"action": "isolation_unrecorded", "detail": str(exc_ledger)},
            )
            return
        self._checked_at = now
        self._single_until = max(self._single_until, now + left)


def _log_lost(exc: ConsumeAnswerLost, *, isolated: bool) -> None:
    if isolated:
        level = logging.ERROR
        message = (
            "an unreadable message was received alone: only it spent a delivery, and it "
            "reaches the DLQ after three"
        )
        action = "unreadable_message"
    else:
        level = logging.WARNING
        message = (
            "a consume answer was lost or unreadable: the messages it served spent a delivery "
            "unseen and come back after the visibility timeout; consuming one at a time"
        )
        action = "consume_answer_lost"
    logger.log(
        level,
        message,
        extra={
            "action": action,
            "queue": exc.queue,
            "route": "POST /v1/queue/consume",
            "code": exc.code,
            "status": exc.status,
            "size_bytes": exc.size,
            "message_ids": list(exc.message_ids),
            "max_messages": exc.max_messages,
            "detail": storable_text(exc.message[:500]),
        },
    )


def _abandon(ahead: Pending[list[QueueMessage]], mode: _ConsumeMode) -> None:
    """A batch received ahead but never processed (the ledger failed): it is not acked, so
    Infrai redelivers it after the visibility timeout. Say so, since it cost a delivery.

    Only the answer already on its way is read: retrying a failed consume here would receive
    another batch just to leave it too."""
    try:
        messages = ahead.wait(retry=False)
    except ConsumeAnswerLost as exc:
        mode.lost(exc, final=True)
        return
    except InfraiError:
        return
    _left_for_redelivery(messages, "a batch received ahead was left for redelivery")


def _left_for_redelivery(messages: Sequence[QueueMessage], why: str) -> None:
    if messages:
        logger.warning(
            why,
            extra={
                "action": "batch_abandoned",
                "message_ids": [m.message_id for m in messages],
            },
        )


def process_batch(
    messages: Sequence[QueueMessage],
    ledger: LedgerPort,
    registry: JobRegistry,
    deadline: float,
    config: DrainConfig,
    *,
    visible_until: float | None = None,
    clock: Callable[[], float] = time.time,
) -> list[MessageResult]:
    """Decide every message of one batch; one bad message never stops the others.

    ``visible_until`` (``clock`` seconds) is when the queue may deliver these messages again:
    no claim's lease ends later (None: one whole visibility timeout from the claim)."""
    return _Batch(
        messages, ledger, registry, deadline, config, visible_until=visible_until, clock=clock
    ).process()


class _Batch:
    """The state of one batch while its messages are claimed, run and settled."""

    def __init__(
        self,
        messages: Sequence[QueueMessage],
        ledger: LedgerPort,
        registry: JobRegistry,
        deadline: float,
        config: DrainConfig,
        *,
        visible_until: float | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.messages = messages
        self.ledger = ledger
        self.registry = registry
        self.deadline = deadline
        self.config = config
        # When the queue may deliver the batch again (None: unknown), on ``clock``.
        self.visible_until = visible_until
        self.clock = clock
        self.lease_until = utc_from_epoch(deadline + config.lease_grace_seconds)
        self.results: dict[str, MessageResult] = {}
        # The first message of each key in this batch, and later copies of a key.
        self.primaries: dict[str, tuple[QueueMessage, DerivedJob]] = {}
        self.copies: list[tuple[QueueMessage, DerivedJob]] = []
        self.takeovers: set[str] = set()
        # Set once a claim failed for the ledger: the rest of the batch is not tried.
        self.ledger_failed = ""

    def process(self) -> list[MessageResult]:
        self._derive_keys()
        requests = [self._request(key) for key in self.primaries]
        self._run_database([r for r in requests if r.effect is Effect.DATABASE])
        self._run_external([r for r in requests if r.effect is not Effect.DATABASE])
        self._mirror_copies()
        return [self.results[m.message_id] for m in self.messages]

    def _derive_keys(self) -> None:
        for message in self.messages:
            try:
                derived = self.registry.derive(message.payload)
            except (KeyDerivationError, ConfigurationError) as exc:
                # A configuration error here is the job's, not the batch's: this message walks
                # to the DLQ with the reason, the others go on.
                self._set(MessageResult(message, Outcome.REJECTED, detail=str(exc)))
                continue
            if derived.idem_key in self.primaries:
                self.copies.append((message, derived))
            else:
                self.primaries[derived.idem_key] = (message, derived)

    def _request(self, key: str) -> ClaimRequest:
        message, derived = self.primaries[key]
        effect = derived.definition.effect
        return ClaimRequest(
            idem_key=key,
            message_id=message.message_id,
            job=derived.definition.name,
            effect=effect,
            fingerprint=derived.fingerprint,
            lease_until=None if effect is Effect.DATABASE else self.lease_until,
            visibility_left=(
                None if self.visible_until is None else self.visible_until - self.clock()
            ),
        )

    def _context(self, request: ClaimRequest, db: psycopg.Connection[Any] | None) -> JobContext:
        message, derived = self.primaries[request.idem_key]
        return JobContext(
            idem_key=request.idem_key,
            job=derived.definition.name,
            message_id=message.message_id,
            delivery_count=message.delivery_count,
            deadline=self.deadline,
            db=db,
        )

    def _run(self, request: ClaimRequest, db: psycopg.Connection[Any] | None) -> JobRun:
        derived = self.primaries[request.idem_key][1]
        guard = self.config.effect_guard if request.effect is not Effect.DATABASE else None
        return run_handler(derived, self._context(request, db), guard)

    def _run_database(self, requests: list[ClaimRequest]) -> None:
        """Claim, run and settle in one transaction for the whole batch."""
        if not requests:
            return
        try:
            decisions, settlements = self.ledger.run_database_batch(requests, self._run)
        except LedgerError as exc:
            for request in requests:
                self._set_for(request, Outcome.LEDGER_UNAVAILABLE, str(exc))
            return
        self._record(decisions, settlements)

    def _run_external(self, requests: list[ClaimRequest]) -> None:
        """Commit claims, then run and settle each job right after its effect.

        Key-passing (``external_idempotent``) jobs are claimed for the batch in one statement:
        if this process dies before calling, a later delivery takes the claim over once its
        lease ends. Irreversible (``external``) jobs are claimed one by one, right before their
        own call, so a crash leaves for a human only the claim whose call had begun, not every
        claim of the batch.
        """
        idempotent = [r for r in requests if r.effect is Effect.EXTERNAL_IDEMPOTENT]
        if idempotent:
            self._claim_and_run(idempotent)
        for request in (r for r in requests if r.effect is Effect.EXTERNAL):
            if self.ledger_failed:
                self._set_for(request, Outcome.LEDGER_UNAVAILABLE, self.ledger_failed)
            else:
                self._claim_and_run([request])

    def _claim_and_run(self, requests: list[ClaimRequest]) -> None:
        try:
            decisions = self.ledger.claim(requests)
        except LedgerError as exc:
            self.ledger_failed = str(exc)
            for request in requests:
                self._set_for(request, Outcome.LEDGER_UNAVAILABLE, str(exc))
            return
        self.takeovers |= {d.request.idem_key for d in decisions if d.takeover}
        settlements: list[Settlement] = []
        for decision in decisions:
            if decision.status is not ClaimStatus.WON:
                continue
            run = self._run(decision.request, None)
            try:
                settlements.append(self.ledger.settle(decision.request, run))
            except LedgerError as exc:
                # The effect may have happened and its claim stays running: a human decides.
                outcome = Outcome.STUCK if run.kind is not RunKind.TRANSIENT else Outcome.RETRY
                detail = f"handler {run.kind}, then settling failed: {exc}"
                self._set_for(decision.request, outcome, detail)
        self._record(decisions, settlements)

    def _record(
        self, decisions: Sequence[ClaimDecision], settlements: Sequence[Settlement]
    ) -> None:
        stuck_reasons: dict[str, str] = {}
        for decision in decisions:
            outcome = CLAIM_OUTCOMES.get(decision.status)
            if outcome is None:  # WON: its settlement decides
                if decision.takeover:
                    self.takeovers.add(decision.request.idem_key)
                continue
            if outcome is Outcome.STUCK:
                stuck_reasons[decision.request.idem_key] = decision.detail
            self._set_for(decision.request, outcome, decision.detail)
        for settlement in settlements:
            outcome = SETTLE_OUTCOMES[settlement.status]
            self._set_for(settlement.request, outcome, settlement.run.error)
        if stuck_reasons:
            try:
                self.ledger.flag_stuck(stuck_reasons)
            except LedgerError as exc:
                logger.warning(
                    "could not flag stuck claims",
                    extra={"action": "flag_failed", "detail": str(exc)},
                )

    def _mirror_copies(self) -> None:
        """A second copy of a key in the same batch never runs; it follows the first."""
        for message, derived in self.copies:
            first_message, first_derived = self.primaries[derived.idem_key]
            first = self.results[first_message.message_id]
            if derived.fingerprint != first_derived.fingerprint:
                outcome = Outcome.CONFLICT
                detail = f"same key as {first_message.message_id} in this batch, different work"
            elif first.ack or first.outcome is Outcome.RETRY:
                # The first copy's message carries the work (or its retries) from here on.
                outcome = Outcome.IN_FLIGHT
                detail = f"copy of {first_message.message_id} in the same batch"
            else:
                outcome = Outcome.BATCH_DUPLICATE
                detail = f"copy of {first_message.message_id}, which ended {first.outcome}"
            self._set(
                MessageResult(message, outcome, derived.idem_key, derived.definition.name, detail)
            )

    def _set_for(self, request: ClaimRequest, outcome: Outcome, detail: str) -> None:
        message, derived = self.primaries[request.idem_key]
        takeover = request.idem_key in self.takeovers
        if takeover:
            detail = f"lease takeover; {detail}" if detail else "lease takeover"
        self._set(
            MessageResult(
                message, outcome, request.idem_key, derived.definition.name, detail, takeover
            )
        )

    def _set(self, result: MessageResult) -> None:
        # The first decision about a message stands (a settle failure is recorded first).
        if result.message.message_id not in self.results:
            self.results[result.message.message_id] = _log(result)


def run_handler(derived: DerivedJob, ctx: JobContext, guard: EffectGuard | None = None) -> JobRun:
    """Run one handler and turn whatever it does into a ``JobRun``.

    This is the one place that catches every exception: a job's failure is an outcome to
    settle, not a crash of the batch. With a ``guard`` (the second layer), the effect runs
    through it, keyed by the same idempotency key.
    """

    def call() -> JsonValue:
        return derived.definition.handler(derived.payload, ctx)

    try:
        result = guard.run(ctx.idem_key, derived.fingerprint, call) if guard else call()
    except PermanentJobError as exc:
        return JobRun(RunKind.PERMANENT, error=_describe(exc))
    except EffectUncertain as exc:
        return JobRun(RunKind.UNCERTAIN, error=_describe(exc))
    except Exception as exc:  # noqa: BLE001 - the one place a handler's failure becomes an outcome
        return JobRun(RunKind.TRANSIENT, error=_describe(exc))
    return JobRun(RunKind.SUCCEEDED, result=_jsonable(result))


class _AckPipeline:
    """Acks sent together and their answers read later, so they overlap the next batch's work.

    Once a batch's acks are sent, the answers of the batch before it are read (by then they have
    usually arrived): at most ``ACKS_IN_FLIGHT_BATCHES`` batches of acks travel at once.
    """

    def __init__(self, queue: QueuePort, queue_name: str, summary: DrainSummary) -> None:
        self._queue = queue
        self._queue_name = queue_name
        self._summary = summary
        self._pending: list[list[tuple[MessageResult, Pending[None]]]] = []

    def send(self, results: Sequence[MessageResult]) -> None:
        batch: list[tuple[MessageResult, Pending[None]]] = []
        # Appended before sending: if a send raises, what was sent is still waited for.
        self._pending.append(batch)
        for r in results:
            if r.ack:
                batch.append((r, self._queue.send_ack(self._queue_name, r.message.receipt_handle)))
        while len(self._pending) > ACKS_IN_FLIGHT_BATCHES - 1:
            self._collect(self._pending.pop(0))

    def wait_all(self) -> None:
        """Read every answer still due; an unexpected error is raised after all are read."""
        first_error: Exception | None = None
        while self._pending:
            try:
                self._collect(self._pending.pop(0))
            except Exception as exc:  # noqa: BLE001 - raised below, once the rest are read
                first_error = first_error or exc
        if first_error is not None:
            raise first_error

    def _collect(self, batch: list[tuple[MessageResult, Pending[None]]]) -> None:
        summary = self._summary
        # Answers are read one after another on this thread: once Infrai has failed one ack
        # through all its retries, the rest of the batch get their sent request's answer only,
        # so an outage costs one ack's retries per batch, not ten in a row.
        retry = True
        unexpected: Exception | None = None
        for result, pending in batch:
            try:
                pending.wait(retry=retry)
            except QueueMessageNotFound:
                summary.ack_lost += 1
                _log_ack(result, "ack_lost")
            except InfraiError as exc:
                # Harmless for correctness: the redelivery finds the claim settled, and is
                # acked then.
                if isinstance(exc, InfraiUnavailable):
                    retry = False
                summary.ack_failed += 1
                _log_ack(result, "ack_failed", str(exc))
            except Exception as exc:  # noqa: BLE001 - the other answers are read first
                # Not an answer from Infrai (a refreshed API key that cannot be used, a bug):
                # the rest of the batch is still read, so no connection is left half-used.
                summary.ack_failed += 1
                _log_ack(result, "ack_failed", _describe(exc))
                unexpected = unexpected or exc
            else:
                summary.acked += 1
        if unexpected is not None:
            raise unexpected


def _count(results: Sequence[MessageResult], summary: DrainSummary) -> None:
    for r in results:
        summary.consumed += 1
        summary.outcomes[r.outcome.value] += 1
        summary.takeovers += int(r.takeover)
        bucket = OUTCOME_RULES[r.outcome].bucket
        setattr(summary, bucket, getattr(summary, bucket) + 1)


def _log(result: MessageResult) -> MessageResult:
    logger.log(
        OUTCOME_RULES[result.outcome].level,
        "message %s",
        result.outcome.value,
        extra={
            "action": result.outcome.value,
            "idem_key": result.idem_key,
            "message_id": result.message.message_id,
            "delivery_count": result.message.delivery_count,
            "job": result.job,
            "acked": result.ack,
            "detail": result.detail,
        },
    )
    return result


def _log_ack(result: MessageResult, action: str, detail: str = "") -> None:
    logger.warning(
        "ack %s",
        action,
        extra={
            "action": action,
            "idem_key": result.idem_key,
            "message_id": result.message.message_id,
            "delivery_count": result.message.delivery_count,
            "job": result.job,
            "detail": detail,
        },
    )


def _describe(exc: BaseException) -> str:
    text = storable_text(f"{type(exc).__name__}: {exc}")
    return text if len(text) <= 2000 else text[:1997] + "..."


def storable_text(text: str) -> str:
    """Text PostgreSQL accepts: no NUL characters, no lone surrogates."""
    return text.replace("\x00", "\ufffd").encode("utf-8", "replace").decode("utf-8")


# Built once: json.dumps with any option builds a new encoder per call (about 1.5 µs).
_RESULT_JSON = json.JSONEncoder(allow_nan=False, ensure_ascii=False)


def _jsonable(result: JsonValue) -> JsonValue:
    """The handler's result as the ledger can store it (jsonb).

    The effect has happened, so a result that cannot be stored must never turn into a retry:
    it is replaced by a printable description instead.
    """
    try:
        text = _RESULT_JSON.encode(result)
        text.encode("utf-8")  # lone surrogates
    except (TypeError, ValueError, RecursionError):
        return {"unserializable_result": _safe_repr(result)}
    if "\\u0000" in text:  # jsonb refuses the NUL escape
        return {"unserializable_result": _safe_repr(result)}
    return result


def _safe_repr(value: object) -> str:
    try:
        text = repr(value)
    except RecursionError:
        text = f"<{type(value).__name__} nested too deeply to print>"
    return storable_text(text[:1000])
