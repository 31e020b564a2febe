"""What a limited job costs: flow control's bookkeeping, measured on the same drain.

    .venv/bin/python bench/flow_bench.py [--jobs 1000] [--rounds 2] [--latency-ms 25]
        [--update bench/results/latest.json ...]

The same drain of ``--jobs`` ``receipt.send`` messages (``external``-class; ``--duplicates`` of
them repeat publishes), one lane, run three ways per round, each in a fresh worker process
(``--worker`` mode of this file) against a fresh queue and a fresh scratch ledger database:

1. ``unlimited``: no flow control at all (no job has a policy, so ``flow_control`` builds no
   feature): the path every job took before flow control existed;
2. ``available``: flow control switched on by a ``JOB_POLICIES`` document that limits another
   job (``digest.build``), none of whose messages is in the queue: every job drained has no
   policy, so it must pay nothing per message (issue 29: "no extra round trip on their path");
   only the invocation's two looks for due deferred work remain;
3. ``limited``: ``JOB_POLICIES`` gives ``receipt.send`` itself a rate limit far above what one
   lane can start and a concurrency key with a large ``max_running``: a policy in force that
   never throttles, so the difference from ``unlimited`` is the limits' bookkeeping alone (the
   concurrency slot and the rate start, taken in one round trip; settling the claim frees the
   slot).

Flow control is built as ``DrainFunction`` builds it (``parse_job_policies``,
``policies_in_force``, ``flow_control`` with its own connection through a ``LedgerConnector``)
and the drain runs through ``drain_invocation``, so its ``around_drain`` runs too. Every
connection the worker opens is traced (``instruments.ProtocolTrace``); the job's effect is an
HTTP POST to the local provider sink, so every round trip counted is the ledger's. Each drain is
checked: one e-mail per distinct job and none twice, one ``done`` claim per job, queue and DLQ
empty, nothing deferred, no rate-limit wait, and for ``limited`` one recorded rate start per job
run with every concurrency slot released (the policy was in force and never throttled).

Without ``--update`` it prints the figures (``--json`` for all of them); with it, it stores them
under ``flow_control`` in each results file and regenerates the chart and
``docs/performance.md`` from the first. ``run_bench.py`` runs the same measurement
(``--flow-jobs``) inside the full benchmark.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, LiteralString

import psycopg

from infrai_jobs.drain.flow import flow_control
from infrai_jobs.drain.loop import drain_invocation
from infrai_jobs.drain.model import DrainConfig, DrainRun
from infrai_jobs.flow.policies import parse_job_policies, policies_in_force
from infrai_jobs.queue.client import InfraiClient
from infrai_jobs.work import store as work_store
from infrai_jobs.work.ledger import PostgresLedger
from infrai_local.sandbox import provider_sink
from jobs import build_registry

import receipt_drain
from bench_env import API_KEY, Workload
from instruments import (
    BatchRecorder,
    ProtocolTrace,
    RoundTrips,
    TimedQueue,
    count_round_trips,
    cpu_use,
    labels_per_message,
    latency_summary,
    memory_mb,
    process_cpu_seconds,
)
from receipt_drain import JOB, Setup, median
from results_file import update_results

# Limits far above what one lane starts (a few hundred a second here), on a key whose every
# value runs once at a time: in force, never reached.
RATE_PER_SECOND = 100_000
MAX_RUNNING = 1_000
POLICIES: dict[str, dict[str, Any] | None] = {
    "unlimited": None,
    # Another job's limits: flow control is on, the drained job has no policy.
    "available": {
        "digest.build": {
            "rate": {"per_second": RATE_PER_SECOND},
            "concurrency": {"key": ["tenant_id"], "max_running": MAX_RUNNING},
        }
    },
    "limited": {
        JOB: {
            "rate": {"per_second": RATE_PER_SECOND},
            "concurrency": {"key": ["invoice_id"], "max_running": MAX_RUNNING},
        }
    },
}
MODES = tuple(POLICIES)
# The job's effect is HTTP: no statement is the job's own, every round trip is the ledger's.
_NO_JOB_STATEMENT = r"(?!)"
# No invocation runs out of time here: the benchmark measures draining, not budgeting.
_TIME_LEFT_MS = 3_600_000
# An extra round trip on every job's path would add 1 per job run (0.7 per message here); a few
# stray round trips over the whole drain stay under this.
UNCHANGED_TOLERANCE = 0.005
# Labels (``instruments.statement_label``) of the messages only a limited job's run sends: its
# slot and its start, taken together in one message after their advisory locks (plain SELECTs,
# so the label ends with the statement that writes). Settling a claim frees its slot inside the
# settle's own statement, which is labelled by the claim it changes.
_LIMIT_STATEMENTS = re.compile(
    r"(^|; )(prepare )?(INSERT flow_rate_starts|\w+ flow_concurrency_slots)$"
)
_CHECK: LiteralString = """
SELECT (SELECT count(*) FROM job_claims WHERE run_after IS NOT NULL),
       (SELECT count(*) FROM flow_rate_starts),
       (SELECT count(*) FROM flow_concurrency_slots)
"""


# --- the worker (a process of its own per drain) ------------------------------------------------


def _round_trips(paths: list[Path]) -> RoundTrips:
    return count_round_trips(paths, re.compile(_NO_JOB_STATEMENT))


def run_worker(spec: dict[str, Any]) -> dict[str, Any]:
    recorder = BatchRecorder()
    trace = ProtocolTrace(Path(spec["trace_dir"]))
    trace.install()
    rss_before = memory_mb()["rss_mb"]
    registry = build_registry()
    registry.bind_settings(dict.fromkeys(registry.declared_settings(), spec["provider_url"]))
    # As DrainService.from_settings builds it from JOB_POLICIES.
    overrides = parse_job_policies(spec["job_policies"], [job.name for job in registry])
    flow = flow_control(registry, policies_in_force(registry, overrides), queue=spec["queue"])
    client = InfraiClient(spec["emulator_url"], spec["api_key"])
    ledger = PostgresLedger(spec["database_url"])
    config = DrainConfig(queue=spec["queue"], features=(flow,) if flow is not None else ())
    run = DrainRun(
        TimedQueue(client, recorder), ledger, config, lambda: _TIME_LEFT_MS, lambda: False
    )
    # Flow control holds no connection of its own: its statements run on the ledger's. What it
    # adds whatever the jobs are is its looks for due deferred work, a transaction each (BEGIN,
    # take due, COMMIT): counted here by the looks it makes.
    looks = [0]
    take_due = work_store.take_due

    def counted_take_due(*args: Any, **kwargs: Any) -> Any:
        looks[0] += 1
        return take_due(*args, **kwargs)

    work_store.take_due = counted_take_due  # type: ignore[assignment]
    cpu0, started = process_cpu_seconds(), time.perf_counter()
    summary = drain_invocation(run, registry)
    elapsed = time.perf_counter() - started
    cpu1 = process_cpu_seconds()
    paths = trace.finish()
    work_store.take_due = take_due  # type: ignore[assignment]
    ledger.close()
    client.close()
    every = _round_trips(paths)
    return {
        "mode": spec["mode"],
        "flow_control_on": flow is not None,
        "consumed": summary.consumed,
        "outcomes": dict(sorted(summary.outcomes.items())),
        "counters": dict(sorted(summary.counters.items())),
        "elapsed_s": round(elapsed, 3),
        "messages_per_s": round(summary.consumed / elapsed, 1) if elapsed > 0 else 0.0,
        "batch_latency_ms": latency_summary(recorder.batch_latencies_ms()),
        "db": {
            "connections": trace.connections,
            "flow_connections": 0,
            "ledger_round_trips": every.total,
            "flow_round_trips": 3 * looks[0],
            "statements": every.statements,
            "round_trips_by_label": dict(every.by_label.most_common()),
        },
        "memory": {"rss_before_mb": rss_before, **memory_mb()},
        "cpu": cpu_use(cpu1 - cpu0, elapsed),
    }


# --- the orchestrator ---------------------------------------------------------------------------


def _one_drain(
    setup: Setup, sink: provider_sink.RunningSink, name: str, mode: str, workload: Workload
) -> dict[str, Any]:
    queue = f"bench-flow-{name}"
    trace_dir = setup.scratch / name
    trace_dir.mkdir()
    policies = POLICIES[mode]
    unique = workload.unique
    with receipt_drain.prepared(setup, queue, workload) as database_url:
        spec = {
            "mode": mode,
            "job_policies": json.dumps(policies) if policies is not None else "",
            "database_url": database_url,
            "emulator_url": setup.emulator.url,
            "api_key": API_KEY,
            "queue": queue,
            "provider_url": sink.url,
            "trace_dir": str(trace_dir),
        }
        worker = receipt_drain.run_worker_process(setup, Path(__file__).resolve(), name, spec, sink)
        result = worker.result
        checks, common_ok = receipt_drain.drain_checks(
            setup, queue, database_url, worker, unique=unique, expected_mails=unique
        )
        with psycopg.connect(database_url, autocommit=True) as conn:
            deferred, rate_starts, slots = conn.execute(_CHECK).fetchone() or (0, 0, 0)
    counters = result["counters"]
    checks |= {
        "deferred_rows": deferred,
        "deferred_outcomes": result["outcomes"].get("deferred", 0),
        "rate_limit_waits": counters.get("rate_limit_waits", 0),
        "rate_starts": rate_starts,
        "concurrency_slots_left": slots,
        # The limits' statements, wherever they ran (none without a limited job).
        "limit_round_trips": sum(
            n
            for label, n in result["db"]["round_trips_by_label"].items()
            if _LIMIT_STATEMENTS.search(label)
        ),
    }
    checks["ok"] = (
        common_ok
        and deferred == 0
        and checks["deferred_outcomes"] == 0
        and checks["rate_limit_waits"] == 0
        and slots == 0
        and rate_starts == (unique if mode == "limited" else 0)
        and (mode == "limited" or checks["limit_round_trips"] == 0)
        and result["flow_control_on"] == (mode != "unlimited")
    )
    consumed = max(int(result["consumed"]), 1)
    db = result["db"]
    db["per_message"] = {
        "ledger_round_trips": round(db["ledger_round_trips"] / consumed, 3),
        "flow_round_trips": round(db["flow_round_trips"] / consumed, 3),
        "statements": round(db["statements"] / consumed, 3),
    }
    db["per_message_by_label"] = {
        label: round(n / consumed, 3) for label, n in db["round_trips_by_label"].items()
    }
    result["name"] = name
    result["messages"] = workload.messages
    result["job_runs"] = unique
    result["background_busy_pct"] = worker.background_busy_pct
    result["verified"] = checks
    shutil.rmtree(trace_dir, ignore_errors=True)
    return receipt_drain.reported(
        result,
        f"{db['per_message']['ledger_round_trips']} ledger round trips/msg "
        f"({db['flow_round_trips']} for flow control's looks for due work)",
    )


def _mode_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "messages_per_s": median([r["messages_per_s"] for r in runs]),
        "elapsed_s": median([r["elapsed_s"] for r in runs]),
        "batch_p50_ms": median([r["batch_latency_ms"]["p50"] for r in runs]),
        "ledger_round_trips_per_message": median(
            [r["db"]["per_message"]["ledger_round_trips"] for r in runs]
        ),
        "flow_round_trips_per_message": median(
            [r["db"]["per_message"]["flow_round_trips"] for r in runs]
        ),
        # Per drain (one invocation): on flow control's own connection.
        "flow_round_trips_per_drain": median([r["db"]["flow_round_trips"] for r in runs]),
        "statements_per_message": median([r["db"]["per_message"]["statements"] for r in runs]),
        "round_trips_per_message_by_label": {
            label: round(n, 3) for label, n in labels_per_message(runs).items()
        },
        "process_cpu_pct": median([r["cpu"]["process_pct_of_one_core"] for r in runs]),
        "peak_rss_mb": median([r["memory"]["peak_rss_mb"] for r in runs]),
        "verified": all(r["verified"]["ok"] for r in runs),
    }


def measure(setup: Setup, workload: Workload, *, rounds: int) -> dict[str, Any]:
    """``rounds`` x (unlimited, available, limited), each drain checked."""
    watch = receipt_drain.Stopwatch()
    sink = provider_sink.start_in_thread()
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    try:
        for round_no in range(1, rounds + 1):
            print(f"flow control round {round_no}/{rounds}", file=sys.stderr)
            for mode in MODES:
                runs[mode].append(_one_drain(setup, sink, f"r{round_no}-{mode}", mode, workload))
    finally:
        sink.stop()
    medians = {mode: _mode_summary(mode_runs) for mode, mode_runs in runs.items()}
    unlimited, available, limited = (medians[mode] for mode in MODES)

    # Per job run (duplicates never reach flow control): what a limited job adds.
    added_ms = [
        (r["elapsed_s"] - u["elapsed_s"]) * 1000 / r["job_runs"]
        for u, r in zip(runs["unlimited"], runs["limited"], strict=True)
    ]
    added_rt = [
        (r["db"]["ledger_round_trips"] - u["db"]["ledger_round_trips"]) / r["job_runs"]
        for u, r in zip(runs["unlimited"], runs["limited"], strict=True)
    ]
    # The unlimited path with flow control on: the drain's own round trips (flow control's
    # connection only looks for due deferred work, once before and once after the consumes,
    # and is checked to make no limit's statement) against flow control off, per message.
    available_extra = [
        round(
            (r["db"]["ledger_round_trips"] - r["db"]["flow_round_trips"]) / max(r["consumed"], 1)
            - u["db"]["per_message"]["ledger_round_trips"],
            3,
        )
        for u, r in zip(runs["unlimited"], runs["available"], strict=True)
    ]

    def ratio(mode: dict[str, Any]) -> float | None:
        if not mode["messages_per_s"] or not unlimited["messages_per_s"]:
            return None
        return round(mode["messages_per_s"] / unlimited["messages_per_s"], 3)

    comparison = {
        "limited_over_unlimited_messages_per_s": ratio(limited),
        "available_over_unlimited_messages_per_s": ratio(available),
        "limited_over_unlimited_ledger_round_trips": round(
            limited["ledger_round_trips_per_message"] / unlimited["ledger_round_trips_per_message"],
            3,
        )
        if unlimited["ledger_round_trips_per_message"]
        else None,
        "added_ledger_round_trips_per_limited_job": median(added_rt),
        "added_ms_per_limited_job": median(added_ms),
        # The unlimited path with flow control on (another job limited) against off: per
        # message, per round; the target is that it stays where it was. Flow control's fixed
        # cost per invocation (its looks for due deferred work) is apart.
        "unlimited_path_extra_round_trips_per_message": median(available_extra),
        "due_work_round_trips_per_drain": available["flow_round_trips_per_drain"],
        "unlimited_path_extra_per_round": available_extra,
        "unchanged_tolerance": UNCHANGED_TOLERANCE,
    }
    return {
        **watch.stamp(),
        "config": {
            **receipt_drain.run_config(setup, workload, rounds),
            "database_latency": "none injected (PostgreSQL on this machine)",
            "job_policies": {mode: POLICIES[mode] for mode in MODES},
            "lanes": 1,
        },
        "median": medians,
        "comparison": comparison,
        "runs": runs,
    }


def summary_text(result: dict[str, Any]) -> str:
    unlimited, available, limited = (result["median"][mode] for mode in MODES)
    comparison = result["comparison"]
    return (
        f"flow control ({result['config']['jobs']} {JOB} messages, "
        f"{result['config']['latency_ms']:g} ms): unlimited {unlimited['messages_per_s']} msg/s "
        f"({unlimited['ledger_round_trips_per_message']} ledger round trips/msg), available "
        f"{available['messages_per_s']} msg/s ({available['ledger_round_trips_per_message']}), "
        f"limited {limited['messages_per_s']} msg/s "
        f"({limited['ledger_round_trips_per_message']}); limited/unlimited "
        f"{comparison['limited_over_unlimited_messages_per_s']}x, "
        f"+{comparison['added_ledger_round_trips_per_limited_job']} round trips and "
        f"+{comparison['added_ms_per_limited_job']} ms per limited job; unlimited path with "
        f"flow control on: {comparison['unlimited_path_extra_round_trips_per_message']:+} round "
        "trips/msg"
    )


def build_parser() -> argparse.ArgumentParser:
    return receipt_drain.build_parser(
        "flow_bench.py",
        __doc__.split("\n\n")[0],
        latency_help="per Infrai call",
        rounds_help="(unlimited, available, limited)",
        stored_under="flow_control",
    )


def main(argv: Sequence[str] | None = None) -> int:
    return receipt_drain.command(build_parser().parse_args(argv), run_worker, _measured)


def _measured(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    workload = Workload(args.jobs, args.duplicates, args.seed)
    with receipt_drain.bench_setup("infrai-bench-flow-", args.latency_ms, args.timeout_s) as setup:
        result = measure(setup, workload, rounds=args.rounds)
    if args.update:

        def with_flow(_path: Path, document: dict[str, Any]) -> None:
            import report  # noqa: PLC0415 - only an update needs it

            document["flow_control"] = result
            document["targets"] = report.evaluate_targets(document)

        update_results(args.update, with_flow)
    return result, summary_text(result)


if __name__ == "__main__":
    sys.exit(main())
