"""Latency and scale: idle polling against scheduled draining, and a backlog fanned out.

    .venv/bin/python bench/scale_bench.py [--trickle-jobs 40] [--backlog-jobs 20000]
        [--concurrency 1,2,4] [--latency-ms 25]      (``make bench`` runs it as one section)

(a) **Latency.** One ``infrai-jobs drain`` process with ``DRAIN_IDLE_POLL_MS`` (200) on an empty
queue; a job is published every 250 ms (``--trickle-jobs`` of them) while it polls. Latency is
from the start of each publish call to the moment its effect ran (``clock_timestamp()`` in a
trigger on ``invoices``), both on this machine's clock. Scheduled draining is **computed, not
run**: a job published at a uniformly random moment waits for the next EventBridge tick,
``U(0, tick)`` (p50 = tick / 2, p99 = 0.99 x tick), plus what a drain then takes to run it
(the polled run's p50, which already holds a consume and a batch).

(b) **Backlog.** ``--backlog-jobs`` messages waiting, drained by one ``infrai-jobs drain``
process with ``DRAIN_MAX_CONCURRENCY`` = 1, 2, 4 and ``DRAIN_FANOUT_AFTER_SECONDS`` = 1 (so the cap,
not the threshold, decides how many drains run): the drain fans out to ``infrai-jobs drain``
processes through the same port Lambda's Invoke serves in AWS, and the command ends when they
all have. Its wall time is the time to clear; ratios are against concurrency 1.

Every run is verified: each effect exactly once (one trigger row per invoice), every claim
done, the queue and the DLQ empty, no drain lease left, and never more drains alive than the cap
(a trigger counts ``drain_leases`` after every change).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, LiteralString

import psycopg

from infrai_jobs.queue.client import InfraiClient
from infrai_local.migrations import apply_migrations
from infrai_local.sandbox.embedded_db import postgres_server_url, scratch_database
from infrai_local.sandbox.fan_out import CLI
from infrai_local.sandbox.queues import ensure_queue

from bench_env import (
    API_KEY,
    EFFECTS_DDL,
    JOB_MIGRATIONS,
    JOBS_PATH,
    EmulatorProcess,
    Workload,
    drain_env,
    invoice_id,
    prepared_run,
    queue_stats,
    recording_table,
)
from instruments import latency_summary, sample_busy_percent

TRICKLE_EVERY_S = 0.25

# Each effect (EFFECTS_DDL), and the drains alive after every change to drain_leases.
_TRACKING_DDL = EFFECTS_DDL + recording_table(
    "bench_fleet_sizes",
    "live int NOT NULL",
    "INSERT INTO bench_fleet_sizes SELECT count(*) FROM drain_leases WHERE lease_until >= now()",
    "INSERT OR UPDATE ON drain_leases FOR EACH STATEMENT",
)
_INVOICES: LiteralString = """
INSERT INTO invoices (id)
SELECT 'inv_' || lpad(g::text, 7, '0') FROM generate_series(0, %(count)s - 1) AS g
"""
_VERIFY: LiteralString = """
SELECT (SELECT count(*) FROM invoices WHERE status = 'final'
            AND total_cents = 1000 + right(id, 7)::int),
       (SELECT count(*) FROM (SELECT id FROM bench_effects GROUP BY id HAVING count(*) = 1) o),
       (SELECT count(*) FROM bench_effects),
       (SELECT count(*) FROM job_claims WHERE state = 'done'),
       (SELECT count(*) FROM drain_leases),
       (SELECT coalesce(max(live), 0) FROM bench_fleet_sizes)
"""
_EFFECT_TIMES: LiteralString = (
    "SELECT id, extract(epoch FROM at)::float8 FROM bench_effects ORDER BY at"
)


def _verify(
    database_url: str, emulator: EmulatorProcess, queue: str, jobs: int, cap: int
) -> dict[str, Any]:
    emulator.set_latency(0)
    with psycopg.connect(database_url, autocommit=True) as conn:
        row = conn.execute(_VERIFY).fetchone()
    assert row is not None
    right, once, effects, done, leases, peak = (int(v) for v in row)
    stats = queue_stats(emulator, queue)
    checks: dict[str, Any] = {
        "invoices_final_with_right_amount": right,
        "invoices_with_exactly_one_effect": once,
        "effects": effects,
        "claims_done": done,
        "queue_left": stats.message_count,
        "dead_lettered": stats.dlq_count,
        "drain_leases_left": leases,
        "peak_drains_alive": peak,
    }
    checks["ok"] = (
        right == once == effects == done == jobs
        and stats.message_count == 0
        and stats.dlq_count == 0
        and leases == 0
        and peak <= cap
    )
    return checks


def _run_drain(env: dict[str, str], budget_s: float, log: Path) -> tuple[dict[str, Any], float]:
    started = time.monotonic()
    with log.open("w") as stderr:
        done = subprocess.run(
            [
                *CLI,
                "drain",
                "--jobs-path",
                str(JOBS_PATH),
                "--time-budget-seconds",
                str(budget_s),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            timeout=budget_s + 120,
            check=False,
        )
    wall = time.monotonic() - started
    if done.returncode != 0:
        raise RuntimeError(f"drain exited {done.returncode}: {log.read_text()[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1]), wall


def _drains_in(summary: dict[str, Any]) -> int:
    return 1 + sum(_drains_in(child) for child in summary.get("fanned_out_drains", []))


def _consumed_in(summary: dict[str, Any]) -> int:
    children = summary.get("fanned_out_drains", [])
    return int(summary["consumed"]) + sum(_consumed_in(child) for child in children)


def measure_latency(
    server_url: str,
    emulator: EmulatorProcess,
    scratch: Path,
    *,
    jobs: int,
    idle_poll_ms: int,
    latency_ms: float,
    tick_seconds: float,
) -> dict[str, Any]:
    """(a): a trickle through one idle-polling drain, and scheduled draining computed."""
    queue = "bench-trickle"
    with scratch_database(server_url, prefix="infrai_bench") as database_url:
        with psycopg.connect(database_url, autocommit=True) as conn:
            apply_migrations(conn, JOB_MIGRATIONS)
            conn.execute(_INVOICES, {"count": jobs})
            conn.execute(_TRACKING_DDL)
        client = InfraiClient(emulator.url, API_KEY)
        ensure_queue(client, queue, dlq=f"{queue}-dlq")
        background = sample_busy_percent(0.5)
        emulator.set_latency(latency_ms)
        trickle_s = jobs * TRICKLE_EVERY_S
        # Polling must outlast the trickle: the budget covers it, a batch and a margin.
        env = drain_env(
            emulator,
            database_url,
            queue,
            DRAIN_IDLE_POLL_MS=str(idle_poll_ms),
            DRAIN_BATCH_BUDGET_MS="2000",
        )
        before = emulator.requests()["consume"]
        result: dict[str, Any] = {}
        drain_thread = threading.Thread(
            target=lambda: result.update(
                zip(
                    ("summary", "wall_s"),
                    _run_drain(env, trickle_s + 8, scratch / "trickle-drain.log"),
                    strict=True,
                )
            )
        )
        drain_thread.start()
        # The trickle starts once the drain is polling (its first consume reached Infrai).
        while emulator.requests()["consume"] == before:
            if not drain_thread.is_alive():
                break
            time.sleep(0.05)
        published: dict[str, float] = {}
        next_at = time.time()
        for index in range(jobs):
            time.sleep(max(0.0, next_at - time.time()))
            started = time.time()
            client.publish(
                queue,
                {
                    "job": "invoice.finalize",
                    "invoice_id": invoice_id(index),
                    "amount_cents": 1000 + index,
                },
            )
            published[invoice_id(index)] = started
            next_at += TRICKLE_EVERY_S
        drain_thread.join()
        client.close()
        verified = _verify(database_url, emulator, queue, jobs, cap=1)
        with psycopg.connect(database_url, autocommit=True) as conn:
            effect_at = dict(conn.execute(_EFFECT_TIMES).fetchall())
    latencies = sorted(1000 * (effect_at[i] - published[i]) for i in published if i in effect_at)
    polled = latency_summary(latencies)
    run_ms = polled["p50"]
    return {
        "jobs": jobs,
        "publish_every_ms": TRICKLE_EVERY_S * 1000,
        "idle_poll_ms": idle_poll_ms,
        "latency_ms_per_call": latency_ms,
        "background_busy_pct": background,
        "idle_polling": {
            **polled,
            "idle_polls": result.get("summary", {}).get("idle_polls"),
            "consumes": emulator.requests()["consume"] - before,
        },
        "scheduled": {
            "computed": True,
            "tick_seconds": tick_seconds,
            "p50": round(tick_seconds * 1000 * 0.5 + run_ms, 1),
            "p99": round(tick_seconds * 1000 * 0.99 + run_ms, 1),
        },
        "verified": verified,
    }


def measure_backlog(
    server_url: str,
    emulator: EmulatorProcess,
    scratch: Path,
    *,
    jobs: int,
    concurrency: list[int],
    latency_ms: float,
    seed: int,
) -> dict[str, Any]:
    """(b): the same backlog cleared with each DRAIN_MAX_CONCURRENCY."""
    runs = []
    for cap in concurrency:
        queue = f"bench-backlog-{cap}"
        workload = Workload(jobs, 0.0, seed)
        with prepared_run(server_url, emulator, queue, workload) as run:
            with psycopg.connect(run.database_url, autocommit=True) as conn:
                conn.execute(_TRACKING_DDL)
            background = sample_busy_percent(0.5)
            print(f"  backlog: {jobs} messages, DRAIN_MAX_CONCURRENCY={cap}", file=sys.stderr)
            emulator.set_latency(latency_ms)
            env = drain_env(
                emulator,
                run.database_url,
                queue,
                DRAIN_MAX_CONCURRENCY=str(cap),
                DRAIN_FANOUT_AFTER_SECONDS="1",
            )
            summary, wall = _run_drain(env, 240, scratch / f"backlog-{cap}.log")
            verified = _verify(run.database_url, emulator, queue, jobs, cap)
            with psycopg.connect(run.database_url, autocommit=True) as conn:
                times = sorted(at for _, at in conn.execute(_EFFECT_TIMES).fetchall())
        row = {
            "max_concurrency": cap,
            "wall_s": round(wall, 2),
            "messages_per_s": round(jobs / wall, 1),
            "first_to_last_effect_s": round(times[-1] - times[0], 2) if times else None,
            "drains_run": _drains_in(summary),
            "consumed": _consumed_in(summary),
            "background_busy_pct": background,
            "verified": verified,
        }
        print(
            f"    {row['wall_s']} s ({row['messages_per_s']} msg/s), {row['drains_run']} drains, "
            f"peak {verified['peak_drains_alive']} alive, verified {verified['ok']}",
            file=sys.stderr,
        )
        runs.append(row)
    base = next((r["wall_s"] for r in runs if r["max_concurrency"] == 1), None)
    for row in runs:
        row["speedup"] = round(base / row["wall_s"], 2) if base else None
    one = next((r for r in runs if r["max_concurrency"] == 1), None)
    return {
        "jobs": jobs,
        "latency_ms_per_call": latency_ms,
        "fan_out_after_seconds": 1,
        "runs": runs,
        "one_drain_messages_per_s": one["messages_per_s"] if one else None,
    }


def measure(
    server_url: str,
    emulator: EmulatorProcess,
    scratch: Path,
    *,
    trickle_jobs: int,
    idle_poll_ms: int,
    backlog_jobs: int,
    concurrency: list[int],
    latency_ms: float,
    tick_seconds: float = 60.0,
    seed: int = 9,
) -> dict[str, Any]:
    result: dict[str, Any] = {}
    if trickle_jobs > 0:
        print(
            f"latency: {trickle_jobs} jobs, one every {TRICKLE_EVERY_S * 1000:.0f} ms, "
            f"idle polling at {idle_poll_ms} ms",
            file=sys.stderr,
        )
        result["latency"] = measure_latency(
            server_url,
            emulator,
            scratch,
            jobs=trickle_jobs,
            idle_poll_ms=idle_poll_ms,
            latency_ms=latency_ms,
            tick_seconds=tick_seconds,
        )
        polled = result["latency"]["idle_polling"]
        print(
            f"  idle polling p50 {polled['p50']} ms, p99 {polled['p99']} ms, verified "
            f"{result['latency']['verified']['ok']}",
            file=sys.stderr,
        )
    if backlog_jobs > 0 and concurrency:
        result["backlog"] = measure_backlog(
            server_url,
            emulator,
            scratch,
            jobs=backlog_jobs,
            concurrency=concurrency,
            latency_ms=latency_ms,
            seed=seed,
        )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scale_bench.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--trickle-jobs", type=int, default=40)
    parser.add_argument("--idle-poll-ms", type=int, default=200)
    parser.add_argument("--backlog-jobs", type=int, default=20_000)
    parser.add_argument("--concurrency", default="1,2,4")
    parser.add_argument("--latency-ms", type=float, default=25.0)
    args = parser.parse_args(argv)
    concurrency = sorted({int(c) for c in args.concurrency.split(",") if c.strip()})
    import tempfile  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as scratch, postgres_server_url() as server_url:
        emulator = EmulatorProcess()
        try:
            result = measure(
                server_url,
                emulator,
                Path(scratch),
                trickle_jobs=args.trickle_jobs,
                idle_poll_ms=args.idle_poll_ms,
                backlog_jobs=args.backlog_jobs,
                concurrency=concurrency,
                latency_ms=args.latency_ms,
            )
        finally:
            emulator.stop()
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
