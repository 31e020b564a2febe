"""Lanes as threads (DrainFunction's ``DRAIN_LANES``) against lanes as separate processes.

    .venv/bin/python bench/lane_processes.py [--lanes 8] [--jobs 10000] [--rounds 2]

A diagnostic, not a target: it tells whether what caps N lanes on this machine is the drain's
one GIL or something every lane shares (the emulator, PostgreSQL, the 2 CPUs). Each round
drains the same workload twice, on a fresh queue and database each time, at ``--latency-ms``
per Infrai call:

* ``threads``: one process, N threads each running ``drain()`` with its own ledger and one
  shared client, as DrainFunction does;
* ``processes``: N processes, each one lane with its own client and ledger, started and
  connected before the clock starts, then released together.

It prints messages per second, the drains' and the emulator's CPU per message and how busy the
machine was. If the
processes do no better than the threads while the machine has CPU to spare, the lanes wait on
what they share, not on each other. Nothing here is written to ``bench/results``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(ROOT / "functions"))

from infrai_local.embedded_db import postgres_server_url  # noqa: E402
from run_bench import PROVIDER_URL  # noqa: E402

import bench_env  # noqa: E402
from instruments import busy_percent, machine_cpu_ticks, pid_cpu_seconds  # noqa: E402

_TIME_LEFT_MS = 600_000


def _lane_process(spec: dict[str, Any], go: Path) -> None:
    """One lane in this process: connect, wait for the start signal, drain, print a summary."""
    from infrai_jobs.drain.loop import drain  # noqa: PLC0415
    from infrai_jobs.drain.model import DrainConfig  # noqa: PLC0415
    from infrai_jobs.queue.client import InfraiClient, PoolOptions  # noqa: PLC0415
    from infrai_jobs.runtime.factory import client_pool_size  # noqa: PLC0415
    from infrai_jobs.work.ledger import PostgresLedger  # noqa: PLC0415
    from jobs import build_registry  # noqa: PLC0415

    client = InfraiClient(
        spec["emulator_url"], spec["api_key"], pool=PoolOptions(maxsize=client_pool_size(1))
    )
    ledger = PostgresLedger(spec["database_url"])
    ledger.ping()
    registry = build_registry()
    registry.bind_settings(dict.fromkeys(registry.declared_settings(), spec["provider_url"]))
    while not go.exists():
        time.sleep(0.001)
    cpu0 = time.process_time()
    summary = drain(
        client, ledger, registry, DrainConfig(queue=spec["queue"]), lambda: _TIME_LEFT_MS
    )
    print(json.dumps({"consumed": summary.consumed, "cpu_s": time.process_time() - cpu0}))
    ledger.close()
    client.close()


def _processes(spec: dict[str, Any], lanes: int, scratch: Path) -> dict[str, Any]:
    go = scratch / "go"
    go.unlink(missing_ok=True)
    children = [
        subprocess.Popen(
            [sys.executable, __file__, "--lane", json.dumps(spec), str(go)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(lanes)
    ]
    time.sleep(2.0)  # imports and connections, outside the measurement
    ticks0, started = machine_cpu_ticks(), time.perf_counter()
    go.touch()
    outputs = [json.loads(child.communicate()[0]) for child in children]
    elapsed = time.perf_counter() - started
    ticks1 = machine_cpu_ticks()
    if any(child.returncode for child in children):
        raise RuntimeError("a lane process failed")
    consumed = sum(o["consumed"] for o in outputs)
    cpu_s = sum(o["cpu_s"] for o in outputs)
    return _figures(consumed, elapsed, cpu_s, busy_percent(ticks0, ticks1))


def _threads(spec: dict[str, Any], lanes: int) -> dict[str, Any]:
    import worker  # noqa: PLC0415
    from instruments import BatchRecorder  # noqa: PLC0415

    drained = worker._drain_lanes(spec, BatchRecorder(), None, lanes)
    return _figures(drained.consumed, drained.elapsed, drained.cpu_s, drained.busy_pct)


def _figures(consumed: int, elapsed: float, cpu_s: float, busy_pct: float | None) -> dict[str, Any]:
    return {
        "messages_per_s": round(consumed / elapsed, 1),
        "cpu_ms_per_message": round(cpu_s * 1000 / max(consumed, 1), 3),
        "machine_busy_pct": busy_pct,
        "consumed": consumed,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lanes", type=int, default=8)
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--latency-ms", type=float, default=25.0)
    parser.add_argument("--lane", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.lane:
        _lane_process(json.loads(args.lane[0]), Path(args.lane[1]))
        return 0
    workload = bench_env.Workload(args.jobs, 0.3, 9)
    with (
        tempfile.TemporaryDirectory(prefix="infrai-lanes-") as scratch,
        postgres_server_url() as server_url,
    ):
        emulator = bench_env.EmulatorProcess()
        try:
            for round_no in range(1, args.rounds + 1):
                for mode in ("threads", "processes"):
                    name = f"bench-lanes-{mode}-{round_no}"
                    with bench_env.prepared_run(server_url, emulator, name, workload) as run:
                        spec = {
                            "database_url": run.database_url,
                            "emulator_url": emulator.url,
                            "api_key": bench_env.API_KEY,
                            "queue": run.queue,
                            "provider_url": PROVIDER_URL,
                        }
                        emulator.set_latency(args.latency_ms)
                        emulator_cpu0 = pid_cpu_seconds(emulator.pid)
                        if mode == "threads":
                            figures = _threads(spec, args.lanes)
                        else:
                            figures = _processes(spec, args.lanes, Path(scratch))
                        emulator_cpu1 = pid_cpu_seconds(emulator.pid)
                        emulator.set_latency(0)
                        if emulator_cpu0 is not None and emulator_cpu1 is not None:
                            # Includes the processes' start-up wait, when the emulator idles.
                            figures["emulator_cpu_ms_per_message"] = round(
                                (emulator_cpu1 - emulator_cpu0)
                                * 1000
                                / max(figures["consumed"], 1),
                                3,
                            )
                        figures["verified"] = bench_env.verify(run, emulator)["ok"]
                    print(f"round {round_no}, {args.lanes} lanes as {mode}: {json.dumps(figures)}")
        finally:
            emulator.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
