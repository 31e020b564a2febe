"""What the outbox costs a producer, and what the relay delivers, measured in one run.

    .venv/bin/python bench/outbox_bench.py [--jobs 500] [--latency-ms 5] [--json]

Against the emulator (its own process, ``--latency-ms`` on every /v1 call) and PostgreSQL
(``DATABASE_URL`` when set, else an embedded server; a scratch database), the same ``--jobs``
intents three ways, one after the other:

1. ``producer``: a transaction that writes one business row, committed per intent; then the
   same transaction with ``enqueue`` in it. The ratio is what enqueue adds to a producer's
   transaction (its time, not Infrai's: nothing is published there).
2. ``throughput``: the intents published directly with ``InfraiClient.publish``, one after the
   other; then the enqueued rows relayed by ``OutboxRelay.run`` (batches of 25). The ratio is
   the relay's throughput against direct publishing: what marking each row costs on top of its
   publish.
3. ``latency``: a relay following the outbox (woken by ``enqueue(..., notify=True)`` through
   LISTEN) and a producer committing one intent every 20 ms; commit -> published, by the
   database's clock on both ends. A scheduled relay (OutboxRelayFunction) adds the wait for its
   next tick, up to its rate (one minute by default): that part is not measured, it is the
   schedule.

``run_bench.py`` runs the same measurement (``--outbox-jobs``) inside the full benchmark.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psycopg

from infrai_jobs.ledger.postgres import LedgerConnector
from infrai_jobs.outbox import enqueue
from infrai_jobs.outbox.relay import OutboxRelay, RelayConfig
from infrai_jobs.queue.client import InfraiClient
from infrai_local.migrations import apply_migrations
from infrai_local.sandbox.embedded_db import postgres_server_url, scratch_database
from infrai_local.sandbox.queues import ensure_queue

from bench_env import API_KEY, EmulatorProcess

QUEUE = "outbox-bench"
PLENTY = 600_000


def _intent(n: int) -> dict[str, Any]:
    return {"job": "bench.outbox", "n": n, "_idempotency_key": f"bench:{n}"}


def _producer(database_url: str, jobs: int, *, with_enqueue: bool) -> float:
    """Seconds for ``jobs`` committed producer transactions."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        started = time.perf_counter()
        for n in range(jobs):
            with conn.transaction():
                conn.execute("INSERT INTO bench_business (n) VALUES (%s)", (n,))
                if with_enqueue:
                    enqueue(conn, _intent(n))
        return time.perf_counter() - started


def _direct(client: InfraiClient, jobs: int) -> float:
    started = time.perf_counter()
    for n in range(jobs):
        client.publish(QUEUE, _intent(n))
    return time.perf_counter() - started


def _relayed(database_url: str, client: InfraiClient) -> tuple[float, int]:
    relay = OutboxRelay(
        LedgerConnector(database_url, application_name="outbox-bench"),
        client,
        RelayConfig(default_queue=QUEUE),
    )
    started = time.perf_counter()
    report = relay.run(lambda: PLENTY)
    return time.perf_counter() - started, report.published


def _latency(database_url: str, client: InfraiClient, jobs: int) -> list[float]:
    """Commit -> published (ms) for ``jobs`` intents with a following, LISTEN-woken relay."""
    relay = OutboxRelay(
        LedgerConnector(database_url, application_name="outbox-bench"),
        client,
        RelayConfig(default_queue=QUEUE),
    )
    done = threading.Event()

    def follow() -> None:
        with psycopg.connect(database_url, autocommit=True) as listener:
            listener.execute("LISTEN infrai_outbox")
            while not done.is_set():
                relay.run(lambda: PLENTY)
                for _ in listener.notifies(timeout=0.5, stop_after=1):
                    pass

    thread = threading.Thread(target=follow)
    thread.start()
    try:
        committed: dict[str, float] = {}
        with psycopg.connect(database_url, autocommit=True) as conn:
            for n in range(jobs):
                with conn.transaction():
                    enqueue(conn, _intent(100_000 + n), notify=True)
                # The commit's moment on this machine's clock, which the database shares.
                committed[f"bench:{100_000 + n}"] = time.time()
                time.sleep(0.02)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                row = conn.execute("SELECT count(*) FROM outbox WHERE state = 'pending'").fetchone()
                if row is not None and row[0] == 0:
                    break
                time.sleep(0.05)
            rows = conn.execute(
                "SELECT idem_key, extract(epoch FROM published_at) FROM outbox"
                " WHERE state = 'published'"
            ).fetchall()
    finally:
        done.set()
        thread.join(timeout=10)
    return [(float(at) - committed[key]) * 1000 for key, at in rows if key in committed]


def measure(
    server_url: str, emulator: EmulatorProcess, jobs: int, latency_ms: float
) -> dict[str, Any]:
    """The three measurements on a scratch database of ``server_url``."""
    with scratch_database(server_url, prefix="infrai_outbox_bench") as database_url:
        with psycopg.connect(database_url, autocommit=True) as conn:
            apply_migrations(conn)
            conn.execute("DROP TABLE IF EXISTS bench_business")
            conn.execute("CREATE TABLE bench_business (n int NOT NULL)")
        # A warm-up, then the two kinds alternated: the fastest round of each is compared.
        _producer(database_url, min(jobs, 50), with_enqueue=False)
        plain_rounds, outbox_rounds = [], []
        for _ in range(3):
            plain_rounds.append(_producer(database_url, jobs, with_enqueue=False))
            outbox_rounds.append(_producer(database_url, jobs, with_enqueue=True))
            with psycopg.connect(database_url, autocommit=True) as conn:
                conn.execute("DELETE FROM outbox")
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute("DELETE FROM outbox")
        _producer(database_url, jobs, with_enqueue=True)
        plain, with_outbox = min(plain_rounds), min(outbox_rounds)
        emulator.set_latency(latency_ms)
        client = InfraiClient(emulator.url, API_KEY)
        try:
            ensure_queue(client, QUEUE, dlq=f"{QUEUE}-dlq")
            direct = _direct(client, jobs)
            relayed, published = _relayed(database_url, client)
            latencies = _latency(database_url, client, min(jobs, 100))
        finally:
            client.close()
            emulator.set_latency(0)
    return {
        "jobs": jobs,
        "latency_ms_injected": latency_ms,
        "producer_tx_ms": round(plain / jobs * 1000, 3),
        "producer_tx_with_enqueue_ms": round(with_outbox / jobs * 1000, 3),
        "enqueue_cost_ratio": round(with_outbox / plain, 2),
        "direct_publishes_per_s": round(jobs / direct, 1),
        "relay_publishes_per_s": round(published / relayed, 1),
        "relay_throughput_ratio": round((published / relayed) / (jobs / direct), 2),
        "relay_published": published,
        "commit_to_publish_ms_median": round(statistics.median(latencies), 1),
        "commit_to_publish_ms_max": round(max(latencies), 1),
        "latency_samples": len(latencies),
    }


def summary_text(result: dict[str, Any]) -> str:
    return (
        f"outbox ({result['jobs']} intents, {result['latency_ms_injected']:g} ms per Infrai "
        f"call): producer transaction {result['producer_tx_ms']} ms -> "
        f"{result['producer_tx_with_enqueue_ms']} ms with enqueue "
        f"(x{result['enqueue_cost_ratio']}); relay {result['relay_publishes_per_s']}/s vs "
        f"direct {result['direct_publishes_per_s']}/s (x{result['relay_throughput_ratio']}); "
        f"commit -> publish with a LISTEN relay: median "
        f"{result['commit_to_publish_ms_median']} ms, max {result['commit_to_publish_ms_max']} ms"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--jobs", type=int, default=500)
    parser.add_argument("--latency-ms", type=float, default=5.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        raise SystemExit("--jobs must be at least 1")
    emulator = EmulatorProcess()
    try:
        with postgres_server_url() as server_url:
            result = measure(server_url, emulator, args.jobs, args.latency_ms)
    finally:
        emulator.stop()
    print(json.dumps(result) if args.json else summary_text(result))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    raise SystemExit(main())
