"""``make bench``: the field notes' worker loop against this project's drain, side by side.

    .venv/bin/python bench/run_bench.py [--jobs 5000] [--latency-ms 25] [--rounds 2]
        [--lanes 1,2,4,8] [--rss-jobs 20000] [--second-layer-jobs 500] [--out bench/results]

One run: DrainFunction's cold start (``cold_start.py``); then, against the emulator (its own
process, ``--latency-ms`` injected on every /v1 call while a drain is measured) and PostgreSQL
(``DATABASE_URL`` when set, else an embedded server; a fresh scratch database per drain):

1. ``--rounds`` rounds of (a) the notes' loop and (b) ``infrai_jobs.drain.loop.drain``, alternating
   (a), (b), (a), (b)..., each on a fresh queue holding ``--jobs`` messages (``--duplicates`` of
   them repeat publishes of another message's job), each in its own process (``worker.py``);
2. (b) in N concurrent lanes for each N of ``--lanes``, draining N x ``--jobs`` messages (or
   ``--lane-messages`` whatever N);
3. (b) draining ``--rss-jobs`` messages, for peak memory;
4. latency and scale (``scale_bench.py``): publish -> effect latency of a trickle of
   ``--trickle-jobs`` (one every 250 ms) with ``DRAIN_IDLE_POLL_MS`` ``--idle-poll-ms`` against
   scheduled draining (computed from the tick), and the time to clear ``--backlog-jobs`` with
   ``DRAIN_MAX_CONCURRENCY`` each of ``--concurrency``; ``0`` skips either;
5. the second layer's cost (``second_layer_bench.py``): ``--second-layer-jobs`` ``receipt.send``
   (external) messages drained with ``IDEMPOTENCY_BACKEND`` off, on (first run) and on again
   with a fresh ledger (replay), DynamoDB being moto's server on 127.0.0.1 with the same
   injected latency; plus the cold start of turning it on. ``--second-layer-jobs 0`` skips it;
6. what a limited job costs (``flow_bench.py``): ``--flow-jobs`` ``receipt.send`` messages
   drained without flow control, with it on for another job only, and with a never-throttling
   rate limit and concurrency key on the job itself, ``--flow-rounds`` times; the ledger round
   trips per message of each, against the target that a job without a policy pays nothing.
   ``--flow-jobs 0`` skips it.

Results: ``<out>/bench-<timestamp>.json``, ``<out>/latest.json``, ``<out>/latest.png`` and
``docs/performance.md`` (``report.py`` regenerates the last two from a JSON file).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg

from infrai_jobs.queue_contract import CONSUME_CAP
from infrai_local.sandbox.embedded_db import configured_database_url, postgres_server_url

import cold_start
import receipt_drain
import report
from bench_env import (
    API_KEY,
    BENCH,
    PROVIDER_URL,
    ROOT,
    EmulatorProcess,
    Workload,
    prepared_run,
    verify,
    worker_result,
)
from instruments import sample_busy_percent

# The job's own statements, told apart from the ledger's in the protocol trace.
JOB_STATEMENT = r"^\s*UPDATE\s+invoices\b"


@dataclass(frozen=True)
class Bench:
    server_url: str
    emulator: EmulatorProcess
    scratch: Path
    latency_ms: float
    trace: bool
    timeout_s: float
    out: Path


def measure(
    bench: Bench,
    name: str,
    variant: str,
    workload: Workload,
    lanes: int = 1,
    *,
    profile: bool = False,
) -> dict[str, Any]:
    """Prepare a fresh queue and database, drain them in a worker process, check the result.

    With ``profile``, the worker runs under cProfile (all threads) and writes
    ``<out>/profile-<name>.txt``; its timings are then not comparable with the others.
    """
    trace_dir = bench.scratch / name
    trace_dir.mkdir()
    spec_path = bench.scratch / f"{name}.spec.json"
    result_path = bench.scratch / f"{name}.result.json"
    log_path = bench.scratch / f"{name}.log"
    with prepared_run(bench.server_url, bench.emulator, f"bench-{name}", workload) as run:
        spec = {
            "variant": variant,
            "lanes": lanes,
            "database_url": run.database_url,
            "emulator_url": bench.emulator.url,
            "api_key": API_KEY,
            "queue": run.queue,
            "provider_url": PROVIDER_URL,
            "trace": bench.trace,
            "trace_dir": str(trace_dir),
            "result_path": str(result_path),
            "job_statement": JOB_STATEMENT,
            "profile_path": str(bench.out / f"profile-{name}.txt") if profile else None,
        }
        spec_path.write_text(json.dumps(spec))
        # Other work on this machine skews every figure: measure it, and say so when it is high.
        background = sample_busy_percent(0.5)
        if background is not None and background > report.BACKGROUND_WARNING_PCT:
            print(
                f"  warning: the machine was {background}% busy before {name} started; "
                "its figures are skewed by other work",
                file=sys.stderr,
            )
        bench.emulator.set_latency(bench.latency_ms)
        before = bench.emulator.requests()
        with log_path.open("w") as log:
            done = subprocess.run(
                [sys.executable, str(BENCH / "worker.py"), str(spec_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=bench.timeout_s,
                check=False,
            )
        after = bench.emulator.requests()
        bench.emulator.set_latency(0)
        result = worker_result(name, done.returncode, log_path, result_path)
        result["verified"] = verify(run, bench.emulator)
    shutil.rmtree(trace_dir, ignore_errors=True)
    calls = {route: after[route] - before[route] for route in after if after[route] > before[route]}
    consumed = max(int(result["consumed"]), 1)
    result["name"] = name
    result["messages"] = workload.messages
    result["background_busy_pct"] = background
    result["http"] = {
        "calls": calls,
        "total": sum(calls.values()),
        "per_message": round(sum(calls.values()) / consumed, 3),
    }
    db = result["db"]
    db["per_message"] = {
        key: round(db[key] / consumed, 3)
        for key in ("round_trips", "ledger_round_trips", "job_round_trips", "statements")
    }
    db["per_message_by_label"] = {
        label: round(count / consumed, 3) for label, count in db["round_trips_by_label"].items()
    }
    print(
        f"  {name}: {result['messages_per_s']} msg/s in {result['elapsed_s']} s, "
        f"{result['http']['per_message']} HTTP/msg, {db['per_message']['round_trips']} DB "
        f"round trips/msg ({db['per_message']['ledger_round_trips']} ledger), batch p50 "
        f"{result['batch_latency_ms']['p50']} ms, peak RSS "
        f"{result['memory']['peak_rss_mb']} MB, verified {result['verified']['ok']}",
        file=sys.stderr,
        flush=True,
    )
    return result


# Figures whose median over rounds is reported, as (name, path into a run's result).
MEDIAN_FIELDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("messages_per_s", ("messages_per_s",)),
    ("elapsed_s", ("elapsed_s",)),
    ("http_per_message", ("http", "per_message")),
    ("db_round_trips_per_message", ("db", "per_message", "round_trips")),
    ("ledger_round_trips_per_message", ("db", "per_message", "ledger_round_trips")),
    ("job_round_trips_per_message", ("db", "per_message", "job_round_trips")),
    ("statements_per_message", ("db", "per_message", "statements")),
    ("batch_p50_ms", ("batch_latency_ms", "p50")),
    ("batch_p99_ms", ("batch_latency_ms", "p99")),
    ("consume_call_p50_ms", ("call_latency_ms", "consume", "p50")),
    ("ack_call_p50_ms", ("call_latency_ms", "ack", "p50")),
    ("between_consumes_p50_ms", ("between_consumes_ms", "p50")),
    ("peak_rss_mb", ("memory", "peak_rss_mb")),
    ("process_cpu_pct", ("cpu", "process_pct_of_one_core")),
    ("machine_busy_pct", ("cpu", "machine_busy_pct")),
    ("background_busy_pct", ("background_busy_pct",)),
)


def _dig(document: dict[str, Any], path: Sequence[str]) -> Any:
    value: Any = document
    for key in path:
        value = value[key]
    return value


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    medians: dict[str, Any] = {}
    for name, path in MEDIAN_FIELDS:
        values = [v for v in (_dig(run, path) for run in runs) if v is not None]
        medians[name] = round(statistics.median(values), 3) if values else None
    medians["verified"] = all(run["verified"]["ok"] for run in runs)
    return medians


def machine_info(server_url: str) -> dict[str, Any]:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        model = platform.processor()
    with psycopg.connect(server_url, autocommit=True) as conn:
        row = conn.execute("SHOW server_version").fetchone()
    return {
        # The load average (1, 5, 15 minutes) when the run began: this machine is shared.
        "load_average_at_start": [round(v, 2) for v in os.getloadavg()],
        "nproc": len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "cpu_model": model,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "postgres": row[0] if row else "",
        "database": "DATABASE_URL" if configured_database_url() else "embedded PostgreSQL",
        "psycopg": psycopg.__version__,
    }


def _lanes(text: str) -> list[int]:
    values = sorted({int(part) for part in text.split(",") if part.strip()})
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError("lanes must be positive integers, e.g. 1,2,4,8")
    return values


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def _add_skippable(
    parser: argparse.ArgumentParser, flag: str, default: int | None, help_text: str
) -> None:
    """A count of messages or runs for one part of the run; 0 skips that part."""
    parser.add_argument(flag, type=int, default=default, help=f"{help_text}; 0 skips it")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="run_bench.py", description=__doc__.split("\n\n")[0].strip("`: ")
    )
    parser.add_argument("--jobs", type=int, default=5000, help="messages per drain (%(default)s)")
    parser.add_argument(
        "--duplicates", type=float, default=0.3, help="share of duplicate publishes (%(default)s)"
    )
    parser.add_argument("--latency-ms", type=float, default=25.0, help="per /v1 call (%(default)s)")
    parser.add_argument(
        "--rounds", type=int, default=2, help="rounds of (a) then (b) (%(default)s)"
    )
    parser.add_argument("--lanes", type=_lanes, default=[1, 2, 4, 8], help="(%(default)s)")
    parser.add_argument(
        "--lane-messages",
        type=_positive,
        default=9000,
        help="messages of every lanes run, whatever its lane count (%(default)s: each lane count "
        "drains the same work, so lanes x one lane's rate is the target)",
    )
    _add_skippable(
        parser, "--rss-jobs", None, "messages of the memory run (default 4 x --jobs, so 20,000)"
    )
    _add_skippable(parser, "--cold-start-runs", 10, "fresh processes per figure")
    _add_skippable(
        parser,
        "--profile-jobs",
        None,
        "messages of an extra (b) drain under cProfile, for hotspots (default: --jobs, at most "
        "2,000)",
    )
    _add_skippable(
        parser,
        "--second-layer-jobs",
        500,
        "messages per drain of the second layer's cost (second_layer_bench.py), about a minute "
        "at the default %(default)s",
    )
    parser.add_argument(
        "--second-layer-rounds",
        type=_positive,
        default=1,
        help="(off, on, replay) rounds of the second layer's cost (%(default)s)",
    )
    _add_skippable(
        parser,
        "--flow-jobs",
        1000,
        "messages per drain of what a limited job costs (flow_bench.py), about a minute at the "
        "default %(default)s",
    )
    _add_skippable(
        parser,
        "--outbox-jobs",
        300,
        "intents of the outbox's cost (outbox_bench.py): enqueue in a producer's transaction, "
        "the relay against direct publishing, commit -> publish (%(default)s)",
    )
    parser.add_argument(
        "--flow-rounds",
        type=_positive,
        default=3,
        help="(unlimited, available, limited) rounds of flow control's cost (%(default)s)",
    )
    _add_skippable(
        parser,
        "--trickle-jobs",
        40,
        "jobs of the idle-polling latency run, one every 250 ms (%(default)s)",
    )
    parser.add_argument(
        "--idle-poll-ms", type=int, default=200, help="DRAIN_IDLE_POLL_MS there (%(default)s)"
    )
    _add_skippable(
        parser, "--backlog-jobs", 20_000, "messages of each backlog fan-out run (%(default)s)"
    )
    parser.add_argument(
        "--concurrency",
        type=_lanes,
        default=[1, 2, 4],
        help="DRAIN_MAX_CONCURRENCY of the backlog runs (%(default)s)",
    )
    parser.add_argument("--seed", type=int, default=9, help="publish order (%(default)s)")
    parser.add_argument(
        "--no-db-trace", action="store_true", help="do not count database round trips"
    )
    parser.add_argument("--out", type=Path, default=BENCH / "results")
    parser.add_argument("--docs", type=Path, default=ROOT / "docs" / "performance.md")
    parser.add_argument(
        "--timeout-s", type=float, default=900, help="per drain before giving up (%(default)s)"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:  # noqa: PLR0912, PLR0915 - one run, in order
    args = build_parser().parse_args(argv)
    if args.rounds < 1 or args.jobs < 1:
        raise SystemExit("--rounds and --jobs must be at least 1")
    started_at = datetime.now(UTC)
    started = time.monotonic()
    workload = Workload(args.jobs, args.duplicates, args.seed)
    if args.rss_jobs is None:
        args.rss_jobs = 4 * args.jobs
    if args.profile_jobs is None:
        args.profile_jobs = min(args.jobs, 2000)

    cold: dict[str, Any] | None = None
    if args.cold_start_runs > 0:
        print(f"cold start: {args.cold_start_runs} fresh processes per figure", file=sys.stderr)
        cold = cold_start.measure(args.cold_start_runs)
        print(f"  tracing off: median {cold['tracing_off']['median_ms']} ms", file=sys.stderr)

    variants: dict[str, list[dict[str, Any]]] = {"notes_loop": [], "drain": []}
    lane_runs: list[dict[str, Any]] = []
    memory_run: dict[str, Any] | None = None
    profile_run: dict[str, Any] | None = None
    second_layer: dict[str, Any] | None = None
    scale: dict[str, Any] | None = None
    flow: dict[str, Any] | None = None
    outbox: dict[str, Any] | None = None
    args.out.mkdir(parents=True, exist_ok=True)
    with (
        tempfile.TemporaryDirectory(prefix="infrai-bench-") as scratch,
        postgres_server_url() as server_url,
    ):
        machine = machine_info(server_url)
        emulator = EmulatorProcess()
        bench = Bench(
            server_url,
            emulator,
            Path(scratch),
            args.latency_ms,
            not args.no_db_trace,
            args.timeout_s,
            args.out,
        )
        try:
            for round_no in range(1, args.rounds + 1):
                print(f"round {round_no}/{args.rounds}", file=sys.stderr)
                for variant in ("notes_loop", "drain"):
                    name = f"r{round_no}-{variant}"
                    variants[variant].append(measure(bench, name, variant, workload))
            for lanes in args.lanes:
                # --jobs per lane: every run lasts about as long, so the start-up and the last
                # empty consumes weigh the same in each (a fixed count made the 8-lane run 2 s).
                messages = args.lane_messages or args.jobs * lanes
                print(f"lanes: {lanes} ({messages} messages)", file=sys.stderr)
                lane_work = Workload(messages, args.duplicates, args.seed)
                lane_runs.append(measure(bench, f"lanes{lanes}", "drain", lane_work, lanes))
            if args.trickle_jobs > 0 or args.backlog_jobs > 0:
                scale = _scale(args, bench)
            if args.rss_jobs > 0:
                print(f"memory: (b) draining {args.rss_jobs} messages", file=sys.stderr)
                big = Workload(args.rss_jobs, args.duplicates, args.seed)
                memory_run = measure(bench, "memory", "drain", big)
            if args.profile_jobs > 0:
                print(f"profile: (b) under cProfile, {args.profile_jobs} messages", file=sys.stderr)
                small = Workload(args.profile_jobs, args.duplicates, args.seed)
                profile_run = measure(bench, "drain", "drain", small, profile=True)
            if args.second_layer_jobs > 0:
                second_layer = _second_layer(args, bench)
            if args.flow_jobs > 0:
                flow = _flow(args, bench)
            if args.outbox_jobs > 0:
                import outbox_bench  # noqa: PLC0415

                outbox = outbox_bench.measure(
                    bench.server_url, bench.emulator, args.outbox_jobs, bench.latency_ms
                )
                print(outbox_bench.summary_text(outbox), file=sys.stderr)
        finally:
            emulator.stop()

    document = assemble(
        args=args,
        machine=machine,
        started_at=started_at,
        duration_s=time.monotonic() - started,
        workload=workload,
        variants=variants,
        lane_runs=lane_runs,
        memory_run=memory_run,
        profile_run=profile_run,
        cold=cold,
        second_layer=second_layer,
        scale=scale,
        flow=flow,
    )
    if outbox is not None:
        document["outbox"] = outbox
    paths = report.write_all(document, args.out, args.docs)
    for path in paths:
        print(f"wrote {path}", file=sys.stderr)
    print(report.summary_text(document))
    return 0


def _scale(args: argparse.Namespace, bench: Bench) -> dict[str, Any]:
    """Idle polling's latency and the backlog's fan-out, on this run's PostgreSQL and emulator."""
    import scale_bench  # noqa: PLC0415

    scratch = bench.scratch / "scale"
    scratch.mkdir()
    result: dict[str, Any] = scale_bench.measure(
        bench.server_url,
        bench.emulator,
        scratch,
        trickle_jobs=args.trickle_jobs,
        idle_poll_ms=args.idle_poll_ms,
        backlog_jobs=args.backlog_jobs,
        concurrency=args.concurrency,
        latency_ms=args.latency_ms,
        seed=args.seed,
    )
    return result


def _second_layer(args: argparse.Namespace, bench: Bench) -> dict[str, Any]:
    """The second layer's cost, on this run's PostgreSQL and emulator."""
    # Imported here: it imports functions/jobs and, when it runs, moto's server.
    import second_layer_bench  # noqa: PLC0415

    setup, workload = _receipt_bench(
        args, bench, "second-layer", "second layer: off / on / replay", args.second_layer_jobs
    )
    result: dict[str, Any] = second_layer_bench.measure(
        setup, workload, rounds=args.second_layer_rounds, cold_start_runs=args.cold_start_runs
    )
    print(second_layer_bench.summary_text(result), file=sys.stderr)
    return result


def _flow(args: argparse.Namespace, bench: Bench) -> dict[str, Any]:
    """What a limited job costs, on this run's PostgreSQL and emulator."""
    import flow_bench  # noqa: PLC0415 - it imports functions/jobs and the provider sink

    setup, workload = _receipt_bench(
        args, bench, "flow", "flow control: unlimited / available / limited", args.flow_jobs
    )
    result: dict[str, Any] = flow_bench.measure(setup, workload, rounds=args.flow_rounds)
    print(flow_bench.summary_text(result), file=sys.stderr)
    return result


def _receipt_bench(
    args: argparse.Namespace, bench: Bench, folder: str, modes: str, jobs: int
) -> tuple[receipt_drain.Setup, Workload]:
    """A receipt benchmark's setup on this run's PostgreSQL and emulator (a scratch ``folder``
    of its own), and its workload of ``jobs`` messages; ``modes`` is said first."""
    print(f"{modes}, {jobs} receipt.send messages", file=sys.stderr)
    scratch = bench.scratch / folder
    scratch.mkdir()
    setup = receipt_drain.Setup(
        bench.server_url, bench.emulator, scratch, bench.latency_ms, bench.timeout_s
    )
    return setup, Workload(jobs, args.duplicates, args.seed)


def assemble(
    *,
    args: argparse.Namespace,
    machine: dict[str, Any],
    started_at: datetime,
    duration_s: float,
    workload: Workload,
    variants: dict[str, list[dict[str, Any]]],
    lane_runs: list[dict[str, Any]],
    memory_run: dict[str, Any] | None,
    profile_run: dict[str, Any] | None,
    cold: dict[str, Any] | None,
    second_layer: dict[str, Any] | None = None,
    scale: dict[str, Any] | None = None,
    flow: dict[str, Any] | None = None,
) -> dict[str, Any]:
    medians = {name: median_of(runs) for name, runs in variants.items()}
    a_rate = medians["notes_loop"]["messages_per_s"]
    b_rate = medians["drain"]["messages_per_s"]
    ceiling = CONSUME_CAP / (args.latency_ms / 1000) if args.latency_ms > 0 else None
    paired = [
        round(b["messages_per_s"] / a["messages_per_s"], 2)
        for a, b in zip(variants["notes_loop"], variants["drain"], strict=True)
    ]
    one_lane = next((r["messages_per_s"] for r in lane_runs if r["lanes"] == 1), b_rate)
    scaling = [
        {
            "lanes": run["lanes"],
            "messages_per_s": run["messages_per_s"],
            "speedup": round(run["messages_per_s"] / one_lane, 2),
            "target_speedup": round(0.8 * run["lanes"], 2),
            "batch_p50_ms": run["batch_latency_ms"]["p50"],
            "batch_p99_ms": run["batch_latency_ms"]["p99"],
            # Absent from results written before it was measured.
            "ahead_work_p50_ms": run.get("consume_ahead_work_ms", {}).get("p50"),
            "ahead_wait_p50_ms": run.get("consume_ahead_wait_ms", {}).get("p50"),
            "process_cpu_pct": run["cpu"]["process_pct_of_one_core"],
            "machine_busy_pct": run["cpu"]["machine_busy_pct"],
            "verified": run["verified"]["ok"],
        }
        for run in lane_runs
    ]
    consume_ms = medians["drain"]["consume_call_p50_ms"]
    comparison = {
        "ratio_b_over_a": round(b_rate / a_rate, 2) if a_rate else None,
        "ratio_per_round": paired,
        "single_lane_ceiling_msgs_per_s": round(ceiling, 1) if ceiling else None,
        "b_fraction_of_ceiling": round(b_rate / ceiling, 3) if ceiling else None,
        "a_fraction_of_ceiling": round(a_rate / ceiling, 3) if ceiling else None,
        # What one consume really took here (latency + loopback HTTP + wake-ups), and the
        # ceiling that implies: the bound (b) meets on this machine.
        "measured_consume_p50_ms": consume_ms,
        "measured_ceiling_msgs_per_s": (
            round(CONSUME_CAP * 1000 / consume_ms, 1) if consume_ms else None
        ),
    }
    document: dict[str, Any] = {
        "schema": 1,
        "started_at": started_at.isoformat(timespec="seconds"),
        "duration_s": round(duration_s, 1),
        "machine": machine,
        "config": {
            **workload.sizes(),
            "duplicate_share": workload.duplicate_share,
            "job": "invoice.finalize",
            "job_effect": "database",
            "latency_ms": args.latency_ms,
            "batch_size": CONSUME_CAP,
            "rounds": args.rounds,
            "lanes": args.lanes,
            "lane_messages": args.lane_messages,
            "rss_jobs": args.rss_jobs,
            "seed": args.seed,
            "db_trace": not args.no_db_trace,
            "emulator": "separate process (python -m infrai_local.sandbox.emulator)",
        },
        "counting": report.COUNTING,
        "variants": {
            name: {"label": report.VARIANT_LABELS[name], "median": medians[name], "runs": runs}
            for name, runs in variants.items()
        },
        "comparison": comparison,
        "lanes": {"baseline_msgs_per_s": one_lane, "scaling": scaling, "runs": lane_runs},
        "memory": (
            None
            if memory_run is None
            else {
                "jobs": memory_run["messages"],
                "peak_rss_mb": memory_run["memory"]["peak_rss_mb"],
                "rss_before_mb": memory_run["memory"]["rss_before_mb"],
                "messages_per_s": memory_run["messages_per_s"],
                "verified": memory_run["verified"]["ok"],
                "run": memory_run,
            }
        ),
        "profile": (
            None
            if profile_run is None
            else {
                "file": "profile-drain.txt",
                "jobs": profile_run["messages"],
                "messages_per_s_under_profiler": profile_run["messages_per_s"],
                "process_cpu_pct": profile_run["cpu"]["process_pct_of_one_core"],
                "top_by_self_time": profile_run.get("profile_top", []),
            }
        ),
        "cold_start": cold,
        "second_layer": second_layer,
        "scale": scale,
        "flow_control": flow,
    }
    document["machine"]["load_average_at_end"] = [round(v, 2) for v in os.getloadavg()]
    document["targets"] = report.evaluate_targets(document)
    return document


if __name__ == "__main__":
    sys.exit(main())
