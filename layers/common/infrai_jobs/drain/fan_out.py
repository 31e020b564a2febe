"""Backlog fan-out: a drain that sees more backlog than it can clear soon starts more drains. A
monitor beside the lanes renews the drain's lease and, if the drains alive would take longer than
``after_seconds`` to clear the backlog at the rate measured, reserves the missing slots (at most
``max_concurrency`` drains) and starts one drain per slot, which adopts it. Each is an ordinary
drain: the claims keep them safe."""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import KW_ONLY, dataclass, field, replace
from typing import Any

from infrai_jobs.drain.loop import stopped_before_receiving
from infrai_jobs.drain.model import DrainFeature, DrainRun, DrainSummary, NextDrain
from infrai_jobs.drain.ports import DrainFleetPort, DrainStarterPort
from infrai_jobs.errors import FanOutError, FanOutThrottled, InfraiError, LedgerError
from infrai_jobs.queue.models import Pending, QueueMessage
from infrai_jobs.queue.ports import ForwardingQueue, QueuePort

logger = logging.getLogger(__name__)

# The key of a fan-out event: {"infrai_jobs_fan_out": {"queue": ..., "drain_id": ...}}.
FAN_OUT_EVENT_KEY = "infrai_jobs_fan_out"
# How often the monitor renews the lease and looks at the backlog.
CHECK_EVERY_SECONDS = 2.0
# A running drain's lease: several checks long, so one slow check does not make it look dead; a
# drain killed mid-run frees its slot within this (reserved concurrency holds the real line).
LEASE_SECONDS = 15.0
# A reserved slot waits this long for its drain to start (an async invoke, a cold start).
START_GRACE_SECONDS = 30.0


@dataclass(frozen=True, slots=True)
class FanOutPolicy:
    queue: str
    max_concurrency: int
    after_seconds: float  # DRAIN_FANOUT_AFTER_SECONDS
    lease_seconds: float = LEASE_SECONDS


def drains_wanted(available: int, rate_per_drain: float, after_seconds: float, cap: int) -> int:
    """How many drains, each consuming ``rate_per_drain`` messages a second, clear ``available``
    messages within ``after_seconds``; never more than ``cap``, 0 without backlog or rate."""
    if available <= 0 or rate_per_drain <= 0:
        return 0
    return min(cap, math.ceil(available / (rate_per_drain * after_seconds)))


def fan_out_event(queue: str, drain_id: str, started_by: str) -> dict[str, Any]:
    return {FAN_OUT_EVENT_KEY: {"queue": queue, "drain_id": drain_id, "started_by": started_by}}


def fan_out_slot(event: object) -> str | None:
    """The reserved slot's id when ``event`` is a fan-out event, else None (a schedule tick, as
    a malformed fan-out event is taken: the drain runs in a free slot instead)."""
    if not isinstance(event, Mapping) or FAN_OUT_EVENT_KEY not in event:
        return None
    body = event[FAN_OUT_EVENT_KEY]
    drain_id = body.get("drain_id") if isinstance(body, Mapping) else None
    try:
        return str(uuid.UUID(str(drain_id)))
    except ValueError:
        logger.warning(
            "a fan-out event without a valid drain_id; running as a scheduled drain",
            extra={"action": "fan_out_event_invalid"},
        )
        return None


@dataclass(frozen=True, slots=True)
class FanOutCheck:  # what one check saw and did
    live: int
    available: int = 0
    rate: float = 0.0
    wanted: int = 0
    started: int = 0


@dataclass(eq=False)
class FleetMonitor:
    """One drain's lease and fan-out decisions: ``check()`` is one step, which ``running()``
    takes every few seconds on a thread of its own. ``consumed``: messages received so far."""

    policy: FanOutPolicy
    drain_id: str
    fleet: DrainFleetPort
    _: KW_ONLY
    queue: QueuePort
    consumed: Callable[[], int]
    starter: DrainStarterPort | None = None
    clock: Callable[[], float] = time.monotonic
    fanned_out: int = field(init=False, default=0)
    throttled: int = field(init=False, default=0)
    failed: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if self.policy.max_concurrency <= 1:
            self.starter = None
        self._since = self._renewed_at = self.clock()
        self._consumed_since = self.consumed()

    def check(self) -> FanOutCheck:
        """Renew the lease; start the drains the backlog calls for, if any."""
        policy = self.policy
        live = self._renew()
        now, consumed = self.clock(), self.consumed()
        elapsed, received = now - self._since, consumed - self._consumed_since
        self._since, self._consumed_since = now, consumed
        # Nothing to start, or nothing received since the last check (idle, or held up: a zero
        # rate says nothing).
        if self.starter is None or live >= policy.max_concurrency or received <= 0 or elapsed <= 0:
            return FanOutCheck(live)
        # The rate since the last check, not the start: time spent idle polling is no slowness.
        rate = received / elapsed
        available = self.queue.stats(policy.queue).available_count
        wanted = drains_wanted(available, rate, policy.after_seconds, policy.max_concurrency)
        if wanted <= live:
            return FanOutCheck(live, available, rate, wanted)
        slots = self.fleet.reserve(
            policy.queue,
            wanted=wanted,
            cap=policy.max_concurrency,
            lease_seconds=START_GRACE_SECONDS,
        )
        started = self._start(slots)
        logger.info(
            "backlog fan-out: started %d more drains",
            started,
            extra={
                "action": "fan_out",
                "queue": policy.queue,
                "available": available,
                "rate_per_second": round(rate, 1),
                "drains_alive": live,
                "drains_wanted": wanted,
                "drains_started": started,
            },
        )
        return FanOutCheck(live, available, rate, wanted, started)

    def _renew(self) -> int:
        self._renewed_at = self.clock()
        return self.fleet.renew(
            self.policy.queue, self.drain_id, lease_seconds=self.policy.lease_seconds
        )

    def _start(self, slots: Sequence[str]) -> int:
        assert self.starter is not None
        for index, slot in enumerate(slots):
            if self.clock() - self._renewed_at >= CHECK_EVERY_SECONDS:
                # A slow Invoke API must not let this drain's own lease run out meanwhile.
                self._renew()
            try:
                self.starter.start(fan_out_event(self.policy.queue, slot, self.drain_id))
            except FanOutError as exc:
                # The slots not started are given back (or expire after START_GRACE_SECONDS).
                msg = "could not give back reserved drain slots"
                _leave(self.fleet, self.policy.queue, slots[index:], msg, "fan_out_release_failed")
                if isinstance(exc, FanOutThrottled):
                    self.throttled += 1
                    logger.warning(
                        "fan-out throttled; the drains alive carry on",
                        extra={"action": "fan_out_throttled", "detail": str(exc)},
                    )
                else:
                    self.failed += 1
                    logger.error(
                        "fan-out failed to start a drain",
                        extra={"action": "fan_out_failed", "detail": str(exc)},
                    )
                return index
            self.fanned_out += 1
        return len(slots)

    @contextmanager
    def running(self) -> Iterator[FleetMonitor]:
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(CHECK_EVERY_SECONDS):
                try:
                    self.check()
                except (LedgerError, InfraiError) as exc:
                    # The lanes meet the same outage and report it; this only skips a check.
                    logger.warning(
                        "fan-out check skipped",
                        extra={"action": "fan_out_check_failed", "detail": str(exc)},
                    )

        thread = threading.Thread(target=loop, name="fleet-monitor", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            stop.set()
            thread.join()


@dataclass(eq=False)
class FleetMembership(DrainFeature):
    """DRAIN_MAX_CONCURRENCY: every drain counts itself in the fleet (or stops at once,
    ``at_capacity``, when one too many) and fans out for a backlog while it drains."""

    policy: FanOutPolicy
    fleet: DrainFleetPort
    starter: DrainStarterPort | None = None

    def around_drain(self, run: DrainRun, next_drain: NextDrain) -> DrainSummary:
        policy, fleet, queue = self.policy, self.fleet, run.config.queue
        drain_id = run.fan_out_slot or str(uuid.uuid4())
        try:
            joined = fleet.join(
                queue,
                drain_id,
                origin="fan_out" if run.fan_out_slot else "schedule",
                lease_seconds=policy.lease_seconds,
                cap=policy.max_concurrency,
            )
        except LedgerError as exc:
            return stopped_before_receiving(exc)
        if not joined:
            logger.info(
                "%d drains of this queue are alive already; this one stops",
                policy.max_concurrency,
                extra={"action": "at_capacity", "queue": queue},
            )
            return DrainSummary(stopped="at_capacity")
        counting = CountingQueue(run.queue)
        monitor = FleetMonitor(
            policy,
            drain_id,
            fleet,
            queue=run.queue,
            consumed=counting.consumed,
            starter=self.starter,
        )
        try:
            with monitor.running():
                summary = next_drain(replace(run, queue=counting))
        finally:
            # Should this fail, its lease ends on its own within LEASE_SECONDS.
            msg = "could not give back this drain's lease"
            _leave(fleet, queue, [drain_id], msg, "fleet_leave_failed")
        summary.counters.update(
            fanned_out=monitor.fanned_out,
            fan_out_throttled=monitor.throttled,
            fan_out_failed=monitor.failed,
        )
        return summary

    def close(self) -> None:
        if (close_fleet := getattr(self.fleet, "close", None)) is not None:
            close_fleet()


def _leave(
    fleet: DrainFleetPort, queue: str, drain_ids: Sequence[str], message: str, action: str
) -> None:
    try:
        fleet.leave(queue, drain_ids)
    except LedgerError as exc:
        logger.warning(message, extra={"action": action, "detail": str(exc)})


class CountingQueue(ForwardingQueue):
    """A ``QueuePort`` that counts the messages its consumes received: the drain's rate."""

    def __init__(self, inner: QueuePort) -> None:
        super().__init__(inner)
        self._lock = threading.Lock()
        self._consumed = 0

    def consumed(self) -> int:
        with self._lock:
            return self._consumed

    def _count(self, messages: list[QueueMessage]) -> list[QueueMessage]:
        with self._lock:
            self._consumed += len(messages)
        return messages

    def consume(self, queue: str, max_messages: int = 10) -> list[QueueMessage]:
        return self._count(self._inner.consume(queue, max_messages))

    def send_consume(self, queue: str, max_messages: int = 10) -> Pending[list[QueueMessage]]:
        sent = self._inner.send_consume(queue, max_messages)
        return Pending(
            lambda: self._count(sent.wait()), lambda: self._count(sent.wait(retry=False))
        )
