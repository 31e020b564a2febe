"""Postgres in one place: connecting (``LedgerConnector``, which picks up a rotated database
secret; ``connect_to_ledger`` for a one-off), translating driver errors (``ledger_errors``),
redacting connection strings, the statements several modules share, and the schema version this
code needs (migrations are applied by the tools in local/, never by a function). libpq quotes in
its errors a string it cannot parse, or the parts it parsed. Only a password is secret, but in a
*malformed* URL such as ``postgresql://u:Hu@nter2/x@host/db`` (an unescaped ``@`` in the password)
the "host" libpq reads, ``nter2``, is the tail of the password. So callers refuse a string
``malformed_reason`` finds before connecting, and ``redact`` removes the password as libpq reads it
and as it was meant (between the user's ``:`` and the last ``@``), raw and percent-decoded, and for
a malformed string each piece of it; ``describe`` names a database without it."""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar, Final, LiteralString
from urllib.parse import unquote

import psycopg
from psycopg.conninfo import conninfo_to_dict
from psycopg.types.json import Jsonb

from infrai_jobs.config.rotation import fetch_again
from infrai_jobs.errors import DatabaseBusy, LedgerError, LedgerUnavailable, SchemaNotMigrated

logger = logging.getLogger(__name__)

MASK = "***"

_URL_SCHEMES = ("postgresql://", "postgres://")
# Any URL's scheme (``mysql://``, a driver's ``postgresql+psycopg://``): libpq reads only its two,
# but the password of any URL sits between the user's ``:`` and the last ``@``.
_ANY_SCHEME = re.compile(r"\s*[A-Za-z][A-Za-z0-9+.-]*://")
# libpq's keyword form starts with ``keyword=``.
_KEYWORD_START = re.compile(r"\s*\w+\s*=")
# Where libpq (or a person reading a URL) may cut a malformed password into pieces.
_PIECE_SEPARATORS = re.compile(r"[@/:?#&=,;\s'\"\[\]]+")
# Pieces shorter than this are left alone: masking every "a" or "db" would garble the text
# around them, and a piece that short tells nothing about the password.
_MIN_PIECE = 3
# ``password=value`` or ``password='quoted \' value'`` in libpq's keyword form.
# An unquoted value runs to the next ``keyword=`` (so ``password=se cret`` is caught whole).
_KEYWORD_PASSWORD = re.compile(
    r"""password\s*=\s*('(?:[^'\\]|\\.)*'?|.*?(?=\s+\w+\s*=|\s*$))""", re.IGNORECASE
)


def _is_url(conninfo: str) -> bool:
    return conninfo.strip().lower().startswith(_URL_SCHEMES)


def parse_conninfo(conninfo: str) -> dict[str, str] | None:
    """A connection string's keywords as libpq reads them; None when libpq cannot read it
    (its own message would quote the whole string, password included)."""
    try:
        return {key: str(value) for key, value in conninfo_to_dict(conninfo).items()}
    except psycopg.Error:
        return None


_PORT = re.compile(r"(?:\[[^\]]*\]|[^:\[\]]*)(?::(\d*))?")


def malformed_reason(conninfo: str) -> str:
    """Why libpq would not read ``conninfo`` as it was meant (an ``@`` in a host or database
    name, or a non-number port: where the tail of a password with an unescaped ``@`` or ``/``
    lands), or "" when it would. The reason names what to fix, never quoting the string."""
    if _ANY_SCHEME.match(conninfo) and not _is_url(conninfo):
        return (
            "its scheme is not PostgreSQL's: the URL must start with postgresql:// or "
            "postgres:// (or be libpq's keyword=value form)"
        )
    if parse_conninfo(conninfo) is None:
        if not _is_url(conninfo) and not _KEYWORD_START.match(conninfo):
            return (
                "it is neither a URL starting with postgresql:// or postgres:// nor libpq's "
                "keyword=value form"
            )
        return (
            "it cannot be parsed (a stray '%', quote or space, or an unclosed '[' are the usual "
            "causes: percent-encode such characters in a password)"
        )
    if not _is_url(conninfo):
        return ""
    # The host part and the database name, cut where libpq cuts them: the user information ends
    # at the first ``@`` met before any ``/``, the host part at ``/`` or ``?``, the name at ``?``.
    rest = conninfo.strip().split("://", 1)[1]
    credentials_end = re.search(r"[@/]", rest)
    if credentials_end and credentials_end.group() == "@":
        rest = rest[credentials_end.end() :]
    host_part, _, dbname = rest.split("?", 1)[0].partition("/")
    if "@" in host_part or "@" in dbname:
        return (
            "its password would be read only in part (an unescaped '@' or '/' in it): "
            "percent-encode them ('@' is %40, '/' is %2F)"
        )
    if any(_PORT.fullmatch(host) is None for host in host_part.split(",")):
        return (
            "its port is not a number (an unescaped '/' in a password also reads that way: "
            "percent-encode it as %2F)"
        )
    return ""


def secrets_of(conninfo: str) -> list[str]:
    """Every string ``redact`` removes for ``conninfo``, longest first."""
    found: set[str] = set()
    parsed = parse_conninfo(conninfo)
    if parsed is not None and parsed.get("password"):
        found.add(parsed["password"])
    if _ANY_SCHEME.match(conninfo):
        # The password as a person wrote it (percent-encoded as it stands), and decoded.
        userinfo, at, _ = conninfo.strip().split("://", 1)[1].rpartition("@")
        _, colon, meant = userinfo.partition(":")
        if at and colon and meant:
            found.update({meant, unquote(meant)})
    else:
        for value in _KEYWORD_PASSWORD.findall(conninfo):
            found.add(value)
            if value.startswith("'"):
                found.add(value.strip("'").replace("\\'", "'").replace("\\\\", "\\"))
    if malformed_reason(conninfo):
        # The pieces libpq may have taken for a host, a port or a database name.
        found |= {p for s in found for p in _PIECE_SEPARATORS.split(s) if len(p) >= _MIN_PIECE}
    return sorted((s for s in found if s), key=len, reverse=True)


def redact(text: str, conninfo: str) -> str:
    for secret in secrets_of(conninfo):
        text = text.replace(secret, MASK)
    return text


def describe(conninfo: str) -> str:
    """``user@host:port/dbname`` for messages and log lines (nothing of a malformed string)."""
    parsed = parse_conninfo(conninfo)
    if parsed is None or malformed_reason(conninfo):
        return "a malformed database URL"
    where = parsed.get("host") or parsed.get("hostaddr") or "localhost"
    if parsed.get("port"):
        where += f":{parsed['port']}"
    user = f"{parsed['user']}@" if parsed.get("user") else ""
    return f"{user}{where}/{parsed.get('dbname', '')}"


def one_line(text: str) -> str:
    return " ".join(text.split())


def _malformed_url(reason: str) -> LedgerUnavailable:
    return LedgerUnavailable(
        f"cannot connect to the ledger database: the database URL is malformed: {reason} "
        "(check DATABASE_URL or the database secret; the value is not shown)"
    )


# How PostgreSQL (SQLSTATE 53300, which libpq does not pass on for a refused connection),
# PgBouncer and RDS Proxy say they are full, or waited too long for a server connection.
_FULL = re.compile(
    r"too many (clients|connections for)|remaining connection slots|no more connections allowed"
    r"|query_wait_timeout|timed-out waiting to acquire",
    re.IGNORECASE,
)


def _busy_or_down(exc: psycopg.Error) -> type[LedgerUnavailable]:
    """The one rule telling a database at its connection limit from one that is down."""
    return DatabaseBusy if exc.sqlstate == "53300" or _FULL.search(str(exc)) else LedgerUnavailable


# How libpq words a certificate or host name that does not verify.
_TLS_FAILURES = ("certificate verify failed", "does not match host name", "root certificate file")


def connect_to_ledger(
    url: str,
    *,
    connect_timeout: int = 5,
    application_name: str = "infrai-jobs",
    prepared_statements: bool = False,
) -> psycopg.Connection[Any]:
    """An autocommit connection, never refreshed; its failure ``LedgerUnavailable`` without the
    URL (nor the driver's error, which may quote it, chained). A malformed URL is refused first:
    its "host" may be the tail of a password, and connecting would send that to a resolver.
    Unless ``prepared_statements`` (DATABASE_PREPARED_STATEMENTS), nothing is prepared on the
    server: behind a transaction pooler the next transaction may meet a server without it."""
    reason = malformed_reason(url)
    if reason:
        raise _malformed_url(reason)
    try:
        conn = psycopg.connect(
            url, autocommit=True, connect_timeout=connect_timeout, application_name=application_name
        )
    except psycopg.ProgrammingError:  # libpq quotes a string it cannot parse whole, password too
        raise _malformed_url("libpq cannot parse it") from None
    except psycopg.Error as exc:
        detail = redact(one_line(str(exc)), url)
        if any(sign in detail for sign in _TLS_FAILURES):
            detail += (
                " (the server's certificate did not verify: sslrootcert, from DATABASE_CA_BUNDLE "
                "in AWS, must hold the CA that signed it, and the host must be a name on it)"
            )
        where = f"cannot connect to the ledger database at {describe(url)}"
        raise _busy_or_down(exc)(f"{where}: {detail}") from None
    if not prepared_statements:
        conn.prepare_threshold = None  # psycopg's default prepares a statement at its sixth run
    return conn


class LedgerConnector:
    """How every adapter connects, and how a warm environment picks up a rotated database secret:
    a failed connection is tried once more with the secret fetched again (``refresh``), the new
    URL kept. ``url`` is the current one, for redacting the errors met on its connections.
    ``options`` are ``connect_to_ledger``'s (``application_name``, ``prepared_statements``, ...)."""

    def __init__(
        self, url: str, *, refresh: Callable[[], str] | None = None, **options: Any
    ) -> None:
        self.url, self._refresh, self._options = url, refresh, options

    def __repr__(self) -> str:
        return f"LedgerConnector(<database url redacted>, {self._options})"

    def connect(self) -> psycopg.Connection[Any]:
        try:
            return self.connect_once()
        except DatabaseBusy:
            raise  # a full database: a fresh secret would not make room
        except LedgerUnavailable:
            fresh = fetch_again(self._refresh, self.url, "database secret")
            if fresh is None:
                raise
        logger.warning(
            "database connection failed; retrying once with the secret fetched again",
            extra={"action": "secret_refresh"},
        )
        self.url = fresh
        return self.connect_once()

    @contextmanager
    def session(self, doing: str) -> Iterator[psycopg.Connection[Any]]:
        """A connection for one piece of work, closed after it, its errors translated."""
        conn = self.connect()
        with ledger_errors(doing, self.url), conn:
            yield conn

    @contextmanager
    def transaction(self, doing: str) -> Iterator[psycopg.Connection[Any]]:
        """A ``session`` whose work is one transaction, committed when the body returns."""
        with self.session(doing) as conn, conn.transaction():
            yield conn

    def connect_once(self) -> psycopg.Connection[Any]:
        """A connection with the current URL, never refreshed (a last-chance clean-up)."""
        return connect_to_ledger(self.url, **self._options)


class LedgerAdapter:
    """What the ledger's adapters share: a ``LedgerConnector`` named ``APPLICATION_NAME`` in
    ``pg_stat_activity``, a repr without the URL, and, for those that keep one, a reusable
    connection (``_translated``) reopened when the server closed or broke it."""

    APPLICATION_NAME: ClassVar[str] = "infrai-jobs"
    # What the errors met on the reusable connection say was being done ("" for nothing).
    DOING: ClassVar[str] = ""
    _conn: psycopg.Connection[Any] | None = None

    def __init__(
        self, database_url: str, *, refresh_url: Callable[[], str] | None = None, **options: Any
    ) -> None:
        self._connector = LedgerConnector(
            database_url, application_name=self.APPLICATION_NAME, refresh=refresh_url, **options
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(<database url redacted>)"

    def close(self) -> None:
        if self._conn is not None:
            self._drop(self._conn)

    def _connection(self) -> psycopg.Connection[Any]:
        conn = self._conn
        if conn is not None and not conn.closed and not conn.broken:
            return conn
        if conn is not None:
            logger.warning("database connection lost; reconnecting", extra={"action": "reconnect"})
            conn.close()
        conn = self._connector.connect()
        try:
            self._opened(conn)
        except BaseException:
            conn.close()
            raise
        self._conn = conn
        return conn

    def _opened(self, conn: psycopg.Connection[Any]) -> None:
        """A new connection, before it is kept: an adapter checks what it needs here (a raise
        closes it)."""

    @contextmanager
    def _translated(
        self, on_broken: Callable[[], None] | None = None
    ) -> Iterator[psycopg.Connection[Any]]:
        """The reusable connection, its driver errors in the package's terms. A broken one runs
        ``on_broken``, then is dropped: the next call reconnects."""
        conn = self._connection()

        def broken() -> None:
            if on_broken is not None:
                on_broken()
            self._drop(conn)

        with ledger_errors(self.DOING, self._connector.url, on_broken=broken):
            yield conn

    def _drop(self, conn: psycopg.Connection[Any]) -> None:
        try:
            conn.close()
        finally:
            if self._conn is conn:
                self._conn = None


# The ledger's schema: SQL files NNNN_name.sql beside the one writer of job_claims (work/),
# shipped in the layer and applied only by the tools (`infrai-jobs migrate`), never by a function.
LEDGER_MIGRATIONS_FOLDER: Final = Path(__file__).parent.parent / "work" / "migrations"


def newest_migration(folder: Path) -> int:
    """The highest ``NNNN`` among ``folder``'s ``NNNN_*.sql`` files. It lists file names and
    reads none, so a cold start pays one directory listing."""
    versions = [int(path.name[:4]) for path in folder.glob("[0-9][0-9][0-9][0-9]_*.sql")]
    if not versions:
        raise FileNotFoundError(f"no ledger migration (NNNN_name.sql) in {folder}")
    return max(versions)


# The schema this code needs: the newest ledger migration, read from the files themselves.
SCHEMA_VERSION: Final = newest_migration(LEDGER_MIGRATIONS_FOLDER)


def table_exists(conn: psycopg.Connection[Any], table: str) -> bool:
    row = conn.execute("SELECT to_regclass(%s) IS NOT NULL", [table]).fetchone()
    return bool(row and row[0])


def current_version(conn: psycopg.Connection[Any]) -> int:
    if not table_exists(conn, "infrai_jobs_schema"):
        return 0
    version = conn.execute("SELECT coalesce(max(version), 0) FROM infrai_jobs_schema").fetchone()
    return int(version[0]) if version else 0


RUN_MIGRATE: Final = "run `infrai-jobs migrate` with DATABASE_URL pointing at it"


def ledger_error(exc: psycopg.Error, doing: str = "", url: str = "") -> LedgerError:
    """A driver error met while ``doing`` something, in the package's terms: a missing table
    or column is ``SchemaNotMigrated`` (never "unreachable"), a broken connection
    ``LedgerUnavailable``. The driver's text goes through ``redact``."""
    missing = isinstance(exc, psycopg.errors.UndefinedTable | psycopg.errors.UndefinedColumn)
    # A missing table's primary message alone (``relation "x" does not exist``), without the
    # statement the server quotes after it.
    text = (exc.diag.message_primary or str(exc).split("\n", 1)[0]) if missing else str(exc)
    detail = redact(one_line(text), url)
    where = f"{doing}: " if doing else ""
    if missing:
        return SchemaNotMigrated(
            f"{where}the ledger database is not migrated ({detail}): {RUN_MIGRATE}"
        )
    if isinstance(exc, psycopg.OperationalError):
        return _busy_or_down(exc)(f"{where}the ledger database failed: {detail}")
    return LedgerError(f"{where}the ledger rejected a statement: {detail}")


@contextmanager
def ledger_errors(
    doing: str = "", url: str = "", *, on_broken: Callable[[], None] | None = None
) -> Iterator[None]:
    """Driver errors raised inside, as ``ledger_error`` says them (redacted with ``url``): no
    other module catches a psycopg error. ``on_broken`` runs first on a broken connection
    (``OperationalError``), to drop it and do whatever else a lost answer asks for."""
    try:
        yield
    except psycopg.Error as exc:
        if on_broken is not None and isinstance(exc, psycopg.OperationalError):
            on_broken()
        raise ledger_error(exc, doing, url) from exc


@contextmanager
def savepoint_rollback_checked(what: str) -> Iterator[None]:
    """Around ``conn.transaction()`` whose body raises ``psycopg.Rollback`` to undo ``what``.
    psycopg lets its own ``Rollback`` out only when the rollback failed, that is when the
    connection broke: said as the ``OperationalError`` it is, so ``ledger_errors`` drops it."""
    try:
        yield
    except psycopg.Rollback as exc:
        raise psycopg.OperationalError(f"the connection failed while rolling back {what}") from exc


def array_literal(values: Iterable[str | uuid.UUID | datetime | float | None]) -> str:
    """A list parameter as the text of a one-dimensional PostgreSQL array (``%(name)s::text[]``):
    the same array to the server, without psycopg's element-by-element dumping: binding ten
    claims took about 160 µs of CPU that way, 30 µs this way. Inside a double-quoted element
    only ``\\`` and ``"`` are special; ``NULL`` unquoted is a null."""
    parts = []
    for value in values:
        if value is None:
            parts.append("NULL")
            continue
        text = value if isinstance(value, str) else str(value)
        if "\\" in text or '"' in text:
            text = text.replace("\\", "\\\\").replace('"', '\\"')
        parts.append(f'"{text}"')
    return "{" + ",".join(parts) + "}"


def storable_json(value: Any) -> Any:
    """``value`` if PostgreSQL's jsonb can hold it, else a description of it that it can: jsonb
    refuses NUL characters and lone surrogates, which a JSON body may carry. What the jsonb
    columns of ``claim_history`` and ``dead_letters`` hold, and what ``--json`` prints."""
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False)
        text.encode("utf-8")
    except (TypeError, ValueError, RecursionError):
        text = ""
    if text and "\\u0000" not in text:
        return value
    try:
        described = json.dumps(value, ensure_ascii=True, default=repr)
    except (TypeError, ValueError, RecursionError):
        described = f"<{type(value).__name__} that JSON cannot describe>"
    # ASCII text with every NUL and surrogate written as an escape: jsonb keeps it as text.
    return {"not_storable_as_jsonb": described}


_HISTORY: LiteralString = """
INSERT INTO claim_history (idem_key, action, actor, before, after, note)
VALUES (%(key)s, %(action)s, %(actor)s, %(before)s, %(after)s, %(note)s)
"""


def record_history(
    conn: psycopg.Connection[Any],
    key: str,
    action: str,
    *,
    actor: str,
    before: dict[str, Any] | None,
    after: dict[str, Any] | None,
    note: str,
) -> None:
    """The one writer of ``claim_history`` (append-only): one change to ``key``, before and
    after, in the caller's transaction, so the change and its record commit together."""
    params: dict[str, Any] = {"key": key, "action": action, "actor": actor, "note": note or None}
    params["before"] = None if before is None else Jsonb(before)
    params["after"] = None if after is None else Jsonb(after)
    conn.execute(_HISTORY, params)
