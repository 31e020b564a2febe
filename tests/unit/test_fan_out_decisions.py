"""Backlog fan-out's decisions on the in-memory fakes: how many drains a backlog calls for, who
starts them, the cap, throttles, leases, and a drain that would be one too many.

The same rules against real PostgreSQL and real drain processes are in
``tests/integration/test_fan_out_fleet.py``.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest
from fakes import FakeClock, InMemoryDrainFleet, InMemoryQueue, RecordingDrainStarter

from infrai_jobs.config.settings import DrainSettings
from infrai_jobs.drain.fan_out import (
    FAN_OUT_EVENT_KEY,
    FanOutPolicy,
    FleetMonitor,
    drains_wanted,
    fan_out_event,
    fan_out_slot,
)
from infrai_jobs.jobs.registry import Effect, JobContext, JobRegistry, JsonValue, Payload
from infrai_jobs.runtime.drain_service import DrainService, drain_features
from infrai_jobs.runtime.factory import make_drain_starter

QUEUE = "billing-jobs"
DLQ = "billing-jobs-dlq"


@pytest.mark.parametrize(
    ("available", "rate", "after", "cap", "wanted"),
    [
        (0, 100.0, 30, 8, 0),  # no backlog
        (5_000, 0.0, 30, 8, 0),  # no rate measured yet
        (3_000, 100.0, 30, 8, 1),  # one drain clears it in exactly 30 s
        (3_001, 100.0, 30, 8, 2),  # one message more needs a second drain
        (12_000, 100.0, 30, 8, 4),
        (1_000_000, 100.0, 30, 8, 8),  # never more than the cap
    ],
)
def test_drains_wanted_clear_the_backlog_within_the_fan_out_time(
    available: int, rate: float, after: int, cap: int, wanted: int
) -> None:
    assert drains_wanted(available, rate, after, cap) == wanted


class Kit:
    """One drain's monitor on a fake queue, fleet and starter, its rate set by hand."""

    def __init__(self, *, cap: int = 4, after: float = 30, backlog: int = 0) -> None:
        self.clock = FakeClock()
        self.queue = InMemoryQueue(self.clock)
        self.queue.ensure_queue(QUEUE, dlq=DLQ)
        for number in range(backlog):
            self.queue.publish_raw(QUEUE, {"job": "test.db", "id": number})
        self.fleet = InMemoryDrainFleet(self.clock)
        self.starter = RecordingDrainStarter()
        self.policy = FanOutPolicy(queue=QUEUE, max_concurrency=cap, after_seconds=after)
        self.received = 0

    def member(self, drain_id: str | None = None) -> FleetMonitor:
        drain_id = drain_id or str(uuid.uuid4())
        joined = self.fleet.join(
            QUEUE, drain_id, origin="schedule", lease_seconds=self.policy.lease_seconds, cap=99
        )
        assert joined
        return FleetMonitor(
            self.policy,
            drain_id,
            self.fleet,
            queue=self.queue,
            consumed=lambda: self.received,
            starter=self.starter,
            clock=self.clock,
        )

    def consume_for(self, seconds: float, rate: float) -> None:
        self.clock.advance(seconds)
        self.received += int(seconds * rate)


def test_a_backlog_too_big_for_one_drain_starts_the_drains_that_clear_it_in_time() -> None:
    # Given 100 messages waiting and a drain that measured 1 message a second
    kit = Kit(cap=8, after=30, backlog=100)
    monitor = kit.member()
    kit.consume_for(2, rate=1)
    # When it checks
    check = monitor.check()
    # Then it starts the 3 more drains that clear it within 30 s (ceil(100 / 30) = 4)
    assert (check.wanted, check.started) == (4, 3)
    assert monitor.fanned_out == 3
    # And each started drain's event names a slot reserved for it in the ledger
    slots = [fan_out_slot(event) for event in kit.starter.events]
    leases = kit.fleet.leases(QUEUE)
    assert all(slot in leases and leases[slot].origin == "fan_out" for slot in slots)
    assert kit.fleet.live(QUEUE) == 4


def test_a_backlog_the_drain_clears_in_time_starts_nothing_and_asks_the_fleet_nothing() -> None:
    # Given 20 messages, which 1 a second clears in 20 s, under a 30 s fan-out time
    kit = Kit(after=30, backlog=20)
    monitor = kit.member()
    kit.consume_for(2, rate=1)
    # When it checks
    check = monitor.check()
    # Then no drain is started, and no slot reserved
    assert check.started == 0
    assert kit.starter.events == []
    assert kit.fleet.live(QUEUE) == 1


def test_two_drains_deciding_one_after_the_other_never_both_start_the_missing_ones() -> None:
    # Given two drains alive on a backlog that wants every drain of the cap
    kit = Kit(cap=4, after=30, backlog=1_000)
    first, second = kit.member(), kit.member()
    kit.consume_for(2, rate=1)
    # When both check
    started = first.check().started + second.check().started
    # Then only the missing two were started, by the first; the second saw them reserved
    assert started == 2
    assert second.fanned_out == 0
    assert kit.fleet.live(QUEUE) == 4
    assert kit.fleet.peak[QUEUE] == 4


def test_a_drain_at_the_cap_does_not_even_read_the_backlog() -> None:
    # Given the cap's worth of drains alive
    kit = Kit(cap=2, backlog=1_000)
    monitor, _other = kit.member(), kit.member()
    kit.consume_for(2, rate=1)
    # When one checks
    check = monitor.check()
    # Then it only renewed its lease: no stats read, nothing started
    assert (check.live, check.available, check.started) == (2, 0, 0)
    assert kit.starter.events == []


def test_nothing_received_since_the_last_check_is_no_reason_to_fan_out() -> None:
    # Given a drain that has received nothing (an idle poller, or one held up)
    kit = Kit(backlog=1_000)
    monitor = kit.member()
    kit.consume_for(2, rate=0)
    # When it checks
    check = monitor.check()
    # Then it starts nothing
    assert check.started == 0
    assert kit.starter.events == []


def test_the_rate_is_measured_since_the_last_check_not_since_the_start() -> None:
    # Given a drain that polled an idle queue for a minute, then met a burst at 10 a second
    kit = Kit(cap=8, after=3, backlog=90)
    monitor = kit.member()
    kit.consume_for(60, rate=0)
    monitor.check()
    kit.consume_for(2, rate=10)
    # When it checks
    check = monitor.check()
    # Then it judged by 10 a second, not by 20 messages over 62 s (which would want the cap)
    assert check.rate == pytest.approx(10)
    assert check.wanted == 3


@pytest.mark.parametrize(
    ("turn_down", "throttled", "failed"),
    [
        (RecordingDrainStarter.throttle_next, 1, 0),  # counted as throttled
        (RecordingDrainStarter.fail_next, 0, 1),  # refused: counted as failed
    ],
    ids=["throttled", "refused"],
)
def test_an_invoke_turned_down_is_counted_and_its_slots_given_back_never_raised(
    turn_down: Callable[[RecordingDrainStarter], None], throttled: int, failed: int
) -> None:
    # Given a backlog that wants 3 more drains, and Lambda turning down the first invoke
    kit = Kit(cap=4, backlog=1_000)
    monitor = kit.member()
    turn_down(kit.starter)
    kit.consume_for(2, rate=1)
    # When it checks
    check = monitor.check()
    # Then nothing was started, the refusal is counted, and the reserved slots are free again
    assert (check.started, monitor.throttled, monitor.failed) == (0, throttled, failed)
    assert kit.fleet.live(QUEUE) == 1
    # And the next check tries again
    kit.consume_for(2, rate=1)
    assert monitor.check().started == 3


def test_with_a_cap_of_one_the_monitor_only_keeps_the_lease() -> None:
    kit = Kit(cap=1, backlog=1_000)
    monitor = kit.member()
    kit.consume_for(2, rate=1)
    assert monitor.check().started == 0
    assert kit.starter.events == []


def test_a_dead_drains_lease_ends_and_frees_its_slot() -> None:
    # Given a drain that joined and was then killed (it never renews)
    kit = Kit(cap=2)
    kit.member()
    assert kit.fleet.live(QUEUE) == 1
    # When its lease runs out
    kit.clock.advance(kit.policy.lease_seconds + 1)
    # Then it is no longer counted
    assert kit.fleet.live(QUEUE) == 0


def test_a_fan_out_event_carries_its_slot_and_anything_else_is_a_tick() -> None:
    slot = str(uuid.uuid4())
    assert fan_out_slot(fan_out_event(QUEUE, slot, "parent")) == slot
    assert fan_out_slot({"detail-type": "Scheduled Event", "detail": {}}) is None
    assert fan_out_slot({FAN_OUT_EVENT_KEY: {"drain_id": "not-a-uuid"}}) is None
    assert fan_out_slot({FAN_OUT_EVENT_KEY: "junk"}) is None
    assert fan_out_slot(["not", "a", "mapping"]) is None


# --- DrainService as one of a fleet ------------------------------------------------------------


def _registry(effects: list[str]) -> JobRegistry:
    registry = JobRegistry()

    @registry.job("test.db", effect=Effect.DATABASE, identity=("id",))
    def db_job(payload: Payload, ctx: JobContext) -> JsonValue:
        effects.append(ctx.idem_key)
        return None

    return registry


def _service(fleet: InMemoryDrainFleet, queue: InMemoryQueue, effects: list[str]) -> Any:
    from fakes import InMemoryLedger  # noqa: PLC0415

    settings = DrainSettings(queue=QUEUE, dlq=DLQ, drain_max_concurrency=2)
    ledger = InMemoryLedger(fleet.clock)
    return DrainService(
        settings=settings,
        queue=queue,
        ledger=ledger,  # type: ignore[arg-type]
        registry=_registry(effects),
        features=drain_features(
            settings,
            make_lane_ledger=lambda: ledger,
            fleet=fleet,
            starter=RecordingDrainStarter(),
        ),
    )


def _one_job_and_a_fleet() -> tuple[InMemoryQueue, InMemoryDrainFleet]:
    """A queue holding one ``test.db`` job and a fleet with no drain in it, on one fake clock."""
    clock = FakeClock()
    queue = InMemoryQueue(clock)
    queue.ensure_queue(QUEUE, dlq=DLQ)
    queue.publish_raw(QUEUE, {"job": "test.db", "id": 1})
    return queue, InMemoryDrainFleet(clock)


def test_a_drain_that_would_be_one_too_many_stops_before_receiving_anything() -> None:
    # Given a queue with work and the cap's worth of drains alive already
    queue, fleet = _one_job_and_a_fleet()
    for _ in range(2):
        fleet.join(QUEUE, str(uuid.uuid4()), origin="schedule", lease_seconds=30, cap=2)
    effects: list[str] = []
    # When one more drain runs
    summary = _service(fleet, queue, effects).run(lambda: 60_000)
    # Then it stops at once: nothing received, nothing run, no delivery spent
    assert summary.stopped == "at_capacity"
    assert summary.consumed == 0
    assert effects == []
    assert queue.stats(QUEUE).available_count == 1


def test_a_started_drain_adopts_its_reserved_slot_even_at_the_cap() -> None:
    # Given one drain alive and the slot it reserved for a second (the cap is two)
    queue, fleet = _one_job_and_a_fleet()
    fleet.join(QUEUE, str(uuid.uuid4()), origin="schedule", lease_seconds=30, cap=2)
    (slot,) = fleet.reserve(QUEUE, wanted=2, cap=2, lease_seconds=30)
    effects: list[str] = []
    # When the started drain runs with its slot
    summary = _service(fleet, queue, effects).run(lambda: 60_000, fan_out_slot=slot)
    # Then it drains, and gives the slot back when done
    assert summary.stopped == "empty"
    assert len(effects) == 1
    assert slot not in fleet.leases(QUEUE)
    assert fleet.live(QUEUE) == 1


# --- Who may start drains: a local invocation never reaches the real Lambda service ----------

_LAMBDA_ENV = {"AWS_LAMBDA_FUNCTION_NAME": "DrainFunction", "DRAIN_MAX_CONCURRENCY": "4"}


@pytest.mark.parametrize(
    ("environment", "starts_drains"),
    [
        ({}, True),  # in Lambda
        ({"AWS_SAM_LOCAL": "true"}, False),  # sam local invoke: no local Lambda endpoint
        ({"AWS_SAM_LOCAL": "true", "AWS_ENDPOINT_URL_LAMBDA": "https://lambda.example"}, False),
        ({"AWS_SAM_LOCAL": "true", "AWS_ENDPOINT_URL_LAMBDA": "http://127.0.0.1:9001"}, True),
        ({"AWS_SAM_LOCAL": "true", "AWS_ENDPOINT_URL_LAMBDA": "http://localhost:9001"}, True),
    ],
)
def test_a_local_invocation_fans_out_only_through_a_lambda_endpoint_on_loopback(
    environment: dict[str, str], starts_drains: bool
) -> None:
    # Given DrainFunction's settings with fan-out on, in Lambda or in a local invocation
    settings = DrainSettings.from_env({**_LAMBDA_ENV, **environment})
    # When the drain's starter is built
    starter = make_drain_starter(settings)
    # Then a local run gets one only when its Lambda endpoint is the local one
    assert (starter is not None) is starts_drains
