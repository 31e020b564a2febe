"""The PostgreSQL helper: embedded server, DATABASE_URL, scratch databases, clean exit."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psycopg
import pytest
from child_process import run_captured
from psycopg.conninfo import conninfo_to_dict

from infrai_jobs.errors import ConfigurationError
from infrai_local.sandbox.embedded_db import (
    DATABASE_URL_ENV,
    EmbeddedPostgres,
    create_scratch_database,
    drop_scratch_database,
    ensure_database_url,
    postgres_server_url,
    scratch_database,
)


def select_one(url: str) -> object:
    with psycopg.connect(url, connect_timeout=5) as conn:
        row = conn.execute("SELECT 1").fetchone()
    return None if row is None else row[0]


def database_exists(server_url: str, name: str) -> bool:
    with psycopg.connect(server_url, connect_timeout=5) as conn:
        row = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone()
    return row is not None


def process_is_alive(pid: int) -> bool:
    # A zombie still answers kill(0); only /proc tells it has exited.
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


# --- The embedded server ------------------------------------------------------------------------


def test_embedded_server_answers_and_is_removed_when_stopped() -> None:
    # Given a freshly started embedded server
    with EmbeddedPostgres() as server:
        data_dir = server.data_dir
        # When it is asked SELECT 1
        answer = select_one(server.url)
        # Then it answers, from a private temporary directory
        assert answer == 1
        assert data_dir is not None
        assert data_dir.is_dir()
    # And once stopped its directory is gone and it refuses connections
    assert not data_dir.exists()
    with pytest.raises(RuntimeError, match="not running"):
        _ = server.url


@pytest.mark.parametrize(
    "death",
    [
        'raise SystemExit("simulated test failure")',
        "os.kill(os.getpid(), signal.SIGTERM)",
        "os.kill(os.getpid(), signal.SIGKILL)",
    ],
    ids=["error", "sigterm", "sigkill"],
)
def test_an_embedded_server_does_not_outlive_its_process(death: str) -> None:
    # Given a process that starts an embedded server and dies without stopping it
    script = textwrap.dedent(
        """
        import os, signal
        from infrai_local.sandbox.embedded_db import EmbeddedPostgres

        server = EmbeddedPostgres()
        server.start()
        pid = (server.data_dir / "pgdata" / "postmaster.pid").read_text().split()[0]
        print(server.data_dir, pid, flush=True)
        """
    )
    env = {name: value for name, value in os.environ.items() if name != DATABASE_URL_ENV}
    # When that process dies
    command = [sys.executable, "-c", script + death]
    finished = subprocess.run(
        command, check=False, capture_output=True, text=True, env=env, timeout=60
    )
    # Then its server is stopped and its directory removed, by its exit hook or its reaper
    assert finished.returncode != 0, finished.stderr
    data_dir, pid = finished.stdout.split()
    deadline = time.monotonic() + 30
    while (Path(data_dir).exists() or process_is_alive(int(pid))) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(data_dir).exists()
    assert not process_is_alive(int(pid))
    assert "Warning" not in finished.stderr


# --- DATABASE_URL -----------------------------------------------------------------------------


def test_database_url_is_used_as_is_when_set(pg_server_url: str) -> None:
    # Given DATABASE_URL names a reachable server (the session's own)
    environ = {DATABASE_URL_ENV: pg_server_url}
    # When a server URL is asked for
    with postgres_server_url(environ) as url:
        # Then it is that URL, untouched, and it answers
        assert url == pg_server_url
        assert select_one(url) == 1


def test_ensure_database_url_announces_the_configured_server(pg_server_url: str) -> None:
    # Given DATABASE_URL is set
    lines: list[str] = []
    # When a local run asks for its database
    url = ensure_database_url({DATABASE_URL_ENV: pg_server_url}, announce=lines.append)
    # Then it gets DATABASE_URL, and one line says so without any password
    assert url == pg_server_url
    assert len(lines) == 1
    assert lines[0].startswith(f"database: {DATABASE_URL_ENV} (")
    password = conninfo_to_dict(pg_server_url).get("password")
    if password:
        assert str(password) not in lines[0]


def test_ensure_database_url_starts_one_embedded_server_per_process() -> None:
    # Given a fresh process with no DATABASE_URL (this test process may already have one)
    script = (
        "from infrai_local.sandbox.embedded_db import ensure_database_url\n"
        "from psycopg import connect\n"
        "lines = []\n"
        "first = ensure_database_url({}, announce=lines.append)\n"
        "second = ensure_database_url({}, announce=lines.append)\n"
        "assert first == second, (first, second)\n"
        "assert connect(first).execute('SELECT 1').fetchone() == (1,)\n"
        "print(len(lines)); print(lines[0])\n"
    )
    env = {name: value for name, value in os.environ.items() if name != DATABASE_URL_ENV}
    # When it asks for its database twice
    finished = run_captured([sys.executable, "-c", script], env=env)
    # Then both calls got the same embedded server, announced once
    assert finished.returncode == 0, finished.stderr
    count, line = finished.stdout.splitlines()[:2]
    assert count == "1"
    assert "embedded PostgreSQL" in line


@pytest.mark.parametrize("malformed", ["not a url", "postgresql://app:s3cret@[::1"])
def test_a_malformed_database_url_names_the_setting(malformed: str) -> None:
    # Given a DATABASE_URL that libpq cannot parse
    # When / Then the error names the setting and the way out, but never the password
    with (
        pytest.raises(ConfigurationError, match=f"{DATABASE_URL_ENV} is malformed.*unset"),
        postgres_server_url({DATABASE_URL_ENV: malformed}),
    ):
        pass
    with pytest.raises(ConfigurationError) as raised:
        ensure_database_url({DATABASE_URL_ENV: malformed})
    assert "s3cret" not in str(raised.value)


def test_an_unreachable_database_url_names_the_fix(tmp_path: Path) -> None:
    # Given a DATABASE_URL whose server is not running (a socket directory with no socket)
    unreachable = f"postgresql://postgres@/test?host={tmp_path}"
    # When / Then the error says where it looked and what to do
    with (
        pytest.raises(ConfigurationError, match=r"cannot reach PostgreSQL.*unset it"),
        postgres_server_url({DATABASE_URL_ENV: unreachable}),
    ):
        pass


# --- Scratch databases --------------------------------------------------------------------------


def test_scratch_databases_are_isolated_and_dropped(pg_server_url: str) -> None:
    # Given two scratch databases on the same server
    with scratch_database(pg_server_url) as first, scratch_database(pg_server_url) as second:
        names = [conninfo_to_dict(url)["dbname"] for url in (first, second)]
        # When a table is created in the first
        with psycopg.connect(first) as conn:
            conn.execute("CREATE TABLE marker (id int)")
        # Then the second does not see it
        with psycopg.connect(second) as conn:
            row = conn.execute("SELECT to_regclass('public.marker')").fetchone()
        assert row == (None,)
        assert names[0] != names[1]
    # And both are gone afterwards
    assert not any(database_exists(pg_server_url, str(name)) for name in names)


def test_a_scratch_database_is_dropped_despite_an_open_session(pg_server_url: str) -> None:
    # Given a scratch database that a test left a connection open to
    scratch_url = create_scratch_database(pg_server_url)
    leaked = psycopg.connect(scratch_url)
    try:
        # When it is dropped
        drop_scratch_database(pg_server_url, scratch_url)
        # Then it is gone all the same
        assert not database_exists(pg_server_url, str(conninfo_to_dict(scratch_url)["dbname"]))
    finally:
        leaked.close()


def test_dropping_a_database_that_is_not_scratch_is_refused(pg_server_url: str) -> None:
    # Given the server's own database
    # When / Then the helper refuses to drop it
    with pytest.raises(ValueError, match="refusing to drop"):
        drop_scratch_database(pg_server_url, pg_server_url)
    assert select_one(pg_server_url) == 1


def test_the_database_url_fixture_is_fresh_and_empty(database_url: str, pg_server_url: str) -> None:
    # Given the per-test database
    # When its tables are listed
    with psycopg.connect(database_url) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_tables"
            " WHERE schemaname NOT IN ('pg_catalog', 'information_schema')"
        ).fetchone()
    # Then it has none, and it is not the server's own database
    assert row == (0,)
    assert conninfo_to_dict(database_url)["dbname"] != conninfo_to_dict(pg_server_url)["dbname"]
