"""Fixtures shared by every test tier.

PostgreSQL: ``DATABASE_URL`` when set (CI's server), else one embedded server for the whole
session. Never skipped: a test that needs a database fails loudly rather than passing without
one. Unit tests request none of these, so they open no sockets.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from infrai_local.sandbox.embedded_db import postgres_server_url, scratch_database

# --- PostgreSQL -------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def pg_server_url() -> Iterator[str]:
    """A reachable server for the session; an embedded one is stopped and removed at the end."""
    with postgres_server_url() as url:
        yield url


@pytest.fixture
def database_url(pg_server_url: str) -> Iterator[str]:
    """A fresh, empty database of this test's own, dropped afterwards.

    Per test rather than per module, so no test sees another's rows: creating one from template0
    measured 35-100 ms on PostgreSQL 15 and 60-400 ms on the embedded server (idle vs. busy
    machine), dropping it about 20 ms.
    """
    with scratch_database(pg_server_url) as url:
        yield url


# --- The test kit for jobs (infrai_local.testkit), on this session's server -----------------------

pytest_plugins = ["infrai_local.testkit"]


@pytest.fixture(scope="session")
def job_kit_server_url(pg_server_url: str) -> str:
    return pg_server_url
