"""What the optional second layer (``IDEMPOTENCY_BACKEND=dynamodb``) costs per external job.

    .venv/bin/python bench/second_layer_bench.py [--jobs 1000] [--rounds 2] [--latency-ms 25]
        [--update bench/results/latest.json ...]

The same drain of ``--jobs`` ``receipt.send`` messages (``external``-class, ``--duplicates`` of
them repeat publishes), run three ways per round, each in a fresh worker process (``--worker``
mode of this file) against a fresh queue and a fresh scratch ledger database:

1. ``off``: no second layer (no feature in ``DrainConfig.features``), as
   ``IDEMPOTENCY_BACKEND=off``;
2. ``on``: the second layer on DynamoDB, a fresh table: every job's first run;
3. ``replay``: on again, a fresh ledger (as if its rows were lost) but the same table: every
   job is a second-layer hit and its effect is not repeated.

The effect is ``functions/jobs``' ``receipt.send``: one HTTP POST to the local provider sink
(``infrai_local.sandbox.provider_sink``, in this process, no injected latency), which counts
e-mails per invoice, so each run is checked: exactly one e-mail per distinct job after ``off``
and ``on``, none more after ``replay``.

DynamoDB is moto's ``ThreadedMotoServer`` on 127.0.0.1 (a real HTTP server, so boto3 and
Powertools do real HTTP), the table created as ``template.yaml`` declares it. ``--latency-ms`` is
injected on every Infrai call (the emulator's fault surface, as in ``run_bench.py``) and on every
DynamoDB HTTP request: a botocore ``before-send`` hook on the worker's DynamoDB client sleeps
that long and lets the request go. A hook rather than a proxy in front of moto: it adds exactly
the latency to each attempt (retries included), waits without the GIL as a network wait does, and
adds no second loopback hop or forwarding code to what is measured. Sibling hooks
(``before-call``/``after-call``) count the DynamoDB calls per operation and time them.

The cold start of turning it on is ``cold_start.py``'s method with ``IDEMPOTENCY_BACKEND`` off
and ``dynamodb``: DrainFunction's ``import app`` plus first ``app.service()``, which then builds
the second layer (Powertools' idempotency utility, boto3 and a DynamoDB client; no request).

Without ``--update`` it prints the figures (``--json`` for all of them); with it, it stores them
under ``second_layer`` in each results file and regenerates the chart and
``docs/performance.md`` from the first. ``run_bench.py`` runs the same measurement
(``--second-layer-jobs``) inside the full benchmark.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from infrai_jobs.drain.loop import drain
from infrai_jobs.drain.model import DrainConfig, DrainFeature
from infrai_jobs.jobs.registry import JobContext
from infrai_jobs.queue.client import InfraiClient
from infrai_jobs.work.ledger import PostgresLedger
from infrai_jobs.work.ports import EffectGuard
from infrai_local.sandbox import provider_sink
from jobs import build_registry

import receipt_drain
from bench_env import API_KEY, Workload
from instruments import (
    BatchRecorder,
    TimedQueue,
    cpu_use,
    latency_summary,
    memory_mb,
    process_cpu_seconds,
    sample_busy_percent,
)
from receipt_drain import Setup, median
from results_file import update_results

ROOT = Path(__file__).resolve().parents[1]
TABLE_PREFIX = "infrai-bench-idempotency"
# Fake credentials for moto; never real ones.
AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
}
# No invocation runs out of time here; Powertools' in-progress records expire with this.
_TIME_LEFT_MS = 3_600_000
_RETENTION_DAYS = 30
MODES = ("off", "on", "replay")


# --- the worker (a process of its own per drain) ------------------------------------------------


class DynamoDBMeter:
    """botocore hooks on one DynamoDB client: injected latency, calls counted and timed."""

    def __init__(self, latency_ms: float) -> None:
        self._latency_s = latency_ms / 1000
        self._lock = threading.Lock()
        self._local = threading.local()
        self.calls: Counter[str] = Counter()  # per operation, with the error code if any
        self.http_requests = 0
        self.durations_ms: list[float] = []

    def install(self, client: Any) -> None:
        events = client.meta.events
        events.register("before-call.dynamodb", self._before_call)
        events.register("after-call.dynamodb", self._after_call)
        events.register("before-send.dynamodb", self._before_send)

    def _before_call(self, **_: Any) -> None:
        self._local.started = time.perf_counter()

    def _after_call(self, model: Any, parsed: Any, **_: Any) -> None:
        elapsed_ms = (time.perf_counter() - self._local.started) * 1000
        error = parsed.get("Error", {}).get("Code") if isinstance(parsed, dict) else None
        name = f"{model.name} ({error})" if error else str(model.name)
        with self._lock:
            self.calls[name] += 1
            self.durations_ms.append(elapsed_ms)

    def _before_send(self, **_: Any) -> None:
        # Returning None lets botocore send the request: the sleep is the network's latency.
        with self._lock:
            self.http_requests += 1
        if self._latency_s > 0:
            time.sleep(self._latency_s)


@dataclass
class TimedGuard(DrainFeature):
    """The second layer as a drain feature, timed: each guarded call's wall time, and the
    effect's part of it."""

    inner: EffectGuard
    overhead_ms: list[float] = field(default_factory=list)
    effect_ms: list[float] = field(default_factory=list)
    calls: int = 0

    def around_effect(self, ctx: JobContext, fingerprint: str, call: Callable[[], Any]) -> Any:
        effect_s = 0.0

        def timed() -> Any:
            nonlocal effect_s
            started = time.perf_counter()
            try:
                return call()
            finally:
                effect_s += time.perf_counter() - started

        started = time.perf_counter()
        try:
            return self.inner.run(ctx.idem_key, fingerprint, timed)
        finally:
            total_s = time.perf_counter() - started
            self.calls += 1
            self.overhead_ms.append((total_s - effect_s) * 1000)
            if effect_s:
                self.effect_ms.append(effect_s * 1000)


class _TimeLeft:
    def get_remaining_time_in_millis(self) -> int:
        return _TIME_LEFT_MS


def _make_guard(spec: dict[str, Any], meter: DynamoDBMeter) -> tuple[Any, float]:
    """The second layer as ``factory.make_effect_guard`` builds it, with the client hooked.

    The client is made exactly as Powertools makes it when given none (a new boto3 session's
    ``dynamodb`` client; endpoint, region and fake credentials come from the environment), and
    handed in only so the hooks can be installed on it.
    """
    started = time.perf_counter()
    import boto3  # noqa: PLC0415 - only the guarded runs import it, as in DrainFunction

    from infrai_jobs.aws import second_layer  # noqa: PLC0415

    client = boto3.session.Session().client("dynamodb")
    meter.install(client)
    store = second_layer.dynamodb_store(spec["table"], client=client)
    guard = second_layer.SecondLayer(
        store, expires_after_seconds=second_layer.record_expiry_seconds(_RETENTION_DAYS)
    )
    guard.start_invocation(_TimeLeft().get_remaining_time_in_millis)
    return guard, (time.perf_counter() - started) * 1000


def run_worker(spec: dict[str, Any]) -> dict[str, Any]:
    recorder = BatchRecorder()
    rss_before = memory_mb()["rss_mb"]
    meter = DynamoDBMeter(float(spec["latency_ms"]))
    guard: Any = None
    timed: TimedGuard | None = None
    setup_ms = 0.0
    if spec["mode"] != "off":
        guard, setup_ms = _make_guard(spec, meter)
        timed = TimedGuard(guard)
    client = InfraiClient(spec["emulator_url"], spec["api_key"])
    ledger = PostgresLedger(spec["database_url"])
    registry = build_registry()
    registry.bind_settings(dict.fromkeys(registry.declared_settings(), spec["provider_url"]))
    config = DrainConfig(queue=spec["queue"], features=[timed] if timed else [])
    cpu0, started = process_cpu_seconds(), time.perf_counter()
    summary = drain(TimedQueue(client, recorder), ledger, registry, config, lambda: _TIME_LEFT_MS)
    elapsed = time.perf_counter() - started
    cpu1 = process_cpu_seconds()
    ledger.close()
    client.close()
    memory = memory_mb()
    return {
        "mode": spec["mode"],
        "consumed": summary.consumed,
        "outcomes": dict(sorted(summary.outcomes.items())),
        "elapsed_s": round(elapsed, 3),
        "messages_per_s": round(summary.consumed / elapsed, 1) if elapsed > 0 else 0.0,
        "batch_latency_ms": latency_summary(recorder.batch_latencies_ms()),
        "guard": None
        if timed is None
        else {
            "calls": timed.calls,
            "hits": guard.take_hits(),
            "setup_ms": round(setup_ms, 1),
            "overhead_ms": latency_summary(timed.overhead_ms),
            "effect_ms": latency_summary(timed.effect_ms),
        },
        "dynamodb": {
            "calls": dict(sorted(meter.calls.items())),
            "total": sum(meter.calls.values()),
            "http_requests": meter.http_requests,
            "call_ms": latency_summary(meter.durations_ms),
        },
        "memory": {"rss_before_mb": rss_before, **memory},
        "boto3_imported": "boto3" in sys.modules,
        "cpu": cpu_use(cpu1 - cpu0, elapsed),
    }


# --- the orchestrator ---------------------------------------------------------------------------


class MotoDynamoDB:
    """moto's ThreadedMotoServer on 127.0.0.1, a free port; ``stop()`` ends it."""

    def __init__(self) -> None:
        # moto's server logs every request through werkzeug; only errors are of interest.
        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        from moto.server import ThreadedMotoServer  # noqa: PLC0415 - the bench extra's

        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.url = f"http://{host}:{port}"
        import boto3  # noqa: PLC0415

        self.client = boto3.session.Session().client(
            "dynamodb",
            endpoint_url=self.url,
            region_name=AWS_ENV["AWS_REGION"],
            aws_access_key_id=AWS_ENV["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=AWS_ENV["AWS_SECRET_ACCESS_KEY"],
        )

    def create_table(self, name: str) -> None:
        """The table as ``template.yaml`` declares it (``IdempotencyTable``)."""
        from cfnlint.decode import cfn_yaml  # noqa: PLC0415

        template = cfn_yaml.load(str(ROOT / "framework.yaml"))
        props = json.loads(json.dumps(template["Resources"]["IdempotencyTable"]["Properties"]))
        self.client.create_table(
            TableName=name,
            BillingMode=props["BillingMode"],
            AttributeDefinitions=props["AttributeDefinitions"],
            KeySchema=props["KeySchema"],
        )
        self.client.update_time_to_live(
            TableName=name, TimeToLiveSpecification=props["TimeToLiveSpecification"]
        )

    def item_count(self, name: str) -> int:
        count = 0
        for page in self.client.get_paginator("scan").paginate(TableName=name, Select="COUNT"):
            count += int(page["Count"])
        return count

    def delete_table(self, name: str) -> None:
        self.client.delete_table(TableName=name)

    def stop(self) -> None:
        self.client.close()
        self._server.stop()


@dataclass(frozen=True)
class _World:
    setup: Setup
    moto: MotoDynamoDB
    sink: provider_sink.RunningSink


def _one_drain(
    world: _World, name: str, mode: str, table: str, workload: Workload
) -> dict[str, Any]:
    setup = world.setup
    queue = f"bench-sl-{name}"
    unique = workload.unique
    with receipt_drain.prepared(setup, queue, workload) as database_url:
        spec = {
            "mode": mode,
            "table": table,
            "latency_ms": setup.latency_ms,
            "database_url": database_url,
            "emulator_url": setup.emulator.url,
            "api_key": API_KEY,
            "queue": queue,
            "provider_url": world.sink.url,
        }
        env = {**os.environ, **AWS_ENV, "AWS_ENDPOINT_URL_DYNAMODB": world.moto.url}
        worker = receipt_drain.run_worker_process(
            setup, Path(__file__).resolve(), name, spec, world.sink, env=env
        )
        result = worker.result
        expected_mails = 0 if mode == "replay" else unique
        checks, common_ok = receipt_drain.drain_checks(
            setup, queue, database_url, worker, unique=unique, expected_mails=expected_mails
        )
    guard = result["guard"]
    checks["records_in_table"] = world.moto.item_count(table) if mode != "off" else None
    checks["ok"] = (
        common_ok
        and (mode == "off" or checks["records_in_table"] == unique)
        and (mode != "replay" or (guard is not None and guard["hits"] == unique))
    )
    result["name"] = name
    result["messages"] = workload.messages
    result["background_busy_pct"] = worker.background_busy_pct
    result["verified"] = checks
    guarded = guard["calls"] if guard else 0
    result["dynamodb"]["per_guarded_job"] = (
        round(result["dynamodb"]["total"] / guarded, 3) if guarded else None
    )
    result["dynamodb"]["per_message"] = round(
        result["dynamodb"]["total"] / max(result["consumed"], 1), 3
    )
    return receipt_drain.reported(
        result,
        f"DynamoDB {result['dynamodb']['total']} calls ({result['dynamodb']['per_guarded_job']} "
        f"per guarded job), peak RSS {result['memory']['peak_rss_mb']} MB",
    )


def _mode_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    guards = [r["guard"] for r in runs if r["guard"]]
    calls: Counter[str] = Counter()
    guarded = 0
    for run in runs:
        calls.update(run["dynamodb"]["calls"])
        guarded += run["guard"]["calls"] if run["guard"] else 0
    return {
        "messages_per_s": median([r["messages_per_s"] for r in runs]),
        "elapsed_s": median([r["elapsed_s"] for r in runs]),
        "batch_p50_ms": median([r["batch_latency_ms"]["p50"] for r in runs]),
        "batch_p99_ms": median([r["batch_latency_ms"]["p99"] for r in runs]),
        "peak_rss_mb": median([r["memory"]["peak_rss_mb"] for r in runs]),
        "rss_before_mb": median([r["memory"]["rss_before_mb"] for r in runs]),
        "process_cpu_pct": median([r["cpu"]["process_pct_of_one_core"] for r in runs]),
        "guarded_jobs": guarded // len(runs),
        "hits": median([g["hits"] for g in guards]) if guards else None,
        "guard_setup_ms": median([g["setup_ms"] for g in guards]) if guards else None,
        "guard_overhead_p50_ms": median([g["overhead_ms"]["p50"] for g in guards]),
        "guard_overhead_p99_ms": median([g["overhead_ms"]["p99"] for g in guards]),
        "guard_overhead_mean_ms": median([g["overhead_ms"]["mean"] for g in guards]),
        "effect_p50_ms": median([g["effect_ms"]["p50"] for g in guards if g["effect_ms"]["count"]]),
        "dynamodb_calls_per_guarded_job": round(sum(calls.values()) / guarded, 3)
        if guarded
        else None,
        "dynamodb_calls_per_message": median([r["dynamodb"]["per_message"] for r in runs]),
        "dynamodb_calls_by_operation": {
            name: round(n / guarded, 3) for name, n in sorted(calls.items())
        }
        if guarded
        else {},
        "dynamodb_call_p50_ms": median(
            [r["dynamodb"]["call_ms"]["p50"] for r in runs if r["dynamodb"]["total"]]
        ),
        "dynamodb_http_requests_per_call": round(
            sum(r["dynamodb"]["http_requests"] for r in runs) / sum(calls.values()), 3
        )
        if calls
        else None,
        "verified": all(r["verified"]["ok"] for r in runs),
    }


def measure_drains(setup: Setup, workload: Workload, rounds: int) -> dict[str, Any]:
    """``rounds`` x (off, on, replay); each round's on and replay share a fresh table."""
    moto = MotoDynamoDB()
    # The sink answers with TCP_NODELAY, so the effect costs ~1.6 ms, not a delayed ACK.
    sink = provider_sink.start_in_thread()
    world = _World(setup, moto, sink)
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    try:
        for round_no in range(1, rounds + 1):
            table = f"{TABLE_PREFIX}-r{round_no}"
            moto.create_table(table)
            print(f"second layer round {round_no}/{rounds}", file=sys.stderr)
            for mode in MODES:
                runs[mode].append(_one_drain(world, f"r{round_no}-{mode}", mode, table, workload))
            moto.delete_table(table)
    finally:
        sink.stop()
        moto.stop()
    medians = {mode: _mode_summary(mode_runs) for mode, mode_runs in runs.items()}
    off, on, replay = medians["off"], medians["on"], medians["replay"]

    def added_ms(mode: str) -> list[float]:
        # Per round, against the same round's off: wall time added per guarded job.
        return [
            (r["elapsed_s"] - o["elapsed_s"]) * 1000 / r["guard"]["calls"]
            for o, r in zip(runs["off"], runs[mode], strict=True)
            if r["guard"] and r["guard"]["calls"]
        ]

    comparison = {
        "added_ms_per_guarded_job_first_run": median(added_ms("on")),
        "added_ms_per_guarded_job_replay": median(added_ms("replay")),
        "on_over_off_messages_per_s": round(on["messages_per_s"] / off["messages_per_s"], 3)
        if off["messages_per_s"] and on["messages_per_s"]
        else None,
        "replay_over_off_messages_per_s": round(replay["messages_per_s"] / off["messages_per_s"], 3)
        if off["messages_per_s"] and replay["messages_per_s"]
        else None,
        "added_peak_rss_mb": round(on["peak_rss_mb"] - off["peak_rss_mb"], 1)
        if on["peak_rss_mb"] is not None and off["peak_rss_mb"] is not None
        else None,
    }
    return {"median": medians, "comparison": comparison, "runs": runs}


# --- cold start ---------------------------------------------------------------------------------


# After an untimed import of the drain's handler: what building the second layer adds, step by
# step.
_BREAKDOWN_CHILD = r"""
import sys, time
from infrai_jobs.handlers import drain as app
t0 = time.perf_counter()
import boto3
t1 = time.perf_counter()
from infrai_jobs.aws import second_layer
t2 = time.perf_counter()
app.service()
t3 = time.perf_counter()
sys.stdout.write("%.3f %.3f %.3f\n" % ((t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3))
"""


def measure_cold_start(runs: int) -> dict[str, Any]:
    """DrainFunction's cold start with the second layer off and on (``cold_start.py``'s way)."""
    import cold_start  # noqa: PLC0415

    background = sample_busy_percent(1.0)
    sink = cold_start._Sink()
    try:
        off_env = cold_start.child_environment(sink.port, tracing=False)
        off_env["IDEMPOTENCY_BACKEND"] = "off"
        on_env = {
            **off_env,
            "IDEMPOTENCY_BACKEND": "dynamodb",
            "IDEMPOTENCY_TABLE": f"{TABLE_PREFIX}-cold-start",
        }
        off = cold_start._series(cold_start._HANDLER_CHILD, off_env, runs, sink)
        on = cold_start._series(cold_start._HANDLER_CHILD, on_env, runs, sink)
        steps = [cold_start._run_child(_BREAKDOWN_CHILD, on_env)[0] for _ in range(runs)]
        if sink.connections():
            raise RuntimeError("the cold start breakdown connected to the network")
    finally:
        sink.close()
    return {
        "method": (
            f"cold_start.py's method: median of {runs} fresh `python -S` processes per figure, "
            "each timing `import app` plus the first `app.service()`, tracing off, no network "
            "(connections counted); `IDEMPOTENCY_BACKEND` off, then `dynamodb`, with which the "
            "first `app.service()` also builds the second layer (Powertools' idempotency "
            "utility, boto3 and a DynamoDB client; no request is sent)"
        ),
        "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "background_busy_pct": background,
        "off": off,
        "dynamodb": on,
        "added_ms": round(on["median_ms"] - off["median_ms"], 1),
        "added_modules": (on["modules_loaded"] or 0) - (off["modules_loaded"] or 0),
        "breakdown_runs": runs,
        # Each step in fresh processes after an untimed `import app`, medians.
        "breakdown_ms": {
            "import_boto3": round(statistics.median(s[0] for s in steps), 1),
            "import_second_layer": round(statistics.median(s[1] for s in steps), 1),
            "first_service_with_guard": round(statistics.median(s[2] for s in steps), 1),
        },
    }


# --- the whole measurement ----------------------------------------------------------------------


def measure(
    setup: Setup,
    workload: Workload,
    *,
    rounds: int,
    cold_start_runs: int,
) -> dict[str, Any]:
    watch = receipt_drain.Stopwatch()
    drains = measure_drains(setup, workload, rounds)
    cold = measure_cold_start(cold_start_runs) if cold_start_runs > 0 else None
    return {
        **watch.stamp(),
        "config": {
            **receipt_drain.run_config(setup, workload, rounds),
            "backend": "dynamodb",
            "store": "moto ThreadedMotoServer on 127.0.0.1 (real HTTP), table as template.yaml",
            "dynamodb_latency": "botocore before-send hook on the worker's DynamoDB client: "
            "sleeps latency_ms per HTTP request, then sends it",
            "lanes": 1,
        },
        **drains,
        "cold_start": cold,
    }


def _update_results(paths: list[Path], result: dict[str, Any], *, cold_only: bool) -> None:
    def with_second_layer(path: Path, document: dict[str, Any]) -> None:
        if cold_only:
            if not document.get("second_layer"):
                raise SystemExit(f"{path}: no second_layer result to add the cold start to")
            document["second_layer"]["cold_start"] = result["cold_start"]
        else:
            document["second_layer"] = result

    update_results(paths, with_second_layer)


def summary_text(result: dict[str, Any]) -> str:
    off, on, replay = (result["median"][mode] for mode in MODES)
    comparison = result["comparison"]
    lines = [
        f"second layer (dynamodb, {result['config']['latency_ms']:g} ms): off "
        f"{off['messages_per_s']} msg/s, on {on['messages_per_s']} msg/s, replay "
        f"{replay['messages_per_s']} msg/s; +{comparison['added_ms_per_guarded_job_first_run']} "
        f"ms per guarded job (first run), +{comparison['added_ms_per_guarded_job_replay']} ms "
        f"(replay); DynamoDB calls per guarded job {on['dynamodb_calls_per_guarded_job']} "
        f"(first run), {replay['dynamodb_calls_per_guarded_job']} (replay); peak RSS "
        f"{off['peak_rss_mb']} -> {on['peak_rss_mb']} MB",
    ]
    cold = result.get("cold_start")
    if cold:
        lines.append(
            f"  cold start: {cold['off']['median_ms']} ms off, {cold['dynamodb']['median_ms']} ms "
            f"with dynamodb (+{cold['added_ms']} ms, +{cold['added_modules']} modules)"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = receipt_drain.build_parser(
        "second_layer_bench.py",
        __doc__.split("\n\n")[0],
        latency_help="per Infrai and DynamoDB call (%(default)s)",
        rounds_help="(off, on, replay) rounds",
        stored_under="second_layer",
    )
    parser.add_argument("--cold-start-runs", type=int, default=10, help="0 skips the cold start")
    parser.add_argument(
        "--cold-start-only",
        action="store_true",
        help="measure only the cold start (with --update: replace only that part)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return receipt_drain.command(build_parser().parse_args(argv), run_worker, _measured)


def _measured(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    if args.cold_start_only:
        if args.cold_start_runs < 1:
            raise SystemExit("--cold-start-only needs --cold-start-runs of at least 1")
        cold = measure_cold_start(args.cold_start_runs)
        if args.update:
            _update_results(args.update, {"cold_start": cold}, cold_only=True)
        return cold, json.dumps(cold, indent=2)
    workload = Workload(args.jobs, args.duplicates, args.seed)
    with receipt_drain.bench_setup("infrai-bench-sl-", args.latency_ms, args.timeout_s) as setup:
        result = measure(setup, workload, rounds=args.rounds, cold_start_runs=args.cold_start_runs)
    if args.update:
        _update_results(args.update, result, cold_only=False)
    return result, summary_text(result)


if __name__ == "__main__":
    sys.exit(main())
