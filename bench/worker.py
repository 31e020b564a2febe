"""One measured drain, in a process of its own: ``python bench/worker.py SPEC.json``.

The orchestrator (``run_bench.py``) has already published the jobs and set the emulator's latency.
This process drains the queue with one variant, timing from just before the first consume to the
moment the queue came back empty (connection set-up included, as on a cold invocation), and
writes what it measured to ``spec["result_path"]`` as JSON. Each variant runs in its own process
so that peak memory and CPU time are that variant's alone and no GIL is shared with the emulator
or the orchestrator.

Variants: ``notes_loop`` (the field notes' loop, ``notes_loop.py``) and ``drain``
(``infrai_jobs.drain.loop.drain`` with ``PostgresLedger`` and ``functions/jobs``' registry), the
latter in ``lanes`` threads at once, each with its own HTTP client and database connection.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

from infrai_jobs.drain.loop import drain
from infrai_jobs.drain.model import DrainConfig, DrainSummary
from infrai_jobs.jobs.registry import JobRegistry
from infrai_jobs.queue.client import InfraiClient
from infrai_jobs.queue.transport import PoolOptions
from infrai_jobs.runtime.factory import client_pool_size
from infrai_jobs.work.ledger import PostgresLedger
from jobs import build_registry

import notes_loop
from instruments import (
    BatchRecorder,
    ProtocolTrace,
    RoundTrips,
    ThreadProfiles,
    TimedQueue,
    busy_percent,
    count_round_trips,
    cpu_use,
    latency_summary,
    machine_cpu_ticks,
    memory_mb,
    process_cpu_seconds,
)

# No invocation ever runs out of time here: the benchmark measures draining, not budgeting.
_TIME_LEFT_MS = 3_600_000


@dataclass
class _Drained:
    consumed: int
    elapsed: float
    cpu_s: float
    busy_pct: float | None
    outcomes: dict[str, int]


def bound_registry(provider_url: str) -> JobRegistry:
    """The functions' registry, every job setting pointed at ``provider_url``."""
    registry = build_registry()
    registry.bind_settings(dict.fromkeys(registry.declared_settings(), provider_url))
    return registry


def _notes_loop(
    spec: dict[str, Any], recorder: BatchRecorder, trace: ProtocolTrace | None
) -> _Drained:
    client = InfraiClient(spec["emulator_url"], spec["api_key"])
    api = TimedQueue(client, recorder)
    cpu0, ticks0, started = process_cpu_seconds(), machine_cpu_ticks(), time.perf_counter()
    db = psycopg.connect(spec["database_url"], autocommit=True)
    consumed = notes_loop.drain_until_empty(api, db, spec["queue"])
    elapsed = time.perf_counter() - started
    cpu1, ticks1 = process_cpu_seconds(), machine_cpu_ticks()
    if trace is not None:
        trace.finish()  # before the connection closes: libpq flushes the trace on untrace
    db.close()
    client.close()
    return _Drained(consumed, elapsed, cpu1 - cpu0, busy_percent(ticks0, ticks1), {})


def _drain_lanes(
    spec: dict[str, Any], recorder: BatchRecorder, trace: ProtocolTrace | None, lanes: int
) -> _Drained:
    # As DrainFunction runs lanes: one client (its pool sized for every lane) and a database
    # connection per lane.
    client = InfraiClient(
        spec["emulator_url"], spec["api_key"], pool=PoolOptions(maxsize=client_pool_size(lanes))
    )
    ledgers = [PostgresLedger(spec["database_url"]) for _ in range(lanes)]
    registries = [bound_registry(spec["provider_url"]) for _ in range(lanes)]
    config = DrainConfig(queue=spec["queue"])

    def lane(index: int) -> DrainSummary:
        queue = TimedQueue(client, recorder)
        return drain(queue, ledgers[index], registries[index], config, lambda: _TIME_LEFT_MS)

    with ThreadPoolExecutor(max_workers=lanes, thread_name_prefix="lane") as pool:
        cpu0, ticks0, started = process_cpu_seconds(), machine_cpu_ticks(), time.perf_counter()
        futures = [pool.submit(lane, index) for index in range(lanes)]
        wait(futures)
        elapsed = time.perf_counter() - started
        cpu1, ticks1 = process_cpu_seconds(), machine_cpu_ticks()
    if trace is not None:
        trace.finish()
    for ledger in ledgers:
        ledger.close()
    client.close()
    summaries = [future.result() for future in futures]  # a lane's failure is raised here
    outcomes: Counter[str] = Counter()
    for summary in summaries:
        outcomes.update(summary.outcomes)
    return _Drained(
        sum(s.consumed for s in summaries),
        elapsed,
        cpu1 - cpu0,
        busy_percent(ticks0, ticks1),
        dict(sorted(outcomes.items())),
    )


def run(spec: dict[str, Any]) -> dict[str, Any]:
    variant = spec["variant"]
    lanes = int(spec.get("lanes", 1))
    recorder = BatchRecorder()
    trace = ProtocolTrace(Path(spec["trace_dir"])) if spec.get("trace") else None
    if trace is not None:
        trace.install()
    rss_before = memory_mb()["rss_mb"]
    profiles = ThreadProfiles() if spec.get("profile_path") else None
    if profiles is not None:
        profiles.start()
    if variant == "notes_loop":
        if lanes != 1:
            raise ValueError("the notes' loop is sequential: one lane only")
        drained = _notes_loop(spec, recorder, trace)
    elif variant == "drain":
        drained = _drain_lanes(spec, recorder, trace, lanes)
    else:
        raise ValueError(f"unknown variant {variant!r}")
    profile_top: list[dict[str, Any]] = []
    if profiles is not None:
        profiles.stop()
        profile_top = profiles.report(Path(spec["profile_path"]))
    memory = memory_mb()
    db_counts = RoundTrips()
    if trace is not None:
        job_statement = re.compile(spec["job_statement"], re.IGNORECASE)
        db_counts = count_round_trips(trace.finish(), job_statement)
    elapsed = drained.elapsed
    ahead_work, ahead_wait = recorder.consume_ahead_ms()
    return {
        "variant": variant,
        "lanes": lanes,
        "consumed": drained.consumed,
        "elapsed_s": round(elapsed, 3),
        "messages_per_s": round(drained.consumed / elapsed, 1) if elapsed > 0 else 0.0,
        "batch_latency_ms": latency_summary(recorder.batch_latencies_ms()),
        "call_latency_ms": {
            call: latency_summary(values) for call, values in recorder.call_durations_ms().items()
        },
        "between_consumes_ms": latency_summary(recorder.between_consumes_ms()),
        "consume_ahead_work_ms": latency_summary(ahead_work),
        "consume_ahead_wait_ms": latency_summary(ahead_wait),
        "client_calls": dict(recorder.calls),
        "outcomes": drained.outcomes,
        "db": {
            "traced": trace is not None,
            "connections": trace.connections if trace is not None else None,
            "round_trips": db_counts.total,
            "ledger_round_trips": db_counts.ledger,
            "job_round_trips": db_counts.job,
            "statements": db_counts.statements,
            "round_trips_by_label": dict(db_counts.by_label.most_common()),
        },
        "memory": {"rss_before_mb": rss_before, **memory},
        "profile_top": profile_top,
        "cpu": {**cpu_use(drained.cpu_s, elapsed), "machine_busy_pct": drained.busy_pct},
    }


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    spec = json.loads(Path(argv[1]).read_text())
    result = run(spec)
    Path(spec["result_path"]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
