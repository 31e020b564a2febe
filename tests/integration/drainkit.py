"""A harness for drain tests: the emulator over HTTP, a migrated ledger in a real PostgreSQL, the
framework tests' fixture jobs (``fixture_jobs``, never the team's ``functions/jobs``) and a few
test jobs whose effects can be counted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fixture_jobs
import psycopg
import pytest
import urllib3
from aws_lambda_powertools import Metrics
from child_process import run_captured
from job_modes import fail_as_asked

from infrai_jobs.config.settings import DrainSettings
from infrai_jobs.drain.loop import drain
from infrai_jobs.drain.model import DrainConfig, DrainSummary
from infrai_jobs.jobs.registry import Effect, JobContext, JobRegistry, JsonValue, Payload
from infrai_jobs.operations.alerting import AlertReport
from infrai_jobs.queue.client import HttpRetryPolicy, InfraiClient
from infrai_jobs.queue.transport import PoolOptions
from infrai_jobs.runtime.drain_service import DrainService, drain_features
from infrai_jobs.runtime.observability import record_alert_check
from infrai_jobs.work import store as flow
from infrai_jobs.work.ledger import PostgresLedger
from infrai_jobs.work.states import ClaimRow
from infrai_jobs.work.store import DeferredWork
from infrai_local.migrations import (
    LEDGER_MIGRATIONS,
    apply_migrations,
    jobs_migrations_folder,
    read_migrations,
)
from infrai_local.sandbox import emulator as emulator_module
from infrai_local.sandbox import provider_sink
from infrai_local.sandbox.queues import ensure_queue

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
INFRAI_JOBS = str(Path(sys.executable).parent / "infrai-jobs")
OPERATOR = "on-call@example.com"
FUNCTIONS_CODE = HERE.parent.parent / "functions"
# The fixture jobs' code root: its jobs package serves them, and declares the test jobs below,
# to every CLI child (INFRAI_JOBS_PATH) and child Python (PYTHONPATH) of the harness, so a child
# derives the keys and judges the dead letters the harness's drain does.
TEST_JOBS_CODE = fixture_jobs.CODE_ROOT

QUEUE = "billing-jobs"
DLQ = "billing-jobs-dlq"
API_KEY = "test-key"
VISIBILITY = 300

EFFECTS_DDL = """
CREATE TABLE IF NOT EXISTS test_effects (idem_key text NOT NULL, message_id text NOT NULL);
CREATE TABLE IF NOT EXISTS test_external_effects (idem_key text NOT NULL);
"""

# A jobs package for drain processes of their own (a code root's jobs/__init__.py): one
# database job whose every run leaves a row, so a double effect shows as two rows for one key.
COUNTING_JOBS = """
from infrai_jobs.jobs.registry import Effect, JobRegistry


def build_registry():
    registry = JobRegistry()

    @registry.job("test.db", effect=Effect.DATABASE, identity=("id",))
    def db_job(payload, ctx):
        ctx.db.execute(
            "INSERT INTO test_effects (idem_key, message_id) VALUES (%s, %s)",
            (ctx.idem_key, ctx.message_id),
        )
        return None

    return registry
"""


def add_test_jobs(registry: JobRegistry, database_url: str) -> None:
    """``test.db`` and ``test.ext`` count their effects in tables; ``mode`` steers failures."""

    @registry.job("test.db", effect=Effect.DATABASE, identity=("id",))
    def db_job(payload: Payload, ctx: JobContext) -> JsonValue:
        assert ctx.db is not None
        ctx.db.execute(
            "INSERT INTO test_effects (idem_key, message_id) VALUES (%s, %s)",
            (ctx.idem_key, ctx.message_id),
        )
        fail_as_asked(payload)  # after the effect: a failure must roll it back
        return {"id": payload["id"]}

    @registry.job("test.ext", effect=Effect.EXTERNAL, identity=("id",))
    def ext_job(payload: Payload, ctx: JobContext) -> JsonValue:
        if payload.get("mode") in (None, "ok", "uncertain"):
            # An effect outside the ledger's transaction: it cannot be rolled back.
            with psycopg.connect(database_url, autocommit=True) as conn:
                conn.execute("INSERT INTO test_external_effects VALUES (%s)", (ctx.idem_key,))
        fail_as_asked(payload)
        return {"sent": payload["id"]}


@dataclass
class Harness:
    server: Any
    sink: provider_sink.RunningSink
    client: InfraiClient
    ledger: PostgresLedger
    registry: JobRegistry
    database_url: str
    control: urllib3.PoolManager = field(default_factory=urllib3.PoolManager)

    @property
    def services(self) -> dict[str, str]:
        """Where this harness's Infrai and ledger are, named as a function's environment names
        them."""
        return {
            "INFRAI_BASE_URL": self.server.url,
            "INFRAI_API_KEY": API_KEY,
            "DATABASE_URL": self.database_url,
        }

    def publish(self, payload: Any, times: int = 1) -> list[str]:
        return [self.client.publish(QUEUE, payload) for _ in range(times)]

    def lane_service(
        self, settings: DrainSettings, client: InfraiClient | None = None
    ) -> DrainService:
        """DrainFunction's service on this harness: a ledger per lane, opened as lanes need."""
        return DrainService(
            settings=settings,
            queue=client or self.client,
            ledger=PostgresLedger(self.database_url),
            registry=self.registry,
            features=drain_features(
                settings, make_lane_ledger=lambda: PostgresLedger(self.database_url)
            ),
        )

    def drain(self, time_left_ms: Callable[[], int] | None = None, **config: Any) -> DrainSummary:
        return drain(
            self.client,
            self.ledger,
            self.registry,
            DrainConfig(queue=QUEUE, **config),
            time_left_ms or (lambda: 120_000),
        )

    def advance(self, seconds: float = VISIBILITY + 1) -> None:
        self.control.request(
            "POST", f"{self.server.url}/_emulator/clock", json={"advance_seconds": seconds}
        )

    def faults(self, **faults: Any) -> None:
        response = self.control.request("POST", f"{self.server.url}/_emulator/faults", json=faults)
        assert response.status == 200, response.data

    def row(self, key: str) -> ClaimRow | None:
        return self.ledger.get(key)

    def assert_settled(
        self, summary: DrainSummary, key: str, *, outcome: str, acked: int, state: str
    ) -> ClaimRow:
        """The drain's one message ended as ``outcome`` with ``acked`` acks, and the claim under
        ``key`` is in ``state``. Returns the claim for the caller's own checks."""
        assert summary.outcomes == {outcome: 1}
        assert summary.acked == acked
        row = self.row(key)
        assert row is not None
        assert row.state == state
        return row

    def sql(self, query: str, params: Any = None) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.database_url, autocommit=True) as conn:
            cursor = conn.execute(query, params)
            return cursor.fetchall() if cursor.description else []

    def effects(self, key: str) -> int:
        return int(self.sql("SELECT count(*) FROM test_effects WHERE idem_key = %s", (key,))[0][0])

    def history(self, key: str) -> list[tuple[Any, ...]]:
        """The key's ``claim_history``, oldest first: (action, actor, note)."""
        return self.sql(
            "SELECT action, actor, note FROM claim_history WHERE idem_key = %s ORDER BY id", (key,)
        )

    def external_effects(self, key: str) -> int:
        rows = self.sql("SELECT count(*) FROM test_external_effects WHERE idem_key = %s", (key,))
        return int(rows[0][0])

    def defer(self, name: str, *, delay: float = 3600.0, queue: str | None = QUEUE) -> str:
        """Deferred work for ``test.db`` (``{"id": name}``) as a drain records it; its key."""
        payload = {"job": "test.db", "id": name}
        key = self.registry.derive(payload).idem_key
        work = DeferredWork(
            idem_key=key,
            job="test.db",
            effect="database",
            payload=payload,
            message_id=f"qmsg-{name}",
            queue=queue,
        )
        with psycopg.connect(self.database_url, autocommit=True) as conn:
            outcome = flow.defer(conn, work, attempts=1, error="upstream 503", delay_seconds=delay)
        assert outcome is flow.DeferOutcome.DEFERRED
        return key

    def take_and_fail(self, key: str, error: str, **options: Any) -> bool:
        """Take the deferred run under ``key`` (due now) and fail it for good, as a drain out
        of attempts does; whether the fail changed the row."""
        with psycopg.connect(self.database_url, autocommit=True) as conn:
            conn.execute("UPDATE job_claims SET run_after = now() WHERE idem_key = %s", (key,))
            (taken,) = flow.take_due(conn, 1, lease_seconds=60)
            assert taken.idem_key == key
            failed = flow.fail(conn, key, taken.claim_token or uuid.uuid4(), error, **options)
            return failed is not None

    def failed_for_good(self, *names: str, error: str = "upstream 503") -> list[str]:
        """Deferred work under each name, failed for good as a drain out of attempts fails it
        (the ledger holds its dead letter); the keys."""
        keys = [self.defer(name) for name in names]
        for key in keys:
            assert self.take_and_fail(key, error)
        return keys


class RecordingAlerter:
    """An alerter that keeps every alert it is handed, in order: ``alerts`` as (subject,
    message), ``sent`` their subjects."""

    def __init__(self) -> None:
        self.alerts: list[tuple[str, str]] = []

    @property
    def sent(self) -> list[str]:
        return [subject for subject, _ in self.alerts]

    def publish(self, subject: str, message: str) -> None:
        self.alerts.append((subject, message))


def watcher_metrics(
    report: AlertReport, capsys: pytest.CaptureFixture[str]
) -> list[dict[str, Any]]:
    """The EMF documents the watcher emits for ``report`` (what was printed before is dropped)."""
    capsys.readouterr()
    metrics = Metrics(namespace="InfraiJobsTest", service="alerting")
    record_alert_check(metrics, report)
    metrics.flush_metrics()
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line]


def code_root(folder: Path, jobs_package: str) -> Path:
    """``folder`` made a code root (what ``--jobs-path`` names) whose ``jobs`` package is the
    source ``jobs_package``."""
    (folder / "jobs").mkdir(parents=True)
    (folder / "jobs" / "__init__.py").write_text(jobs_package)
    return folder


def migrate_by_hand(conn: psycopg.Connection[Any], *, up_to: int) -> None:
    """Apply the ledger's first ``up_to`` migrations and record each as applied, the state a
    ledger of that version's code is in, so a test can watch migrate add the rest to it."""
    conn.execute(
        "CREATE TABLE infrai_jobs_schema (version int PRIMARY KEY, name text NOT NULL,"
        " applied_at timestamptz NOT NULL DEFAULT now())"
    )
    for migration in LEDGER_MIGRATIONS[:up_to]:
        conn.execute(migration.sql)
        conn.execute(
            "INSERT INTO infrai_jobs_schema (version, name) VALUES (%s, %s)",
            (migration.version, migration.name),
        )


def prepare_database(database_url: str, code_root: Path = TEST_JOBS_CODE) -> None:
    with psycopg.connect(database_url, autocommit=True) as conn:
        # The ledger's, then the jobs' own migrations (the fixture jobs': invoices), as
        # `migrate` does.
        apply_migrations(conn, read_migrations(jobs_migrations_folder(code_root)))
        conn.execute(EFFECTS_DDL)


@contextmanager
def harness(
    database_url: str,
    *,
    visibility: float = VISIBILITY,
    max_answer_bytes: int | None = None,
    jobs: Callable[[], JobRegistry] = fixture_jobs.build_registry,
    code_root: Path = TEST_JOBS_CODE,
) -> Iterator[Harness]:
    """The harness on ``database_url``. Its jobs are the fixture jobs, with their tables, unless
    ``jobs`` and ``code_root`` name others (the example tests pass the team's)."""
    prepare_database(database_url, code_root)
    server = emulator_module.start_in_thread(visibility_timeout=visibility)
    sink = provider_sink.start_in_thread()
    pool = None if max_answer_bytes is None else PoolOptions(max_answer_bytes=max_answer_bytes)
    client = InfraiClient(server.url, API_KEY, pool=pool, retry=HttpRetryPolicy(base_delay=0.01))
    ensure_queue(client, QUEUE, dlq=DLQ)
    ledger = PostgresLedger(database_url)
    registry = jobs()
    add_test_jobs(registry, database_url)
    # The fixture jobs' settings (MAIL_PROVIDER_URL, ...) all point at the sink.
    registry.bind_settings(dict.fromkeys(registry.declared_settings(), sink.url))
    kit = Harness(server, sink, client, ledger, registry, database_url)
    try:
        yield kit
    finally:
        ledger.close()
        client.close()
        kit.control.clear()
        sink.stop()
        server.stop()


def run_concurrently(*targets: Callable[[], Any]) -> list[Any]:
    """Run callables in threads at once; re-raise the first failure."""
    results: list[Any] = [None] * len(targets)
    errors: list[BaseException] = []

    def runner(index: int, target: Callable[[], Any]) -> None:
        try:
            results[index] = target()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=runner, args=(i, t)) for i, t in enumerate(targets)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    if errors:
        raise errors[0]
    return results


def child_env() -> dict[str, str]:
    """This environment, with the path a child Python needs to import this module (and the
    tests' shared helpers beside it), the fixture jobs (``fixture_jobs``, and the ``jobs``
    package of their code root, first) and the functions' handler modules."""
    path = [str(HERE), str(HERE.parent), str(TEST_JOBS_CODE), str(FUNCTIONS_CODE)]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


def run_until_killed(script: str, *args: str) -> None:
    """Run ``script`` (with ``args``) in a child Python that SIGKILLs itself at the moment the
    test chose, and assert that is how it ended. The child finds this module and the fixture
    jobs on its path (``child_env``)."""
    finished = run_captured([sys.executable, "-c", script, *args], env=child_env())
    assert finished.returncode == -signal.SIGKILL, finished.stderr


def run_cli(
    kit: Harness, *args: str, cwd: Path = ROOT, **env: str
) -> subprocess.CompletedProcess[str]:
    """``infrai-jobs ARGS`` in a child process (from the project root unless ``cwd`` says
    otherwise), configured for the harness's emulator, ledger and provider sink and its jobs
    (the fixture code root's; ``INFRAI_JOBS_PATH`` in ``env`` names another), and for no
    endpoint of the shell running the tests."""
    return run_captured([INFRAI_JOBS, *args], env=cli_environment(kit, **env), cwd=cwd)


def reconciled_under_a_live_lease(
    kit: Harness, key: str, until: str, *flags: str
) -> tuple[dict[str, Any], list[subprocess.CompletedProcess[str]]]:
    """``claims reconcile KEY FLAGS``, as text and as ``--json``, on a claim under a live lease
    ending ``until``: both exit 0 and the text advises asking again after ``until`` (asserted
    here); the JSON's one outcome, and both runs."""
    shown = run_cli(kit, "claims", "reconcile", key, *flags)
    as_json = run_cli(kit, "claims", "reconcile", key, *flags, "--json")
    for finished in (shown, as_json):
        assert finished.returncode == 0, finished.stdout + finished.stderr
        assert "Traceback" not in finished.stderr
    assert (
        f"{key}: running under a live lease until {until}: its run may still settle it; "
        f"after then, run `infrai-jobs claims reconcile {key}` again"
    ) in shown.stdout
    (outcome,) = json.loads(as_json.stdout)["claims"]
    assert outcome["lease_until"] == until
    return outcome, [shown, as_json]


def start_cli(kit: Harness, *args: str, **env: str) -> subprocess.Popen[str]:
    """``infrai-jobs ARGS`` started as ``run_cli`` runs it, for a test that signals it; its
    stdout and stderr are pipes."""
    return subprocess.Popen(
        [INFRAI_JOBS, *args],
        env=cli_environment(kit, **env),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def cli_environment(kit: Harness, **env: str) -> dict[str, str]:
    """The environment of a CLI child on the harness (see ``run_cli``)."""
    environment = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("INFRAI_", "DATABASE_", "PROVIDER_", "IDEMPOTENCY_"))
    }
    environment.update(
        {
            **kit.services,
            "INFRAI_JOBS_PATH": str(TEST_JOBS_CODE),
            **fixture_jobs.provider_settings(kit.sink.url),
            "OPERATOR": OPERATOR,
            **env,
        }
    )
    return environment
