"""What the ``receipt.send`` benchmarks share (``flow_bench.py``, ``second_layer_bench.py``).

Each of their drains runs ``--jobs`` ``receipt.send`` messages in a fresh worker process (the
``--worker`` mode of the benchmark's own file) against a fresh queue and a fresh scratch ledger
database. The job's effect is one HTTP POST to the local provider sink, which counts e-mails per
invoice, so every drain is checked for its e-mails as well as its claims and its queue. The
latency is injected on the emulator only while the worker drains.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, LiteralString

import psycopg

from infrai_jobs.queue.client import InfraiClient
from infrai_local.migrations import apply_migrations
from infrai_local.sandbox.embedded_db import postgres_server_url, scratch_database
from infrai_local.sandbox.queues import ensure_queue

from bench_env import API_KEY, EmulatorProcess, Workload, queue_stats, worker_result
from instruments import sample_busy_percent
from results_file import add_output_options

if TYPE_CHECKING:
    from infrai_local.sandbox import provider_sink

JOB = "receipt.send"
EFFECT = (
    "one HTTP POST /v1/mail/send to the local provider sink (loopback, no injected latency), "
    "counted per invoice by the sink"
)
_CHECK_CLAIMS: LiteralString = (
    "SELECT count(*), count(*) FILTER (WHERE state = 'done') FROM job_claims"
)


@dataclass(frozen=True)
class Setup:
    """What the measurement borrows: PostgreSQL, the emulator, a scratch folder."""

    server_url: str
    emulator: EmulatorProcess
    scratch: Path
    latency_ms: float
    timeout_s: float


@contextmanager
def bench_setup(scratch_prefix: str, latency_ms: float, timeout_s: float) -> Iterator[Setup]:
    """A scratch folder, PostgreSQL and the emulator for one benchmark; all ended after it."""
    with (
        tempfile.TemporaryDirectory(prefix=scratch_prefix) as scratch,
        postgres_server_url() as server_url,
    ):
        emulator = EmulatorProcess()
        try:
            yield Setup(server_url, emulator, Path(scratch), latency_ms, timeout_s)
        finally:
            emulator.stop()


def receipt_payloads(workload: Workload) -> list[dict[str, Any]]:
    """The benchmark's seeded publish order, as ``receipt.send`` jobs (one per invoice)."""
    return [
        {"job": JOB, "invoice_id": p["invoice_id"], "email": f"{p['invoice_id']}@example.com"}
        for p in workload.payloads()
    ]


def run_config(setup: Setup, workload: Workload, rounds: int) -> dict[str, Any]:
    """The start of a result's ``config``: the workload, the rounds, the job and its effect, and
    the latency injected into every Infrai call."""
    return {
        **workload.sizes(),
        "duplicate_share": workload.duplicate_share,
        "seed": workload.seed,
        "rounds": rounds,
        "job": JOB,
        "job_effect": "external",
        "effect": EFFECT,
        "latency_ms": setup.latency_ms,
    }


@dataclass(frozen=True)
class Stopwatch:
    """When a measurement started: on the calendar, and on the monotonic clock."""

    started_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    started: float = field(default_factory=time.monotonic)

    def stamp(self) -> dict[str, Any]:
        """A result's ``measured_at`` (when it started) and ``duration_s`` (until now)."""
        return {
            "measured_at": self.started_at.isoformat(timespec="seconds"),
            "duration_s": round(time.monotonic() - self.started, 1),
        }


@contextmanager
def prepared(setup: Setup, queue: str, workload: Workload) -> Iterator[str]:
    """A scratch ledger database and a queue holding the receipt jobs; yields the database."""
    with scratch_database(setup.server_url, prefix="infrai_bench") as database_url:
        with psycopg.connect(database_url, autocommit=True) as conn:
            apply_migrations(conn)
        setup.emulator.set_latency(0)
        client = InfraiClient(setup.emulator.url, API_KEY)
        try:
            ensure_queue(client, queue, dlq=f"{queue}-dlq")
            for payload in receipt_payloads(workload):
                client.publish(queue, payload)
        finally:
            client.close()
        yield database_url


# --- one drain in a worker process --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WorkerRun:
    result: dict[str, Any]  # the worker's own JSON result
    background_busy_pct: float | None  # the machine just before the drain
    mails: dict[str, int]  # e-mails the sink received during the drain, per invoice (none 0)


def run_worker_process(
    setup: Setup,
    script: Path,
    name: str,
    spec: Mapping[str, Any],
    sink: provider_sink.RunningSink,
    *,
    env: Mapping[str, str] | None = None,
) -> WorkerRun:
    """``script --worker`` on ``spec`` under the injected latency; its result and the e-mails."""
    spec_path = setup.scratch / f"{name}.spec.json"
    result_path = setup.scratch / f"{name}.result.json"
    log_path = setup.scratch / f"{name}.log"
    spec_path.write_text(json.dumps(spec))
    mails_before = Counter(sink.state.snapshot()["mails"])
    background = sample_busy_percent(0.5)
    setup.emulator.set_latency(setup.latency_ms)
    with log_path.open("w") as log:
        done = subprocess.run(
            [sys.executable, str(script), "--worker", str(spec_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            timeout=setup.timeout_s,
            check=False,
        )
    setup.emulator.set_latency(0)
    result = worker_result(name, done.returncode, log_path, result_path)
    mails = Counter(sink.state.snapshot()["mails"])
    mails.subtract(mails_before)
    return WorkerRun(result, background, {key: n for key, n in mails.items() if n})


def worker_mode(spec_path: Path, run_worker: Callable[[dict[str, Any]], dict[str, Any]]) -> int:
    """The ``--worker`` mode: one drain from the spec file, its result written beside it."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    spec = json.loads(spec_path.read_text())
    Path(str(spec_path).replace(".spec.json", ".result.json")).write_text(
        json.dumps(run_worker(spec))
    )
    return 0


def drain_checks(
    setup: Setup,
    queue: str,
    database_url: str,
    worker: WorkerRun,
    *,
    unique: int,
    expected_mails: int,
) -> tuple[dict[str, Any], bool]:
    """The checks every receipt drain makes, read from its ledger database, its queue and the
    e-mails its worker caused, and whether they pass: one ``done`` claim per distinct job, queue
    and DLQ empty, ``expected_mails`` e-mails and no invoice mailed twice."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        claims, claims_done = conn.execute(_CHECK_CLAIMS).fetchone() or (0, 0)
    stats = queue_stats(setup.emulator, queue)
    mails = worker.mails
    checks: dict[str, Any] = {
        "claims": claims,
        "claims_done": claims_done,
        "queue_left": stats.message_count,
        "dead_lettered": stats.dlq_count,
        "mails_sent": sum(mails.values()),
        "invoices_mailed_twice": sum(1 for n in mails.values() if n > 1),
    }
    ok = (
        claims == claims_done == unique
        and stats.message_count == 0
        and stats.dlq_count == 0
        and checks["mails_sent"] == expected_mails
        and checks["invoices_mailed_twice"] == 0
    )
    return checks, ok


def reported(result: dict[str, Any], details: str) -> dict[str, Any]:
    """``result``, once its drain's line is on stderr (its name and pace, ``details``, whether it
    was verified: ``result["verified"]``); a drain that was not stops the benchmark."""
    checks = result["verified"]
    print(
        f"  {result['name']}: {result['messages_per_s']} msg/s in {result['elapsed_s']} s, "
        f"{details}, verified {checks['ok']}",
        file=sys.stderr,
        flush=True,
    )
    if not checks["ok"]:
        raise RuntimeError(f"{result['name']}: the drain's result is wrong: {checks}")
    return result


def median(values: Sequence[float | None]) -> float | None:
    """The median of the values present, rounded to 3 places (None if there is none)."""
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 3) if present else None


# --- the command --------------------------------------------------------------------------------


def build_parser(
    prog: str, description: str, *, latency_help: str, rounds_help: str, stored_under: str
) -> argparse.ArgumentParser:
    """The options every receipt benchmark takes; ``stored_under``: its key in results files."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--jobs", type=int, default=1000, help="messages per drain (%(default)s)")
    parser.add_argument(
        "--duplicates", type=float, default=0.3, help="share of duplicate publishes (%(default)s)"
    )
    parser.add_argument("--latency-ms", type=float, default=25.0, help=latency_help)
    parser.add_argument("--rounds", type=int, default=2, help=rounds_help)
    parser.add_argument("--seed", type=int, default=9)
    parser.add_argument("--timeout-s", type=float, default=900, help="per drain")
    add_output_options(parser, stored_under=stored_under)
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    return parser


def command(
    args: argparse.Namespace,
    run_worker: Callable[[dict[str, Any]], dict[str, Any]],
    measure: Callable[[argparse.Namespace], tuple[dict[str, Any], str]],
) -> int:
    """A receipt benchmark's command: one drain in ``--worker`` mode; else what ``measure``
    gives (it stores the result with ``--update``): the result with ``--json``, else its text."""
    if args.worker is not None:
        return worker_mode(args.worker, run_worker)
    if args.rounds < 1 or args.jobs < 1:
        raise SystemExit("--rounds and --jobs must be at least 1")
    result, text = measure(args)
    print(json.dumps(result, indent=2) if args.json else text)
    return 0
