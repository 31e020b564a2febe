"""Three drains at once over one queue: every effect once, every job accounted for."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from drainkit import QUEUE, Harness, harness, run_concurrently

from infrai_jobs.drain.features import Lanes
from infrai_jobs.drain.loop import drain
from infrai_jobs.drain.model import DrainConfig
from infrai_jobs.queue.client import HttpRetryPolicy, InfraiClient
from infrai_jobs.work.ledger import PostgresLedger

JOBS = 500
DUPLICATE_SHARE = 0.3


def _payload(n: int) -> dict[str, object]:
    kind = n % 3
    if kind == 0:
        return {"job": "test.db", "id": f"j{n}"}
    if kind == 1:
        return {"job": "receipt.send", "invoice_id": f"inv_{n}", "email": f"u{n}@example.com"}
    return {"job": "digest.build", "tenant_id": f"tenant_{n}", "period": "2026-07"}


@pytest.mark.slow
def test_three_concurrent_drains_apply_every_effect_once(database_url: str) -> None:
    with harness(database_url) as kit:
        # Given 500 jobs, 30% of them published twice, in shuffled order
        rng = random.Random(42)
        publishes = list(range(JOBS)) + rng.sample(range(JOBS), int(JOBS * DUPLICATE_SHARE))
        rng.shuffle(publishes)
        for n in publishes:
            kit.publish(_payload(n))
        keys = {kit.registry.derive(_payload(n)).idem_key for n in range(JOBS)}

        # When three drains with their own connections run at the same time
        def lane() -> dict[str, object]:
            client = InfraiClient(
                kit.server.url, "test-key", retry=HttpRetryPolicy(base_delay=0.01)
            )
            ledger = PostgresLedger(database_url)
            try:
                summary = drain(
                    client, ledger, kit.registry, DrainConfig(queue=QUEUE), lambda: 120_000
                )
                return summary.as_dict()
            finally:
                ledger.close()
                client.close()

        summaries = run_concurrently(lane, lane, lane)

        # Then every message was consumed once and acked, and the queue is empty
        assert sum(int(s["consumed"]) for s in summaries) == len(publishes)
        assert sum(int(s["acked"]) for s in summaries) == len(publishes)
        assert kit.client.stats(QUEUE).message_count == 0
        # And every database effect happened exactly once
        _assert_database_effects_once(kit, [n for n in range(JOBS) if n % 3 == 0])
        # And every external call at most once per key (exactly once: no faults here)
        sink = kit.sink.state.snapshot()
        assert set(sink["mails"].values()) == {1}
        assert len(sink["mails"]) == len([n for n in range(JOBS) if n % 3 == 1])
        assert set(sink["digests"].values()) == {1}
        # And every job is accounted for in the ledger: done
        states = Counter(
            state
            for (state,) in kit.sql(
                "SELECT state FROM job_claims WHERE idem_key = ANY(%s)", (list(keys),)
            )
        )
        assert states == {"done": JOBS}


def _assert_database_effects_once(kit: Harness, numbers: list[int]) -> None:
    rows = dict(kit.sql("SELECT idem_key, count(*) FROM test_effects GROUP BY idem_key"))
    assert rows == {f"test.db:j{n}": 1 for n in numbers}


def test_drain_lanes_share_one_invocation_and_still_run_every_job_once(
    database_url: str,
) -> None:
    from infrai_jobs.config.settings import DrainSettings  # noqa: PLC0415

    with harness(database_url) as kit:
        # Given 300 database jobs, a third of them published twice
        for n in range(300):
            kit.publish({"job": "test.db", "id": f"l{n}"}, times=2 if n % 3 == 0 else 1)
        service = kit.lane_service(DrainSettings(queue=QUEUE, drain_lanes=3))
        # When one invocation drains with three lanes
        summary = service.run(lambda: 120_000)
        service.close()
        # Then the lanes' summaries add up, and every effect happened once
        assert summary.consumed == 400
        assert summary.acked == 400
        assert summary.done == 300
        assert summary.stopped == "empty"
        (lanes,) = service.features
        assert isinstance(lanes, Lanes)
        assert len(lanes.extra_ledgers) == 2
        _assert_database_effects_once_prefixed(kit, "l", 300)


def _assert_database_effects_once_prefixed(kit: Harness, prefix: str, count: int) -> None:
    rows = dict(kit.sql("SELECT idem_key, count(*) FROM test_effects GROUP BY idem_key"))
    assert rows == {f"test.db:{prefix}{n}": 1 for n in range(count)}


def test_lanes_reuse_their_connections_instead_of_reconnecting_per_ack(
    database_url: str,
) -> None:
    from infrai_jobs.config.settings import DrainSettings  # noqa: PLC0415
    from infrai_jobs.drain.ack_pipeline import HTTP_CONNECTIONS_PER_LANE  # noqa: PLC0415
    from infrai_jobs.runtime.factory import client_pool_size, make_queue_client  # noqa: PLC0415

    with harness(database_url) as kit:
        # Given 1,200 jobs, and a latency that keeps each batch's ten acks in flight together
        for n in range(1200):
            kit.publish({"job": "test.db", "id": f"c{n}"})
        settings = DrainSettings(
            infrai_base_url=kit.server.url,
            infrai_api_key="test-key",
            queue=QUEUE,
            drain_lanes=8,
        )
        client = make_queue_client(settings)
        service = kit.lane_service(settings, client)
        kit.faults(latency_ms=20)
        # Counted from here to the end of the run: the lanes' connections and nothing else (the
        # harness's own calls, such as setting the faults, open connections of their own)
        before = kit.server.emulator.snapshot()["connections_accepted"]
        # When eight lanes drain them through the client DrainFunction builds
        summary = service.run(lambda: 120_000)
        opened = kit.server.emulator.snapshot()["connections_accepted"] - before
        kit.faults()
        service.close()
        client.close()
        # Then every job ran once
        assert summary.done == 1200
        assert summary.acked == 1200
        _assert_database_effects_once_prefixed(kit, "c", 1200)
        # And the lanes opened no more connections than they can have calls in flight at once
        # (their acks and the consume sent ahead): a pool keeping fewer would reconnect for
        # most of the 1,200 acks. How many below that bound depends on how the lanes' calls
        # overlapped, so only the bound is asserted.
        assert client_pool_size(8) == 8 * HTTP_CONNECTIONS_PER_LANE
        assert opened <= client_pool_size(8), opened
