"""Fixtures the integration tests share: the drain harness (``kit``), the project a test invokes
(``fixture_project``), a real Redis for the second layer's tests and a PgBouncer in transaction
mode for the pooler tier's (``pooled_database_url``)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from collections.abc import Iterator

import pytest
from aws_lambda_powertools.utilities import parameters
from drainkit import Harness, harness
from fixture_project import project  # noqa: F401 - the fixture, for this tier's tests
from pgbouncer import MISSING, RunningPooler, pgbouncer_binary, running_pgbouncer
from redis_server import wait_for_redis


@pytest.fixture
def kit(database_url: str) -> Iterator[Harness]:
    """The drain harness on this test's own database; a test module that needs the harness set
    up its own way defines its own ``kit``."""
    with harness(database_url) as h:
        yield h


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@pytest.fixture(scope="session")
def redis_url(
    pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """``REDIS_URL`` when set (CI's server), else a throwaway redis-server; never skipped."""

    def say(line: str) -> None:
        # Past pytest's capture, so the run's output says which Redis the tests used.
        capture = pytestconfig.pluginmanager.get_plugin("capturemanager")
        with capture.global_and_fixture_disabled():
            reporter = pytestconfig.pluginmanager.get_plugin("terminalreporter")
            reporter.write("\n")
            reporter.write_line(line)

    url = os.environ.get("REDIS_URL", "").strip()
    if url:
        say("second layer tests: Redis from REDIS_URL")
        yield url
        return
    server = shutil.which("redis-server")
    if server is None:
        pytest.fail(
            "no Redis for the second-layer tests: REDIS_URL is not set and redis-server is not "
            "installed. Set REDIS_URL=redis://127.0.0.1:6379/0 or apt-get install redis-server."
        )
    port = _free_port()
    process = subprocess.Popen(
        [server, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no"],
        cwd=tmp_path_factory.mktemp("redis"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        wait_for_redis(url, process)
        say(f"second layer tests: redis-server started on 127.0.0.1:{port}")
        yield url
    finally:
        process.terminate()
        process.wait(timeout=10)


@pytest.fixture(scope="session")
def pgbouncer(pg_server_url: str) -> Iterator[RunningPooler]:
    """A PgBouncer in transaction mode before the session's PostgreSQL; never skipped."""
    if pgbouncer_binary() is None:
        pytest.fail(MISSING)
    with running_pgbouncer(pg_server_url) as pooler:
        yield pooler


@pytest.fixture
def pooled_database_url(database_url: str, pgbouncer: RunningPooler) -> str:
    """This test's own database (``database_url``), reached through the pooler, its pool's
    server connections open (``RunningPooler.warm``)."""
    pgbouncer.warm(database_url)
    return pgbouncer.url_for(database_url)


@pytest.fixture
def fake_aws_credentials(monkeypatch: pytest.MonkeyPatch) -> str:
    """Credentials and a region for moto's mock_aws, and Powertools' parameter caches empty;
    the region is returned."""
    region = "us-east-1"
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": region,
        "AWS_REGION": region,
    }.items():
        monkeypatch.setenv(name, value)
    parameters.clear_caches()
    return region
