"""The drain loop on the in-memory fakes: its time budget, its batches and every outcome row of
docs/design.md that the fakes can express, in milliseconds and without a socket.

The same rows run against real Postgres and the emulator in
``tests/integration/test_drain_outcomes.py``; these are the fast tier.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from fakes import FakeClock, InMemoryLedger, InMemoryQueue
from job_modes import fail_as_asked

from infrai_jobs.drain.features import IdlePolling
from infrai_jobs.drain.loop import budget_shortfall, drain
from infrai_jobs.drain.model import DrainConfig, DrainSummary
from infrai_jobs.errors import (
    ConfigurationError,
    InfraiUnavailable,
    PermanentJobError,
)
from infrai_jobs.jobs.registry import (
    Effect,
    JobContext,
    JobDefinition,
    JobRegistry,
    JsonValue,
    Payload,
)
from infrai_jobs.queue.models import Pending, QueueMessage
from infrai_jobs.runtime.drain_service import check_time_budget
from infrai_jobs.work.states import ClaimRow

QUEUE = "billing-jobs"
DLQ = "billing-jobs-dlq"
VISIBILITY = 300
TIME_LEFT_MS = 120_000


class RecordingQueue(InMemoryQueue):
    """The fake queue, remembering how many messages each consume served."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock)
        self.batch_sizes: list[int] = []

    def consume(self, queue: str, max_messages: int = 10) -> list[QueueMessage]:
        served = super().consume(queue, max_messages)
        if served:
            self.batch_sizes.append(len(served))
        return served


@dataclass
class Kit:
    clock: FakeClock
    queue: RecordingQueue
    ledger: InMemoryLedger
    registry: JobRegistry
    # Handler calls per idempotency key: the number of times an effect was attempted.
    calls: Counter[str] = field(default_factory=Counter)

    def publish(self, payload: Any, times: int = 1) -> list[str]:
        return [self.queue.publish_raw(QUEUE, payload) for _ in range(times)]

    def drain(
        self, time_left_ms: Callable[[], int] = lambda: TIME_LEFT_MS, **config: Any
    ) -> DrainSummary:
        return drain(
            self.queue,
            self.ledger,
            self.registry,
            DrainConfig(queue=QUEUE, **config),
            time_left_ms,
            clock=self.clock,
        )

    def publish_database_jobs(self, numbers: range) -> None:
        """A database job for each of ``numbers``, identified by it."""
        for n in numbers:
            self.publish(_db(str(n)))

    def waiting(self) -> tuple[int, int]:
        """The queue's messages available and in flight."""
        stats = self.queue.stats(QUEUE)
        return stats.available_count, stats.in_flight_count

    def redeliver(self) -> None:
        """Let every unacked delivery's visibility lapse."""
        self.clock.advance(VISIBILITY + 1)

    def row(self, key: str) -> ClaimRow:
        row = self.ledger.get(key)
        assert row is not None, f"no claim row for {key}"
        return row

    def fingerprint(self, payload: Payload) -> str:
        return self.registry.derive(payload).fingerprint

    def seed_running_claim(
        self, payload: Payload, *, message_id: str, effect: Effect, lease_for: timedelta
    ) -> ClaimRow:
        """The ``running`` claim a delivery of ``payload`` would hold: under its derived key, with
        its fingerprint, the lease ending ``lease_for`` after now (negative: already over)."""
        return self.ledger.seed(
            self.registry.derive(payload).idem_key,
            message_id=message_id,
            effect=effect,
            fingerprint=self.fingerprint(payload),
            lease_until=self.clock.utcnow() + lease_for,
        )


def _act(payload: Payload) -> JsonValue:
    """What a test job does, steered by the payload's ``mode``."""
    fail_as_asked(payload)
    mode = payload.get("mode", "ok")
    if mode == "long_error":
        raise PermanentJobError("x" * 5000)
    if mode == "unserializable":
        return {"ids": {1, 2}}
    if mode == "nan":
        return float("nan")
    if mode == "echo":
        return {"echo": payload["text"]}
    if mode == "error_echo":
        raise PermanentJobError(f"cannot use {payload['text']}")
    if mode == "deep":
        nested: list[Any] = []
        for _ in range(100_000):
            nested = [nested]
        return nested
    return {"id": payload["id"]}


@pytest.fixture
def kit() -> Kit:
    clock = FakeClock()
    queue = RecordingQueue(clock)
    queue.ensure_queue(QUEUE, dlq=DLQ)
    kit = Kit(clock, queue, InMemoryLedger(clock), JobRegistry())

    def counted(payload: Payload, ctx: JobContext) -> JsonValue:
        kit.calls[ctx.idem_key] += 1
        return _act(payload)

    def hijacked(payload: Payload, ctx: JobContext) -> JsonValue:
        # An operator re-assigns the claim while the effect runs.
        kit.calls[ctx.idem_key] += 1
        kit.ledger.reassign(ctx.idem_key)
        return {"sent": True}

    kit.registry.job("test.db", effect=Effect.DATABASE, identity=("id",))(counted)
    kit.registry.job("test.ext", effect=Effect.EXTERNAL, identity=("id",))(counted)
    kit.registry.job("test.idem", effect=Effect.EXTERNAL_IDEMPOTENT, identity=("id",))(counted)
    kit.registry.job("test.hijacked", effect=Effect.EXTERNAL, identity=("id",))(hijacked)
    return kit


def _db(ident: str, **fields: Any) -> dict[str, Any]:
    return {"job": "test.db", "id": ident, **fields}


def _ext(ident: str, **fields: Any) -> dict[str, Any]:
    return {"job": "test.ext", "id": ident, **fields}


# --- the time budget and the batches ----------------------------------------------------------


def test_no_batch_is_consumed_when_the_time_left_cannot_cover_one(kit: Kit) -> None:
    # Given a waiting job and less time left than one batch may need
    kit.publish(_db("a"))
    # When the drain runs
    summary = kit.drain(time_left_ms=lambda: 5_000, batch_budget_ms=20_000)
    # Then it consumed nothing, so no delivery was burned
    assert (summary.consumed, summary.batches, summary.stopped) == (0, 0, "time_budget")
    assert kit.queue.stats(QUEUE).available_count == 1
    (message,) = kit.queue.consume(QUEUE)
    assert message.delivery_count == 1


@pytest.mark.parametrize(
    ("budget_ms", "poll_ms", "window_s", "refused", "polls"),
    [
        (5_000, 0, 0, True, True),  # less than one batch budget: refused
        (19_999, 0, 0, True, True),
        (20_000, 0, 0, False, True),  # exactly one batch
        (3_000, 200, 0, True, False),  # the idle poller: refused, cannot poll either
        (20_100, 200, 0, False, False),  # one batch, but no poll after it
        (20_200, 200, 0, False, True),
        (60_000, 200, 0.1, False, False),  # a window shorter than one interval
        (60_000, 200, 58, False, True),
    ],
)
def test_a_drain_says_when_its_time_cannot_hold_a_batch_or_a_poll(
    budget_ms: int, poll_ms: int, window_s: float, refused: bool, polls: bool
) -> None:
    # Given a drain's batch budget of 20 s, its idle polling and its time budget
    polling = IdlePolling(poll_ms, window_s)
    config = DrainConfig(queue=QUEUE, batch_budget_ms=20_000, features=[polling])
    # When its budget is checked
    # Then one that cannot hold a batch is refused with the reason, before anything is received
    if refused:
        with pytest.raises(ConfigurationError, match="cannot hold one batch"):
            check_time_budget(config, budget_ms)
        assert budget_shortfall(config.batch_budget_ms, budget_ms)
    else:
        check_time_budget(config, budget_ms)
        assert budget_shortfall(config.batch_budget_ms, budget_ms) == ""
    # And idle polling that cannot poll has a reason of its own (a warning, the drain runs)
    assert (polling.shortfall(config.batch_budget_ms, budget_ms) == "") is (polls or poll_ms == 0)


def test_a_stop_request_ends_the_drain_before_its_next_receive_and_settles_what_it_holds(
    kit: Kit,
) -> None:
    # Given 35 jobs, and a stop requested once the first batch has been run
    kit.publish_database_jobs(range(35))

    def stop_requested() -> bool:
        return kit.ledger.calls["run_database_batch"] >= 1

    # When the drain runs
    summary = drain(
        kit.queue,
        kit.ledger,
        kit.registry,
        DrainConfig(queue=QUEUE),
        lambda: TIME_LEFT_MS,
        clock=kit.clock,
        stop_requested=stop_requested,
    )
    # Then it finished the batch it was running and the one received ahead, acked both, and
    # received nothing more
    assert (summary.batches, summary.consumed, summary.acked) == (2, 20, 20)
    assert summary.stopped == "interrupted"
    assert kit.waiting() == (15, 0)


def test_the_loop_stops_when_the_budget_runs_out_between_batches(kit: Kit) -> None:
    # Given 25 jobs and a budget that covers two batches only
    kit.publish_database_jobs(range(25))

    # (each batch processed takes 20 s of the 60 s left)
    def time_left() -> int:
        return 60_000 - 20_001 * kit.ledger.calls["run_database_batch"]

    # When the drain runs
    summary = kit.drain(time_left_ms=time_left, batch_budget_ms=20_000)
    # Then two full batches ran and the rest waits, undelivered
    assert (summary.batches, summary.consumed, summary.done) == (2, 20, 20)
    assert summary.stopped == "time_budget"
    assert kit.waiting() == (5, 0)


def test_a_batch_whose_receive_ran_long_is_left_for_redelivery_not_cut_off(kit: Kit) -> None:
    # Given 20 jobs, and a second receive that takes 30 s of the 45 s left (retries, say)
    kit.publish_database_jobs(range(20))

    def time_left() -> int:
        return 45_000 - (30_000 if len(kit.queue.batch_sizes) >= 2 else 0)

    # When the drain runs with a 20 s batch budget
    summary = kit.drain(time_left_ms=time_left, batch_budget_ms=20_000)
    # Then the first batch ran, the second was received but not started
    assert (summary.batches, summary.done) == (1, 10)
    assert summary.stopped == "time_budget"
    assert kit.ledger.calls["run_database_batch"] == 1
    # And its ten messages were not acked: they come back after the visibility timeout
    assert kit.queue.stats(QUEUE).in_flight_count == 10
    kit.redeliver()
    again = kit.drain()
    assert (again.done, again.stopped) == (10, "empty")
    assert sum(kit.calls.values()) == 20


def test_a_job_whose_key_rule_is_broken_rejects_its_messages_only(kit: Kit) -> None:
    # Given a job definition that got past registration with a rule no key can be made from
    # (registration refuses it; this one is put in place behind its back)
    bad = JobDefinition("billing:bad", Effect.DATABASE, lambda p, c: None, identity=("id",))
    kit.registry._jobs[bad.name] = bad
    # And a batch of nine good jobs and one of that job
    kit.publish_database_jobs(range(9))
    kit.publish({"job": "billing:bad", "id": "x"})
    # When the drain runs
    summary = kit.drain()
    # Then the nine ran and were acked, and that one alone is rejected with the reason
    assert (summary.done, summary.acked) == (9, 9)
    assert summary.outcomes.get("rejected") == 1
    assert kit.queue.stats(QUEUE).in_flight_count == 1


def test_the_loop_drains_in_batches_of_ten_until_empty(kit: Kit) -> None:
    # Given 25 database jobs
    kit.publish_database_jobs(range(25))
    # When drained
    summary = kit.drain()
    # Then three batches of 10, 10 and 5 ran, one ledger transaction each, and all were acked
    assert kit.queue.batch_sizes == [10, 10, 5]
    assert (summary.batches, summary.done, summary.acked) == (3, 25, 25)
    assert summary.stopped == "empty"
    assert kit.ledger.calls["run_database_batch"] == 3
    assert kit.queue.stats(QUEUE).message_count == 0


def test_max_batches_ends_the_loop_early(kit: Kit) -> None:
    # Given 25 jobs
    kit.publish_database_jobs(range(25))
    # When drained with at most two batches
    summary = kit.drain(max_batches=2)
    # Then two ran and the rest waits, undelivered
    assert (summary.batches, summary.consumed, summary.stopped) == (2, 20, "max_batches")
    assert kit.queue.stats(QUEUE).available_count == 5


def test_an_empty_queue_ends_the_loop_at_once(kit: Kit) -> None:
    # Given nothing waiting; When drained
    summary = kit.drain()
    # Then the loop stopped at its first consume; the ledger was only asked whether it answers
    # and whether the queue is to be consumed one message at a time
    assert (summary.batches, summary.consumed, summary.stopped) == (0, 0, "empty")
    assert kit.ledger.calls == Counter({"ping": 1, "consume_isolation": 1})


def test_an_unreachable_ledger_stops_the_drain_before_anything_is_received(kit: Kit) -> None:
    # Given a job waiting, and a ledger that does not answer
    kit.publish(_db("waiting"))
    kit.ledger.fail_next("ping")
    # When drained
    summary = kit.drain()
    # Then nothing was received (no delivery spent), and the reason is the ledger
    assert (summary.consumed, summary.stopped) == (0, "ledger_unavailable")
    assert kit.queue.stats(QUEUE).available_count == 1


def test_an_external_claim_lease_is_the_deadline_plus_the_grace(kit: Kit) -> None:
    # Given an external job whose settle fails (so its claim stays as it was claimed)
    kit.publish(_ext("x"))
    kit.ledger.fail_next("settle")
    start = kit.clock.now()
    # When drained with 120 s left and a 60 s grace
    kit.drain(time_left_ms=lambda: 120_000, lease_grace_seconds=60)
    # Then the claim's lease ends 60 s after the invocation's deadline
    assert kit.row("test.ext:x").lease_until == datetime.fromtimestamp(start + 120 + 60, tz=UTC)


# --- two copies in one batch ------------------------------------------------------------------


@pytest.mark.parametrize("payload", [_db("twin"), _ext("twin")])
def test_two_copies_in_one_batch_run_once_and_both_are_acked(
    kit: Kit, payload: dict[str, Any]
) -> None:
    # Given a producer retry: one job published twice
    kit.publish(payload, times=2)
    # When one batch holds both
    summary = kit.drain()
    # Then the work ran once, and both copies are acked
    assert kit.calls == {f"{payload['job']}:twin": 1}
    assert summary.outcomes == {"done": 1, "duplicate_in_flight": 1}
    assert (summary.batches, summary.consumed, summary.done, summary.acked) == (1, 2, 1, 2)
    assert kit.queue.stats(QUEUE).message_count == 0


def test_a_copy_of_a_failing_job_in_its_batch_leaves_the_retries_to_the_first(kit: Kit) -> None:
    # Given two copies of a job that fails transiently
    first, _ = kit.publish(_db("flaky", mode="transient"), times=2)
    # When drained
    summary = kit.drain()
    # Then it ran once; the copy is acked and the first copy's message carries the retries
    assert kit.calls == {"test.db:flaky": 1}
    assert summary.outcomes == {"retry": 1, "duplicate_in_flight": 1}
    assert summary.acked == 1
    kit.redeliver()
    (again,) = kit.queue.consume(QUEUE)
    assert (again.message_id, again.delivery_count) == (first, 2)


# --- the outcome table ------------------------------------------------------------------------


def test_ran_now_and_succeeded_is_done_with_its_result_and_acked(kit: Kit) -> None:
    # Given one database job
    kit.publish(_db("a"))
    # When drained
    summary = kit.drain()
    # Then its claim is done with the result, and its message acked
    row = kit.row("test.db:a")
    assert (row.state, row.result, row.effect, row.job) == (
        "done",
        {"id": "a"},
        "database",
        "test.db",
    )
    assert row.payload_sha256 == kit.fingerprint(_db("a"))
    assert (summary.consumed, summary.done, summary.acked) == (1, 1, 1)
    assert kit.queue.stats(QUEUE).message_count == 0


def test_a_duplicate_of_done_is_acked_and_changes_nothing(kit: Kit) -> None:
    # Given the job done once
    kit.publish(_ext("a"))
    kit.drain()
    before = kit.row("test.ext:a")
    # When a producer retry delivers it again
    kit.publish(_ext("a"))
    summary = kit.drain()
    # Then the effect did not repeat, the row is unchanged and the copy is acked
    assert kit.calls == {"test.ext:a": 1}
    assert kit.row("test.ext:a") == before
    assert (summary.outcomes, summary.acked, summary.duplicates) == ({"duplicate_done": 1}, 1, 1)


def test_a_duplicate_while_another_holds_a_live_claim_is_acked(kit: Kit) -> None:
    # Given another delivery holding a live claim on the job
    payload = _ext("busy")
    before = kit.seed_running_claim(
        payload, message_id="qmsg_other", effect=Effect.EXTERNAL, lease_for=timedelta(hours=1)
    )
    # When a copy arrives
    kit.publish(payload)
    summary = kit.drain()
    # Then it is acked (the owner's message drives retries) and nothing ran or changed
    assert (summary.outcomes, summary.acked) == ({"duplicate_in_flight": 1}, 1)
    assert kit.calls == {}
    assert kit.row("test.ext:busy") == before


def test_an_external_claim_with_an_expired_lease_is_flagged_stuck_and_not_acked(
    kit: Kit,
) -> None:
    # Given an external claim whose holder died an hour ago
    payload = _ext("dead")
    kit.seed_running_claim(
        payload, message_id="qmsg_dead", effect=Effect.EXTERNAL, lease_for=-timedelta(hours=1)
    )
    # When a copy arrives
    kit.publish(payload)
    summary = kit.drain()
    # Then the claim stays running with the reason, the copy is not acked, nothing ran
    assert (summary.outcomes, summary.acked, summary.parked) == ({"stuck": 1}, 0, 1)
    row = kit.row("test.ext:dead")
    assert row.state == "running"
    assert "lease expired" in (row.error or "")
    assert kit.calls == {}
    assert kit.queue.stats(QUEUE).in_flight_count == 1


def test_a_transient_failure_releases_the_claim_and_walks_to_the_dlq(kit: Kit) -> None:
    # Given a job that fails every time
    kit.publish(_db("poison", mode="transient"))
    for delivery in (1, 2, 3):
        # When it is delivered
        summary = kit.drain()
        # Then no claim remains and the message is not acked
        assert summary.outcomes == {"retry": 1}, f"delivery {delivery}"
        assert (summary.acked, summary.retried, summary.failed) == (0, 1, 0)
        assert kit.ledger.get("test.db:poison") is None
        kit.redeliver()
    # And the third unacked delivery dead-lettered it, after three attempts
    assert kit.calls == {"test.db:poison": 3}
    stats = kit.queue.stats(QUEUE)
    assert (stats.message_count, stats.dlq_count) == (0, 1)
    (dead,) = kit.queue.consume(DLQ)
    assert dead.payload == _db("poison", mode="transient")


def test_a_permanent_failure_is_recorded_failed_and_not_acked(kit: Kit) -> None:
    # Given a job whose handler raises PermanentJobError
    kit.publish(_db("bad", mode="permanent"))
    # When drained
    summary = kit.drain()
    # Then its claim is failed with the error, and its message is left for the DLQ
    assert (summary.outcomes, summary.acked, summary.retried, summary.failed) == (
        {"failed": 1},
        0,
        0,
        1,
    )
    row = kit.row("test.db:bad")
    assert (row.state, row.error) == ("failed", "PermanentJobError: simulated permanent failure")
    assert kit.queue.stats(QUEUE).in_flight_count == 1


def test_a_duplicate_of_failed_is_left_for_the_dlq(kit: Kit) -> None:
    # Given a job that failed permanently
    kit.publish(_db("bad", mode="permanent"))
    kit.drain()
    before = kit.row("test.db:bad")
    # When its redelivery and a fresh copy arrive in one batch
    kit.publish(_db("bad", mode="permanent"))
    kit.redeliver()
    summary = kit.drain()
    # Then neither runs nor is acked, and the row is unchanged
    assert summary.outcomes == {"duplicate_failed": 1, "batch_duplicate": 1}
    assert (summary.acked, summary.parked) == (0, 2)
    assert kit.calls == {"test.db:bad": 1}
    assert kit.row("test.db:bad") == before


def test_an_uncertain_external_effect_stays_running_flagged_and_not_acked(kit: Kit) -> None:
    # Given an external job whose call times out after it may have happened
    kit.publish(_ext("x", mode="uncertain"))
    summary = kit.drain()
    # Then its claim stays running, flagged, and the message is not acked
    assert (summary.outcomes, summary.acked) == ({"stuck": 1}, 0)
    row = kit.row("test.ext:x")
    assert row.state == "running"
    assert (row.error or "").startswith("effect uncertain")
    # And its own redelivery does not run it again, nor replace the first reason
    kit.redeliver()
    summary = kit.drain()
    assert (summary.outcomes, summary.acked) == ({"stuck": 1}, 0)
    assert kit.calls == {"test.ext:x": 1}
    assert kit.row("test.ext:x").error == row.error


def test_our_own_redelivery_of_a_running_external_claim_is_flagged_not_rerun(kit: Kit) -> None:
    # Given a delivery that claimed an irreversible job and died mid-call, its lease not over
    payload = _ext("mid-call")
    kit.publish(payload)
    (message,) = kit.queue.consume(QUEUE)
    kit.seed_running_claim(
        payload, message_id=message.message_id, effect=Effect.EXTERNAL, lease_for=timedelta(hours=1)
    )
    # When the same message is redelivered
    kit.redeliver()
    summary = kit.drain()
    # Then it is not run, not acked, and flagged with the reason
    assert (summary.outcomes, summary.acked) == ({"stuck": 1}, 0)
    assert kit.calls == {}
    assert "redelivered while its own claim" in (kit.row("test.ext:mid-call").error or "")


def test_an_uncertain_database_job_is_released_for_a_retry(kit: Kit) -> None:
    # Given a database job raising EffectUncertain
    kit.publish(_db("x", mode="uncertain"))
    # When drained
    summary = kit.drain()
    # Then its effect rolled back with its savepoint, so the claim is released for a retry
    assert (summary.outcomes, summary.acked) == ({"retry": 1}, 0)
    assert kit.ledger.get("test.db:x") is None


def test_the_same_key_for_different_work_is_a_conflict_left_unacked(kit: Kit) -> None:
    # Given a job done once
    kit.publish(_db("a", amount=1))
    kit.drain()
    before = kit.row("test.db:a")
    # When different work arrives under its key
    kit.publish(_db("a", amount=2))
    summary = kit.drain()
    # Then it is a conflict: not run, not acked, the row untouched
    assert (summary.outcomes, summary.acked) == ({"conflict": 1}, 0)
    assert kit.calls == {"test.db:a": 1}
    assert kit.row("test.db:a") == before


def test_different_work_under_one_key_in_one_batch_is_a_conflict(kit: Kit) -> None:
    # Given two different jobs under one key in one batch
    kit.publish(_db("a", amount=1))
    kit.publish(_db("a", amount=2))
    # When drained
    summary = kit.drain()
    # Then the first ran and the second is a conflict, left unacked
    assert summary.outcomes == {"done": 1, "conflict": 1}
    assert summary.acked == 1
    assert kit.calls == {"test.db:a": 1}


def test_messages_without_a_derivable_key_are_left_while_the_batch_goes_on(kit: Kit) -> None:
    # Given a batch mixing what no key can be derived from with one good job
    for odd in (None, [1, 2], "text", {"job": "no.such.job"}, {"job": "test.db"}):
        kit.publish(odd)
    kit.publish(_db("fine"))
    # When drained
    summary = kit.drain()
    # Then the rejects are unacked with no claims, and the good job ran
    assert summary.outcomes == {"rejected": 5, "done": 1}
    assert (summary.acked, summary.parked) == (1, 5)
    assert list(kit.ledger.rows) == ["test.db:fine"]
    assert kit.queue.stats(QUEUE).in_flight_count == 5


def test_a_lost_claim_is_not_acked(kit: Kit) -> None:
    # Given an external job whose claim is re-assigned while it runs
    kit.publish({"job": "test.hijacked", "id": "1"})
    # When the drain settles it, the fenced update matches nothing
    summary = kit.drain()
    # Then it is not acked, and the row is left as the other party made it
    assert (summary.outcomes, summary.acked) == ({"claim_lost": 1}, 0)
    assert kit.row("test.hijacked:1").state == "running"


def test_an_ack_answered_not_found_counts_as_ack_lost(kit: Kit) -> None:
    # Given an ack that is applied but whose answer is lost
    kit.publish(_db("a"))
    kit.queue.lose_ack_answers(1)
    # When drained
    summary = kit.drain()
    # Then it counts as harmless, and the message is gone all the same
    assert (summary.done, summary.acked, summary.ack_lost) == (1, 0, 1)
    assert kit.queue.stats(QUEUE).message_count == 0


def test_a_failed_ack_is_made_good_by_the_redelivery(kit: Kit) -> None:
    # Given a done job whose ack failed
    kit.publish(_db("a"))
    kit.queue.fail_acks(1)
    first = kit.drain()
    assert (first.done, first.acked, first.ack_failed) == (1, 0, 1)
    # When it is redelivered
    kit.redeliver()
    second = kit.drain()
    # Then it is a duplicate of done, acked without running again
    assert (second.outcomes, second.acked) == ({"duplicate_done": 1}, 1)
    assert kit.calls == {"test.db:a": 1}
    assert kit.queue.stats(QUEUE).message_count == 0


def test_an_idempotent_claim_is_taken_over_after_its_lease(kit: Kit) -> None:
    # Given a digest whose first attempt died after claiming
    payload = {"job": "test.idem", "id": "d"}
    kit.publish(payload)
    (message,) = kit.queue.consume(QUEUE)
    kit.seed_running_claim(
        payload,
        message_id=message.message_id,
        effect=Effect.EXTERNAL_IDEMPOTENT,
        lease_for=timedelta(seconds=60),
    )
    # When its redelivery arrives after the lease
    kit.redeliver()
    summary = kit.drain()
    # Then it takes the claim over and finishes the work
    assert (summary.outcomes, summary.acked) == ({"done": 1}, 1)
    row = kit.row("test.idem:d")
    assert (row.state, row.attempts, row.result) == ("done", 2, {"id": "d"})


def test_an_unavailable_ledger_stops_the_drain_without_acking(kit: Kit) -> None:
    # Given an external job and a ledger that fails its next claim
    kit.publish(_ext("a"))
    kit.ledger.fail_next("claim")
    # When drained
    summary = kit.drain()
    # Then nothing ran or was acked, and the loop stopped
    assert (summary.outcomes, summary.acked) == ({"ledger_unavailable": 1}, 0)
    assert summary.stopped == "ledger_unavailable"
    assert kit.calls == {}
    # And the redelivery completes it
    kit.redeliver()
    assert kit.drain().outcomes == {"done": 1}


def test_a_settle_that_fails_after_an_external_effect_is_stuck(kit: Kit) -> None:
    # Given an external job whose settle will fail after its effect
    kit.publish(_ext("a"))
    kit.ledger.fail_next("settle")
    # When drained
    summary = kit.drain()
    # Then it is not acked and its claim stays running for a human
    assert (summary.outcomes, summary.acked) == ({"stuck": 1}, 0)
    assert kit.calls == {"test.ext:a": 1}
    assert kit.row("test.ext:a").state == "running"


# --- the summary ------------------------------------------------------------------------------


def test_the_summary_counts_add_up(kit: Kit) -> None:
    # Given one batch holding most outcomes
    done_payload = _db("done-before")
    kit.publish(done_payload)
    kit.drain()
    kit.publish(done_payload)  # duplicate
    kit.publish(_db("new"), times=2)  # done + in_flight
    kit.publish(_db("flaky", mode="transient"))  # retry
    kit.publish(_ext("bad", mode="permanent"))  # failed
    kit.publish(_ext("unsure", mode="uncertain"))  # stuck
    kit.publish(_db("done-before", extra=1))  # conflict in the ledger
    kit.publish({"job": "nope"})  # rejected
    kit.queue.lose_ack_answers(1)
    # When drained
    summary = kit.drain()
    # Then every message is counted once, in one of the five buckets
    assert summary.outcomes == {
        "duplicate_done": 1,
        "done": 1,
        "duplicate_in_flight": 1,
        "retry": 1,
        "failed": 1,
        "stuck": 1,
        "conflict": 1,
        "rejected": 1,
    }
    assert (summary.consumed, summary.done, summary.duplicates) == (8, 1, 2)
    assert (summary.retried, summary.failed, summary.parked, summary.batches) == (1, 1, 3, 1)
    assert summary.consumed == sum(summary.outcomes.values())
    buckets = summary.done + summary.duplicates + summary.retried + summary.failed + summary.parked
    assert summary.consumed == buckets
    # And every settled message was acked once, one of them with a lost answer
    assert (summary.acked, summary.ack_lost, summary.ack_failed) == (2, 1, 0)
    assert summary.acked + summary.ack_lost == summary.done + summary.duplicates
    assert kit.queue.stats(QUEUE).in_flight_count == 5


# --- what handlers return and raise -----------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "stored"),
    [("unserializable", "{'ids': {1, 2}}"), ("nan", "nan")],
)
def test_a_result_json_cannot_carry_still_ends_done(kit: Kit, mode: str, stored: str) -> None:
    # Given a handler that returns what JSON cannot carry, after its effect
    kit.publish(_ext("r", mode=mode))
    # When drained
    summary = kit.drain()
    # Then the effect is not retried: the job is done with a description of its result
    assert (summary.outcomes, summary.acked) == ({"done": 1}, 1)
    assert kit.row("test.ext:r").result == {"unserializable_result": stored}


def test_a_long_handler_error_is_truncated_to_2000_characters(kit: Kit) -> None:
    # Given a handler raising a 5000-character message
    kit.publish(_db("long", mode="long_error"))
    # When drained
    kit.drain()
    # Then the stored error is cut to 2000 characters, marked as cut
    error = kit.row("test.db:long").error or ""
    assert len(error) == 2000
    assert error.startswith("PermanentJobError: xxx")
    assert error.endswith("x...")


# --- results and errors PostgreSQL could not store -------------------------------------------


def test_a_result_postgres_cannot_store_is_described_not_fatal_to_the_batch(kit: Kit) -> None:
    # Given a database job echoing a NUL character from its payload, beside an innocent one
    kit.publish(_db("nul", mode="echo", text="a\x00b"))
    kit.publish(_db("innocent"))
    # When drained
    summary = kit.drain()
    # Then both should end done (the unstorable result described, like any other)
    assert summary.outcomes == {"done": 2}


def test_an_error_message_with_nul_still_settles_as_failed(kit: Kit) -> None:
    # Given an external job failing permanently with a NUL character in its message
    kit.publish(_ext("nul", mode="error_echo", text="a\x00b"))
    # When drained
    summary = kit.drain()
    # Then it should be failed, like any permanent failure
    assert summary.outcomes == {"failed": 1}
    assert kit.row("test.ext:nul").state == "failed"


def test_a_deeply_nested_result_is_described_not_a_crash(kit: Kit) -> None:
    # Given an external job returning a list nested 100 000 deep, after its effect
    kit.publish(_ext("deep", mode="deep"))
    # When drained
    summary = kit.drain()
    # Then it should end done with its result described, like any unserializable result
    assert summary.outcomes == {"done": 1}


def test_the_next_batch_is_received_ahead_only_when_the_time_covers_both(kit: Kit) -> None:
    # Given 30 jobs and time for exactly two batches at once
    kit.publish_database_jobs(range(30))
    # When the drain runs with plenty of time
    summary = kit.drain(time_left_ms=lambda: 40_000, batch_budget_ms=20_000)
    # Then it drained everything, receiving ahead, and stopped on an empty queue
    assert (summary.batches, summary.done, summary.stopped) == (3, 30, "empty")
    # And with time for one batch but not two, it still drains, one batch at a time
    kit.publish_database_jobs(range(30, 40))
    summary = kit.drain(time_left_ms=lambda: 39_999, batch_budget_ms=20_000)
    assert (summary.batches, summary.done, summary.stopped) == (1, 10, "empty")


def test_a_batch_received_ahead_when_the_ledger_fails_is_left_for_redelivery(kit: Kit) -> None:
    # Given 20 jobs, and a ledger that fails on the first batch
    kit.publish_database_jobs(range(20))
    kit.ledger.fail_next("run_database_batch")
    # When the drain runs
    summary = kit.drain()
    # Then it stopped; nothing was acked; both batches come back after the visibility timeout
    assert summary.stopped == "ledger_unavailable"
    assert summary.acked == 0
    assert kit.queue.stats(QUEUE).in_flight_count == 20
    kit.redeliver()
    again = kit.drain()
    assert (again.done, again.acked) == (20, 20)


def test_abandoning_a_failed_consume_sent_ahead_does_not_retry_it(kit: Kit) -> None:
    # Given 20 jobs, a ledger that fails on the first batch, and a consume sent ahead whose
    # first answer is a 500 (a retry would receive the next ten messages)
    kit.publish_database_jobs(range(20))
    kit.ledger.fail_next("run_database_batch")
    retried: list[int] = []

    def send_consume(queue: str, max_messages: int = 10) -> Pending[list[QueueMessage]]:
        def first() -> list[QueueMessage]:
            raise InfraiUnavailable(
                "INTERNAL", "injected: the consume sent ahead", 500, call="consume"
            )

        def with_retries() -> list[QueueMessage]:
            retried.append(1)
            return kit.queue.consume(queue, max_messages)

        return Pending(with_retries, first)

    kit.queue.send_consume = send_consume  # type: ignore[method-assign]
    # When the drain stops on the ledger's failure
    summary = kit.drain()
    assert summary.stopped == "ledger_unavailable"
    # Then the failed consume was not tried again: the other ten were never received
    assert retried == []
    assert kit.waiting() == (10, 10)


class EventQueue(RecordingQueue):
    """The fake queue, logging on which thread each call is sent and when its answer is read."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock)
        self.events: list[str] = []
        self.threads: set[int] = set()
        self.ids: dict[str, str] = {}

    def send_consume(self, queue: str, max_messages: int = 10) -> Pending[list[QueueMessage]]:
        self.threads.add(threading.get_ident())
        return super().send_consume(queue, max_messages)

    def send_ack(self, queue: str, receipt_handle: str) -> Pending[None]:
        self.threads.add(threading.get_ident())
        sent = super().send_ack(queue, receipt_handle)

        def read() -> None:
            self.events.append(f"ack read {self.ids[receipt_handle]}")
            sent.wait()

        return Pending(read)

    def consume(self, queue: str, max_messages: int = 10) -> list[QueueMessage]:
        served = super().consume(queue, max_messages)
        for message in served:
            self.ids[message.receipt_handle] = message.payload["id"]
        return served


def test_a_lane_sends_its_acks_and_next_consume_on_its_own_thread_and_reads_them_later() -> None:
    # Given 30 jobs on a queue that logs its calls, and a job that logs when it runs
    clock = FakeClock()
    queue = EventQueue(clock)
    queue.ensure_queue(QUEUE, dlq=DLQ)
    registry = JobRegistry()
    threads_seen: list[int] = []

    @registry.job("test.db", effect=Effect.DATABASE, identity=("id",))
    def logged(payload: Payload, ctx: JobContext) -> JsonValue:
        queue.events.append(f"ran {payload['id']}")
        threads_seen.append(threading.active_count())
        return None

    for n in range(30):
        queue.publish_raw(QUEUE, _db(f"{n:02d}"))
    threads_before = threading.active_count()

    # When one lane drains them
    summary = drain(
        queue, InMemoryLedger(clock), registry, DrainConfig(queue=QUEUE), lambda: TIME_LEFT_MS
    )

    # Then everything was done and acked, without a thread beyond the lane's own
    assert (summary.done, summary.acked, summary.stopped) == (30, 30, "empty")
    assert queue.threads == {threading.get_ident()}
    assert set(threads_seen) == {threads_before}
    # And a batch's acks were read only after the next batch had run: they travelled meanwhile
    events = queue.events
    assert events.index("ack read 00") > events.index("ran 19")
    assert events.index("ack read 10") > events.index("ran 29")
    assert events[-10:] == [f"ack read {n}" for n in range(20, 30)]


class FailingSecondConsume(RecordingQueue):
    """The fake queue, whose second consume fails as Infrai would after its retries."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock)
        self.consumes = 0

    def consume(self, queue: str, max_messages: int = 10) -> list[QueueMessage]:
        self.consumes += 1
        if self.consumes == 2:
            raise InfraiUnavailable("INTERNAL", "injected: consume failed", 500, call="consume")
        return super().consume(queue, max_messages)


def test_a_failed_consume_sent_ahead_surfaces_its_own_error_after_the_acks() -> None:
    # Given 20 jobs, and a queue whose second consume (the one sent ahead) fails
    clock = FakeClock()
    queue = FailingSecondConsume(clock)
    queue.ensure_queue(QUEUE, dlq=DLQ)
    registry = JobRegistry()
    registry.job("test.db", effect=Effect.DATABASE, identity=("id",))(lambda p, ctx: None)
    for n in range(20):
        queue.publish_raw(QUEUE, _db(str(n)))
    # When one lane drains them, the Infrai error is what the caller sees
    with pytest.raises(InfraiUnavailable, match="consume failed"):
        drain(
            queue, InMemoryLedger(clock), registry, DrainConfig(queue=QUEUE), lambda: TIME_LEFT_MS
        )
    # And the first batch, processed before the error surfaced, was acked
    assert queue.stats(QUEUE).message_count == 10
    assert queue.batch_sizes == [10]


class AckOutcomes(RecordingQueue):
    """The fake queue, whose acks answer as scripted and record how each answer was read."""

    def __init__(self, clock: FakeClock, fail: Callable[[int], Exception | None]) -> None:
        super().__init__(clock)
        self.fail = fail
        self.reads: list[tuple[int, bool]] = []
        self.sent = 0

    def send_ack(self, queue: str, receipt_handle: str) -> Pending[None]:
        number = self.sent
        self.sent += 1
        error = self.fail(number)

        def read(retry: bool) -> None:
            self.reads.append((number, retry))
            if error is not None:
                raise error
            self.ack(queue, receipt_handle)

        return Pending(lambda: read(True), lambda: read(False))


def _queue_with_acks(fail: Callable[[int], Exception | None], jobs: int) -> AckOutcomes:
    queue = AckOutcomes(FakeClock(), fail)
    queue.ensure_queue(QUEUE, dlq=DLQ)
    for n in range(jobs):
        queue.publish_raw(QUEUE, _db(str(n)))
    return queue


def _drain(queue: AckOutcomes) -> DrainSummary:
    registry = JobRegistry()
    registry.job("test.db", effect=Effect.DATABASE, identity=("id",))(lambda p, ctx: None)
    ledger = InMemoryLedger(queue.clock)
    return drain(queue, ledger, registry, DrainConfig(queue=QUEUE), lambda: TIME_LEFT_MS)


def test_once_an_ack_fails_through_its_retries_the_rest_of_its_batch_get_one_try() -> None:
    # Given Infrai failing every ack of the first batch (acks 0-9), and none after
    def fail(number: int) -> Exception | None:
        if number < 10:
            return InfraiUnavailable("INTERNAL", "injected: ack failed", 500, call="ack")
        return None

    queue = _queue_with_acks(fail, jobs=20)
    # When the 20 jobs are drained
    summary = _drain(queue)
    # Then the first failing ack was read with its retries, the other nine without
    first_batch = sorted(r for r in queue.reads if r[0] < 10)
    assert first_batch == [(0, True)] + [(n, False) for n in range(1, 10)]
    # And the next batch's acks were read with their retries again, and landed
    assert sorted(r for r in queue.reads if r[0] >= 10) == [(n, True) for n in range(10, 20)]
    assert (summary.ack_failed, summary.acked, summary.done) == (10, 10, 20)


def test_an_unexpected_error_reading_an_ack_is_raised_after_the_others_are_read() -> None:
    # Given the third ack's answer raising something that is not an Infrai answer
    def fail(number: int) -> Exception | None:
        return ConfigurationError("INFRAI_API_KEY contains a line break") if number == 2 else None

    queue = _queue_with_acks(fail, jobs=10)
    # When the 10 jobs are drained, Then that error reaches the caller
    with pytest.raises(ConfigurationError, match="line break"):
        _drain(queue)
    # And every other ack was still read, and landed
    assert len(queue.reads) == 10
    assert queue.stats(QUEUE).message_count == 1
