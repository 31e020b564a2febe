"""Idle polling on the in-memory fakes: after an empty consume the lane waits and consumes again,
for as long as its idle window and its time budget allow, and not at all by default.

The same against real PostgreSQL and the emulator, in real time, is in
``tests/integration/test_idle_polling_latency.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from fakes import FakeClock, InMemoryLedger, InMemoryQueue

from infrai_jobs.config.settings import DrainSettings
from infrai_jobs.drain.features import IdlePolling
from infrai_jobs.drain.loop import drain
from infrai_jobs.drain.model import DrainConfig, DrainSummary
from infrai_jobs.errors import ConfigurationError
from infrai_jobs.jobs.registry import Effect, JobContext, JobRegistry, JsonValue, Payload
from infrai_jobs.queue.models import QueueMessage
from infrai_jobs.runtime.drain_service import DrainService, drain_features

QUEUE = "billing-jobs"
DLQ = "billing-jobs-dlq"


class TimedQueue(InMemoryQueue):
    """The fake queue, remembering when each consume happened and what it served."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock)
        self.consumes: list[tuple[float, int]] = []

    def consume(self, queue: str, max_messages: int = 10) -> list[QueueMessage]:
        served = super().consume(queue, max_messages)
        self.consumes.append((self.clock(), len(served)))
        return served


@dataclass
class Kit:
    clock: FakeClock = field(default_factory=FakeClock)
    ran: list[tuple[float, str]] = field(default_factory=list)
    # Called with the time since the start at every idle wait, after the clock moved.
    on_wait: Callable[[float], None] | None = None

    def __post_init__(self) -> None:
        self.queue = TimedQueue(self.clock)
        self.queue.ensure_queue(QUEUE, dlq=DLQ)
        self.ledger = InMemoryLedger(self.clock)
        self.registry = JobRegistry()
        self.started = self.clock()

        @self.registry.job("test.db", effect=Effect.DATABASE, identity=("id",))
        def db_job(payload: Payload, ctx: JobContext) -> JsonValue:
            self.ran.append((self.clock() - self.started, ctx.idem_key))
            return None

    def publish(self, number: int) -> None:
        self.queue.publish_raw(QUEUE, {"job": "test.db", "id": number})

    def sleep(self, seconds: float) -> None:
        self.clock.advance(seconds)
        if self.on_wait is not None:
            self.on_wait(self.clock() - self.started)

    def drain(
        self, budget_seconds: float = 240, idle_poll_ms: int = 0, idle_window_seconds: float = 0
    ) -> DrainSummary:
        deadline = self.started + budget_seconds
        polling = [IdlePolling(idle_poll_ms, idle_window_seconds)] if idle_poll_ms else []
        return drain(
            self.queue,
            self.ledger,
            self.registry,
            DrainConfig(queue=QUEUE, batch_budget_ms=20_000, features=polling),
            lambda: int((deadline - self.clock()) * 1000),
            clock=self.clock,
            sleep=self.sleep,
        )


def test_by_default_a_drain_stops_at_the_first_empty_consume() -> None:
    # Given an empty queue and no idle polling (DRAIN_IDLE_POLL_MS unset)
    kit = Kit()
    # When a drain runs
    summary = kit.drain()
    # Then it consumed once, waited never, and stopped
    assert (summary.stopped, summary.counters["idle_polls"]) == ("empty", 0)
    assert len(kit.queue.consumes) == 1


def test_an_idle_drain_picks_up_a_job_published_a_second_later_within_one_poll() -> None:
    # Given an empty queue, idle polling every 200 ms for a 10 s window, and a job that is
    # published 1 s after the drain started
    kit = Kit()
    published: list[float] = []

    def publish_once(elapsed: float) -> None:
        if elapsed >= 1.0 and not published:
            published.append(elapsed)
            kit.publish(1)

    kit.on_wait = publish_once
    # When the drain runs
    summary = kit.drain(idle_poll_ms=200, idle_window_seconds=10)
    # Then the job ran once, within one poll interval of its publish
    assert summary.done == 1
    ((ran_at, key),) = kit.ran
    assert key == "test.db:1"
    assert ran_at - published[0] <= 0.2
    # And the drain polled on until its window ended: 10 s of 200 ms waits, then stopped
    assert summary.stopped == "empty"
    assert summary.counters["idle_polls"] == 50 - 1
    assert kit.clock() - kit.started <= 10


def test_polling_stops_where_the_time_left_no_longer_covers_a_batch() -> None:
    # Given a 30 s budget, 20 s per batch, and a window longer than the budget
    kit = Kit()
    # When a drain polls an empty queue every second
    summary = kit.drain(budget_seconds=30, idle_poll_ms=1_000, idle_window_seconds=120)
    # Then it stops polling once a wait would leave less than a batch's budget: after 10 s
    assert summary.stopped == "empty"
    assert summary.counters["idle_polls"] == 10
    last_consume_at = kit.queue.consumes[-1][0] - kit.started
    assert 30 - last_consume_at >= 20


def test_the_window_runs_from_the_start_so_a_drain_busy_past_it_stops_at_empty() -> None:
    # Given a backlog that keeps the drain busy past its 2 s idle window (each job 1 s)
    kit = Kit()
    for number in range(3):
        kit.publish(number)
    original = kit.queue.consume

    def consume_slowly(queue: str, max_messages: int = 10) -> list[QueueMessage]:
        served = original(queue, max_messages)
        kit.clock.advance(1.0 * len(served))
        return served

    kit.queue.consume = consume_slowly  # type: ignore[method-assign]
    # When the drain runs with idle polling
    summary = kit.drain(idle_poll_ms=200, idle_window_seconds=2)
    # Then it drained the backlog and, the window being over, did not poll after it
    assert summary.done == 3
    assert (summary.stopped, summary.counters["idle_polls"]) == ("empty", 0)


def test_the_settings_reach_scheduled_drains_and_not_the_ones_a_fan_out_started() -> None:
    # Given DRAIN_IDLE_POLL_MS and DRAIN_IDLE_WINDOW_SECONDS as the template sets them
    settings = DrainSettings.from_env(
        {"DRAIN_IDLE_POLL_MS": "200", "DRAIN_IDLE_WINDOW_SECONDS": "55"}
    )
    clock = FakeClock()
    ledger = InMemoryLedger(clock)
    service = DrainService(
        settings=settings,
        queue=InMemoryQueue(clock),
        ledger=ledger,  # type: ignore[arg-type]
        registry=JobRegistry(),
        features=drain_features(settings, make_lane_ledger=lambda: ledger),
    )
    # Then a scheduled drain (and the CLI's) polls with them, within its time budget
    (polling,) = service.config().features
    assert isinstance(polling, IdlePolling)
    assert (polling.poll_ms, polling.window_seconds) == (200, 55)
    # And a drain started by a fan-out drains the backlog and stops
    assert service.config(fanned_out=True).features == ()


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"DRAIN_IDLE_POLL_MS": "10"}, "DRAIN_IDLE_POLL_MS=10 is below 50"),
        ({"DRAIN_IDLE_POLL_MS": "-1"}, "below the minimum of 0"),
        ({"DRAIN_MAX_CONCURRENCY": "5000"}, "DRAIN_MAX_CONCURRENCY=5000 is above 1000"),
        ({"DRAIN_FANOUT_AFTER_SECONDS": "0"}, "below the minimum of 1"),
    ],
)
def test_bad_latency_and_scale_settings_name_the_setting(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        DrainSettings.from_env(env)
