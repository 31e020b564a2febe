"""The in-memory fakes keep the contracts they stand in for: docs/infrai-api.md for the queue, the
claim rules of ``PostgresLedger`` for the ledger. Unit tests of the drain are only worth what
these fakes are worth.

The claim scenarios themselves are in the ledger contract suite (tests/contract), which runs them
against this fake and the Postgres ledger alike; what is here is the fakes' own (their clock,
their knobs, what only a fake can do)."""

from __future__ import annotations

import threading
from decimal import Decimal

import pytest
from claim_requests import claim_request
from fakes import Clock, FakeClock, InMemoryLedger, InMemoryQueue

from infrai_jobs.errors import InfraiError, LedgerUnavailable, QueueMessageNotFound
from infrai_jobs.jobs.registry import Effect
from infrai_jobs.queue.ports import QueuePort
from infrai_jobs.work.ports import LedgerPort
from infrai_jobs.work.states import (
    ClaimRequest,
    ClaimStatus,
    JobRun,
    RunKind,
    SettleStatus,
)

QUEUE = "billing-jobs"
DLQ = "billing-jobs-dlq"
VISIBILITY = 300


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def queue(clock: FakeClock) -> InMemoryQueue:
    fake = InMemoryQueue(clock)
    fake.ensure_queue(QUEUE, dlq=DLQ)
    return fake


@pytest.fixture
def ledger(clock: FakeClock) -> InMemoryLedger:
    return InMemoryLedger(clock)


def test_the_fakes_are_typed_as_the_ports_they_replace(clock: FakeClock) -> None:
    # Given the fakes bound to the Protocol types (mypy checks these assignments)
    queue: QueuePort = InMemoryQueue(clock)
    ledger: LedgerPort = InMemoryLedger(clock)
    as_clock: Clock = clock
    # Then they are usable through the ports alone
    assert queue.publish_price().usd_per_message == Decimal("0.00002")
    assert ledger.claim([]) == []
    assert as_clock.now() == clock()


# --- the clock --------------------------------------------------------------------------------


def test_the_clock_moves_only_forward_and_only_by_hand(clock: FakeClock) -> None:
    # Given a fake clock, read both ways
    start = clock.now()
    assert clock() == start
    # When a test moves it
    moved = clock.advance(1.5)
    # Then it moved by exactly that, and it refuses to go back
    assert moved == start + 1.5
    assert clock.utcnow().timestamp() == start + 1.5
    with pytest.raises(ValueError, match="forward"):
        clock.advance(-1)


# --- the queue --------------------------------------------------------------------------------


def test_two_publishes_of_one_body_are_two_messages(queue: InMemoryQueue) -> None:
    # Given one body published twice (a producer retry)
    body = {"job": "invoice.finalize", "invoice_id": "inv_8812"}
    first = queue.publish(QUEUE, body)
    second = queue.publish(QUEUE, body)
    # Then there is no producer-side deduplication
    assert first != second
    assert first.startswith("qmsg_")
    assert len(first) == len("qmsg_") + 24
    assert queue.stats(QUEUE).available_count == 2


def test_consume_serves_oldest_first_and_hides_what_it_served(queue: InMemoryQueue) -> None:
    # Given three messages, published in order
    ids = [queue.publish(QUEUE, {"n": n}) for n in range(3)]
    # When one consume asks for two
    served = queue.consume(QUEUE, 2)
    # Then the two oldest come, in flight, first delivery, handle = id
    assert [m.message_id for m in served] == ids[:2]
    assert [m.payload for m in served] == [{"n": 0}, {"n": 1}]
    assert {(m.delivery_count, m.queue) for m in served} == {(1, QUEUE)}
    assert all(m.receipt_handle == m.message_id for m in served)
    assert [m.message_id for m in queue.consume(QUEUE)] == ids[2:]
    assert queue.consume(QUEUE) == []


def test_consume_is_capped_at_ten(queue: InMemoryQueue) -> None:
    # Given twelve waiting messages
    for n in range(12):
        queue.publish(QUEUE, {"n": n})
    # When a consume asks for fifty
    first = queue.consume(QUEUE, 50)
    # Then it is served as ten, and the rest waits for the next consume
    assert len(first) == 10
    assert len(queue.consume(QUEUE, 50)) == 2


def test_a_consumer_mutating_its_payload_does_not_change_the_message(
    queue: InMemoryQueue, clock: FakeClock
) -> None:
    # Given a consumed message whose payload the consumer changed
    queue.publish(QUEUE, {"n": 1})
    (message,) = queue.consume(QUEUE)
    message.payload["n"] = 2
    # When it is redelivered
    clock.advance(VISIBILITY + 1)
    (again,) = queue.consume(QUEUE)
    # Then it carries the payload as published
    assert again.payload == {"n": 1}


def test_an_unacked_message_returns_after_the_visibility_timeout(
    queue: InMemoryQueue, clock: FakeClock
) -> None:
    # Given a consumed, unacked message
    message_id = queue.publish(QUEUE, {"n": 1})
    queue.consume(QUEUE)
    # When less than the visibility timeout passes, it stays hidden
    clock.advance(VISIBILITY - 1)
    assert queue.consume(QUEUE) == []
    # Then once it lapses, it comes back as its second delivery
    clock.advance(1)
    (again,) = queue.consume(QUEUE)
    assert (again.message_id, again.delivery_count) == (message_id, 2)


def test_the_third_lapse_moves_the_message_to_the_dlq(
    queue: InMemoryQueue, clock: FakeClock
) -> None:
    # Given a message delivered three times and never acked
    message_id = queue.publish(QUEUE, {"job": "poison"})
    for delivery in (1, 2, 3):
        (message,) = queue.consume(QUEUE)
        assert message.delivery_count == delivery
        clock.advance(VISIBILITY)
    # Then there is no fourth delivery: it sits in the DLQ, its count restarting there
    assert queue.consume(QUEUE) == []
    stats = queue.stats(QUEUE)
    assert (stats.message_count, stats.dlq_count) == (0, 1)
    (dead,) = queue.consume(DLQ)
    assert (dead.message_id, dead.payload, dead.delivery_count) == (
        message_id,
        {"job": "poison"},
        1,
    )


def test_a_dlq_message_is_never_dropped(queue: InMemoryQueue, clock: FakeClock) -> None:
    # Given a message in the DLQ (a queue without a DLQ of its own)
    queue.publish(DLQ, {"n": 1})
    # When it lapses unacked more than three times
    for delivery in (1, 2, 3, 4):
        (message,) = queue.consume(DLQ)
        assert message.delivery_count == delivery
        clock.advance(VISIBILITY)
    # Then it is still there
    assert queue.stats(DLQ).message_count == 1


def test_ack_removes_the_message_and_a_second_ack_is_not_found(queue: InMemoryQueue) -> None:
    # Given a consumed message, acked once
    queue.publish(QUEUE, {"n": 1})
    (message,) = queue.consume(QUEUE)
    queue.ack(QUEUE, message.receipt_handle)
    # When it is acked again
    with pytest.raises(QueueMessageNotFound) as caught:
        queue.ack(QUEUE, message.receipt_handle)
    # Then the queue no longer holds it, and says so with the contract's code
    assert (caught.value.code, caught.value.status) == ("QUEUE_MESSAGE_NOT_FOUND", 404)
    assert queue.acked == [message.message_id]
    assert queue.stats(QUEUE).message_count == 0


def test_a_lapsed_but_held_message_can_still_be_acked(
    queue: InMemoryQueue, clock: FakeClock
) -> None:
    # Given a delivery whose visibility lapsed before its ack
    queue.publish(QUEUE, {"n": 1})
    (message,) = queue.consume(QUEUE)
    clock.advance(VISIBILITY + 10)
    # When it is acked
    queue.ack(QUEUE, message.receipt_handle)
    # Then the ack still removes it (the queue held it)
    assert queue.stats(QUEUE).message_count == 0


def test_acking_a_dead_lettered_handle_is_not_found(queue: InMemoryQueue, clock: FakeClock) -> None:
    # Given a message dead-lettered after three lapsed deliveries
    queue.publish(QUEUE, {"n": 1})
    for _ in range(3):
        (message,) = queue.consume(QUEUE)
        clock.advance(VISIBILITY)
    # When its last handle is acked on the main queue, it is not found there
    with pytest.raises(QueueMessageNotFound):
        queue.ack(QUEUE, message.receipt_handle)
    # Then it stays in the DLQ
    assert queue.stats(QUEUE).dlq_count == 1


def test_stats_count_every_state_and_age(queue: InMemoryQueue, clock: FakeClock) -> None:
    # Given one delayed, one in flight and one available message
    queue.publish(QUEUE, {"n": 0}, delay_seconds=60)
    queue.publish(QUEUE, {"n": 1})
    queue.publish(QUEUE, {"n": 2})
    queue.consume(QUEUE, 1)
    clock.advance(10.7)
    # Then the counters add up and the age is whole seconds
    stats = queue.stats(QUEUE)
    assert stats.queue == QUEUE
    assert (stats.available_count, stats.in_flight_count, stats.delayed_count) == (1, 1, 1)
    assert stats.message_count == 3
    assert (stats.dlq_count, stats.oldest_message_age_seconds) == (0, 10.0)


def test_stats_are_zero_once_the_queue_is_drained(queue: InMemoryQueue) -> None:
    # Given three messages
    for n in range(3):
        queue.publish(QUEUE, {"n": n})
    # When all are consumed and acked
    for message in queue.consume(QUEUE):
        queue.ack(QUEUE, message.receipt_handle)
    # Then every counter is zero, the age too
    stats = queue.stats(QUEUE)
    assert (
        stats.message_count,
        stats.available_count,
        stats.in_flight_count,
        stats.delayed_count,
        stats.dlq_count,
        stats.oldest_message_age_seconds,
    ) == (0, 0, 0, 0, 0, 0.0)


def test_a_delayed_message_waits_for_its_delay(queue: InMemoryQueue, clock: FakeClock) -> None:
    # Given a message published with a delay
    queue.publish(QUEUE, {"n": 1}, delay_seconds=30)
    # When consumed before and after the delay
    early = queue.consume(QUEUE)
    clock.advance(30)
    late = queue.consume(QUEUE)
    # Then it is served only after, as its first delivery
    assert early == []
    assert [m.delivery_count for m in late] == [1]


def test_bad_calls_are_refused_as_the_service_refuses_them(queue: InMemoryQueue) -> None:
    # Given a queue set up once; When called wrongly; Then the client's errors come back
    with pytest.raises(InfraiError) as unknown:
        queue.publish("no-such-queue", {"n": 1})
    assert unknown.value.code == "QUEUE_NOT_FOUND"
    with pytest.raises(InfraiError) as delay:
        queue.publish(QUEUE, {"n": 1}, delay_seconds=86_401)
    assert delay.value.code == "VALIDATION_ERROR"
    with pytest.raises(ValueError, match="max_messages"):
        queue.consume(QUEUE, 0)
    assert queue.ensure_queue(QUEUE, dlq=DLQ) is False


def test_publish_price_is_todays_discovery_price(queue: InMemoryQueue) -> None:
    # Given the fake's default price; When read
    price = queue.publish_price()
    # Then it is the notes' price, as discovery's billing object carries it
    assert price.usd_per_message == Decimal("0.00002")
    assert price.billing["price_usd"] == "0.00002"


def test_a_lost_ack_answer_is_applied_but_reported_not_found(queue: InMemoryQueue) -> None:
    # Given an ack whose answer will be lost
    queue.publish(QUEUE, {"n": 1})
    (message,) = queue.consume(QUEUE)
    queue.lose_ack_answers(1)
    # When acked
    with pytest.raises(QueueMessageNotFound):
        queue.ack(QUEUE, message.receipt_handle)
    # Then the caller heard "not found", yet the message is gone
    assert queue.stats(QUEUE).message_count == 0


def test_a_failed_ack_is_not_applied(queue: InMemoryQueue) -> None:
    # Given a delivery whose next ack will fail
    queue.publish(QUEUE, {"n": 1})
    (message,) = queue.consume(QUEUE)
    queue.fail_acks(1)
    # When acked
    with pytest.raises(InfraiError) as caught:
        queue.ack(QUEUE, message.receipt_handle)
    # Then it is an unavailable service, not "not found", and the message is still held
    assert not isinstance(caught.value, QueueMessageNotFound)
    assert queue.stats(QUEUE).in_flight_count == 1
    # And the next ack goes through
    queue.ack(QUEUE, message.receipt_handle)
    assert queue.stats(QUEUE).message_count == 0


def test_acks_from_many_threads_each_remove_one_message(queue: InMemoryQueue) -> None:
    # Given ten consumed messages acked concurrently, each twice
    for n in range(10):
        queue.publish(QUEUE, {"n": n})
    handles = [m.receipt_handle for m in queue.consume(QUEUE)] * 2
    outcomes: list[str] = []

    def ack(handle: str) -> None:
        try:
            queue.ack(QUEUE, handle)
            outcomes.append("acked")
        except QueueMessageNotFound:
            outcomes.append("not_found")

    threads = [threading.Thread(target=ack, args=(h,)) for h in handles]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # Then exactly one ack per message succeeded
    assert sorted(outcomes) == ["acked"] * 10 + ["not_found"] * 10
    assert queue.stats(QUEUE).message_count == 0


# --- the ledger -------------------------------------------------------------------------------


def test_a_database_batch_runs_its_handlers_without_a_connection(ledger: InMemoryLedger) -> None:
    # Given two database jobs; When run as one batch
    seen: list[object] = []

    def runner(request: ClaimRequest, db: object) -> JobRun:
        seen.append(db)
        return JobRun(RunKind.SUCCEEDED, result=request.idem_key)

    requests = [claim_request(k, effect=Effect.DATABASE) for k in ("db:a", "db:b")]
    _, settlements = ledger.run_database_batch(requests, runner)
    # Then each handler got no connection (the fake has none), and the batch was one call
    assert seen == [None, None]
    assert [s.status for s in settlements] == [SettleStatus.DONE, SettleStatus.DONE]
    assert ledger.calls["run_database_batch"] == 1


def test_an_injected_failure_changes_nothing_and_passes(ledger: InMemoryLedger) -> None:
    # Given a ledger told to fail its next claim
    ledger.fail_next("claim")
    # When claimed twice
    with pytest.raises(LedgerUnavailable):
        ledger.claim([claim_request()])
    rows_after_failure = ledger.rows
    (decision,) = ledger.claim([claim_request()])
    # Then the first failed without a trace, and the second went through
    assert rows_after_failure == {}
    assert decision.status is ClaimStatus.WON
