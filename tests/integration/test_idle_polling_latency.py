"""Idle polling on real PostgreSQL and the emulator, in real time: a drain started on an empty
queue picks up a job published a second later, within the same invocation."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from drainkit import QUEUE, Harness, harness

from infrai_jobs.drain.features import IdlePolling
from infrai_jobs.drain.loop import drain
from infrai_jobs.drain.model import DrainConfig, DrainSummary
from infrai_jobs.queue.models import QueueMessage


@pytest.fixture
def kit(database_url: str) -> Iterator[Harness]:
    with harness(database_url) as running:
        yield running


class WatchedClient:
    """The harness's Infrai client, telling when a consume first came back empty."""

    def __init__(self, kit: Harness) -> None:
        self._client = kit.client
        self.found_empty = threading.Event()

    def __getattr__(self, name: str) -> object:
        return getattr(self._client, name)

    def consume(self, queue: str, max_messages: int = 10) -> list[QueueMessage]:
        served = self._client.consume(queue, max_messages)
        if not served:
            self.found_empty.set()
        return served


def test_an_idle_drain_picks_up_a_job_published_a_second_later(kit: Harness) -> None:
    # Given a drain on an empty queue, polling every 100 ms for up to 60 s, one batch at most
    client = WatchedClient(kit)
    result: list[DrainSummary] = []
    deadline = time.monotonic() + 120

    def run() -> None:
        polling = IdlePolling(poll_ms=100, window_seconds=60)
        config = DrainConfig(queue=QUEUE, max_batches=1, features=[polling])
        result.append(
            drain(
                client,  # type: ignore[arg-type]
                kit.ledger,
                kit.registry,
                config,
                lambda: int((deadline - time.monotonic()) * 1000),
            )
        )

    thread = threading.Thread(target=run)
    thread.start()
    # When, once it found the queue empty, a job is published a second later
    assert client.found_empty.wait(timeout=60)
    time.sleep(1.0)
    kit.publish({"job": "test.db", "id": "late"})
    thread.join(timeout=90)
    # Then that same drain ran it (and stopped after its one batch)
    (summary,) = result
    assert summary.done == 1
    assert summary.counters["idle_polls"] >= 1
    assert summary.stopped == "max_batches"
    assert kit.effects("test.db:late") == 1
    row = kit.row("test.db:late")
    assert row is not None
    assert row.state == "done"
