"""Fixtures the end-to-end tests share: the project they invoke (``fixture_project``), the
stand-ins a local invocation talks to, and this tree's wheel as a team installs it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import fixture_jobs
import psycopg
import pytest
from built_versions import build_wheel, source_copy
from fixture_project import (
    project,  # noqa: F401 - the fixture, for this tier's tests
    running_services,
)

from infrai_jobs.queue.client import InfraiClient
from infrai_local.jobs_package import JOBS_PATH_ENV
from infrai_local.migrations import apply_migrations, jobs_migrations_folder, read_migrations
from infrai_local.sandbox.queues import ensure_queue


@pytest.fixture
def services(database_url: str) -> Iterator[dict[str, str]]:
    """A ledger migrated with the fixture jobs' tables, holding draft invoices inv_8812 and
    inv_9000, the emulator and the provider sink, as the environment a function is invoked with
    (and an ``infrai-jobs`` child that publishes to it: the fixture jobs' code root)."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        apply_migrations(conn, read_migrations(jobs_migrations_folder(fixture_jobs.CODE_ROOT)))
        conn.execute("INSERT INTO invoices VALUES ('inv_8812', 'draft', NULL)")
        conn.execute("INSERT INTO invoices VALUES ('inv_9000', 'draft', NULL)")
    with running_services("local-dev-key") as running:
        yield {
            **running,
            "DATABASE_URL": database_url,
            JOBS_PATH_ENV: str(fixture_jobs.CODE_ROOT),
        }


@pytest.fixture
def billing_queue(services: dict[str, str]) -> Iterator[InfraiClient]:
    """A client of the emulator, whose queue billing-jobs (the env-vars file's) and its DLQ
    exist."""
    client = InfraiClient(services["INFRAI_BASE_URL"], services["INFRAI_API_KEY"])
    try:
        ensure_queue(client, "billing-jobs", dlq="billing-jobs-dlq")
        yield client
    finally:
        client.close()


@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This tree's wheel, built once a run (``init``'s tests, and the upgrade's base version)."""
    work = tmp_path_factory.mktemp("wheel")
    return build_wheel(source_copy(work / "source"), work / "dist")
