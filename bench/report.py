"""The benchmark's outputs: JSON, a PNG chart and ``docs/performance.md``.

``run_bench.py`` calls ``write_all`` at the end of a run; ``python bench/report.py [JSON]``
regenerates the chart and the page from a results file (default ``bench/results/latest.json``)
without measuring again.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import cost
from infrai_jobs.drain.ack_pipeline import HTTP_CONNECTIONS_PER_LANE

from instruments import labels_per_message

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent

VARIANT_LABELS = {
    "notes_loop": "(a) field notes' loop",
    "drain": "(b) infrai_jobs drain",
}

COUNTING = {
    "http_call": (
        "one request the emulator received on a /v1 route, read from its own per-route "
        "counters (GET /_emulator/state) before and after the drain: every consume (the final "
        "empty one included) and every ack, retries included. Divided by messages consumed."
    ),
    "db_round_trip": (
        "one exchange in libpq's protocol trace (PQtrace, switched on for every connection the "
        "worker opens, after the handshake): a run of messages the client sent, answered by the "
        "server. Every execute, BEGIN, COMMIT, SAVEPOINT, RELEASE and ROLLBACK TO, psycopg's "
        "extra Parse when it prepares a statement and its DEALLOCATE ALL, and the ledger's "
        "schema check each count one; a pipeline flush with many statements counts one. "
        "Connection handshakes are not counted (one per connection). Divided by messages "
        "consumed."
    ),
    "ledger_round_trip": (
        "a round trip none of whose statements is the job's own (a statement beginning "
        "UPDATE invoices): claims, settles, transaction control, prepares. A ledger statement "
        "pipelined into the same exchange as the job's UPDATE costs nothing extra and is not "
        "counted."
    ),
    "statement": "one Execute or simple Query message in the trace",
    "batch_latency": (
        "from the start of the consume call that returned a batch to the end of the last ack "
        "of its messages, timed in the worker around the queue port both variants use; (b) "
        "sends a batch's acks together and reads their answers after processing the next "
        "batch, so its figure can include that processing"
    ),
    "between_consumes": (
        "per lane, from one consume's answer to the start of the next consume: the work the "
        "loop does on its critical path per batch (for (a) that includes its ten acks)"
    ),
    "work_while_the_consume_travels": (
        "per lane, from sending the next consume to asking for its answer: the batch in hand "
        "processed, its acks sent and the previous batch's acks read; then the wait for the "
        "answer. While the work is shorter than the round trip, latency sets a lane's pace; "
        "once it is longer, the lane's own work (its CPU, the GIL, the database) does"
    ),
    "messages_per_s": (
        "messages consumed / wall time from just before the first consume (connections "
        "included) until a consume came back empty (every lane finished)"
    ),
    "peak_rss": (
        "VmHWM of the worker process (one process per drain, so per variant); the worker "
        "imports only what that variant needs"
    ),
    "cpu": (
        "the worker's user+system CPU seconds over the drain (as % of one core), and how busy "
        "the whole machine was (/proc/stat): emulator, PostgreSQL and the worker share it"
    ),
}

_LEDGER_TARGET = 0.3
_RATIO_TARGET = 8.0
_CEILING_TARGET = 0.70
_LANES_TARGET = 0.8
_RSS_TARGET_MB = 150.0
_RSS_TARGET_JOBS = 20_000
_COLD_START_TARGET_MS = 250.0
# Idle polling's latency, and the backlog's speedup with more drains alive.
_IDLE_P50_TARGET_MS = 500.0
_IDLE_P99_TARGET_MS = 1500.0
_FAN_OUT_TARGETS = {2: 1.6, 4: 2.5}
# Issue 29: a job without a policy pays nothing for flow control being on (per message).
_FLOW_UNCHANGED_TOLERANCE = 0.005


# --- targets -------------------------------------------------------------------------------------


def _target(name: str, required: str, measured: str, passed: bool | None) -> dict[str, Any]:
    return {"target": name, "required": required, "measured": measured, "pass": passed}


def _figure_target(
    name: str,
    required: str,
    figure: float | None,
    *,
    shown: Callable[[float], str],
    passed: Callable[[float], bool],
    missing: str = "n/a",
) -> dict[str, Any]:
    """A target met by one figure of the run: ``missing`` and not judged when it is None."""
    if figure is None:
        return _target(name, required, missing, None)
    return _target(name, required, shown(figure), passed(figure))


def evaluate_targets(document: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 9's targets against this run's figures; pass is None when not measured."""
    latency = document["config"]["latency_ms"]
    comparison = document["comparison"]
    drain = document["variants"]["drain"]["median"]
    targets: list[dict[str, Any]] = []

    ratio = comparison["ratio_b_over_a"]
    targets.append(
        _figure_target(
            f"(b) / (a) messages per second at {latency:g} ms",
            f">= {_RATIO_TARGET:g}x",
            ratio,
            shown=lambda r: f"{r}x",
            passed=lambda r: r >= _RATIO_TARGET,
        )
    )
    ceiling = comparison["single_lane_ceiling_msgs_per_s"]
    targets.append(
        _figure_target(
            f"(b) against the single-lane ceiling ({ceiling} msg/s)",
            f">= {_CEILING_TARGET:.0%}",
            comparison["b_fraction_of_ceiling"],
            shown=lambda f: f"{f:.1%}",
            passed=lambda f: f >= _CEILING_TARGET,
        )
    )
    targets.append(
        _figure_target(
            "ledger round trips per message, (b)",
            f"<= {_LEDGER_TARGET:g}",
            drain["ledger_round_trips_per_message"] if document["config"]["db_trace"] else None,
            shown=lambda n: f"{n:g}",
            passed=lambda n: n <= _LEDGER_TARGET,
            missing="not counted",
        )
    )
    scaling = [s for s in document["lanes"]["scaling"] if 1 < s["lanes"] <= 8]
    targets.append(
        _target(
            "throughput with N lanes (N <= 8)",
            f">= {_LANES_TARGET:g} x N",
            ", ".join(f"{s['lanes']}: {s['speedup']}x" for s in scaling) or "not run",
            all(s["speedup"] >= _LANES_TARGET * s["lanes"] for s in scaling) if scaling else None,
        )
    )
    memory = document.get("memory")
    if memory is None:
        targets.append(
            _target(f"peak RSS draining {_RSS_TARGET_JOBS:,} jobs", "< 150 MB", "not run", None)
        )
    else:
        note = "" if memory["jobs"] == _RSS_TARGET_JOBS else f" ({memory['jobs']:,} jobs)"
        targets.append(
            _target(
                f"peak RSS draining {_RSS_TARGET_JOBS:,} jobs",
                f"< {_RSS_TARGET_MB:g} MB",
                f"{memory['peak_rss_mb']} MB{note}",
                memory["peak_rss_mb"] < _RSS_TARGET_MB
                if memory["jobs"] >= _RSS_TARGET_JOBS
                else None,
            )
        )
    targets += _scale_targets(document)
    targets.append(_flow_target(document))
    cold = document.get("cold_start")
    if cold is None:
        targets.append(_target("cold start, tracing off", "< 250 ms", "not run", None))
    else:
        off = cold["tracing_off"]
        targets.append(
            _target(
                "DrainFunction cold start (import + first setup), tracing off",
                f"< {_COLD_START_TARGET_MS:g} ms",
                f"{off['median_ms']} ms",
                off["median_ms"] < _COLD_START_TARGET_MS,
            )
        )
        targets.append(
            _target(
                "cold start imports nothing unused (boto3 only when a feature needs it)",
                "boto3 not imported",
                "boto3 imported" if off["boto3_imported"] else "boto3 not imported",
                not off["boto3_imported"],
            )
        )
    return targets


def _scale_targets(document: dict[str, Any]) -> list[dict[str, Any]]:
    scale = document.get("scale") or {}
    targets = []
    latency = scale.get("latency")
    polled = latency["idle_polling"] if latency else None
    for name, key, limit in (
        ("p50", "p50", _IDLE_P50_TARGET_MS),
        ("p99", "p99", _IDLE_P99_TARGET_MS),
    ):
        targets.append(
            _target(
                f"publish -> effect latency {name}, idle polling at "
                f"{latency['idle_poll_ms'] if latency else 200} ms",
                f"<= {limit / 1000:g} s",
                f"{polled[key] / 1000:.2f} s" if polled else "not run",
                None if not polled else polled[key] <= limit and latency["verified"]["ok"],
            )
        )
    runs = {r["max_concurrency"]: r for r in (scale.get("backlog") or {}).get("runs", [])}
    for cap, required in _FAN_OUT_TARGETS.items():
        run = runs.get(cap)
        targets.append(
            _target(
                f"backlog cleared with DRAIN_MAX_CONCURRENCY {cap}, against 1",
                f">= {required:g}x",
                f"{run['speedup']}x" if run and run.get("speedup") else "not run",
                None
                if not run or not run.get("speedup")
                else run["speedup"] >= required and run["verified"]["ok"],
            )
        )
    return targets


def _flow_target(document: dict[str, Any]) -> dict[str, Any]:
    name = "ledger round trips per message of a job without a policy, flow control on vs off"
    required = f"unchanged (within {_FLOW_UNCHANGED_TOLERANCE:g})"
    flow = document.get("flow_control")
    if not flow:
        return _target(name, required, "not run", None)
    comparison = flow["comparison"]
    extra = comparison["unlimited_path_extra_round_trips_per_message"]
    per_round = comparison["unlimited_path_extra_per_round"]
    return _target(
        name,
        required,
        f"{extra:+.3f} (per round {', '.join(f'{v:+.3f}' for v in per_round)}; plus "
        f"{_fmt(comparison['due_work_round_trips_per_drain'], 0)} per drain looking for due "
        "deferred work)",
        max(abs(v) for v in per_round) <= _FLOW_UNCHANGED_TOLERANCE
        and flow["median"]["available"]["verified"],
    )


# --- files -------------------------------------------------------------------------------------


# Parts a script of their own measures and stores with ``--update``: a full run keeps them from
# the results file it replaces, so the page still shows them (each section gives its own date).
MEASURED_APART = ("lane_processes", "many_drains")


def write_all(document: dict[str, Any], out: Path, docs: Path) -> list[Path]:
    document["cost"] = cost.per_million(document, cost.DrainShape.from_template())
    out.mkdir(parents=True, exist_ok=True)
    if (out / "latest.json").exists():
        previous = json.loads((out / "latest.json").read_text())
        for part in MEASURED_APART:
            if previous.get(part) and not document.get(part):
                document[part] = previous[part]
    stamp = datetime.fromisoformat(document["started_at"]).strftime("%Y%m%dT%H%M%SZ")
    text = json.dumps(document, indent=2) + "\n"
    written = [out / f"bench-{stamp}.json", out / "latest.json"]
    for path in written:
        path.write_text(text)
    chart = out / "latest.png"
    write_chart(document, chart)
    docs.parent.mkdir(parents=True, exist_ok=True)
    docs.write_text(render_markdown(document, chart))
    return [*written, chart, docs]


def write_chart(document: dict[str, Any], path: Path) -> None:
    import matplotlib  # noqa: PLC0415 - only the report needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    config = document["config"]
    variants = document["variants"]
    ceiling = document["comparison"]["single_lane_ceiling_msgs_per_s"]
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))

    names = ["(a) notes' loop", "(b) drain"]
    rates = [
        variants["notes_loop"]["median"]["messages_per_s"],
        variants["drain"]["median"]["messages_per_s"],
    ]
    bars = left.bar(names, rates, color=["#9e9e9e", "#1f77b4"])
    left.bar_label(bars, labels=[f"{r:.0f}" for r in rates])
    if ceiling:
        left.axhline(ceiling, color="#2ca02c", linestyle="--", label=f"ceiling {ceiling:.0f}")
        left.axhline(
            _CEILING_TARGET * ceiling,
            color="#ff7f0e",
            linestyle=":",
            label=f"target {_CEILING_TARGET:.0%} of ceiling",
        )
        left.axhline(
            _RATIO_TARGET * rates[0], color="#d62728", linestyle="-.", label="target 8x (a)"
        )
        left.legend(loc="upper left", fontsize=8)
    left.set_ylabel("messages per second (median)")
    left.set_title(
        f"{config['jobs']:,} jobs, {config['duplicate_share']:.0%} duplicates, "
        f"{config['latency_ms']:g} ms per call",
        fontsize=10,
    )

    scaling = document["lanes"]["scaling"]
    if scaling:
        lanes = [s["lanes"] for s in scaling]
        lane_rates = [s["messages_per_s"] for s in scaling]
        base = document["lanes"]["baseline_msgs_per_s"]
        positions = range(len(lanes))
        bars = right.bar(positions, lane_rates, color="#1f77b4")
        right.bar_label(bars, labels=[f"{r:.0f}" for r in lane_rates])
        right.plot(positions, [base * n for n in lanes], "g--", marker="o", label="linear")
        right.plot(
            positions,
            [_LANES_TARGET * base * n for n in lanes],
            color="#ff7f0e",
            linestyle=":",
            marker="o",
            label=f"target {_LANES_TARGET:g} x N",
        )
        right.set_xticks(list(positions), [str(n) for n in lanes])
        right.set_xlabel("concurrent lanes of (b)")
        right.set_ylabel("messages per second")
        right.set_title(f"lanes on {document['machine']['nproc']} CPUs", fontsize=10)
        right.legend(loc="upper left", fontsize=8)
    else:
        right.set_axis_off()
    figure.suptitle("infrai-jobs drain benchmark", fontsize=12)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


# --- the page ----------------------------------------------------------------------------------


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def _share(value: float) -> str:
    """A per-message figure; a few exchanges per run (connection set-up) show as such."""
    if value == 0:
        return "0"
    return "<0.001" if value < 0.001 else f"{value:.3f}"


def _pass(value: bool | None) -> str:
    return "not measured" if value is None else ("**pass**" if value else "**FAIL**")


def render_markdown(document: dict[str, Any], chart: Path) -> str:
    lines: list[str] = []
    add = lines.append
    add("# Performance")
    add("")
    add(
        f"Generated by `make bench` (`bench/run_bench.py`) from `bench/results/latest.json`, run "
        f"started {document['started_at']} and took {document['duration_s']:.0f} s. Do not edit "
        "by hand: `bench/report.py` writes this page (`.venv/bin/python bench/report.py` "
        "regenerates it from a results file)."
    )
    add("")
    # The package ships this page without the chart, so a link to it would lead nowhere there.
    try:
        add(
            f"The run's chart is `{chart.resolve().relative_to(ROOT).as_posix()}` in the "
            "framework's repository."
        )
    except ValueError:
        add(f"![benchmark chart]({chart.resolve().as_uri()})")
    add("")
    for section in (
        _targets_section,
        _setup_section,
        _comparison_section,
        _round_trips_section,
        _lanes_section,
        _scale_section,
        _cost_section,
        _memory_section,
        _profile_section,
        _cold_start_section,
        _second_layer_section,
        _flow_section,
        _measured_apart_section,
        _method_section,
    ):
        lines.extend(section(document))
    return "\n".join(lines)


def _targets_section(document: dict[str, Any]) -> list[str]:
    lines = [
        "## Targets",
        "",
        "| target | required | measured | result |",
        "| --- | --- | --- | --- |",
    ]
    lines += [
        f"| {t['target']} | {t['required']} | {t['measured']} | {_pass(t['pass'])} |"
        for t in document["targets"]
    ]
    skewed = _skewed_runs(document)
    if skewed:
        lines += [
            "",
            f"Other work was running on this machine: {len(skewed)} drain(s) started with it "
            f"more than {BACKGROUND_WARNING_PCT:g}% busy ({', '.join(skewed)}). Their figures "
            "are skewed by it (throughput low, latency high); rerun on a quiet machine to "
            "judge the targets.",
        ]
    return [*lines, ""]


BACKGROUND_WARNING_PCT = 20.0


def _all_runs(document: dict[str, Any]) -> list[dict[str, Any]]:
    runs = [run for variant in document["variants"].values() for run in variant["runs"]]
    runs += document["lanes"]["runs"]
    if document.get("memory"):
        runs.append(document["memory"]["run"])
    return runs


def _skewed_runs(document: dict[str, Any]) -> list[str]:
    return [
        f"{run['name']} {run['background_busy_pct']:g}%"
        for run in _all_runs(document)
        if (run.get("background_busy_pct") or 0) > BACKGROUND_WARNING_PCT
    ]


def _setup_section(document: dict[str, Any]) -> list[str]:
    config = document["config"]
    machine = document["machine"]
    return [
        "## What ran",
        "",
        f"- Machine: {machine['nproc']} CPUs ({machine['cpu_model']}), Python "
        f"{machine['python']}, PostgreSQL {machine['postgres']} ({machine['database']}), "
        f"psycopg {machine['psycopg']}, {machine['platform']}.",
        *_load_line(machine),
        f"- Workload per drain: {config['jobs']:,} messages = {config['unique_jobs']:,} distinct "
        f"`{config['job']}` ({config.get('job_effect', 'database')}-class) jobs + "
        f"{config['duplicate_publishes']:,} duplicate publishes "
        f"({config['duplicate_share']:.0%}) in one seeded, shuffled order (seed "
        f"{config['seed']}); an `invoices` table (the invoice job's migration) with "
        f"{config['jobs']:,} rows.",
        f"- Infrai: the local emulator in its own process on 127.0.0.1, with "
        f"{config['latency_ms']:g} ms injected into every /v1 call while a drain is measured "
        "(`POST /_emulator/faults`); publishing and checking run without it.",
        "- Every drain gets a fresh queue and a fresh scratch database migrated with the "
        "project's migrations (both variants use the same `job_claims` table), runs in a worker "
        "process of its own, and is checked afterwards: every invoice finalised with its "
        "amount, one `done` claim per distinct job, queue and DLQ empty.",
        f"- (a) and (b) alternate, (a) (b) (a) (b)..., {config['rounds']} "
        f"round{'s' if config['rounds'] != 1 else ''} each; the tables show medians over the "
        "rounds.",
        "- (a) is `bench/notes_loop.py`, the field notes' Node worker loop ported line for "
        "line: consume 10; per message one claim `INSERT ... ON CONFLICT DO NOTHING "
        "RETURNING`, the `UPDATE invoices`, one `UPDATE job_claims SET state = 'done'`, one "
        "ack; autocommit; repeated until the queue is empty. It uses the project's "
        "`InfraiClient`, the same keep-alive HTTP stack as (b).",
        "- (b) is `infrai_jobs.drain.loop.drain` with `PostgresLedger`, `functions/jobs`' job "
        "registry and `DrainConfig(queue=...)`, as DrainFunction runs it.",
        "",
    ]


def _load_line(machine: dict[str, Any]) -> list[str]:
    start, end = machine.get("load_average_at_start"), machine.get("load_average_at_end")
    if not start:
        return []
    text = f"- Load average (1, 5, 15 min) at the start: {', '.join(f'{v:g}' for v in start)}"
    if end:
        text += f"; at the end: {', '.join(f'{v:g}' for v in end)}"
    return [text + f" ({machine['nproc']} CPUs; the machine is shared with other work)."]


_COMPARISON_ROWS = (
    ("messages per second", "messages_per_s", 1),
    ("wall time, s", "elapsed_s", 1),
    ("HTTP calls per message", "http_per_message", 3),
    ("DB round trips per message", "db_round_trips_per_message", 3),
    ("- ledger's own", "ledger_round_trips_per_message", 3),
    ("- the job's own", "job_round_trips_per_message", 3),
    ("statements per message", "statements_per_message", 3),
    ("batch latency p50, ms", "batch_p50_ms", 1),
    ("batch latency p99, ms", "batch_p99_ms", 1),
    ("consume call p50, ms", "consume_call_p50_ms", 1),
    ("ack call p50, ms", "ack_call_p50_ms", 1),
    ("loop's own work between consumes p50, ms", "between_consumes_p50_ms", 1),
    ("peak RSS, MB", "peak_rss_mb", 1),
    ("worker CPU, % of one core", "process_cpu_pct", 1),
    ("machine busy, % of all CPUs", "machine_busy_pct", 1),
    ("machine busy just before (other work), %", "background_busy_pct", 1),
)


def _comparison_section(document: dict[str, Any]) -> list[str]:
    a = document["variants"]["notes_loop"]["median"]
    b = document["variants"]["drain"]["median"]
    comparison = document["comparison"]
    latency = document["config"]["latency_ms"]
    lines = [
        "## (a) against (b)",
        "",
        "| per drain (median) | (a) notes' loop | (b) drain | (b) / (a) |",
        "| --- | ---: | ---: | ---: |",
    ]
    for label, key, digits in _COMPARISON_ROWS:
        ratio = ""
        if a[key] and b[key] is not None and key in ("messages_per_s", "batch_p50_ms"):
            ratio = f"{b[key] / a[key]:.2f}x"
        lines.append(f"| {label} | {_fmt(a[key], digits)} | {_fmt(b[key], digits)} | {ratio} |")
    lines.append(f"| every drain verified | {_fmt(a['verified'])} | {_fmt(b['verified'])} | |")
    b_share = 100 * (comparison["b_fraction_of_ceiling"] or 0)
    a_share = 100 * (comparison["a_fraction_of_ceiling"] or 0)
    rounds = ", ".join(f"{r}x" for r in comparison["ratio_per_round"])
    lines += [
        "",
        f"Single-lane ceiling: 10 messages per consume round trip at {latency:g} ms = "
        f"**{_fmt(comparison['single_lane_ceiling_msgs_per_s'])} msg/s**. (b) reaches "
        f"**{_fmt(b_share)}%** of it, (a) {_fmt(a_share)}%. (b)/(a) per round: {rounds}.",
        "",
        f"A consume actually took {_fmt(comparison['measured_consume_p50_ms'])} ms here "
        "(median, client side: injected latency + loopback HTTP + the VM waking processes up), so "
        "on this machine one lane that waits for each consume can do at most "
        f"{_fmt(comparison['measured_ceiling_msgs_per_s'])} msg/s.",
        "",
    ]
    return lines


def _round_trips_section(document: dict[str, Any]) -> list[str]:
    if not document["config"]["db_trace"]:
        return []
    a_labels = labels_per_message(document["variants"]["notes_loop"]["runs"])
    b_labels = labels_per_message(document["variants"]["drain"]["runs"])
    lines = [
        "### Where the database round trips go",
        "",
        "Round trips per consumed message, by what each exchange carried (all rounds together; "
        "`;` separates statements in one simple-protocol message, `+` statements pipelined in "
        "one exchange; `prepare` is psycopg's extra Parse when it first prepares a statement).",
        "",
        "| exchange | (a) per message | (b) per message |",
        "| --- | ---: | ---: |",
    ]
    lines += [
        f"| `{label}` | {_share(a_labels.get(label, 0.0))} | {_share(b_labels.get(label, 0.0))} |"
        for label in dict.fromkeys([*a_labels, *b_labels])
    ]
    return [*lines, ""]


def _lanes_section(document: dict[str, Any]) -> list[str]:
    scaling = document["lanes"]["scaling"]
    if not scaling:
        return []
    nproc = document["machine"]["nproc"]
    lines = [
        "## Lanes",
        "",
        "(b) with N concurrent lanes, as DrainFunction runs `DRAIN_LANES`: N threads in one "
        "worker process, each running `drain()` with its own `PostgresLedger`, all sharing one "
        f"`InfraiClient` whose pool keeps {HTTP_CONNECTIONS_PER_LANE} connections per lane, on "
        "the same queue and ledger "
        + _lane_messages(document["config"])
        + f" The emulator, PostgreSQL and the worker share this machine's {nproc} CPUs.",
        "",
        "| lanes | msg/s | speedup | target | batch p50 ms | batch p99 ms "
        "| work while the consume travels, p50 ms | then waiting for it, p50 ms | worker CPU % "
        "| machine busy % | worker CPU ms/msg | machine CPU ms/msg | result |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| --- |",
    ]
    for s in scaling:
        result = "" if s["lanes"] == 1 else _pass(s["speedup"] >= s["target_speedup"])
        worker_ms, machine_ms = _cpu_per_message(s, nproc)
        lines.append(
            f"| {s['lanes']} | {_fmt(s['messages_per_s'])} | {s['speedup']}x | "
            f"{s['target_speedup']}x | {_fmt(s['batch_p50_ms'])} | {_fmt(s['batch_p99_ms'])} "
            f"| {_fmt(s.get('ahead_work_p50_ms'))} | {_fmt(s.get('ahead_wait_p50_ms'))} "
            f"| {_fmt(s['process_cpu_pct'])} | {_fmt(s['machine_busy_pct'])} "
            f"| {worker_ms:.2f} | {machine_ms:.2f} | {result} |"
        )
    lines += [
        "",
        *_cpu_budget(scaling, nproc),
        "",
        "To tell the drain's one GIL from what all lanes share here (the emulator, PostgreSQL, "
        "the CPUs), `bench/lane_processes.py` drains the same workload with N lanes as threads "
        "and as N separate processes: if the processes do no better while the machine has CPU "
        "to spare, the lanes are waiting on what they share.",
        "",
        "When the CPUs are the limit, what lanes wait on most is the job's own database round "
        "trips: psycopg lets go of the GIL several times in each (around the send, `PQisBusy` "
        "and the wait for the answer), and under contention another lane's thread takes it "
        "every time. In a slow phase of the machine of 2026-11-29, 8 lanes with the example "
        "job's UPDATE swapped for a no-op drained 2,670-2,870 msg/s with 1.1-2.0 voluntary "
        "context switches per message, against 2,270-2,600 msg/s and about 4 with the UPDATE. "
        "The more round trips a job makes, the less lanes in one process gain.",
        "",
        *_lambda_sizing(scaling, nproc),
    ]
    return [*lines, ""]


def _lane_messages(config: dict[str, Any]) -> str:
    if config.get("lane_messages"):
        return f"({config['lane_messages']:,} messages whatever N, one run per N)."
    return (
        f"(N x {config['jobs']:,} messages, one run per N, so that every run lasts about as "
        "long and the lanes' start and their last, empty consumes weigh the same in each)."
    )


# Lambda allocates CPU in proportion to memory: 1,769 MB is one full vCPU (AWS documentation).
_LAMBDA_MB_PER_VCPU = 1769
_TEMPLATE_DRAIN_MEMORY_MB = 512


def _lambda_sizing(scaling: list[dict[str, Any]], nproc: int) -> list[str]:
    base = next((s for s in scaling if s["lanes"] == 1), None)
    if base is None:
        return []
    worker_ms, _ = _cpu_per_message(base, nproc)
    if not worker_ms or math.isnan(worker_ms):
        return []
    share = _TEMPLATE_DRAIN_MEMORY_MB / _LAMBDA_MB_PER_VCPU
    return [
        "Sizing lanes in AWS: the drain's own CPU is what lanes run into there (the queue and "
        f"the database are elsewhere). At {worker_ms:.2f} ms of CPU per message, one vCPU "
        f"sustains about {_fmt(1000 / worker_ms)} msg/s. Lambda gives a function CPU in "
        f"proportion to its memory ({_LAMBDA_MB_PER_VCPU:,} MB is one vCPU), so DrainFunction "
        f"at the template's {_TEMPLATE_DRAIN_MEMORY_MB} MB (about {share:.2f} vCPU) tops out "
        f"near {_fmt(1000 / worker_ms * share)} msg/s whatever `DrainLanes` says; raise "
        "`MemorySize` with the lanes. This machine's x86 cores are not Lambda's arm64 ones, so "
        "take the figure as an order of magnitude.",
    ]


def _cpu_per_message(row: dict[str, Any], nproc: int) -> tuple[float, float]:
    """The worker's, and the whole machine's, CPU milliseconds per message drained."""
    rate = row["messages_per_s"] or float("nan")
    worker = row["process_cpu_pct"] / 100 * 1000 / rate
    machine = row["machine_busy_pct"] / 100 * nproc * 1000 / rate
    return round(worker, 3), round(machine, 3)


def _cpu_budget(scaling: list[dict[str, Any]], nproc: int) -> list[str]:
    """What the machine could do at best if CPU were the only limit, against what N lanes need."""
    base = next((s for s in scaling if s["lanes"] == 1), None)
    widest = max(scaling, key=lambda s: s["lanes"])
    if base is None or widest["lanes"] == 1:
        return []
    worker_ms, machine_ms = _cpu_per_message(widest, nproc)
    if not machine_ms or math.isnan(machine_ms):  # no CPU reading
        return []
    ceiling = nproc * 1000 / machine_ms
    needed = widest["target_speedup"] * base["messages_per_s"]
    gil = 1000 / worker_ms if worker_ms else float("inf")
    return [
        f"CPU budget: at {widest['lanes']} lanes the whole machine (worker, emulator, "
        f"PostgreSQL, the benchmark's own sampling, this machine's other services) spent "
        f"{machine_ms:.2f} ms of CPU per message, so its {nproc} CPUs could drain at most about "
        f"**{_fmt(ceiling)} msg/s** however the lanes were arranged; {widest['lanes']} lanes at "
        f"the target need {_fmt(needed)} msg/s ({widest['target_speedup']}x of "
        f"{_fmt(base['messages_per_s'])}). Lanes are threads under one GIL: the worker spent "
        f"{worker_ms:.2f} ms of CPU per message, which caps one process at about {_fmt(gil)} "
        "msg/s.",
    ]


def _memory_section(document: dict[str, Any]) -> list[str]:
    memory = document.get("memory")
    if not memory:
        return []
    return [
        "## Memory",
        "",
        f"(b) draining {memory['jobs']:,} messages in one worker process: peak RSS "
        f"**{memory['peak_rss_mb']} MB** (RSS before the first consume "
        f"{memory['rss_before_mb']} MB), {_fmt(memory['messages_per_s'])} msg/s, verified "
        f"{_fmt(memory['verified'])}.",
        "",
    ]


def _profile_section(document: dict[str, Any]) -> list[str]:
    profile = document.get("profile")
    if not profile:
        return []
    lines = [
        "## Where (b)'s worker spends its CPU",
        "",
        f"One more (b) drain of {profile['jobs']:,} messages under cProfile in every thread "
        f"(every lane's): {_fmt(profile['messages_per_s_under_profiler'])} msg/s under "
        f"the profiler, worker CPU {_fmt(profile['process_cpu_pct'])}% of one core. The "
        "profiler's clock is each thread's CPU time, so waiting (network, database, the GIL) "
        "is not counted, and its own overhead inflates call-heavy functions. The full listing "
        f"is `bench/results/{profile['file']}`.",
        "",
        "| function | calls | self s | cumulative s |",
        "| --- | ---: | ---: | ---: |",
    ]
    lines += [
        f"| `{row['function']}` | {row['calls']:,} | {row['self_s']:.3f} | "
        f"{row['cumulative_s']:.3f} |"
        for row in profile["top_by_self_time"]
    ]
    return [*lines, ""]


_COLD_SCENARIOS = (
    ("tracing off (`POWERTOOLS_TRACE_DISABLED=true`)", "tracing_off"),
    ("tracing on (`POWERTOOLS_TRACE_DISABLED=false`)", "tracing_on"),
    ("secrets by name: Parameters + 2 boto3 clients (extra)", "secrets_by_name_extra"),
    ("dependency floor: `import psycopg`, Powertools `Logger()` + `Metrics()`", "dependency_floor"),
)


def _cold_start_section(document: dict[str, Any]) -> list[str]:
    cold = document.get("cold_start")
    if not cold:
        return []
    lines = [
        "## Cold start (DrainFunction)",
        "",
        cold["method"][0].upper()
        + cold["method"][1:]
        + (f"; measured {cold['measured_at']}" if cold.get("measured_at") else "")
        + ".",
        "",
        "| scenario | median ms | import ms | setup ms | min-max ms | process wall ms | "
        "modules | boto3 imported | connections |",
        "| --- | ---: | ---: | ---: | --- | ---: | ---: | --- | ---: |",
    ]
    for label, key in _COLD_SCENARIOS:
        row = cold.get(key)
        if row is None:
            continue
        if row.get("status") == "n/a":
            lines.append(f"| {label} | n/a: {row['reason']} | | | | | | | |")
            continue
        lines.append(
            f"| {label} | {_fmt(row['median_ms'])} | {_fmt(row['import_ms'])} | "
            f"{_fmt(row['setup_ms'])} | {_fmt(row['min_ms'])}-{_fmt(row['max_ms'])} | "
            f"{_fmt(row['process_wall_ms'])} | {_fmt(row['modules_loaded'])} | "
            f"{_fmt(row['boto3_imported'])} | {_fmt(row['network_connections'])} |"
        )
    off, on = cold["tracing_off"], cold["tracing_on"]
    if cold.get("ratio_to_floor"):
        busy = cold.get("background_busy_pct")
        lines += [
            "",
            f"**The handler's cold start is {cold['ratio_to_floor']}x its dependencies' own "
            f"import floor** ({_fmt(off['median_ms'])} ms against "
            f"{_fmt(cold['dependency_floor']['median_ms'])} ms, both measured in this run"
            + (f", the machine {_fmt(busy)}% busy before it" if busy is not None else "")
            + "). Absolute milliseconds move with the machine; the ratio moves much less, "
            "since a busy or slow machine slows both alike.",
        ]
    if on.get("status") == "n/a":
        tracing = "Tracing on could not be measured: " + on["reason"] + "."
    elif on["modules_loaded"] == off["modules_loaded"]:
        tracing = "Tracing on imports nothing more: both settings run the same code."
    else:
        tracing = (
            f"Tracing on imports {on['modules_loaded'] - off['modules_loaded']} more modules "
            f"(the X-Ray SDK behind Powertools' Tracer) and adds "
            f"{on['median_ms'] - off['median_ms']:.0f} ms."
        )
    lines += [
        "",
        tracing + " In AWS the template names the secrets (`INFRAI_API_KEY_PARAMETER`, "
        "`DATABASE_SECRET_ARN`), so the first invocation also pays the secrets-by-name row "
        "plus two network calls; here the plain values are set and neither runs.",
        "",
    ]
    for key, title in (("importtime_tracing_off", "off"), ("importtime_tracing_on", "on")):
        breakdown = cold.get(key)
        if not breakdown:
            continue
        lines += [
            f"`python -X importtime`, tracing {title}: top modules by cumulative time (median of "
            f"{breakdown['runs']} runs; {breakdown['modules_imported']} modules imported; "
            "indentation is nesting)",
            "",
            "| module | cumulative ms | self ms |",
            "| --- | ---: | ---: |",
        ]
        lines += [
            f"| {'&nbsp;&nbsp;' * row['depth']}`{row['module']}` | "
            f"{_fmt(row['cumulative_ms'], 2)} | {_fmt(row['self_ms'], 2)} |"
            for row in breakdown["top_by_cumulative"]
        ]
        packages = ", ".join(
            f"`{p['package']}` {p['self_ms']:.1f}" for p in breakdown["top_packages_by_self"]
        )
        lines += ["", f"Self time by top-level package, ms: {packages}.", ""]
    return lines


def _scale_section(document: dict[str, Any]) -> list[str]:
    scale = document.get("scale")
    if not scale:
        return []
    lines = ["## Latency and scale (idle polling, backlog fan-out)", ""]
    latency = scale.get("latency")
    if latency:
        polled, scheduled = latency["idle_polling"], latency["scheduled"]
        lines += [
            f"(a) {latency['jobs']} jobs published one every {latency['publish_every_ms']:g} ms "
            f"to an empty queue, at {latency['latency_ms_per_call']:g} ms per Infrai call, "
            "drained by one `infrai-jobs drain` with "
            f"`DRAIN_IDLE_POLL_MS={latency['idle_poll_ms']}`; latency from the start of each "
            "publish call to its effect (a trigger's `clock_timestamp()` on `invoices`). "
            f"Scheduled draining is **computed, not run**: a job waits for the next tick, "
            f"uniformly 0 to {scheduled['tick_seconds']:g} s, plus what the polled drain took "
            "(its p50); a cold start comes on top when the environment is cold. "
            f"Machine {_fmt(latency.get('background_busy_pct'))}% busy before the run.",
            "",
            "| draining | latency p50 | latency p99 | how |",
            "| --- | ---: | ---: | --- |",
            f"| idle polling every {latency['idle_poll_ms']} ms | {polled['p50'] / 1000:.2f} s "
            f"| {polled['p99'] / 1000:.2f} s | measured: {polled['count']} jobs, "
            f"{polled.get('consumes')} consumes ({polled.get('idle_polls')} after an empty one); "
            f"verified {_pass(latency['verified']['ok'])} |",
            f"| scheduled, every {scheduled['tick_seconds']:g} s | "
            f"{scheduled['p50'] / 1000:.1f} s | {scheduled['p99'] / 1000:.1f} s | computed from "
            "the tick period |",
            "",
        ]
    backlog = scale.get("backlog")
    if backlog:
        lines += [
            f"(b) {backlog['jobs']:,} messages waiting, at {backlog['latency_ms_per_call']:g} ms "
            "per Infrai call, drained by one `infrai-jobs drain` with `DRAIN_MAX_CONCURRENCY` N "
            f"and `DRAIN_FANOUT_AFTER_SECONDS={backlog['fan_out_after_seconds']}` (so the cap, "
            "not the threshold, decides how many drains run). It fans out to more `infrai-jobs "
            "drain` processes through the port Lambda's Invoke serves in AWS, and the command "
            "ends when all have: its wall time is the time to clear, start-up included. Every "
            "run verified: each invoice's effect exactly once (one trigger row each), every "
            "claim done, queue and DLQ empty, no drain lease left, never more drains alive than "
            "N (a trigger counts `drain_leases` after every change).",
            "",
            "| DRAIN_MAX_CONCURRENCY | wall s | msg/s | against 1 | first to last effect s "
            "| drains run | most alive at once | machine busy before % | verified |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
        ]
        for run in backlog["runs"]:
            verified = run["verified"]
            lines.append(
                f"| {run['max_concurrency']} | {_fmt(run['wall_s'], 2)} | "
                f"{_fmt(run['messages_per_s'])} | {run.get('speedup')}x | "
                f"{_fmt(run['first_to_last_effect_s'], 2)} | {run['drains_run']} | "
                f"{verified['peak_drains_alive']} | {_fmt(run.get('background_busy_pct'))} | "
                f"{_pass(verified['ok'])} |"
            )
        nproc = document["machine"]["nproc"]
        lines += [
            "",
            f"Every drain here is a process on the same {nproc} CPUs as the emulator and "
            "PostgreSQL, so past about two drains they share the CPUs rather than add them: "
            "what more drains gain on this machine is bounded by its cores, not by the fan-out. "
            "In AWS each invocation has its own CPU share and connection.",
            "",
            *_million_on_paper(document, backlog),
        ]
    return [*lines, ""]


def _million_on_paper(document: dict[str, Any], backlog: dict[str, Any]) -> list[str]:
    """1,000,000 messages in AWS at the per-lane rate measured here, for a few settings."""
    rate = backlog.get("one_drain_messages_per_s")
    if not rate:
        return []
    lanes = {s["lanes"]: s["speedup"] for s in document.get("lanes", {}).get("scaling", [])}
    http = document.get("variants", {}).get("drain", {}).get("median", {})
    calls_per_message = http.get("http_per_message") or 1.1
    db_per_message = http.get("db_round_trips_per_message")
    lines = [
        "### 1,000,000 messages in AWS, on paper",
        "",
        f"From the rate one drain of one lane measured here ({_fmt(rate)} msg/s at "
        f"{backlog['latency_ms_per_call']:g} ms per call), each Lambda invocation with its own "
        "CPU and database connections, lanes scaling as measured in the Lanes section (linearly "
        "where not measured), drains adding up linearly, and about 4 s before the fan-out has "
        "them all running (the first check after 2 s, then an async invoke and a cold start):",
        "",
        "| DrainLanes | DrainMaxConcurrency | msg/s | 1,000,000 messages | Infrai calls/s "
        "| Postgres connections | DB round trips/s |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for lane_count, drains in ((1, 4), (4, 4), (4, 16), (8, 50), (8, 100)):
        speedup = lanes.get(lane_count, float(lane_count))
        total = rate * speedup * drains
        seconds = 1_000_000 / total + 4
        minutes = f"{seconds / 60:.1f} min" if seconds >= 120 else f"{seconds:.0f} s"
        db = f"{total * db_per_message:,.0f}" if db_per_message else "n/a"
        lines.append(
            f"| {lane_count} | {drains} | {total:,.0f} | {minutes} | "
            f"{total * calls_per_message:,.0f} | {drains * (lane_count + 1)} | {db} |"
        )
    lines += [
        "",
        "What bounds it, before Lambda does:",
        "",
        f"- **Infrai's rate limits.** Each message costs about {calls_per_message:g} calls "
        "(a consume per ten, an ack each); consume, ack and stats are free but rate-limited, "
        "and the field notes give no figure. A 429 is retried within the invocation's time "
        "(`Retry-After`), so a limit shows up as a lower rate, not as errors: the rate above "
        "is the most the limit allows, never more.",
        "- **Postgres connections.** Each invocation holds `DrainLanes` lane connections and one "
        "for its lease: `DrainMaxConcurrency x (DrainLanes + 1)` in all. RDS sets "
        "`max_connections` from the instance's memory (a few hundred on a small instance); RDS "
        "Proxy pools more clients onto fewer server connections; the ledger's own work per "
        "message (the DB round trips column) is what "
        "the server must keep up with.",
        "- **Lambda.** `DrainMaxConcurrency` is also the function's reserved concurrency, taken "
        "from the account's pool (1,000 by default, of which 100 stay unreserved).",
    ]
    return lines


_SECOND_LAYER_ROWS: tuple[tuple[str, str, int], ...] = (
    ("messages per second", "messages_per_s", 1),
    ("wall time, s", "elapsed_s", 2),
    ("guarded jobs (second-layer calls)", "guarded_jobs", 0),
    ("second-layer hits (effect not called)", "hits", 0),
    ("DynamoDB calls per guarded job", "dynamodb_calls_per_guarded_job", 3),
    ("DynamoDB calls per message", "dynamodb_calls_per_message", 3),
    ("DynamoDB call p50, ms (client side)", "dynamodb_call_p50_ms", 1),
    ("second layer's time per guarded job p50, ms", "guard_overhead_p50_ms", 1),
    ("second layer's time per guarded job p99, ms", "guard_overhead_p99_ms", 1),
    ("the effect (provider POST) p50, ms", "effect_p50_ms", 1),
    ("batch latency p50, ms", "batch_p50_ms", 1),
    ("batch latency p99, ms", "batch_p99_ms", 1),
    ("peak RSS, MB", "peak_rss_mb", 1),
    ("RSS before the first consume, MB", "rss_before_mb", 1),
    ("worker CPU, % of one core", "process_cpu_pct", 1),
)


def _second_layer_section(document: dict[str, Any]) -> list[str]:
    result = document.get("second_layer")
    if not result:
        return []
    config = result["config"]
    medians = result["median"]
    off, on, replay = medians["off"], medians["on"], medians["replay"]
    comparison = result["comparison"]
    latency = config["latency_ms"]
    rounds = config["rounds"]
    lines = [
        "## Second layer cost (`IDEMPOTENCY_BACKEND=dynamodb`)",
        "",
        f"Measured by `bench/second_layer_bench.py` ({result['measured_at']}, "
        f"{result['duration_s']:.0f} s). The same drain of {config['jobs']:,} "
        f"`{config['job']}` messages ({config['unique_jobs']:,} distinct `external`-class jobs "
        f"+ {config['duplicate_publishes']:,} duplicate publishes, seed {config['seed']}), one "
        "lane, each drain in a fresh worker process with a fresh queue and ledger database, "
        f"{rounds} round{'s' if rounds != 1 else ''} of: **off** (no second layer); **on**, a "
        "fresh DynamoDB table (every job's first run); **replay**, a fresh ledger (its rows "
        "lost) over the same table (every job a second-layer hit, no effect repeated). The "
        "effect is one HTTP POST to the local provider sink (loopback, no injected latency), "
        "which counts e-mails: each drain is checked for exactly one e-mail per distinct job "
        "(none more after replay), one `done` claim per job, one record per job in the table, "
        "empty queue and DLQ. DynamoDB is moto's `ThreadedMotoServer` on 127.0.0.1 (real HTTP), "
        "the table as `template.yaml` declares it. The same "
        f"{latency:g} ms is injected into every Infrai call (the emulator) and every DynamoDB "
        "HTTP request (a botocore `before-send` hook that sleeps, then sends: exactly one "
        "latency per attempt, no extra proxy hop in what is measured).",
        "",
        *_per_drain_header(rounds, "off", "on: first run", "on: replay"),
    ]
    for label, key, digits in _SECOND_LAYER_ROWS:
        cells = [_fmt(m[key], digits) for m in (off, on, replay)]
        if key == "effect_p50_ms" and replay["hits"] and replay["hits"] == replay["guarded_jobs"]:
            cells[2] = "not called"
        if key.startswith(("dynamodb_call", "guard_", "effect_", "hits")):
            cells[0] = "-"
        lines.append(f"| {label} | {' | '.join(cells)} |")
    ops = [
        ", ".join(f"`{op}` {n:g}" for op, n in m["dynamodb_calls_by_operation"].items()) or "-"
        for m in (off, on, replay)
    ]
    lines.append(f"| DynamoDB calls per guarded job, by operation | {' | '.join(ops)} |")
    lines.append(
        f"| messages per second against off | 1.00x | "
        f"{_fmt(comparison['on_over_off_messages_per_s'], 2)}x | "
        f"{_fmt(comparison['replay_over_off_messages_per_s'], 2)}x |"
    )
    lines.append(
        f"| wall time added per guarded job against off, ms | - | "
        f"{_fmt(comparison['added_ms_per_guarded_job_first_run'])} | "
        f"{_fmt(comparison['added_ms_per_guarded_job_replay'])} |"
    )
    lines.append(
        f"| every drain verified | {_fmt(off['verified'])} | {_fmt(on['verified'])} | "
        f"{_fmt(replay['verified'])} |"
    )
    call_ms = on["dynamodb_call_p50_ms"]
    own = f"{call_ms - latency:.1f}" if call_ms is not None else "n/a"
    lines += [
        "",
        f"A guarded first run costs {_fmt(on['dynamodb_calls_per_guarded_job'], 0)} sequential "
        f"DynamoDB calls on the lane's critical path, a replay "
        f"{_fmt(replay['dynamodb_calls_per_guarded_job'], 0)} (a `PutItem` that fails its "
        "condition and returns the stored record; the effect and the `UpdateItem` are "
        "skipped). Each call took "
        f"{_fmt(call_ms)} ms at the median: the {latency:g} ms injected plus {own} ms of boto3 "
        "(signing, serialising, parsing) and moto's Python server. Duplicates the ledger "
        "answers never reach the layer, and `database`-class jobs never use it.",
        "",
    ]
    lines += _busy_machine_note(result)
    cold = result.get("cold_start")
    if cold:
        when = f" (measured {cold['measured_at']})" if cold.get("measured_at") else ""
        lines += [
            f"Cold start of turning it on{when}: " + cold["method"] + ".",
            "",
            "| DrainFunction cold start | median ms | import ms | setup ms | modules | "
            "boto3 imported | connections |",
            "| --- | ---: | ---: | ---: | ---: | --- | ---: |",
        ]
        for label, key in (("`IDEMPOTENCY_BACKEND=off`", "off"), ("`dynamodb`", "dynamodb")):
            row = cold[key]
            lines.append(
                f"| {label} | {_fmt(row['median_ms'])} | {_fmt(row['import_ms'])} | "
                f"{_fmt(row['setup_ms'])} | {_fmt(row['modules_loaded'])} | "
                f"{_fmt(row['boto3_imported'])} | {_fmt(row['network_connections'])} |"
            )
        steps = cold["breakdown_ms"]
        lines += [
            "",
            f"Turning it on adds **{cold['added_ms']:.0f} ms** and {cold['added_modules']} "
            "modules to the first invocation, once per execution environment: the first "
            "`app.service()` builds the second layer (the setup column); `import app` imports "
            "the same modules either way, so its difference is run-to-run noise. Step by step, "
            "after "
            f"an untimed `import app` (median of {cold['breakdown_runs']} fresh processes): "
            f"`import boto3` {_fmt(steps['import_boto3'])} ms, `import "
            f"infrai_jobs.aws.second_layer` (Powertools' idempotency utility) "
            f"{_fmt(steps['import_second_layer'])} ms, then the first `app.service()` with the "
            f"DynamoDB client and persistence layer {_fmt(steps['first_service_with_guard'])} ms.",
            "",
        ]
    first = comparison["added_ms_per_guarded_job_first_run"]
    calls = on["dynamodb_calls_per_guarded_job"]
    rss = comparison["added_peak_rss_mb"]
    cold_ms = f"{cold['added_ms']:.0f} ms" if cold else "a few hundred ms (not measured here)"
    lines += [
        "### How to decide",
        "",
        f"The layer costs about {_fmt(calls, 0)} store round trips per external job that "
        f"actually runs (here **+{_fmt(first)} ms** per job at {latency:g} ms per call, so an "
        f"all-external lane drops from {_fmt(off['messages_per_s'])} to "
        f"{_fmt(on['messages_per_s'])} msg/s), about {_fmt(rss)} MB more peak memory and "
        f"{cold_ms} more cold start; to estimate your own cost, multiply your DynamoDB round "
        "trip (single-digit ms from Lambda in the table's region, where the per-call client "
        "overhead measured above also shrinks) by two per external job run. It buys one thing: "
        "an irreversible effect is not repeated when the ledger has lost a job's row (a "
        "restore from an older backup, a too-early prune, a hand-deleted row) and the message "
        "or a producer's retry arrives again. Turn it on when your external jobs are few or "
        "slow compared with that cost and a repeat is expensive (money moved, mail sent to "
        "customers); leave it off when most jobs are `database`-class (they never use it), "
        "when external calls pass an idempotency key the provider honours "
        "(`external_idempotent`), or when external throughput per lane matters more than that "
        "rare recovery case; more lanes (`DRAIN_LANES`) win back throughput, not per-job "
        "latency.",
        "",
        "Caveats: moto is not DynamoDB (its Python server adds milliseconds a real table "
        "does not; a real table adds TLS and throttling moto does not); the latency is a fixed "
        "sleep with no jitter; the effect is a fast loopback POST, so the slowdown ratio is an "
        "upper bound for real providers, while the added milliseconds per job are what to "
        "carry over; one lane only.",
        "",
    ]
    return lines


_FLOW_ROWS = (
    ("messages per second", "messages_per_s", 1),
    ("drain wall time, s", "elapsed_s", 2),
    ("batch latency p50, ms", "batch_p50_ms", 1),
    ("ledger round trips per message", "ledger_round_trips_per_message", 3),
    ("of which flow control's looks for due work", "flow_round_trips_per_message", 3),
    ("flow control's round trips per drain", "flow_round_trips_per_drain", 0),
    ("statements per message", "statements_per_message", 3),
    ("worker CPU, % of one core", "process_cpu_pct", 1),
    ("peak RSS, MB", "peak_rss_mb", 1),
)


def _flow_section(document: dict[str, Any]) -> list[str]:
    result = document.get("flow_control")
    if not result:
        return []
    config = result["config"]
    medians = result["median"]
    unlimited, available, limited = medians["unlimited"], medians["available"], medians["limited"]
    comparison = result["comparison"]
    rounds = config["rounds"]
    limited_policy = json.dumps(config["job_policies"]["limited"])
    available_policy = json.dumps(config["job_policies"]["available"])
    lines = [
        "## What a limited job costs (flow control, issue 29)",
        "",
        f"Measured by `bench/flow_bench.py` ({result['measured_at']}, "
        f"{result['duration_s']:.0f} s). The same drain of {config['jobs']:,} `{config['job']}` "
        f"messages ({config['unique_jobs']:,} distinct `external`-class jobs + "
        f"{config['duplicate_publishes']:,} duplicate publishes, seed {config['seed']}), one "
        f"lane, {config['latency_ms']:g} ms injected into every Infrai call, each drain in a "
        "fresh worker process with a fresh queue and ledger database, "
        f"{rounds} round{'s' if rounds != 1 else ''} of: **unlimited**, no flow control (no "
        "job has a policy); **available**, flow control on because `JOB_POLICIES` limits "
        f"another job (`{available_policy}`), so every job drained takes the no-policy path; "
        f"**limited**, `JOB_POLICIES` = `{limited_policy}`: a rate limit far above what a lane "
        "starts and a concurrency key no run ever waits for, so the policy is in force but "
        "never throttles and the difference is the limits' bookkeeping alone. Flow control is "
        "built as DrainFunction builds it and the drain runs through `drain_invocation`. Each "
        "drain is checked: one e-mail per distinct job and none twice, every claim `done`, "
        "queue and DLQ empty, nothing deferred, no rate-limit wait, every concurrency slot "
        "released, one recorded rate start per limited job run, and none of the limits' "
        "statements without a limited job.",
        "",
        *_per_drain_header(rounds, "unlimited", "available", "limited"),
    ]
    for label, key, digits in _FLOW_ROWS:
        cells = [_fmt(m[key], digits) for m in (unlimited, available, limited)]
        lines.append(f"| {label} | {' | '.join(cells)} |")
    lines.append(
        f"| messages per second against unlimited | 1.00x | "
        f"{_fmt(comparison['available_over_unlimited_messages_per_s'], 2)}x | "
        f"{_fmt(comparison['limited_over_unlimited_messages_per_s'], 2)}x |"
    )
    lines.append(
        f"| ledger round trips per message against unlimited | 1.00x | - | "
        f"{_fmt(comparison['limited_over_unlimited_ledger_round_trips'], 2)}x |"
    )
    lines.append(
        f"| every drain verified | {_fmt(unlimited['verified'])} | "
        f"{_fmt(available['verified'])} | {_fmt(limited['verified'])} |"
    )
    added = comparison["added_ledger_round_trips_per_limited_job"]
    ratio = comparison["limited_over_unlimited_messages_per_s"]
    by_label = limited["round_trips_per_message_by_label"]
    base = unlimited["round_trips_per_message_by_label"]
    runs_per_message = config["unique_jobs"] / config["jobs"]
    per_round = ", ".join(
        f"{lim['messages_per_s'] / unl['messages_per_s']:.2f}x"
        for unl, lim in zip(result["runs"]["unlimited"], result["runs"]["limited"], strict=True)
        if unl["messages_per_s"]
    )
    extra_labels = ", ".join(
        f"{label} {(n - base.get(label, 0)) / runs_per_message:.2g}"
        for label, n in by_label.items()
        if (n - base.get(label, 0)) / runs_per_message >= 0.05
    )
    lines += [
        "",
        f"**A job without a policy pays nothing.** With flow control on, the drain's own "
        f"round trips per message moved by "
        f"{comparison['unlimited_path_extra_round_trips_per_message']:+.3f} (target: "
        "unchanged); flow control's connection made "
        f"{_fmt(comparison['due_work_round_trips_per_drain'], 0)} round trips per drain, its "
        "two looks for due deferred work (before and after the consumes, a transaction each), "
        "whatever the drain's size, and none of the limits' statements.",
        "",
        f"**A limited job** costs **{_fmt(added, 1)} more ledger round trips** per run "
        f"(duplicates never reach flow control), by message: {extra_labels}. That is one "
        "message per run, on the lane's ledger connection, before the call: the concurrency "
        "key's advisory lock, then the job's rate lock, then one statement that takes the slot "
        "and the start together (both or neither), in one transaction. The statement that "
        "settles the run's claim deletes its slot too, so the release costs no round trip of "
        "its own. Here PostgreSQL is on the same machine, so they added "
        f"{_fmt(comparison['added_ms_per_limited_job'], 2)} ms of wall time per run, and "
        f"throughput was {_fmt(ratio, 2)}x unlimited's (issue 47 asks for at least 0.8x; round "
        f"by round: {per_round})"
        + (
            f": the lane's pace is set by the {config['latency_ms']:g} ms Infrai round trip, "
            "which the consume sent ahead overlaps with the batch's work."
            if ratio is not None and ratio >= 0.95
            else "."
        )
        + " To carry it over, multiply your database's round trip by that count: at 1 ms a "
        f"limited job adds about {_fmt(added, 0)} ms, which stays hidden only while a batch's "
        "limited runs fit in one Infrai round trip. A job with a retry policy and no limit "
        "pays none per run: a copy of work the ledger holds deferred is told apart by the "
        "claim statement itself.",
        "",
    ]
    lines += _busy_machine_note(result)
    return lines


def _measured_apart_section(document: dict[str, Any]) -> list[str]:
    """The parts in ``MEASURED_APART``, each rendered by the script that measures it."""
    lines: list[str] = []
    if document.get("lane_processes"):
        import lane_processes  # noqa: PLC0415 - it imports the drain's modules

        lines += lane_processes.markdown(document["lane_processes"])
    if document.get("many_drains"):
        import many_drains  # noqa: PLC0415 - it imports the drain's modules

        lines += many_drains.markdown(document["many_drains"])
    return lines


def _per_drain_header(rounds: int, *columns: str) -> list[str]:
    """The head of a receipt benchmark's table: one column of medians per mode."""
    over = f" of {rounds} rounds" if rounds > 1 else ""
    return [
        f"| per drain (median{over}) | {' | '.join(columns)} |",
        "| --- |" + " ---: |" * len(columns),
    ]


def _busy_machine_note(result: dict[str, Any]) -> list[str]:
    """A paragraph naming the drains of a receipt benchmark that started while other work kept
    the machine busy (none when there were none)."""
    skewed = [
        f"{run['name']} {run['background_busy_pct']:g}%"
        for mode_runs in result["runs"].values()
        for run in mode_runs
        if (run.get("background_busy_pct") or 0) > BACKGROUND_WARNING_PCT
    ]
    if not skewed:
        return []
    return [
        f"Other work was running when {len(skewed)} of these drains started (more than "
        f"{BACKGROUND_WARNING_PCT:g}% busy: {', '.join(skewed)}); their figures may be skewed.",
        "",
    ]


def _method_section(document: dict[str, Any]) -> list[str]:
    nproc = document["machine"]["nproc"]
    lines = ["## How it counts", ""]
    lines += [
        f"- **{name.replace('_', ' ')}**: {text}" for name, text in document["counting"].items()
    ]
    return [
        *lines,
        "",
        "## Running it",
        "",
        "```",
        "make bench                                   # the default run, about 20 minutes",
        "make bench BENCH_ARGS='--jobs 500 --rounds 1 --lanes 1,2'   # smoke, about 6 minutes "
        "(the backlog and second-layer parts keep their sizes)",
        ".venv/bin/python bench/run_bench.py --help   # every option",
        ".venv/bin/python bench/cold_start.py         # the cold start alone",
        ".venv/bin/python bench/scale_bench.py        # idle polling and fan-out alone, "
        "about 6 minutes",
        ".venv/bin/python bench/cold_start.py --update bench/results/latest.json  # re-measure it",
        ".venv/bin/python bench/second_layer_bench.py --update bench/results/latest.json"
        "  # the second layer's cost alone, about 4 minutes",
        ".venv/bin/python bench/flow_bench.py --update bench/results/latest.json"
        "  # what a limited job costs alone, about a minute",
        ".venv/bin/python bench/lane_processes.py     # N lanes as threads vs as processes, "
        "about 2 minutes",
        ".venv/bin/python bench/lane_processes.py --lanes 1,2,4 --jobs 9000 --rounds 1 "
        "--update bench/results/latest.json  # lanes on a fixed 9,000 messages, about 5 minutes",
        "make bench-many                              # many drains under a connection limit, "
        "direct and through PgBouncer, about a minute",
        ".venv/bin/python bench/report.py             # this page and the chart from latest.json",
        "```",
        "",
        "With `DATABASE_URL` set, that server is used (its role needs CREATEDB for the scratch "
        "databases); otherwise an embedded PostgreSQL. Servers listen on 127.0.0.1 or a unix "
        "socket only. The scripts run alone need the `bench` extra, which `make bench` "
        "installs (`.venv/bin/pip install -e '.[dev,bench]'`).",
        "",
        "## Caveats",
        "",
        "- Latency is a wait in the emulator before it answers: no bandwidth limit, jitter or "
        "TLS; every call also costs a loopback HTTP/1.1 exchange with a Python server (the "
        "standard library's threading HTTP server, one thread per connection).",
        f"- The emulator, PostgreSQL and the worker share {nproc} CPUs: the `machine busy` "
        "column shows when the machine, not the drain, was the limit.",
        "- One run, one figure per lane count, and the machine's speed drifts. On the 2-core "
        "machines of 2026-11-29 the same code drained 8 lanes at anywhere from about 2,100 to"
        " 3,000 msg/s; the cold start moves with the machine too, which is why it is also "
        "given against its dependencies' import floor from the same run. The CPU each message"
        " cost moved with it: the worker's 0.15-0.37 ms, the whole machine's 0.37-0.82 ms. In"
        " the slow phases the machine was about 85% busy at 8 lanes and its 2 CPUs, shared "
        "with the emulator and PostgreSQL, set the pace (8 lanes 5.8-6.0x, below the 6.4x "
        "target); in the fast ones 8 lanes kept pace with the latency (7.96x and 8.03x at "
        "51-61% busy). The `machine busy` and `machine CPU ms/msg` columns tell which phase a"
        " run met.",
        "- The protocol trace is on during measured drains (libpq writes each message to a "
        "buffered file; no difference in throughput was measurable); `--no-db-trace` turns it "
        "off.",
        "- (a) acks duplicates too (its `runOnce` returns true on a skip), so both variants make "
        "one consume per 10 messages and one ack per message.",
        "- Why the queue client keeps its own HTTP transport, and what the emulator's server "
        "costs: measured by hand in the framework repository's `bench/transport.md` "
        "(`make bench-transport`).",
        "- What preparing nothing on the server (the default, safe behind a transaction pooler) "
        "costs the ledger's statements on a direct connection: 0.90-0.95x their throughput with "
        "`DATABASE_PREPARED_STATEMENTS=true`, measured by hand in the framework repository's "
        "`bench/prepared_statements.md` (`bench/prepared_statements_bench.py`).",
        "",
    ]


def _cost_section(document: dict[str, Any]) -> list[str]:
    if "cost" not in document:
        return []
    machine = document.get("machine", {})
    start = machine.get("load_average_at_start")
    load = (
        f"load average {start[0]:g} on {machine['nproc']} CPUs at the start"
        if start
        else "load not recorded"
    )
    return cost.markdown(document["cost"], document["started_at"], load)


def summary_text(document: dict[str, Any]) -> str:
    a = document["variants"]["notes_loop"]["median"]
    b = document["variants"]["drain"]["median"]
    comparison = document["comparison"]
    parts = [
        f"(a) {a['messages_per_s']} msg/s, (b) {b['messages_per_s']} msg/s, "
        f"(b)/(a) {comparison['ratio_b_over_a']}x, "
        f"(b) {_fmt(100 * (comparison['b_fraction_of_ceiling'] or 0))}% of the "
        f"{comparison['single_lane_ceiling_msgs_per_s']} msg/s ceiling",
    ]
    for target in document["targets"]:
        parts.append(f"  {target['target']}: {target['measured']} ({_pass(target['pass'])})")
    for row in document.get("cost", {}).get("lanes", []):
        parts.append(
            f"  1,000,000 messages at {row['lanes']} lane(s): {row['gb_seconds']:,.1f} GB-s, "
            f"{row['requests']} requests, ${row['arm64_usd']:.4f} arm64 / "
            f"${row['x86_64_usd']:.4f} x86_64 in Lambda"
        )
    if "cost" in document:
        publish, saves = document["cost"]["infrai_publish_usd"], document["cost"]["outbox_saves"]
        parts.append(
            f"  Infrai publishes: ${publish:,.2f} per million; the outbox saves "
            f"${saves['publish_usd']:,.2f} of them at the stated producer retry rate"
        )
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Regenerate the chart and docs/performance.md.")
    parser.add_argument("results", nargs="?", type=Path, default=BENCH / "results" / "latest.json")
    parser.add_argument("--docs", type=Path, default=ROOT / "docs" / "performance.md")
    for name, default in cost.PRICES.items():
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            type=float,
            default=default,
            help="for the cost of a million jobs (%(default)s)",
        )
    args = parser.parse_args(argv)
    document = json.loads(args.results.read_text())
    prices = {name: getattr(args, name) for name in cost.PRICES}
    document["cost"] = cost.per_million(document, cost.DrainShape.from_template(), prices)
    chart = args.results.parent / "latest.png"
    write_chart(document, chart)
    args.docs.write_text(render_markdown(document, chart))
    print(summary_text(document))
    return 0


if __name__ == "__main__":
    sys.exit(main())
