"""Backlog fan-out through Lambda's Invoke API: the deployed starter (boto3) against the loopback
Lambda ``infrai-jobs invoke`` serves, and DrainFunction fanning out on a backlog that way."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import fixture_jobs
import psycopg
import pytest
import urllib3

from infrai_jobs.aws.lambda_starter import LambdaDrainStarter
from infrai_jobs.drain.fan_out import fan_out_event
from infrai_jobs.errors import FanOutError, FanOutThrottled
from infrai_jobs.queue.client import InfraiClient
from infrai_local.migrations import apply_migrations, jobs_migrations_folder, read_migrations
from infrai_local.sandbox import emulator, provider_sink
from infrai_local.sandbox.fan_out import CLI, LocalLambda
from infrai_local.sandbox.queues import ensure_queue

ROOT = Path(__file__).resolve().parents[2]
EVENTS = ROOT / "events"
QUEUE = "billing-jobs"
SLOT = "6b1f2a3c-4d5e-4f60-8a7b-9c0d1e2f3a4b"


@pytest.fixture
def loopback_lambda(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[LocalLambda, Path]]:
    """A loopback Lambda for "DrainFunction" with a reserved concurrency of one, whose
    invocations run until the test creates ``release``; boto3 in this process calls it."""
    release = tmp_path / "release"
    waiter = (
        f"import pathlib, time\nwhile not pathlib.Path({str(release)!r}).exists(): time.sleep(0.05)"
    )
    endpoint = LocalLambda(
        "DrainFunction",
        lambda payload: [sys.executable, "-c", waiter],
        env=os.environ,
        reserved_concurrency=1,
    ).start()
    for name, value in endpoint.client_env().items():
        monkeypatch.setenv(name, value)
    try:
        yield endpoint, release
    finally:
        release.touch()
        endpoint.stop(timeout=30)


def test_the_starter_invokes_asynchronously_and_a_full_reserved_concurrency_throttles(
    loopback_lambda: tuple[LocalLambda, Path],
) -> None:
    endpoint, _release = loopback_lambda
    starter = LambdaDrainStarter("DrainFunction")
    # When the starter invokes the function with a fan-out event
    starter.start(fan_out_event(QUEUE, SLOT, "parent"))
    # Then Lambda accepted it (202) and an invocation runs
    assert endpoint.invocations == 1
    # And while it runs, the reserved concurrency of one is full: the next is throttled
    with pytest.raises(FanOutThrottled, match="TooManyRequestsException"):
        starter.start(fan_out_event(QUEUE, SLOT, "parent"))
    assert endpoint.throttled == 1


def test_invoking_another_function_is_an_error_not_a_throttle(
    loopback_lambda: tuple[LocalLambda, Path],
) -> None:
    with pytest.raises(FanOutError) as raised:
        LambdaDrainStarter("SomeOtherFunction").start(fan_out_event(QUEUE, SLOT, "parent"))
    assert not isinstance(raised.value, FanOutThrottled)
    assert "ResourceNotFoundException" in str(raised.value)


@pytest.mark.slow
def test_drain_function_fans_out_on_a_backlog_through_the_loopback_lambda(
    database_url: str, tmp_path: Path, project: Path
) -> None:
    # Given 600 invoices to finalize waiting, Infrai answering in 100 ms, and DrainFunction
    # allowed three drains alive with a fan-out time of one second
    with psycopg.connect(database_url, autocommit=True) as conn:
        apply_migrations(conn, read_migrations(jobs_migrations_folder(project / "functions")))
        conn.execute(
            "INSERT INTO invoices SELECT 'inv_' || n, 'draft', NULL FROM generate_series(1, 600) n"
        )
    server = emulator.start_in_thread()
    sink = provider_sink.start_in_thread()
    try:
        client = InfraiClient(server.url, "local-dev-key")
        ensure_queue(client, QUEUE, dlq=f"{QUEUE}-dlq")
        for n in range(1, 601):
            client.publish(
                QUEUE, {"job": "invoice.finalize", "invoice_id": f"inv_{n}", "amount_cents": n}
            )
        urllib3.request("POST", f"{server.url}/_emulator/faults", json={"latency_ms": 100})
        env_vars = tmp_path / "env.json"
        env_vars.write_text(
            json.dumps(
                {
                    "Parameters": {
                        "INFRAI_BASE_URL": server.url,
                        "INFRAI_API_KEY": "local-dev-key",
                        "INFRAI_API_KEY_PARAMETER": "",
                        "DATABASE_URL": database_url,
                        "DATABASE_SECRET_ARN": "",
                    },
                    "DrainFunction": {
                        # The jobs' settings reach a function in one variable, as in AWS
                        "JOB_SETTINGS": json.dumps(fixture_jobs.provider_settings(sink.url)),
                        "DRAIN_MAX_CONCURRENCY": "3",
                        "DRAIN_FANOUT_AFTER_SECONDS": "1",
                    },
                }
            )
        )
        # When DrainFunction is invoked with the schedule's event
        done = subprocess.run(
            [
                *CLI,
                "invoke",
                "DrainFunction",
                "--event",
                str(EVENTS / "drain-schedule.json"),
                "--env-vars",
                str(env_vars),
            ],
            cwd=project,
            capture_output=True,
            text=True,
            timeout=240,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        summary = json.loads(done.stdout)
        # Then it started more drains through Lambda's Invoke, and they all drained
        assert summary["fanned_out"] >= 1
        assert summary["fan_out_throttled"] == 0
        stats = client.stats(QUEUE)
        assert (stats.available_count, stats.in_flight_count, stats.dlq_count) == (0, 0, 0)
        with psycopg.connect(database_url) as conn:
            finals = conn.execute("SELECT count(*) FROM invoices WHERE status = 'final'")
            assert finals.fetchone() == (600,)
            leases = conn.execute("SELECT count(*) FROM drain_leases").fetchone()
            assert leases == (0,)
        client.close()
    finally:
        sink.stop()
        server.stop()
