"""Many drains at once against one PostgreSQL that cannot give each the connections it wants.

    .venv/bin/python bench/many_drains.py [--drains 16] [--lanes 2] [--connection-limit 6]
        [--jobs 12000] [--latency-ms 25] [--modes direct,pgbouncer]
        [--update bench/results/latest.json]                       (``make bench-many``)

``--drains`` drain processes of ``--lanes`` lanes each, built as DrainFunction builds its drain
(``DrainService.from_settings`` from the environment, ``functions/jobs``' registry), are started,
set up, then released together on one queue of ``--jobs`` ``invoice.finalize`` messages, at
``--latency-ms`` per Infrai call (the emulator in its own process). They log in as a role whose
``CONNECTION LIMIT`` is ``--connection-limit``, below their naive demand (drains x lanes):

* ``direct``: straight to PostgreSQL, so the database refuses connections beyond the limit and
  each drain waits for its first connection or sheds the lanes it cannot open;
* ``pgbouncer``: through PgBouncer in ``pool_mode = transaction`` (Debian's package, started on
  127.0.0.1 by the pooler tests' own ``tests/integration/pgbouncer.py``) holding at most
  ``--connection-limit`` server connections, so every lane connects and the pooler queues their
  transactions.

Each mode gets a fresh queue and scratch database and is checked: every invoice's effect exactly
once (a trigger counts the job's UPDATEs), one ``done`` claim per distinct job, the queue and
its DLQ empty, no drain exited with an error. It reports per mode the drains that waited, gave
up as full or shed lanes, throughput (all drains, and per drain), and the claim latency: from
the moment a drain read the consume answer carrying a message to the moment the message's claim
row was inserted (``clock_timestamp()`` in a trigger on ``job_claims``), both on this machine's
clock, so a wait for a connection or for the pooler's server connection counts in it.

The table goes to stdout, the result to ``<out>/many-drains-<time>.json``; ``--update`` also
stores it under ``many_drains`` in results files and regenerates ``docs/performance.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any, LiteralString

import psycopg

from infrai_jobs.drain.fan_out import CountingQueue
from infrai_jobs.queue.models import QueueMessage
from infrai_jobs.queue.ports import QueuePort
from infrai_local.sandbox.embedded_db import postgres_server_url

from bench_env import (
    BENCH,
    EFFECTS_DDL,
    JOB,
    EmulatorProcess,
    PreparedRun,
    Workload,
    drain_env,
    prepared_run,
    queue_stats,
    recording_table,
)
from instruments import (
    busy_percent,
    latency_summary,
    machine_cpu_ticks,
    pid_cpu_seconds,
    postmaster_pid,
    sample_busy_percent,
    server_cpu_seconds,
)
from results_file import Span, add_output_options, measured_by, update_results

# The limited role and the pooler come from the integration tests' own helpers, so that the
# benchmark and the tests make them one way.
sys.path.append(str(Path(__file__).resolve().parents[1] / "tests" / "integration"))
from connection_limit import limited_role
from pgbouncer import pgbouncer_binary, running_pgbouncer

MODES = ("direct", "pgbouncer")
STORED_UNDER = "many_drains"

# Each effect (EFFECTS_DDL), and each claim row inserted, stamped with the server's clock at
# that moment.
_TRACKING_DDL = EFFECTS_DDL + recording_table(
    "bench_claims",
    "idem_key text NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp()",
    "INSERT INTO bench_claims (idem_key) VALUES (NEW.idem_key)",
    "INSERT ON job_claims FOR EACH ROW",
)
_VERIFY: LiteralString = """
SELECT (SELECT count(*) FROM invoices WHERE status = 'final'
            AND total_cents = 1000 + right(id, 7)::int),
       (SELECT count(*) FROM (SELECT id FROM bench_effects GROUP BY id HAVING count(*) = 1) o),
       (SELECT count(*) FROM bench_effects),
       (SELECT count(*) FROM job_claims),
       (SELECT count(*) FROM job_claims WHERE state = 'done')
"""
_CLAIM_TIMES: LiteralString = "SELECT idem_key, extract(epoch FROM at)::float8 FROM bench_claims"


# --- what the drains' results come to (pure: tests/unit/test_bench_many_drains.py) -------------


def claim_latencies_ms(
    receives: Iterable[tuple[str, float]], claims: Mapping[str, float]
) -> tuple[list[float], int]:
    """Per claimed invoice, milliseconds from the last time a drain read one of its messages
    before the claim (a duplicate publish or a redelivery is read again) to the claim; and how
    many claims had no such read (0 unless the clocks disagree)."""
    reads: dict[str, list[float]] = {}
    for invoice, at in receives:
        reads.setdefault(invoice, []).append(at)
    latencies: list[float] = []
    unmatched = 0
    for invoice, claimed_at in claims.items():
        before = [at for at in reads.get(invoice, ()) if at <= claimed_at]
        if before:
            latencies.append((claimed_at - max(before)) * 1000)
        else:
            unmatched += 1
    return sorted(latencies), unmatched


def _spread(values: Sequence[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {
        "median": round(statistics.median(values), 1),
        "min": round(min(values), 1),
        "max": round(max(values), 1),
    }


def mode_figures(drains: Sequence[Mapping[str, Any]], lanes: int, wall_s: float) -> dict[str, Any]:
    """What a mode's drains did together, from each drain's record (``drain_record``)."""
    finished = [d for d in drains if d["exit_code"] == 0]
    working = [d for d in finished if d["consumed"] > 0]
    consumed = sum(d["consumed"] for d in finished)
    return {
        "drains": len(drains),
        "drains_exited_with_error": len(drains) - len(finished),
        "drains_that_waited": sum(1 for d in finished if d["connection_waits"] > 0),
        "drains_gave_up_full": sum(1 for d in finished if d["stopped"] == "database_full"),
        "lanes_shed": sum(d["lanes_shed"] for d in finished),
        "drains_that_consumed": len(working),
        "lanes_that_ran": sum(lanes - d["lanes_shed"] for d in working),
        "consumed": consumed,
        "retried": sum(d["retried"] for d in finished),
        "failed": sum(d["failed"] for d in finished),
        "wall_s": round(wall_s, 2),
        "messages_per_s": round(consumed / wall_s, 1) if wall_s > 0 else None,
        "per_drain_messages_per_s": _spread([d["messages_per_s"] for d in working]),
        "drain_cpu_s": round(sum(d["cpu_s"] for d in finished), 2),
    }


def drain_record(index: int, exit_code: int, output: Mapping[str, Any] | None) -> dict[str, Any]:
    """One drain process's row: its exit code and, when it wrote its result, what it did."""
    if output is None:
        return {
            "drain": index,
            "exit_code": exit_code,
            "consumed": 0,
            "stopped": "error",
            "lanes_shed": 0,
            "connection_waits": 0,
            "retried": 0,
            "failed": 0,
            "messages_per_s": 0.0,
            "cpu_s": 0.0,
        }
    summary = output["summary"]
    elapsed = output["ended"] - output["started"]
    return {
        "drain": index,
        "exit_code": exit_code,
        "consumed": summary["consumed"],
        "done": summary["done"],
        "duplicates": summary["duplicates"],
        "retried": summary["retried"],
        "failed": summary["failed"],
        "stopped": summary["stopped"],
        "database_full": summary["database_full"],
        "lanes_shed": summary["lanes_shed"],
        "connection_waits": output["actions"].get("connection_wait", 0),
        "warnings_by_action": output["actions"],
        "elapsed_s": round(elapsed, 3),
        "messages_per_s": round(summary["consumed"] / elapsed, 1) if elapsed > 0 else 0.0,
        "cpu_s": round(output["cpu_s"], 3),
    }


_TABLE_ROWS: tuple[tuple[str, Any], ...] = (
    ("drains exited with an error", lambda m: m["figures"]["drains_exited_with_error"]),
    ("drains that waited for a connection", lambda m: m["figures"]["drains_that_waited"]),
    (
        "drains that gave up as full (nothing received)",
        lambda m: m["figures"]["drains_gave_up_full"],
    ),
    ("lanes shed", lambda m: m["figures"]["lanes_shed"]),
    ("drains that drained messages", lambda m: m["figures"]["drains_that_consumed"]),
    ("their lanes", lambda m: m["figures"]["lanes_that_ran"]),
    ("messages consumed", lambda m: f"{m['figures']['consumed']:,}"),
    ("messages retried (a delivery spent)", lambda m: m["figures"]["retried"]),
    ("jobs done exactly once", lambda m: _of(m["verified"], "effects_once", "unique_jobs")),
    ("dead-lettered (dlq_count)", lambda m: m["verified"]["dead_lettered"]),
    ("left in the queue", lambda m: m["verified"]["queue_left"]),
    ("wall time, s", lambda m: _num(m["figures"]["wall_s"], 2)),
    ("messages per second, all drains", lambda m: _num(m["figures"]["messages_per_s"])),
    ("per drain that drained, median (min-max)", lambda m: _spread_text(m["figures"])),
    ("claim latency p50, ms", lambda m: _num(m["claim_latency_ms"]["p50"])),
    ("claim latency p99, ms", lambda m: _num(m["claim_latency_ms"]["p99"])),
    ("claim latency max, ms", lambda m: _num(m["claim_latency_ms"]["max"])),
    ("CPU s: drains / emulator / PostgreSQL / PgBouncer", lambda m: _cpu_text(m["cpu"])),
    ("machine busy, % of all CPUs", lambda m: _num(m["cpu"]["machine_busy_pct"])),
    (
        "machine busy just before (other work), %",
        lambda m: _num(m["cpu"].get("background_busy_pct")),
    ),
    ("verified", lambda m: "yes" if m["verified"]["ok"] else "NO"),
)


def _num(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def _of(checks: Mapping[str, Any], part: str, whole: str) -> str:
    return f"{checks[part]:,} of {checks[whole]:,}"


def _spread_text(figures: Mapping[str, Any]) -> str:
    spread = figures["per_drain_messages_per_s"]
    if spread is None:
        return "n/a"
    return f"{spread['median']:,.1f} ({spread['min']:,.1f}-{spread['max']:,.1f})"


def _cpu_text(cpu: Mapping[str, Any]) -> str:
    parts = [cpu.get(k) for k in ("drains_s", "emulator_s", "postgres_s", "pgbouncer_s")]
    return " / ".join("-" if v is None else f"{v:.1f}" for v in parts)


def table_rows(result: Mapping[str, Any]) -> list[list[str]]:
    """The comparison as rows of cells: a heading row, then one row per figure, one column per
    mode measured."""
    modes = [result["modes"][name] for name in result["modes"]]
    rows = [["", *result["modes"]]]
    rows += [[label, *(str(cell(mode)) for mode in modes)] for label, cell in _TABLE_ROWS]
    return rows


def table_text(result: Mapping[str, Any]) -> str:
    """The comparison as aligned plain text, for a terminal."""
    rows = table_rows(result)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(
            cell.ljust(width) if i == 0 else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    )


def markdown(result: Mapping[str, Any]) -> list[str]:
    """Its section of ``docs/performance.md`` (``report.py`` renders it when a results file
    holds one)."""
    config = result["config"]
    rows = table_rows(result)
    lines = [
        "## Many drains at once (issue 47)",
        "",
        measured_by("many_drains.py", result, config["nproc"])
        + f"{config['drains']} drain processes of `DRAIN_LANES={config['lanes']}`, each built as "
        "DrainFunction builds its drain (`DrainService.from_settings`), set up and then released "
        f"together on one queue of {config['jobs']:,} `{config['job']}` messages "
        f"({config['unique_jobs']:,} distinct jobs + {config['duplicate_publishes']:,} duplicate "
        f"publishes), {config['latency_ms']:g} ms injected into every Infrai call. They log in as "
        f"a role whose `CONNECTION LIMIT` is {config['connection_limit']}, against a naive demand "
        f"of {config['drains'] * config['lanes']} connections: **direct** to PostgreSQL, and "
        f"through **pgbouncer** ({config.get('pgbouncer_version') or 'PgBouncer'}, "
        f"`pool_mode = transaction`, at most {config['pool_size']} server connections). A fresh "
        "queue and ledger database per mode; a trigger counts each invoice's effect and another "
        "stamps each claim row.",
        "",
        "| " + " | ".join(rows[0]) + " |",
        "| --- |" + " ---: |" * (len(rows[0]) - 1),
        *("| " + " | ".join(row) + " |" for row in rows[1:]),
        "",
        *_findings(result),
        "Claim latency: per distinct job, from the last time a drain read one of its messages "
        "(the consume answer that carried it) before its claim row was inserted, to that "
        "insert (`clock_timestamp()` in a trigger on `job_claims`), both on this machine's "
        "clock. It holds the batch's own work before the claim statement and any wait for the "
        "database, which through the pooler is a wait for one of its server connections; a "
        "drain's wait for its first connection is not in it, as it receives nothing before.",
        "",
        "Reproduce with `make bench-many` (the same as `.venv/bin/python bench/many_drains.py "
        "--update bench/results/latest.json`; `--help` for the sizes).",
        "",
    ]
    return lines


# What one mode's figures say, a sentence each (``_findings``).
_MODE_SENTENCES = {
    "direct": "Directly, the limit let {drains_that_consumed} of {drains} drains drain, with "
    "{lanes_that_ran} lanes between them ({lanes_shed} shed); {drains_that_waited} waited for a "
    "connection, {drains_gave_up_full} gave up as full having received nothing, "
    "{drains_exited_with_error} exited with an error.",
    "pgbouncer": "Through PgBouncer all {lanes_that_ran} lanes of {drains_that_consumed} drains "
    "ran on at most {pool_size} server connections, {drains_exited_with_error} drains exited "
    "with an error.",
}


def _findings(result: Mapping[str, Any]) -> list[str]:
    """What the table says, in a sentence per mode and one comparing them."""
    modes = result["modes"]
    sentences = [
        template.format(**modes[mode]["figures"], pool_size=result["config"]["pool_size"])
        for mode, template in _MODE_SENTENCES.items()
        if mode in modes
    ]
    if "direct" in modes and "pgbouncer" in modes:
        direct, pooled = modes["direct"], modes["pgbouncer"]
        rates = (direct["figures"]["messages_per_s"], pooled["figures"]["messages_per_s"])
        if all(rates):
            sentences.append(
                f"On this machine's CPUs the pooled fleet drained {rates[1] / rates[0]:.2f}x "
                "the direct one's messages per second, its claims waiting longer for a server "
                f"connection (p99 {pooled['claim_latency_ms']['p99']:,.1f} ms against "
                f"{direct['claim_latency_ms']['p99']:,.1f} ms)."
            )
    return [" ".join(sentences), ""] if sentences else []


# --- one drain process (``--drain SPEC``) -------------------------------------------------------


class ReceiveTimes(CountingQueue):
    """The queue port, noting when the drain read each message (its ``invoice_id``): when a
    consume's answer was read, which for a consume sent ahead is when the drain asked for it.
    The fan-out's counting wrapper already sees every answer as it is read, both for a consume
    and for one sent ahead: this notes the time at that same point."""

    def __init__(self, inner: QueuePort) -> None:
        super().__init__(inner)
        self.reads: list[tuple[str, float]] = []

    def _count(self, messages: list[QueueMessage]) -> list[QueueMessage]:
        now = time.time()
        for message in messages:
            payload = message.payload
            if isinstance(payload, dict) and isinstance(payload.get("invoice_id"), str):
                self.reads.append((payload["invoice_id"], now))  # list.append: thread-safe
        return super()._count(messages)


class ActionCounter(logging.Handler):
    """Counts the package's warnings and errors by their ``action`` word (``connection_wait``,
    ``lanes_shed``, ``database_full``, ...)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.counts: Counter[str] = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        self.counts[str(getattr(record, "action", "other"))] += 1


def drain_process(spec_path: Path) -> int:
    """Build the drain from the environment, say it is ready, wait for the start, drain once and
    write what it did. A drain that raises exits with an error, as its invocation would fail."""
    import jobs  # noqa: PLC0415
    from infrai_jobs.config.settings import DrainSettings  # noqa: PLC0415
    from infrai_jobs.ledger.job_schema import job_migrations_in  # noqa: PLC0415
    from infrai_jobs.runtime.drain_service import DrainService  # noqa: PLC0415
    from jobs import build_registry  # noqa: PLC0415

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    actions = ActionCounter()
    logging.getLogger("infrai_jobs").addHandler(actions)
    spec = json.loads(spec_path.read_text())
    registry = build_registry()
    settings = DrainSettings.from_env(
        job_settings=registry.declared_settings(), job_secrets=registry.declared_secrets()
    )
    service = DrainService.from_settings(
        settings, registry, job_migrations=job_migrations_in(Path(str(jobs.__file__)).parent)
    )
    receives = ReceiveTimes(service.queue)
    service.queue = receives
    Path(spec["ready"]).touch()
    go = Path(spec["go"])
    while not go.exists():
        time.sleep(0.005)
    budget_s = float(spec["time_budget_s"])
    started, cpu0 = time.time(), time.process_time()
    try:
        summary = service.run(lambda: int((started + budget_s - time.time()) * 1000))
    finally:
        ended, cpu1 = time.time(), time.process_time()
        service.close()
    Path(spec["result"]).write_text(
        json.dumps(
            {
                "summary": summary.as_dict(),
                "started": started,
                "ended": ended,
                "cpu_s": cpu1 - cpu0,
                "actions": dict(actions.counts),
                "receives": receives.reads,
            }
        )
    )
    return 0


# --- the role, the pooler, the drains -----------------------------------------------------------


def pgbouncer_version() -> str | None:
    binary = pgbouncer_binary()
    if binary is None:
        return None
    done = subprocess.run([binary, "--version"], capture_output=True, text=True, check=False)
    return done.stdout.split("\n", 1)[0].strip() or None


def run_drains(
    env: Mapping[str, str], count: int, folder: Path, budget_s: float
) -> tuple[list[tuple[int, dict[str, Any] | None, str]], float]:
    """``count`` drain processes, started and set up, then released together; each one's exit
    code, its result (None if it wrote none) and its log's tail, and the wall time from the
    release to the last one's end."""
    folder.mkdir()
    go = folder / "go"
    children = []
    for index in range(count):
        spec = {
            "go": str(go),
            "ready": str(folder / f"{index}.ready"),
            "result": str(folder / f"{index}.result.json"),
            "time_budget_s": budget_s,
        }
        spec_path = folder / f"{index}.spec.json"
        spec_path.write_text(json.dumps(spec))
        with (folder / f"{index}.log").open("w") as log:
            children.append(
                subprocess.Popen(
                    [sys.executable, __file__, "--drain", str(spec_path)],
                    env=dict(env),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
    deadline = time.monotonic() + 120
    for index, child in enumerate(children):
        while not (folder / f"{index}.ready").exists() and child.poll() is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"drain {index} was not ready in 120 s")
            time.sleep(0.02)
    released = time.time()
    go.touch()
    for child in children:
        try:
            child.wait(timeout=budget_s + 60)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    wall = time.time() - released
    outcomes = []
    for index, child in enumerate(children):
        result_path = folder / f"{index}.result.json"
        output = json.loads(result_path.read_text()) if result_path.exists() else None
        tail = "\n".join((folder / f"{index}.log").read_text().strip().splitlines()[-20:])
        outcomes.append((child.returncode, output, tail))
    return outcomes, wall


def _verify(run: PreparedRun, emulator: EmulatorProcess) -> dict[str, Any]:
    emulator.set_latency(0)
    with psycopg.connect(run.database_url, autocommit=True) as conn:
        row = conn.execute(_VERIFY).fetchone()
    assert row is not None
    right, once, effects, claims, done = (int(v) for v in row)
    stats = queue_stats(emulator, run.queue)
    unique = run.workload.unique
    checks: dict[str, Any] = {
        "unique_jobs": unique,
        "invoices_final_with_right_amount": right,
        "effects_once": once,
        "effects": effects,
        "claims": claims,
        "claims_done": done,
        "queue_left": stats.message_count,
        "dead_lettered": stats.dlq_count,
    }
    checks["ok"] = (
        right == once == effects == claims == done == unique
        and stats.message_count == 0
        and stats.dlq_count == 0
    )
    return checks


def measure_mode(
    server_url: str, emulator: EmulatorProcess, scratch: Path, mode: str, args: argparse.Namespace
) -> dict[str, Any]:
    workload = Workload(args.jobs, args.duplicates, args.seed)
    print(f"{mode}: publishing {workload.messages:,} messages", file=sys.stderr, flush=True)
    with prepared_run(server_url, emulator, f"bench-many-{mode}", workload) as run:
        with psycopg.connect(run.database_url, autocommit=True) as conn:
            conn.execute(_TRACKING_DDL)
        postgres = postmaster_pid(server_url)
        with ExitStack() as stack:
            url = stack.enter_context(limited_role(run.database_url, args.connection_limit))
            pooler_pid: int | None = None
            if mode == "pgbouncer":
                pooler = stack.enter_context(
                    running_pgbouncer(
                        url,
                        pool_size=args.pool_size or args.connection_limit,
                        max_clients=args.drains * (args.lanes + 1) + 10,
                    )
                )
                url, pooler_pid = pooler.url_for(url), pooler.pid
            env = drain_env(emulator, url, run.queue, DRAIN_LANES=str(args.lanes))
            print(
                f"{mode}: {args.drains} drains of {args.lanes} lanes, connection limit "
                f"{args.connection_limit}",
                file=sys.stderr,
                flush=True,
            )
            background = sample_busy_percent(0.5)
            emulator.set_latency(args.latency_ms)
            cpu0, ticks0 = _cpu_snapshot(emulator.pid, postgres, pooler_pid), machine_cpu_ticks()
            outcomes, wall = run_drains(env, args.drains, scratch / mode, args.time_budget_s)
            ticks1, cpu1 = machine_cpu_ticks(), _cpu_snapshot(emulator.pid, postgres, pooler_pid)
            emulator.set_latency(0)
        verified = _verify(run, emulator)
        with psycopg.connect(run.database_url, autocommit=True) as conn:
            claims = dict(conn.execute(_CLAIM_TIMES).fetchall())
    drains = [drain_record(i, code, output) for i, (code, output, _) in enumerate(outcomes)]
    receives = [
        (invoice, at) for _, output, _ in outcomes if output for invoice, at in output["receives"]
    ]
    prefix = f"{JOB}:"
    latencies, unmatched = claim_latencies_ms(
        receives, {key.removeprefix(prefix): at for key, at in claims.items()}
    )
    figures = mode_figures(drains, args.lanes, wall)
    cpu = {
        key: round(cpu1[key] - cpu0[key], 2)
        for key in cpu0
        if cpu0[key] is not None and cpu1[key] is not None
    }
    cpu["drains_s"] = figures["drain_cpu_s"]
    cpu["machine_busy_pct"] = busy_percent(ticks0, ticks1)
    cpu["background_busy_pct"] = background
    errors = [
        {"drain": i, "exit_code": code, "log_tail": tail}
        for i, (code, _, tail) in enumerate(outcomes)
        if code != 0
    ]
    verified["ok"] = verified["ok"] and not errors
    result = {
        "figures": figures,
        "claim_latency_ms": {**latency_summary(latencies), "unmatched": unmatched},
        "cpu": cpu,
        "verified": verified,
        "errors": errors,
        "drains": drains,
    }
    print(
        f"  {mode}: {figures['consumed']:,} consumed in {figures['wall_s']} s by "
        f"{figures['drains_that_consumed']} drains, {figures['drains_exited_with_error']} "
        f"errors, claim p99 {result['claim_latency_ms']['p99']} ms, verified {verified['ok']}",
        file=sys.stderr,
        flush=True,
    )
    return result


def _cpu_snapshot(emulator: int, postgres: int | None, pooler: int | None) -> dict[str, Any]:
    return {
        "emulator_s": pid_cpu_seconds(emulator),
        "postgres_s": server_cpu_seconds(postgres) if postgres else None,
        "pgbouncer_s": pid_cpu_seconds(pooler) if pooler else None,
    }


# --- the command --------------------------------------------------------------------------------


def _modes(text: str) -> list[str]:
    modes = [part.strip() for part in text.split(",") if part.strip()]
    unknown = set(modes) - set(MODES)
    if not modes or unknown:
        raise argparse.ArgumentTypeError(f"modes are {', '.join(MODES)}")
    return modes


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="many_drains.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--drains", type=int, default=16, help="drain processes (%(default)s)")
    parser.add_argument("--lanes", type=int, default=2, help="DRAIN_LANES of each (%(default)s)")
    parser.add_argument(
        "--connection-limit", type=int, default=6, help="the role's CONNECTION LIMIT (%(default)s)"
    )
    parser.add_argument(
        "--pool-size", type=int, default=0, help="PgBouncer's server connections (the limit)"
    )
    parser.add_argument("--jobs", type=int, default=12_000, help="messages (%(default)s)")
    parser.add_argument(
        "--duplicates", type=float, default=0.3, help="share of duplicate publishes (%(default)s)"
    )
    parser.add_argument("--latency-ms", type=float, default=25.0, help="per Infrai call")
    parser.add_argument("--seed", type=int, default=9)
    parser.add_argument("--modes", type=_modes, default=list(MODES), help="direct,pgbouncer")
    parser.add_argument(
        "--time-budget-s", type=float, default=120, help="each drain's time (%(default)s)"
    )
    parser.add_argument("--out", type=Path, default=BENCH / "results")
    add_output_options(parser, stored_under=STORED_UNDER)
    parser.add_argument("--drain", type=Path, help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.drain is not None:
        return drain_process(args.drain)
    if "pgbouncer" in args.modes and pgbouncer_binary() is None:
        raise SystemExit("pgbouncer is not installed: run `make pgbouncer` (Debian's package)")
    span = Span()
    workload = Workload(args.jobs, args.duplicates, args.seed)
    modes: dict[str, Any] = {}
    with (
        tempfile.TemporaryDirectory(prefix="infrai-many-drains-") as scratch,
        postgres_server_url() as server_url,
    ):
        emulator = EmulatorProcess()
        try:
            for mode in args.modes:
                modes[mode] = measure_mode(server_url, emulator, Path(scratch), mode, args)
        finally:
            emulator.stop()
    result = {
        **span.times(),
        "config": {
            "drains": args.drains,
            "lanes": args.lanes,
            "connection_limit": args.connection_limit,
            "pool_size": args.pool_size or args.connection_limit,
            "pgbouncer_version": pgbouncer_version() if "pgbouncer" in args.modes else None,
            **workload.sizes(),
            "seed": args.seed,
            "job": JOB,
            "latency_ms": args.latency_ms,
            "time_budget_s": args.time_budget_s,
            "nproc": len(os.sched_getaffinity(0)),
        },
        "modes": modes,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"many-drains-{span.started_at.strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}", file=sys.stderr)
    if args.update:
        update_results(args.update, lambda _path, document: document.update({STORED_UNDER: result}))
    print(json.dumps(result, indent=2) if args.json else table_text(result))
    return 0 if all(m["verified"]["ok"] for m in modes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
