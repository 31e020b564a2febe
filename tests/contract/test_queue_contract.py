"""One contract, two implementations: the in-memory fake and the emulator over HTTP.

Every scenario runs against ``InMemoryQueue`` (the fake unit tests use) and against
``InfraiClient`` talking to the emulator on loopback. Both serve the same model
(``infrai_local.sandbox.queue_model``); this suite is what keeps them saying the same thing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from fakes import FakeClock, InMemoryQueue

from infrai_jobs.errors import InfraiError, QueueMessageNotFound
from infrai_jobs.queue.client import HttpRetryPolicy, InfraiClient
from infrai_jobs.queue_contract import CONSUME_CAP, MAX_RECEIVE_COUNT
from infrai_local.sandbox.emulator import start_in_thread
from infrai_local.sandbox.queue_model import MAX_BODY_DEPTH
from infrai_local.sandbox.queues import ensure_queue

QUEUE = "contract-jobs"
DLQ = "contract-jobs-dlq"
VISIBILITY = 30.0
JOB = {"job": "invoice.finalize", "invoice_id": "inv_8812", "amount_cents": 4900}


@dataclass
class Backend:
    """A queue as the drain sees it, and a way to move its clock forward."""

    queue: Any
    advance: Callable[[float], None]


@pytest.fixture(params=["in-memory fake", "emulator over HTTP"])
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    if request.param == "in-memory fake":
        clock = FakeClock()
        fake = InMemoryQueue(clock, visibility_timeout=VISIBILITY)
        fake.ensure_queue(QUEUE, dlq=DLQ)
        yield Backend(fake, clock.advance)
        return
    server = start_in_thread(visibility_timeout=VISIBILITY)
    client = InfraiClient(server.url, "contract-key", retry=HttpRetryPolicy(base_delay=0.01))
    try:
        ensure_queue(client, QUEUE, dlq=DLQ)
        yield Backend(client, server.emulator.advance_clock)
    finally:
        client.close()
        server.stop()


def test_every_publish_is_a_new_message_even_for_the_same_body(backend: Backend) -> None:
    first = backend.queue.publish(QUEUE, JOB)
    second = backend.queue.publish(QUEUE, JOB)
    assert first != second
    assert first.startswith("qmsg_")
    assert backend.queue.stats(QUEUE).available_count == 2


def test_a_consume_serves_at_most_the_cap_oldest_first(backend: Backend) -> None:
    ids = [backend.queue.publish(QUEUE, {**JOB, "n": n}) for n in range(CONSUME_CAP + 2)]
    served = backend.queue.consume(QUEUE, 50)
    assert [m.message_id for m in served] == ids[:CONSUME_CAP]
    assert {m.delivery_count for m in served} == {1}
    assert [m.payload["n"] for m in served] == list(range(CONSUME_CAP))
    rest = backend.queue.consume(QUEUE, 50)
    assert [m.message_id for m in rest] == ids[CONSUME_CAP:]


def test_a_consumed_message_is_hidden_until_its_visibility_lapses(backend: Backend) -> None:
    (message_id,) = [backend.queue.publish(QUEUE, JOB)]
    assert [m.message_id for m in backend.queue.consume(QUEUE, 10)] == [message_id]
    assert backend.queue.consume(QUEUE, 10) == []
    stats = backend.queue.stats(QUEUE)
    assert (stats.available_count, stats.in_flight_count, stats.message_count) == (0, 1, 1)
    backend.advance(VISIBILITY + 1)
    (again,) = backend.queue.consume(QUEUE, 10)
    assert (again.message_id, again.delivery_count) == (message_id, 2)


def test_the_third_unacked_delivery_moves_a_message_to_its_dlq(backend: Backend) -> None:
    message_id = backend.queue.publish(QUEUE, JOB)
    for delivery in range(1, MAX_RECEIVE_COUNT + 1):
        (message,) = backend.queue.consume(QUEUE, 10)
        assert message.delivery_count == delivery
        backend.advance(VISIBILITY + 1)
    assert backend.queue.consume(QUEUE, 10) == []
    stats = backend.queue.stats(QUEUE)
    assert (stats.message_count, stats.dlq_count) == (0, 1)
    (dead,) = backend.queue.consume(DLQ, 10)
    assert (dead.message_id, dead.delivery_count, dead.payload) == (message_id, 1, JOB)


def test_an_ack_removes_the_message_and_a_second_ack_finds_nothing(backend: Backend) -> None:
    backend.queue.publish(QUEUE, JOB)
    (message,) = backend.queue.consume(QUEUE, 10)
    backend.advance(VISIBILITY + 1)  # a lapsed visibility does not stop the ack
    backend.queue.ack(QUEUE, message.receipt_handle)
    assert backend.queue.stats(QUEUE).message_count == 0
    with pytest.raises(QueueMessageNotFound):
        backend.queue.ack(QUEUE, message.receipt_handle)


def test_a_delayed_message_becomes_available_after_its_delay(backend: Backend) -> None:
    backend.queue.publish(QUEUE, JOB, delay_seconds=5)
    assert backend.queue.stats(QUEUE).delayed_count == 1
    assert backend.queue.consume(QUEUE, 10) == []
    backend.advance(6)
    assert len(backend.queue.consume(QUEUE, 10)) == 1


def test_the_oldest_message_age_counts_whole_seconds(backend: Backend) -> None:
    assert backend.queue.stats(QUEUE).oldest_message_age_seconds == 0
    backend.queue.publish(QUEUE, JOB)
    backend.advance(7.5)
    assert backend.queue.stats(QUEUE).oldest_message_age_seconds in (7, 8)


def test_an_unknown_queue_is_queue_not_found(backend: Backend) -> None:
    with pytest.raises(InfraiError) as raised:
        backend.queue.consume("no-such-queue", 1)
    assert (raised.value.code, raised.value.status) == ("QUEUE_NOT_FOUND", 404)


def test_publish_refuses_a_body_no_consume_could_serve(backend: Backend) -> None:
    deep: Any = "bottom"
    for _ in range(MAX_BODY_DEPTH):
        deep = [deep]
    with pytest.raises(InfraiError) as raised:
        backend.queue.publish(QUEUE, {"job": "deep", "x": deep})
    assert (raised.value.code, raised.value.status) == ("VALIDATION_ERROR", 400)
    assert f"at most {MAX_BODY_DEPTH}" in raised.value.message
    assert backend.queue.stats(QUEUE).message_count == 0
