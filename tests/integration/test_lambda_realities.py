"""What Lambda does to a drain that a laptop does not: timeouts that kill mid-batch, execution
environments frozen between invocations (their database connections die meanwhile), and
scheduled invocations that overlap."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psycopg
from drainkit import DLQ, QUEUE, Harness, add_test_jobs, child_env, run_concurrently
from fixture_jobs import build_registry

from infrai_jobs.config.settings import DrainSettings
from infrai_jobs.drain.loop import drain
from infrai_jobs.drain.model import DrainConfig
from infrai_jobs.errors import LedgerUnavailable
from infrai_jobs.jobs.registry import Effect, JobContext, JsonValue, Payload
from infrai_jobs.runtime.drain_service import DrainService
from infrai_jobs.work.ledger import PostgresLedger

HERE = Path(__file__).parent
ROOT = HERE.parent.parent

# A drain invocation whose third job sleeps far past the invocation's deadline on its first
# delivery. The parent kills the process at the deadline, as Lambda's runtime does on timeout.
TIMED_OUT_INVOCATION = textwrap.dedent(
    """
    import sys, time
    from drainkit import QUEUE, add_test_jobs
    from infrai_jobs.drain.model import DrainConfig
    from infrai_jobs.drain.loop import drain
    from infrai_jobs.jobs.registry import Effect
    from infrai_jobs.work.ledger import PostgresLedger
    from infrai_jobs.queue.client import InfraiClient
    from fixture_jobs import build_registry

    base_url, database_url, provider_url, seconds = sys.argv[1:5]
    deadline = time.time() + float(seconds)
    registry = build_registry()
    add_test_jobs(registry, database_url)
    registry.bind_settings(dict.fromkeys(registry.declared_settings(), provider_url))

    @registry.job("test.sleepy", effect=Effect.EXTERNAL_IDEMPOTENT, identity=("id",))
    def sleepy(payload, ctx):
        print("sleeping past the deadline", flush=True)
        time.sleep(3600)

    drain(
        InfraiClient(base_url, "test-key"),
        PostgresLedger(database_url),
        registry,
        DrainConfig(queue=QUEUE, batch_budget_ms=500, lease_grace_seconds=1),
        lambda: max(0, int((deadline - time.time()) * 1000)),
    )
    """
)
INVOCATION_SECONDS = 3.0


def countdown(seconds: float) -> Callable[[], int]:
    """A Lambda context's remaining time, in milliseconds, from now."""
    deadline = time.monotonic() + seconds
    return lambda: max(0, int((deadline - time.monotonic()) * 1000))


def record_external_effect(database_url: str, key: str) -> None:
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("INSERT INTO test_external_effects VALUES (%s)", (key,))


def service_for(kit: Harness) -> DrainService:
    """A DrainService as DrainFunction builds it (settings, factory, registry), on loopback."""
    registry = build_registry()
    add_test_jobs(registry, kit.database_url)
    declared = registry.declared_settings()
    settings = DrainSettings(
        infrai_base_url=kit.server.url,
        infrai_api_key="test-key",
        queue=QUEUE,
        dlq=DLQ,
        database_url=kit.database_url,
        job_settings=dict.fromkeys(declared, kit.sink.url),
        job_setting_owners=declared,
        batch_budget_ms=1_000,
    )
    return DrainService.from_settings(settings, registry)


def terminate_drain_connections(database_url: str) -> int:
    """What an idle timeout, a failover or RDS Proxy does while an environment is frozen."""
    with psycopg.connect(database_url, autocommit=True) as admin:
        rows = admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE application_name = 'infrai-jobs' AND datname = current_database()"
        ).fetchall()
    return len(rows)


# --- Timeouts ---------------------------------------------------------------------------------


def test_a_batch_that_outlives_the_deadline_is_the_last_one_consumed(kit: Harness) -> None:
    # Given a job that sleeps past the invocation's deadline, in the first of two batches
    def slow(payload: Payload, ctx: JobContext) -> JsonValue:
        time.sleep(1.5)
        return {"slept": True}

    kit.registry.job("test.slow", effect=Effect.DATABASE, identity=("id",))(slow)
    kit.publish({"job": "test.slow", "id": "1"})
    for n in range(14):
        kit.publish({"job": "test.db", "id": f"after-{n}"})
    time_left = countdown(1.2)
    # When a drain runs with a 1.2 s budget and a 1 s batch budget
    summary = kit.drain(time_left, batch_budget_ms=1_000)
    # Then it finished the batch it had started, and consumed no other
    assert time_left() == 0
    assert summary.batches == 1
    assert summary.stopped == "time_budget"
    assert summary.consumed == 10
    assert summary.acked == 10
    # And the second batch was never received: none of its three deliveries was burnt
    stats = kit.client.stats(QUEUE)
    assert (stats.available_count, stats.in_flight_count) == (5, 0)
    assert {m.delivery_count for m in kit.client.consume(QUEUE, 10)} == {1}


def test_an_invocation_killed_at_its_timeout_mid_batch_loses_nothing(kit: Harness) -> None:
    # Given a batch of a database job, a key-passing external job and one that hangs
    kit.publish({"job": "test.db", "id": "timeout"})
    kit.publish({"job": "digest.build", "tenant_id": "t_timeout", "period": "2026-07"})
    kit.publish({"job": "test.sleepy", "id": "1"})
    env = child_env()
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            TIMED_OUT_INVOCATION,
            kit.server.url,
            kit.database_url,
            kit.sink.url,
            str(INVOCATION_SECONDS),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    # When the invocation is still inside that batch at its deadline, and is killed then
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "sleeping past the deadline"
    time.sleep(INVOCATION_SECONDS)
    assert child.poll() is None, "the batch should still be running at the deadline"
    child.send_signal(signal.SIGKILL)
    child.communicate(timeout=30)
    # Then nothing of that batch was acked: all three come back
    assert kit.client.stats(QUEUE).in_flight_count == 3

    # And after the visibility timeout the redeliveries settle every job, each effect once
    def sleepy(payload: Payload, ctx: JobContext) -> JsonValue:
        record_external_effect(kit.database_url, ctx.idem_key)
        return {"woke": True}

    kit.registry.job("test.sleepy", effect=Effect.EXTERNAL_IDEMPOTENT, identity=("id",))(sleepy)
    kit.advance()
    summary = kit.drain()
    assert summary.acked == 3
    assert kit.client.stats(QUEUE).message_count == 0
    assert kit.effects("test.db:timeout") == 1
    assert kit.sink.state.snapshot()["digests"] == {"digest.build:t_timeout:2026-07": 1}
    assert kit.external_effects("test.sleepy:1") == 1
    rows = [kit.row(key) for key in _keys()]
    assert [row.state if row else None for row in rows] == ["done"] * 3


def _keys() -> list[str]:
    return ["test.db:timeout", "digest.build:t_timeout:2026-07", "test.sleepy:1"]


# --- Frozen, then thawed ----------------------------------------------------------------------


def test_a_connection_that_died_while_frozen_costs_no_job(kit: Harness) -> None:
    # Given a warm DrainService that drained once, so its ledger connection is open
    service = service_for(kit)
    kit.publish({"job": "test.db", "id": "before-freeze"})
    assert service.run(countdown(30)).outcomes == {"done": 1}
    # When the server ends that connection while the environment is frozen
    assert terminate_drain_connections(kit.database_url) == 1
    kit.publish({"job": "test.db", "id": "after-thaw"})
    kit.publish({"job": "receipt.send", "invoice_id": "inv_thaw", "email": "t@example.com"})
    # Then the thawed environment reconnects within two invocations (a failed one is raised,
    # so the Errors alarm sees it) and nothing is lost or doubled once redelivered
    for _ in range(2):
        try:
            service.run(countdown(30))
            break
        except LedgerUnavailable:
            kit.advance()
    kit.advance()
    service.run(countdown(30))
    assert kit.client.stats(QUEUE).message_count == 0
    assert kit.effects("test.db:after-thaw") == 1
    assert kit.sink.state.snapshot()["mails"] == {"inv_thaw": 1}
    service.close()


def test_a_thawed_invocation_reconnects_before_its_first_batch(kit: Harness) -> None:
    # Given a warm DrainService whose connection the server ended while it was frozen
    service = service_for(kit)
    kit.publish({"job": "test.db", "id": "warm"})
    service.run(countdown(30))
    terminate_drain_connections(kit.database_url)
    kit.publish({"job": "test.db", "id": "thawed"})
    # When the next scheduled invocation runs
    try:
        summary = service.run(countdown(30))
    finally:
        service.close()
    # Then it reconnects and does the work at once
    assert summary.outcomes == {"done": 1}


def test_a_drain_whose_ledger_is_unreachable_consumes_nothing(kit: Harness) -> None:
    # Given a message, and a ledger whose database does not answer
    kit.publish({"job": "test.db", "id": "waiting"})
    unreachable = PostgresLedger("postgresql://nobody@127.0.0.1:1/none", connect_timeout=1)
    # When a drain runs
    summary = drain(kit.client, unreachable, kit.registry, DrainConfig(queue=QUEUE), countdown(30))
    # Then it stops for the ledger without receiving the message (no delivery burnt)
    assert summary.stopped == "ledger_unavailable"
    stats = kit.client.stats(QUEUE)
    assert (stats.available_count, stats.in_flight_count) == (1, 0)


# --- Overlapping scheduled invocations --------------------------------------------------------


def test_two_overlapping_invocations_run_every_job_once(kit: Harness) -> None:
    # Given 300 jobs of three effect classes, a third of them published twice
    payloads = []
    for n in range(300):
        if n % 3 == 0:
            payloads.append({"job": "test.db", "id": f"o{n}"})
        elif n % 3 == 1:
            payloads.append(
                {"job": "receipt.send", "invoice_id": f"inv_o{n}", "email": f"o{n}@example.com"}
            )
        else:
            payloads.append({"job": "digest.build", "tenant_id": f"t_o{n}", "period": "2026-07"})
    for n, payload in enumerate(payloads):
        kit.publish(payload, times=2 if n % 3 == 0 else 1)
    published = 300 + 100
    # When two scheduled invocations (two warm environments) start at the same moment
    services = [service_for(kit), service_for(kit)]
    start = threading.Barrier(2)

    def invocation(service: DrainService) -> dict[str, object]:
        start.wait(timeout=30)
        return service.run(countdown(120)).as_dict()

    summaries = run_concurrently(*[lambda s=s: invocation(s) for s in services])
    for service in services:
        service.close()
    # Then both worked, every message was consumed once and acked, and the queue is empty
    assert all(int(s["consumed"]) > 0 for s in summaries)
    assert sum(int(s["consumed"]) for s in summaries) == published
    assert sum(int(s["acked"]) for s in summaries) == published
    assert kit.client.stats(QUEUE).message_count == 0
    # And every effect happened exactly once
    effects = dict(kit.sql("SELECT idem_key, count(*) FROM test_effects GROUP BY idem_key"))
    assert effects == {f"test.db:o{n}": 1 for n in range(0, 300, 3)}
    sink = kit.sink.state.snapshot()
    assert sink["mails"] == {f"inv_o{n}": 1 for n in range(1, 300, 3)}
    assert set(sink["digests"].values()) == {1}
    assert len(sink["digests"]) == 100
