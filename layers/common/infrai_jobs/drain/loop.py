"""The drain loop: consume in batches of ten, claim, run, settle, ack what is settled. One call
drains one queue lane while the time budget allows another whole batch: every receive burns one
of a message's three deliveries, so the loop never consumes what it cannot finish."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from infrai_jobs.drain.ack_pipeline import AckPipeline
from infrai_jobs.drain.batch import MessageResult, process_batch, storable_text
from infrai_jobs.drain.model import DrainConfig, DrainRun, DrainSummary, LaneClock, NextDrain
from infrai_jobs.errors import (
    ConsumeAnswerLost,
    DatabaseBusy,
    InfraiError,
    LedgerError,
    SchemaNotMigrated,
)
from infrai_jobs.jobs.correlation import correlation_of
from infrai_jobs.jobs.registry import JobRegistry
from infrai_jobs.queue.models import Pending, QueueMessage
from infrai_jobs.queue.ports import QueuePort
from infrai_jobs.work.outcomes import Outcome
from infrai_jobs.work.ports import LedgerPort

logger = logging.getLogger(__name__)

# A lease and a handler's deadline end this long before the queue may deliver the message again.
VISIBILITY_MARGIN_SECONDS = 2.0
# Lost consume answers in a row after which a lane raises the last: a queue losing every answer
# costs a few deliveries, not one per message for the whole budget.
LOST_ANSWERS_IN_A_ROW = 3
# Visibility timeouts an unreadable answer opens the queue's one-at-a-time window for.
ISOLATION_VISIBILITY_TIMEOUTS = 2
# How often a lane re-reads the window another drain may have opened meanwhile.
ISOLATION_REREAD_SECONDS = 60.0
# Codes of a lost answer whose cause may be a message (deterministic), not the network.
UNREADABLE_CODES = frozenset({"ANSWER_TOO_LARGE", "INVALID_RESPONSE"})


def drain(
    queue: QueuePort,
    ledger: LedgerPort,
    registry: JobRegistry,
    config: DrainConfig,
    time_left_ms: Callable[[], int],
    *,
    clock: Callable[[], float] = time.time,
    sleep: Callable[[float], None] = time.sleep,
    stop_requested: Callable[[], bool] | None = None,
) -> DrainSummary:
    """Drain ``config.queue`` until it is empty, the budget is spent, the ledger fails, or
    ``stop_requested()`` (``interrupted``: before the next receive; what the lane holds is
    still settled and acked). ``sleep`` is how idle polling waits (a test's fake clock)."""
    summary = DrainSummary()
    lane_time = LaneClock(clock(), time_left_ms, clock, sleep)
    try:
        # First: a receive spends a delivery, for nothing if the batch cannot be claimed.
        ledger.ping()
        mode = _ConsumeMode(ledger, config, summary, lane_time.clock)
    except LedgerError as exc:
        return stopped_before_receiving(exc)
    acks = AckPipeline(queue, config.queue, summary)
    stop = stop_requested or (lambda: False)
    try:
        _drain_batches(queue, ledger, registry, config, lane_time, mode=mode, acks=acks, stop=stop)
    finally:
        # Every ack sent is waited for before the invocation reports.
        acks.wait_all()
    logger.info("drain finished", extra={"action": "drain_summary", **summary.as_dict()})
    return summary


def _drain_batches(
    queue: QueuePort,
    ledger: LedgerPort,
    registry: JobRegistry,
    config: DrainConfig,
    lane_time: LaneClock,
    *,
    mode: _ConsumeMode,
    acks: AckPipeline,
    stop: Callable[[], bool],
) -> None:
    """Process batches, receiving the next while this one runs, only while the time left covers
    both, on one thread: the consume ahead and the acks travel while the batch is processed,
    their answers read after (``Pending``). ``lane_time`` is the lane's one clock: the time
    left, the wall clock deadlines are on, and the start the idle window counts from."""
    summary = acks.summary
    ahead: Pending[list[QueueMessage]] | None = None
    ahead_sent_at = 0.0
    try:
        while True:
            try:
                if ahead is not None:
                    # Taken before waiting: a consume that failed is not waited for twice.
                    received, ahead = ahead, None
                    sent_at = ahead_sent_at
                    messages = received.wait()
                else:
                    why = "interrupted" if stop() else ""
                    why = why or _stop_reason(config, summary, lane_time.time_left_ms(), 1)
                    if why:
                        summary.stopped = why
                        return
                    sent_at = lane_time.clock()
                    messages = queue.consume(config.queue, mode.size())
            except ConsumeAnswerLost as exc:
                mode.lost(exc)
                continue
            mode.served()
            if not messages:
                if any(f.poll_again(config, lane_time, summary.counters) for f in config.features):
                    continue
                summary.stopped = "empty"
                return
            remaining = lane_time.time_left_ms()
            why = _stop_reason(config, summary, remaining, 1)
            if why:
                # The receive ran long (retries, a Retry-After). Cut off half-way, the batch could
                # leave an external effect uncertain; unacked, it costs one delivery instead.
                _left_for_redelivery(
                    messages,
                    "a batch received when the time left no longer covered it was left "
                    "for redelivery",
                )
                summary.stopped = why
                return
            summary.batches += 1
            if not stop() and not _stop_reason(config, summary, remaining, 2):
                ahead_sent_at = lane_time.clock()
                ahead = queue.send_consume(config.queue, mode.size())
            # The queue may redeliver from here on: no handler deadline and no lease runs past it.
            visible_until = sent_at + config.visibility_timeout_seconds - VISIBILITY_MARGIN_SECONDS
            deadline = min(lane_time.clock() + remaining / 1000, visible_until)
            results = process_batch(
                messages,
                ledger,
                registry,
                deadline,
                config,
                visible_until=visible_until,
                clock=lane_time.clock,
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
    config: DrainConfig, summary: DrainSummary, remaining_ms: int, batches: int
) -> str:
    """Why one more batch may not be received now, or "". ``batches``: how many the time left
    must cover (the one to receive, plus the one in process when receiving ahead)."""
    if config.max_batches is not None and summary.batches >= config.max_batches:
        return "max_batches"
    if remaining_ms < config.batch_budget_ms * batches:
        return "time_budget"
    return ""


def drain_invocation(run: DrainRun, registry: JobRegistry) -> DrainSummary:
    """One invocation's drain: each feature's ``around_drain`` (first outermost), then a lane."""

    def one_lane(r: DrainRun) -> DrainSummary:
        return drain(
            r.queue, r.ledger, registry, r.config, r.time_left_ms, stop_requested=r.stop_requested
        )

    next_drain: NextDrain = one_lane
    for feature in reversed(run.config.features):
        next_drain = partial(feature.around_drain, next_drain=next_drain)
    return next_drain(run)


def stopped_before_receiving(exc: LedgerError) -> DrainSummary:
    """The ledger failed before anything was received: say so, and stop (``ledger_unavailable``).
    A schema the code may not run on (behind it, or a floor above it) is no outage: raised. A
    database at its connection limit is none either: ``database_full``, a warning and a count."""
    level, what, action = logging.ERROR, "the ledger is unreachable", "ledger_unavailable"
    if isinstance(exc, DatabaseBusy):
        level, what, action = logging.WARNING, "the ledger database is full", "database_full"
    elif isinstance(exc, SchemaNotMigrated):
        what, action = "the ledger's schema does not fit this code", "schema_not_migrated"
    extra = {"action": action, "detail": str(exc)}
    logger.log(level, "%s; nothing was received", what, extra=extra)
    if isinstance(exc, SchemaNotMigrated):
        raise exc
    full = action == "database_full"
    return DrainSummary(counters=Counter(database_full=1) if full else Counter(), stopped=action)


def budget_shortfall(batch_budget_ms: int, time_budget_ms: int) -> str:
    """Why a drain given ``time_budget_ms`` could not receive a single batch, or "": it would
    stop at once and look like an empty queue, so its caller refuses it instead."""
    if time_budget_ms >= batch_budget_ms:
        return ""
    return (
        f"a time budget of {time_budget_ms / 1000:g} s cannot hold one batch: "
        f"DRAIN_BATCH_BUDGET_MS is {batch_budget_ms} ms, and a batch is received only when the "
        "time left covers it (each receive spends one of a message's three deliveries)"
    )


@dataclass
class _ConsumeMode:
    """How many messages a lane's next consume asks for: one at a time after a lost answer, and
    while the queue's isolation window, which an unreadable answer opens in the ledger, lasts
    (docs/design.md, "A message nobody can read costs only its own deliveries")."""

    _ledger: LedgerPort
    _config: DrainConfig
    _summary: DrainSummary
    _clock: Callable[[], float]
    _single_next: bool = False
    _lost_in_a_row: int = 0

    def __post_init__(self) -> None:
        self._checked_at = self._clock()
        self._single_until = self._checked_at + self._ledger.consume_isolation(self._config.queue)

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
        if isolated:
            level, action = logging.ERROR, "unreadable_message"
            message = (
                "an unreadable message was received alone: only it spent a delivery, and it "
                "reaches the DLQ after three"
            )
        else:
            level, action = logging.WARNING, "consume_answer_lost"
            message = (
                "a consume answer was lost or unreadable: the messages it served spent a delivery "
                "unseen and come back after the visibility timeout; consuming one at a time"
            )
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
        self._single_next = True
        self._lost_in_a_row += 1
        if unreadable:
            seconds = float(ISOLATION_VISIBILITY_TIMEOUTS * self._config.visibility_timeout_seconds)
            now = self._clock()
            self._single_until = max(self._single_until, now + seconds)
            try:
                left = self._ledger.isolate_consumes(
                    self._config.queue, seconds, storable_text(f"{exc.code}: {exc.message}")
                )
                self._checked_at = now
                self._single_until = max(self._single_until, now + left)
            except LedgerError as exc_ledger:
                logger.warning(
                    "could not record the queue's isolation window; this lane keeps it alone",
                    extra={"action": "isolation_unrecorded", "detail": str(exc_ledger)},
                )
        if self._lost_in_a_row >= LOST_ANSWERS_IN_A_ROW and not final:
            raise exc


def _abandon(ahead: Pending[list[QueueMessage]], mode: _ConsumeMode) -> None:
    """Say that a batch received ahead was never processed (it cost a delivery). Only the answer
    on its way is read: retrying a failed consume would receive another batch to leave too."""
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
        extra: dict[str, Any] = {
            "action": "batch_abandoned",
            "message_ids": [m.message_id for m in messages],
        }
        correlation_ids = [correlation_of(m.payload).correlation_id or "" for m in messages]
        if any(correlation_ids):
            # In the order of message_ids; "" for a message whose producer sent none.
            extra["correlation_ids"] = correlation_ids
        logger.warning(why, extra=extra)


def _count(results: Sequence[MessageResult], summary: DrainSummary) -> None:
    for r in results:
        summary.consumed += 1
        # The totals (done, duplicates, ...) follow from the outcomes by the outcome table.
        summary.outcomes[r.outcome.value] += 1
        summary.takeovers += int(r.takeover)
        summary.visibility_mismatches += int(r.visibility_mismatch)
