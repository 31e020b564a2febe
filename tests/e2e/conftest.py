"""Fixtures the end-to-end tests share: the stand-ins a local invocation talks to."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from infrai_local import emulator, provider_sink
from infrai_local.migrations import apply_migrations, jobs_migrations_folder, read_migrations
from infrai_local.provider_sink import sink_settings

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def services(database_url: str) -> Iterator[dict[str, str]]:
    """A migrated ledger with draft invoices inv_8812 and inv_9000, the emulator and the
    provider sink, as the environment a function is invoked with."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        apply_migrations(conn, read_migrations(jobs_migrations_folder(ROOT / "functions")))
        conn.execute("INSERT INTO invoices VALUES ('inv_8812', 'draft', NULL)")
        conn.execute("INSERT INTO invoices VALUES ('inv_9000', 'draft', NULL)")
    server = emulator.start_in_thread()
    sink = provider_sink.start_in_thread()
    try:
        yield {
            "INFRAI_BASE_URL": server.url,
            "INFRAI_API_KEY": "local-dev-key",
            "DATABASE_URL": database_url,
            **sink_settings(sink.url),
        }
    finally:
        sink.stop()
        server.stop()
