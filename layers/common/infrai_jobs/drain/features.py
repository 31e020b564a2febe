"""The drain's optional features that need nothing beyond its own adapters: idle polling, lanes
and the second layer (fan-out is in ``drain.fan_out``, tracing in ``runtime.observability``)."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Protocol

from infrai_jobs.drain.model import (
    DrainConfig,
    DrainFeature,
    DrainRun,
    DrainSummary,
    LaneClock,
    NextDrain,
    merge_summaries,
)
from infrai_jobs.errors import DatabaseBusy
from infrai_jobs.jobs.registry import JobContext, JsonValue
from infrai_jobs.work.ports import EffectGuard, LedgerPort

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class IdlePolling(DrainFeature):
    """After an empty consume: wait ``poll_ms`` and consume again while the idle window from the
    lane's start (0: the whole budget) and the time left allow (docs/design.md, "Idle polling")."""

    in_fanned_out_drains = False
    poll_ms: int
    window_seconds: float = 0.0

    def around_drain(self, run: DrainRun, next_drain: NextDrain) -> DrainSummary:
        if shortfall := self.shortfall(run.config.batch_budget_ms, run.time_left_ms()):
            logger.warning(
                "this drain does not poll an idle queue",
                extra={"action": "idle_polling_off", "detail": shortfall},
            )
        return next_drain(run)

    def poll_again(self, config: DrainConfig, time: LaneClock, counters: Counter[str]) -> bool:
        if self.poll_ms <= 0:
            return False
        wait = self.poll_ms / 1000
        if self.window_seconds > 0 and time.clock() + wait > time.started_at + self.window_seconds:
            return False
        if time.time_left_ms() - self.poll_ms < config.batch_budget_ms:
            return False
        time.sleep(wait)
        counters["idle_polls"] += 1
        return True

    def shortfall(self, batch_budget_ms: int, time_budget_ms: int) -> str:
        """Why this polling could not poll even once in ``time_budget_ms``, or ""."""
        poll_ms = self.poll_ms
        if poll_ms <= 0:
            return ""
        if time_budget_ms - poll_ms < batch_budget_ms:
            return (
                f"idle polling (DRAIN_IDLE_POLL_MS={poll_ms}) cannot poll: after one interval the "
                f"time left of a {time_budget_ms / 1000:g} s budget is below "
                f"DRAIN_BATCH_BUDGET_MS ({batch_budget_ms} ms)"
            )
        if 0 < self.window_seconds * 1000 < poll_ms:
            return (
                f"idle polling (DRAIN_IDLE_POLL_MS={poll_ms}) cannot poll: its window, "
                f"DRAIN_IDLE_WINDOW_SECONDS={self.window_seconds:g}, is shorter than one interval"
            )
        return ""


class ClosableLedger(LedgerPort, Protocol):
    def close(self) -> None: ...


@dataclass(eq=False)
class Lanes(DrainFeature):
    """DRAIN_LANES > 1: several lanes drain one queue at once, the claims keeping them apart,
    each on its own database connection (kept for reuse); the HTTP pool is shared. Every lane's
    connection is opened before any lane consumes: one the database refuses as full is shed for
    this invocation (``lanes_shed``), the drain running with the lanes it could open."""

    count: int
    _make_ledger: Callable[[], ClosableLedger]
    extra_ledgers: list[ClosableLedger] = field(init=False, default_factory=list)

    def around_drain(self, run: DrainRun, next_drain: NextDrain) -> DrainSummary:
        while len(self.extra_ledgers) < self.count - 1:
            self.extra_ledgers.append(self._make_ledger())
        # A lane's other failure (the database down) is raised before any lane consumes.
        ledgers = [run.ledger, *filter(_opened, self.extra_ledgers)]
        if shed := self.count - len(ledgers):
            logger.warning(
                "the ledger database is full: %d of %d lanes shed",
                *(shed, self.count),
                extra={"action": "lanes_shed", "lanes_shed": shed},
            )
        with ThreadPoolExecutor(max_workers=len(ledgers), thread_name_prefix="lane") as pool:
            futures = [pool.submit(next_drain, replace(run, ledger=ledger)) for ledger in ledgers]
            summary = merge_summaries([future.result() for future in futures])
        summary.counters["lanes_shed"] += shed
        return summary

    def close(self) -> None:
        for ledger in self.extra_ledgers:
            ledger.close()


def _opened(ledger: LedgerPort) -> bool:
    """False when the database refuses the lane's connection as full."""
    try:
        ledger.ping()
    except DatabaseBusy:
        return False
    return True


class SecondLayerGuard(EffectGuard, Protocol):
    """The second layer as the drain uses it (``aws.second_layer.SecondLayer`` says what each
    method does)."""

    def start_invocation(self, time_left_ms: Callable[[], int]) -> None: ...

    def take_hits(self) -> int: ...


@dataclass(eq=False)
class SecondLayerFeature(DrainFeature):
    """The optional second layer (IDEMPOTENCY_BACKEND): each external job's effect runs through
    the guard, keyed by the same idempotency key, after the ledger claim was won."""

    guard: SecondLayerGuard

    def around_drain(self, run: DrainRun, next_drain: NextDrain) -> DrainSummary:
        # Every invocation: an in-progress record of a crashed call expires with its deadline.
        self.guard.start_invocation(run.time_left_ms)
        return next_drain(run)

    def around_effect(
        self, ctx: JobContext, fingerprint: str, call: Callable[[], JsonValue]
    ) -> JsonValue:
        return self.guard.run(ctx.idem_key, fingerprint, call)
