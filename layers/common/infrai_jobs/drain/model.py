"""What one drain is told (``DrainConfig``) and what it reports (``DrainSummary``).

The loop, the batch and the ack pipeline all read these; they live apart from the loop so that
none of the three imports another only for its types.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, fields
from typing import Any

from infrai_jobs.jobs.registry import JobContext
from infrai_jobs.ledger.ports import EffectGuard
from infrai_jobs.queue_contract import CONSUME_CAP, DEFAULT_VISIBILITY_TIMEOUT_SECONDS


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
    # Around each handler run, with tracing on (``observability.message_tracing``): a span
    # that continues the producer's trace. None: no tracing, nothing imported.
    message_span: Callable[[JobContext], AbstractContextManager[object]] | None = None


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
    # Messages that came back while their own claim's lease was live: the queue's visibility
    # timeout is shorter than the drain was told (INFRAI_VISIBILITY_TIMEOUT_SECONDS).
    visibility_mismatches: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    stopped: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            **{name: getattr(self, name) for name in _SUMMARY_TOTALS},
            "outcomes": dict(sorted(self.outcomes.items())),
            "stopped": self.stopped,
        }


# The counters, in field order: what the lanes of one invocation add up.
_SUMMARY_TOTALS = tuple(
    f.name for f in fields(DrainSummary) if f.name not in {"outcomes", "stopped"}
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
    for reason in ("ledger_unavailable", "interrupted", "time_budget", "max_batches", "empty"):
        if reason in reasons:
            merged.stopped = reason
            break
    return merged
