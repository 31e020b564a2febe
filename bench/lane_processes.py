"""Lanes as threads (DrainFunction's ``DRAIN_LANES``) against lanes as separate processes.

    .venv/bin/python bench/lane_processes.py [--lanes 8] [--jobs 10000] [--rounds 2]
        [--modes threads,processes] [--update bench/results/latest.json]

A diagnostic, not a target: it tells whether what caps N lanes on this machine is the drain's
one GIL or something every lane shares (the emulator, PostgreSQL, the 2 CPUs). Each round
drains the same workload (``--jobs`` messages, whatever the lane count) once per lane count of
``--lanes`` (e.g. ``1,2,4``) and mode, on a fresh queue and database each time, at
``--latency-ms`` per Infrai call:

* ``threads``: one process, N threads each running ``drain()`` with its own ledger and one
  shared client, as DrainFunction does;
* ``processes``: N processes, each one lane with its own client and ledger, started and
  connected before the clock starts, then released together.

It prints messages per second, the CPU per message of the drains, the emulator and PostgreSQL
(its postmaster and backends, read from /proc) and how busy the machine was. If the processes do
no better than the threads while the machine has CPU to spare, the lanes wait on what they
share, not on each other. With ``1`` among the lane counts, each count's speedup over one lane
and its share per lane (speedup / lanes) follow. ``--update`` stores the result under
``lane_processes`` in results files and regenerates ``docs/performance.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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

from infrai_local.sandbox.embedded_db import postgres_server_url  # noqa: E402

import bench_env  # noqa: E402
from instruments import (  # noqa: E402
    busy_percent,
    machine_cpu_ticks,
    pid_cpu_seconds,
    postmaster_pid,
    sample_busy_percent,
    server_cpu_seconds,
)
from results_file import Span, add_output_options, measured_by, update_results  # noqa: E402

_TIME_LEFT_MS = 600_000


def _lane_process(spec: dict[str, Any], go: Path) -> None:
    """One lane in this process: connect, wait for the start signal, drain, print a summary."""
    from infrai_jobs.drain.loop import drain  # noqa: PLC0415
    from infrai_jobs.drain.model import DrainConfig  # noqa: PLC0415
    from infrai_jobs.queue.client import InfraiClient  # noqa: PLC0415
    from infrai_jobs.queue.transport import PoolOptions  # noqa: PLC0415
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


def _cpu_ms_per_message(before: float | None, after: float | None, consumed: int) -> float | None:
    # Includes the connections' set-up and, for processes, their start-up wait (idle).
    if before is None or after is None:
        return None
    return round((after - before) * 1000 / max(consumed, 1), 3)


def _measure(
    spec: dict[str, Any], mode: str, lanes: int, scratch: Path, postgres: int | None
) -> dict[str, Any]:
    """One drain of ``spec``'s queue with ``lanes`` lanes in ``mode``, with what the emulator and
    PostgreSQL spent meanwhile."""
    emulator_pid = spec["emulator_pid"]
    emulator_cpu0, postgres_cpu0 = pid_cpu_seconds(emulator_pid), _server_cpu(postgres)
    figures = _threads(spec, lanes) if mode == "threads" else _processes(spec, lanes, scratch)
    emulator_cpu1, postgres_cpu1 = pid_cpu_seconds(emulator_pid), _server_cpu(postgres)
    consumed = figures["consumed"]
    figures["emulator_cpu_ms_per_message"] = _cpu_ms_per_message(
        emulator_cpu0, emulator_cpu1, consumed
    )
    figures["postgres_cpu_ms_per_message"] = _cpu_ms_per_message(
        postgres_cpu0, postgres_cpu1, consumed
    )
    return figures


def _server_cpu(pid: int | None) -> float | None:
    return server_cpu_seconds(pid) if pid else None


# --- what the runs come to (pure) --------------------------------------------------------------


def lane_rows(runs: list[dict[str, Any]], nproc: int) -> list[dict[str, Any]]:
    """Per mode and lane count, the median over rounds: throughput, speedup over one lane of the
    same mode and its share per lane, and each process's CPU as a share of one core."""
    rows = []
    keys = sorted({(r["mode"], r["lanes"]) for r in runs}, key=lambda k: (k[0] != "threads", k))
    for mode, lanes in keys:
        same = [r for r in runs if (r["mode"], r["lanes"]) == (mode, lanes)]
        rate = _median([r["messages_per_s"] for r in same])
        row: dict[str, Any] = {"mode": mode, "lanes": lanes, "messages_per_s": rate}
        for name in ("cpu", "emulator_cpu", "postgres_cpu"):
            per_message = _median([r.get(f"{name}_ms_per_message") for r in same])
            row[f"{name}_ms_per_message"] = per_message
            # CPU ms per message x messages per second = ms per second: / 10 is % of one core.
            row[f"{name}_pct"] = (
                round(per_message * rate / 10, 1) if per_message is not None and rate else None
            )
        busy = _median([r.get("machine_busy_pct") for r in same])
        row["machine_busy_pct"] = busy
        row["machine_cpu_ms_per_message"] = (
            round(busy / 100 * nproc * 1000 / rate, 3) if busy is not None and rate else None
        )
        row["verified"] = all(r["verified"] for r in same)
        rows.append(row)
    for row in rows:
        one = next((r for r in rows if (r["mode"], r["lanes"]) == (row["mode"], 1)), None)
        if one and one["messages_per_s"] and row["messages_per_s"]:
            row["speedup"] = round(row["messages_per_s"] / one["messages_per_s"], 2)
            row["per_lane"] = round(row["speedup"] / row["lanes"], 3)
        else:
            row["speedup"] = row["per_lane"] = None
    return rows


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 3) if present else None


def cpu_verdict(rows: list[dict[str, Any]], nproc: int, per_lane_target: float) -> str:
    """Whether the machine's CPUs could carry the widest threads run at the per-lane target:
    the whole machine's CPU per message (other work included) and the benchmark's own (the
    drain, the emulator, PostgreSQL), each against what that target needs."""
    threads = [r for r in rows if r["mode"] == "threads"]
    one = next((r for r in threads if r["lanes"] == 1), None)
    widest = max(threads, key=lambda r: r["lanes"], default=None)
    if one is None or widest is None or widest["lanes"] == 1:
        return ""
    machine_ms = widest["machine_cpu_ms_per_message"]
    if not machine_ms:
        return ""
    lanes = widest["lanes"]
    ceiling = nproc * 1000 / machine_ms
    needed = per_lane_target * lanes * one["messages_per_s"]
    own = [widest[f"{name}_ms_per_message"] for name in ("cpu", "emulator_cpu", "postgres_cpu")]
    own_ms = sum(own) if None not in own else None
    text = (
        f"At {lanes} lanes the machine (the drain, the emulator, PostgreSQL and everything else "
        f"running) spent {machine_ms:.2f} ms of CPU per message at "
        f"{widest['machine_busy_pct']:g}% busy, so its {nproc} CPUs could drain at most about "
        f"{ceiling:,.0f} msg/s however the lanes were arranged"
        + (
            f"; the benchmark's own processes spent {own_ms:.2f} ms of it (drain "
            f"{own[0]:.2f}, emulator {own[1]:.2f}, PostgreSQL {own[2]:.2f}), about "
            f"{nproc * 1000 / own_ms:,.0f} msg/s on CPUs of their own"
            if own_ms
            else ""
        )
        + f". {lanes} lanes at {per_lane_target:g} per lane need {needed:,.0f} msg/s "
        f"({per_lane_target:g} x {lanes} x {one['messages_per_s']:,.1f}). "
    )
    if widest["per_lane"] is not None and widest["per_lane"] >= per_lane_target:
        return text + f"They reached {widest['per_lane']:.2f} per lane: the target is met here."
    if ceiling < needed:
        return text + "**The CPUs are what stops it here.**"
    return text + "The CPUs had room for it: something else held the lanes back."


PER_LANE_TARGET = 0.9
BUSY_BEFORE_PCT = 20.0  # report.BACKGROUND_WARNING_PCT's threshold


def markdown(result: dict[str, Any]) -> list[str]:
    """Its section of ``docs/performance.md`` (``report.py`` renders it when a results file
    holds one)."""
    config = result["config"]
    lines = [
        "## Lanes on a fixed workload (issue 47)",
        "",
        measured_by("lane_processes.py", result, config["nproc"])
        + f"Every run drains the same {config['jobs']:,} `invoice.finalize` "
        f"messages ({config['unique_jobs']:,} distinct jobs + {config['duplicate_publishes']:,} "
        f"duplicate publishes) at {config['latency_ms']:g} ms per Infrai call, whatever its "
        f"lane count, on a fresh queue and database; {config['rounds']} round(s). **threads** "
        "is DrainFunction's `DRAIN_LANES` (N threads in one process, one shared client); "
        "**processes** is N one-lane processes released together. CPU is each part's share of "
        "one core over the drain: the drain process(es) (their own clock), the emulator and "
        "PostgreSQL (postmaster and backends) from /proc, the machine from /proc/stat. The "
        f"issue's target is {PER_LANE_TARGET:g} per lane up to 4 lanes.",
        "",
        "| lanes | mode | msg/s | speedup | per lane | drain CPU % | emulator CPU % "
        "| PostgreSQL CPU % | machine busy % | machine CPU ms/msg | verified |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for row in sorted(result["rows"], key=lambda r: (r["lanes"], r["mode"] != "threads")):
        cells = [
            str(row["lanes"]),
            row["mode"],
            _cell(row["messages_per_s"]),
            "-" if row["speedup"] is None else f"{row['speedup']:.2f}x",
            "-" if row["per_lane"] is None else f"{row['per_lane']:.2f}",
            _cell(row["cpu_pct"]),
            _cell(row["emulator_cpu_pct"]),
            _cell(row["postgres_cpu_pct"]),
            _cell(row["machine_busy_pct"]),
            _cell(row["machine_cpu_ms_per_message"], 2),
            "yes" if row["verified"] else "NO",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    verdict = cpu_verdict(result["rows"], config["nproc"], PER_LANE_TARGET)
    lines += ["", *([verdict, ""] if verdict else [])]
    busy = [
        f"{r['lanes']} lane{'s' if r['lanes'] != 1 else ''} as {r['mode']}: "
        f"{r['background_busy_pct']:g}%"
        for r in result["runs"]
        if (r.get("background_busy_pct") or 0) > BUSY_BEFORE_PCT
    ]
    if busy:
        lines += [
            f"Other work kept the machine more than {BUSY_BEFORE_PCT:g}% busy just before "
            f"{len(busy)} of these runs ({'; '.join(busy)}); their figures may be skewed, and "
            "the machine's CPU per message counts that work too.",
            "",
        ]
    lines += [
        "Reproduce with `.venv/bin/python bench/lane_processes.py --lanes "
        f"{','.join(str(n) for n in config['lanes'])} --jobs {config['jobs']} --rounds "
        f"{config['rounds']} --update bench/results/latest.json`.",
        "",
    ]
    return lines


def _cell(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


# --- the command --------------------------------------------------------------------------------


def _counts(text: str) -> list[int]:
    values = sorted({int(part) for part in text.split(",") if part.strip()})
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError("lane counts are positive integers, e.g. 1,2,4")
    return values


def _modes(text: str) -> list[str]:
    modes = [part.strip() for part in text.split(",") if part.strip()]
    if not modes or set(modes) - {"threads", "processes"}:
        raise argparse.ArgumentTypeError("modes are threads and processes")
    return modes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lanes", type=_counts, default=[8], help="lane counts, e.g. 1,2,4")
    parser.add_argument("--jobs", type=int, default=10_000, help="messages of every run")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--latency-ms", type=float, default=25.0)
    parser.add_argument("--modes", type=_modes, default=["threads", "processes"])
    add_output_options(parser, stored_under="lane_processes")
    parser.add_argument("--lane", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.lane:
        _lane_process(json.loads(args.lane[0]), Path(args.lane[1]))
        return 0
    span = Span()
    workload = bench_env.Workload(args.jobs, 0.3, 9)
    runs: list[dict[str, Any]] = []
    with (
        tempfile.TemporaryDirectory(prefix="infrai-lanes-") as scratch,
        postgres_server_url() as server_url,
    ):
        postgres = postmaster_pid(server_url)
        emulator = bench_env.EmulatorProcess()
        try:
            for round_no in range(1, args.rounds + 1):
                for lanes in args.lanes:
                    for mode in args.modes:
                        name = f"bench-lanes-{mode}-{lanes}-{round_no}"
                        with bench_env.prepared_run(server_url, emulator, name, workload) as run:
                            spec = {
                                "database_url": run.database_url,
                                "emulator_url": emulator.url,
                                "emulator_pid": emulator.pid,
                                "api_key": bench_env.API_KEY,
                                "queue": run.queue,
                                "provider_url": bench_env.PROVIDER_URL,
                            }
                            background = sample_busy_percent(0.5)
                            emulator.set_latency(args.latency_ms)
                            figures = _measure(spec, mode, lanes, Path(scratch), postgres)
                            emulator.set_latency(0)
                            figures["verified"] = bench_env.verify(run, emulator)["ok"]
                        figures |= {"round": round_no, "mode": mode, "lanes": lanes}
                        figures["background_busy_pct"] = background
                        runs.append(figures)
                        print(
                            f"round {round_no}, {lanes} lanes as {mode}: {json.dumps(figures)}",
                            file=sys.stderr,
                            flush=True,
                        )
        finally:
            emulator.stop()
    nproc = len(os.sched_getaffinity(0))
    result = {
        **span.times(),
        "config": {
            **workload.sizes(),
            "latency_ms": args.latency_ms,
            "rounds": args.rounds,
            "lanes": args.lanes,
            "modes": args.modes,
            "nproc": nproc,
        },
        "rows": lane_rows(runs, nproc),
        "runs": runs,
    }
    if args.update:
        update_results(args.update, lambda _path, document: document.update(lane_processes=result))
    print(json.dumps(result, indent=2) if args.json else "\n".join(markdown(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
