"""What one drain is told (``DrainConfig``), what it reports (``DrainSummary``), and the seam the
optional features plug into (``DrainFeature``)."""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from infrai_jobs.config.settings import DrainSettings
from infrai_jobs.jobs.registry import DerivedJob, JobContext, JsonValue
from infrai_jobs.queue_contract import CONSUME_CAP
from infrai_jobs.work.outcomes import OUTCOME_RULES
from infrai_jobs.work.states import JobRun

if TYPE_CHECKING:
    from infrai_jobs.queue.ports import QueuePort
    from infrai_jobs.work.ports import LedgerPort


@dataclass(frozen=True, slots=True)
class DrainConfig:
    queue: str
    batch_size: int = CONSUME_CAP
    # The settings' (DRAIN_BATCH_BUDGET_MS, LEASE_GRACE_SECONDS, INFRAI_VISIBILITY_TIMEOUT_SECONDS).
    batch_budget_ms: int = DrainSettings().batch_budget_ms
    lease_grace_seconds: int = DrainSettings().lease_grace_seconds
    visibility_timeout_seconds: int = DrainSettings().visibility_timeout_seconds
    max_batches: int | None = None
    # The optional features switched on, outermost first.
    features: Sequence[DrainFeature] = ()


# The features' counters, in report order; each is reported (0 when off): the keys never change.
FEATURE_COUNTERS = (
    "idle_polls",  # IdlePolling: empty consumes it waited after and repeated
    "fanned_out",  # FleetMembership: drains this one started for the backlog
    "fan_out_throttled",  # ... starts Lambda throttled
    "fan_out_failed",  # ... starts Lambda refused
    "deferred_ran",  # FlowControl: deferred jobs this drain took from the ledger and ran
    "deferred_done",  # ... of them, done
    "deferred_failed",  # ... of them, failed for good (out of attempts or a final error)
    "rate_limit_waits",  # ... handler starts that waited for their job's rate limit
    "database_full",  # the drain's first connection: refused as full after its wait, so 1
    "lanes_shed",  # Lanes: lanes the database refused as full, this drain running without them
)


class _Total:
    """A read-only ``DrainSummary`` total named after its bucket (``summary.done``)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.bucket = name

    def __get__(self, summary: DrainSummary, owner: type | None = None) -> int:
        return summary.total(self.bucket)


@dataclass
class DrainSummary:
    """What one drain did: one outcome per consumed message in ``outcomes``, whose totals
    (``done``, ``retried``, ...) follow by ``OUTCOME_RULES``; the features' own ``counters``."""

    consumed: int = 0
    acked: int = 0
    ack_lost: int = 0
    ack_failed: int = 0
    batches: int = 0
    takeovers: int = 0
    # Lost or unreadable consume answers, and those that served one message (so isolated it).
    answers_lost: int = 0
    unreadable: int = 0
    # Messages back while their claim's lease was live (INFRAI_VISIBILITY_TIMEOUT_SECONDS too long).
    visibility_mismatches: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    counters: Counter[str] = field(default_factory=Counter)
    stopped: str = ""

    def total(self, bucket: str) -> int:
        """Messages whose outcome counts under ``bucket`` (an ``OutcomeRule.bucket``)."""
        return sum(n for o, n in self.outcomes.items() if _BUCKET_OF.get(o) == bucket)

    done = _Total()
    duplicates = _Total()
    retried = _Total()
    failed = _Total()
    parked = _Total()
    deferred = _Total()

    def as_dict(self) -> dict[str, Any]:
        counts = {
            **{name: getattr(self, name) for name in _CORE_COUNTERS},
            **{bucket: self.total(bucket) for bucket in OUTCOME_BUCKETS},
            **{name: self.counters[name] for name in FEATURE_COUNTERS},
        }
        return {
            **{name: counts[name] for name in SUMMARY_COUNTS},
            "outcomes": dict(sorted(self.outcomes.items())),
            "stopped": self.stopped,
        }


# The outcome table's summary totals, in the order the summary reports them.
OUTCOME_BUCKETS = ("done", "duplicates", "retried", "failed", "parked", "deferred")
# Each outcome's summary total, by the outcome's value (the keys of ``outcomes``).
_BUCKET_OF = {o.value: rule.bucket for o, rule in OUTCOME_RULES.items()}
# The consume and ack counters the core loop keeps, in field order: what lanes add up.
_CORE_COUNTERS = tuple(
    f.name for f in fields(DrainSummary) if f.name not in {"outcomes", "counters", "stopped"}
)
# Every count the summary reports, in the order it reports them (the metrics follow it, as a
# unit test holds): visibility_mismatches, the last core counter, comes after the fan-out ones.
SUMMARY_COUNTS = (
    "consumed",
    *OUTCOME_BUCKETS,
    *_CORE_COUNTERS[1:-1],
    *FEATURE_COUNTERS[:4],
    "visibility_mismatches",
    *FEATURE_COUNTERS[4:],
)


def merge_summaries(summaries: Sequence[DrainSummary]) -> DrainSummary:
    merged = DrainSummary()
    for summary in summaries:
        for name in _CORE_COUNTERS:
            setattr(merged, name, getattr(merged, name) + getattr(summary, name))
        merged.outcomes.update(summary.outcomes)
        merged.counters.update(summary.counters)
    reasons = {s.stopped for s in summaries}
    # The most alarming reason wins: an outage must not hide behind a lane that found no work.
    alarming = ("ledger_unavailable", "database_full", "interrupted", "time_budget", "max_batches")
    merged.stopped = next((r for r in (*alarming, "empty") if r in reasons), "")
    return merged


@dataclass(frozen=True, slots=True)
class LaneClock:
    """One lane's time as a feature's hooks read it (a test passes its fake clock's)."""

    started_at: float
    time_left_ms: Callable[[], int]
    clock: Callable[[], float]
    sleep: Callable[[float], None]


@dataclass(frozen=True, slots=True)
class DrainRun:
    """One invocation's drain as the features see it; each may hand the next a changed copy."""

    queue: QueuePort
    ledger: LedgerPort
    config: DrainConfig
    time_left_ms: Callable[[], int]
    stop_requested: Callable[[], bool]
    # The slot a fan-out reserved for this drain (its event says so); None for a schedule tick.
    fan_out_slot: str | None = None


@dataclass(frozen=True, slots=True)
class HandlerAttempt:
    """One handler run as ``around_handler`` sees it; the claim's token fences a release."""

    ctx: JobContext
    derived: DerivedJob
    claim_token: uuid.UUID
    # The lane's ledger: flow control's statements run on its connection.
    ledger: LedgerPort


# What a feature's ``around_drain`` calls to go on: the features after it, then the lane.
NextDrain = Callable[[DrainRun], DrainSummary]


class DrainFeature:
    """An optional feature of the drain: it overrides the hooks it needs and keeps its counters
    in ``DrainSummary.counters``. ``around_drain`` wraps the rest of the drain, ``poll_again``
    decides after an empty consume, ``around_handler`` wraps a run (never raising), and
    ``around_effect`` an external job's call (what it raises becomes the run's outcome)."""

    # False for a feature a drain started by a fan-out goes without.
    in_fanned_out_drains: bool = True

    def around_drain(self, run: DrainRun, next_drain: NextDrain) -> DrainSummary:
        return next_drain(run)

    def poll_again(self, config: DrainConfig, time: LaneClock, counters: Counter[str]) -> bool:
        return False

    def around_handler(self, attempt: HandlerAttempt, run: Callable[[], JobRun]) -> JobRun:
        return run()

    def around_effect(
        self, ctx: JobContext, fingerprint: str, call: Callable[[], JsonValue]
    ) -> JsonValue:
        return call()

    def close(self) -> None:
        """Release what the feature holds open (connections)."""
