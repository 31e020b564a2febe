"""The benchmark's world: the emulator in its own process, a fresh database per run, the jobs.

The emulator runs as a child process (``python -m infrai_local.sandbox.emulator``) so its request
handling never competes with the measured drain for a GIL. Latency is injected through its
fault surface (``POST /_emulator/faults``) only while a drain is measured: publishing and
checking run without it. Every run gets a fresh queue and a fresh scratch database migrated with
the project's own migrations, so both variants use the same ``job_claims`` table.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, LiteralString

import psycopg
import urllib3

from infrai_jobs.queue.client import InfraiClient
from infrai_jobs.queue.models import QueueStats
from infrai_local.migrations import apply_migrations, jobs_migrations_folder, read_migrations
from infrai_local.sandbox.embedded_db import scratch_database
from infrai_local.sandbox.queues import ensure_queue

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
JOBS_PATH = ROOT / "functions"
sys.path.insert(0, str(JOBS_PATH))

API_KEY = "bench-key"
JOB = "invoice.finalize"
# The example jobs' downstream; invoice.finalize never calls it.
PROVIDER_URL = "http://127.0.0.1:9"

_INSERT_INVOICES: LiteralString = """
INSERT INTO invoices (id)
SELECT 'inv_' || lpad(g::text, 7, '0') FROM generate_series(0, %(count)s - 1) AS g
"""
_CHECK_INVOICES: LiteralString = """
SELECT count(*) FILTER (WHERE status = 'final'),
       count(*) FILTER (WHERE status = 'final' AND total_cents = 1000 + right(id, 7)::int)
FROM invoices
"""
_CHECK_CLAIMS: LiteralString = """
SELECT count(*), count(*) FILTER (WHERE state = 'done') FROM job_claims
"""


def recording_table(
    name: LiteralString, columns: LiteralString, insert: LiteralString, after: LiteralString
) -> LiteralString:
    """DDL for a table ``name`` (``columns``) that a trigger fills by ``insert`` after each
    ``after`` (e.g. ``UPDATE ON invoices FOR EACH ROW``): what a bench reads back to time and
    count what happened in the database, stamped by the server's clock."""
    return f"""
CREATE TABLE {name} ({columns});
CREATE FUNCTION {name}_record() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    {insert};
    RETURN NULL;
END $$;
CREATE TRIGGER {name}_record AFTER {after} EXECUTE FUNCTION {name}_record();
"""


# The effect's moment and count: one row in bench_effects per committed UPDATE of an invoice, so
# a double effect shows as two rows for one invoice.
EFFECTS_DDL = recording_table(
    "bench_effects",
    "id text NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp()",
    "INSERT INTO bench_effects (id) VALUES (NEW.id)",
    "UPDATE ON invoices FOR EACH ROW",
)

# The ledger's tables come with apply_migrations; the invoices table is the invoice job's own
# migration, applied the way `infrai-jobs migrate` applies it.
JOB_MIGRATIONS = read_migrations(jobs_migrations_folder(JOBS_PATH))


def invoice_id(index: int) -> str:
    return f"inv_{index:07d}"


@dataclass(frozen=True, slots=True)
class Workload:
    """``messages`` publishes: ``unique`` distinct invoices, the rest duplicate publishes."""

    messages: int
    duplicate_share: float
    seed: int

    @property
    def duplicates(self) -> int:
        return round(self.messages * self.duplicate_share)

    @property
    def unique(self) -> int:
        return self.messages - self.duplicates

    def sizes(self) -> dict[str, int]:
        """The sizes a result's config records."""
        return {
            "jobs": self.messages,
            "unique_jobs": self.unique,
            "duplicate_publishes": self.duplicates,
        }

    def payloads(self) -> list[dict[str, Any]]:
        """The same seeded publish order for every run with this workload."""
        rng = random.Random(self.seed)
        indexes = list(range(self.unique))
        indexes += [rng.randrange(self.unique) for _ in range(self.duplicates)]
        rng.shuffle(indexes)
        return [
            {"job": JOB, "invoice_id": invoice_id(i), "amount_cents": 1000 + i} for i in indexes
        ]


class EmulatorProcess:
    """``python -m infrai_local.sandbox.emulator`` on 127.0.0.1, a free port, stopped by
    ``stop()``."""

    def __init__(self) -> None:
        # Its stderr, for the error message when it fails to start; closed by stop().
        self._log: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115
        self._process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "infrai_local.sandbox.emulator",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
            ],
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )
        assert self._process.stdout is not None
        self.url = self._process.stdout.readline().strip()
        if not self.url.startswith("http://127.0.0.1:"):
            self.stop(keep_log=True)
            self._log.seek(0)
            stderr = self._log.read().decode(errors="replace")[-2000:]
            self._log.close()
            raise RuntimeError(f"the emulator did not start (first line {self.url!r}): {stderr}")
        self.pid = self._process.pid
        self._http = urllib3.PoolManager(retries=False, timeout=10.0)

    def set_latency(self, latency_ms: float) -> None:
        body = {"latency_ms": latency_ms} if latency_ms else {}
        self._control("POST", "/_emulator/faults", body)

    def requests(self) -> Counter[str]:
        state = self._control("GET", "/_emulator/state", None)
        return Counter({route: int(n) for route, n in state["requests"].items()})

    def _control(self, method: str, path: str, body: Any) -> Any:
        response = self._http.request(
            method, self.url + path, body=None if body is None else json.dumps(body).encode()
        )
        document = json.loads(response.data)
        if response.status != 200 or not document.get("ok"):
            raise RuntimeError(f"emulator {method} {path} answered {response.status}: {document}")
        return document["data"]

    def stop(self, *, keep_log: bool = False) -> None:
        """End the emulator this object started (SIGTERM, then SIGKILL after 10 s)."""
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        if self._process.stdout is not None:
            self._process.stdout.close()
        if not keep_log:
            self._log.close()


@dataclass(frozen=True, slots=True)
class PreparedRun:
    database_url: str
    queue: str
    workload: Workload


@contextmanager
def prepared_run(
    server_url: str, emulator: EmulatorProcess, queue: str, workload: Workload
) -> Iterator[PreparedRun]:
    """A scratch database with the ledger schema and the invoices, and a queue holding the jobs."""
    with scratch_database(server_url, prefix="infrai_bench") as database_url:
        with psycopg.connect(database_url, autocommit=True) as conn:
            apply_migrations(conn, JOB_MIGRATIONS)
            conn.execute(_INSERT_INVOICES, {"count": workload.messages})
            conn.execute("VACUUM ANALYZE invoices")
        emulator.set_latency(0)
        client = InfraiClient(emulator.url, API_KEY)
        try:
            ensure_queue(client, queue, dlq=f"{queue}-dlq")
            for payload in workload.payloads():
                client.publish(queue, payload)
        finally:
            client.close()
        yield PreparedRun(database_url, queue, workload)


def drain_env(
    emulator: EmulatorProcess, database_url: str, queue: str, **extra: str
) -> dict[str, str]:
    """This process's environment with what a drain of ``queue`` reads: the emulator, the
    database, every setting the example jobs declare (at ``PROVIDER_URL``), and ``extra``."""
    from jobs import build_registry  # noqa: PLC0415 - only the scripts that start drains need it

    job_settings = dict.fromkeys(build_registry().declared_settings(), PROVIDER_URL)
    return {
        **os.environ,
        **job_settings,
        "INFRAI_BASE_URL": emulator.url,
        "INFRAI_API_KEY": API_KEY,
        "INFRAI_QUEUE": queue,
        "INFRAI_DLQ": f"{queue}-dlq",
        "DATABASE_URL": database_url,
        **extra,
    }


def queue_stats(emulator: EmulatorProcess, queue: str) -> QueueStats:
    client = InfraiClient(emulator.url, API_KEY)
    try:
        return client.stats(queue)
    finally:
        client.close()


def verify(run: PreparedRun, emulator: EmulatorProcess) -> dict[str, Any]:
    """After a drain: each invoice finalised with its amount, each claim done, the queue empty."""
    emulator.set_latency(0)
    with psycopg.connect(run.database_url, autocommit=True) as conn:
        final, right_amount = conn.execute(_CHECK_INVOICES).fetchone() or (0, 0)
        claims, done = conn.execute(_CHECK_CLAIMS).fetchone() or (0, 0)
    stats = queue_stats(emulator, run.queue)
    unique = run.workload.unique
    checks = {
        "invoices_final": final,
        "invoices_with_right_amount": right_amount,
        "claims": claims,
        "claims_done": done,
        "queue_left": stats.message_count,
        "dead_lettered": stats.dlq_count,
    }
    checks["ok"] = (
        final == right_amount == claims == done == unique
        and stats.message_count == 0
        and stats.dlq_count == 0
    )
    return checks


def worker_result(name: str, returncode: int, log_path: Path, result_path: Path) -> dict[str, Any]:
    """A finished worker's JSON result; its log's tail is shown, and a failure raised with it."""
    worker_log = log_path.read_text()
    if returncode != 0:
        raise RuntimeError(f"{name}: worker exited {returncode}:\n{worker_log[-4000:]}")
    if worker_log.strip():
        tail = "\n".join(worker_log.strip().splitlines()[-10:])
        print(f"  ({name}: the worker logged:)\n{tail}", file=sys.stderr)
    result: dict[str, Any] = json.loads(result_path.read_text())
    return result
