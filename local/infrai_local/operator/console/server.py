"""``infrai-jobs console``: serve the operator console until Ctrl-C.

It reads the settings the on-call commands read (``DATABASE_URL``, ``INFRAI_*``), refuses to
start without a real ledger and queue, and listens on 127.0.0.1 unless ``--bind`` names another
address (with a warning; off loopback it answers only to the name ``--hostname`` gives). The URL
it prints once carries this start's token, and connects.

Each connection is served on a thread of its own, and a connection that sends nothing for
``IDLE_TIMEOUT`` seconds (or does not take its answer) is closed: a client that opens a request
and waits, or an action that waits on a slow provider, holds up no other page.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable, Sequence
from http import HTTPStatus
from typing import Any

from werkzeug.serving import ThreadedWSGIServer, WSGIRequestHandler

from infrai_jobs.config.settings import AlertSettings, DrainSettings
from infrai_jobs.errors import ConfigurationError
from infrai_jobs.runtime.factory import ledger_url, make_queue_client, with_secrets
from infrai_local.cli import ops_context
from infrai_local.operator.cli_ops import add_jobs_path
from infrai_local.operator.console.commands import CommandBackend, ConsoleLedger
from infrai_local.operator.console.guard import (
    Guard,
    hostname_refusal,
    is_loopback,
    is_wildcard,
    new_token,
)
from infrai_local.operator.console.views import create_app

DEFAULT_PORT = 8780
# Seconds a connection may keep the server waiting for the rest of its request, or for taking
# its answer: long enough for an operator's slow link, short enough that idle ones go.
IDLE_TIMEOUT = 15.0

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


class _QuietHandler(WSGIRequestHandler):
    """One line per request on stderr, without the query string: the first one carries the
    token. A request the server cannot read is refused with 400 and one line that quotes
    nothing of it (its request line may hold the token)."""

    # A request line that cannot be read is answered as HTTP/1.0, with a status line and
    # headers (the standard library would assume HTTP/0.9: a bare body, no status).
    default_request_version = "HTTP/1.0"

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        path = getattr(self, "path", None)
        if path is None:  # the request line could not be read; log_error has said so
            return
        path = path.split("?", 1)[0]
        print(f"console: {self.command} {path} {code}", file=sys.stderr, flush=True)

    def log_error(self, format: str, *args: Any) -> None:
        if format.startswith("Request timed out"):
            what = f"closed a connection that sent no complete request within {self.timeout:g} s"
        else:  # send_error's "code %d, message %s"; the message may quote the request line
            code = args[0] if args and isinstance(args[0], int) else HTTPStatus.BAD_REQUEST
            what = f"refused a request it could not read ({code})"
        print(f"console: {what}", file=sys.stderr, flush=True)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        # An HTTP version this server does not speak is a request line it cannot read, as junk
        # is: both are 400 (the standard library would say 505 for the first).
        if code == HTTPStatus.HTTP_VERSION_NOT_SUPPORTED:
            code = HTTPStatus.BAD_REQUEST
        super().send_error(code, message, explain)


class ConsoleServer(ThreadedWSGIServer):
    """Werkzeug's threaded server, with a timeout per connection and no traceback on stderr."""

    def __init__(
        self, host: str, port: int, app: WsgiApp, *, idle_timeout: float = IDLE_TIMEOUT
    ) -> None:
        """Bound to ``host``:``port`` (0 picks a free one), not yet serving."""
        # The handler's ``timeout`` bounds every read and write on its connection.
        handler = type("_TimedHandler", (_QuietHandler,), {"timeout": idle_timeout})
        super().__init__(host, port, app, handler=handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # What escaped a connection's thread (the app's own errors are pages already).
        kind = sys.exc_info()[0]
        name = kind.__name__ if kind else "error"
        print(f"console: a connection failed ({name}); the others go on", file=sys.stderr)


class _Late:
    """The WSGI app, set once the server's port is known (``--port 0`` picks a free one)."""

    app: WsgiApp | None = None

    def __call__(self, environ: dict[str, Any], start: Callable[..., Any]) -> Iterable[bytes]:
        assert self.app is not None
        return self.app(environ, start)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="infrai-jobs console",
        description="Serve the operator console: dead letters, stuck claims with their probes' "
        "answers, deferred work, one key's history, a chart of outcomes. It changes no claim "
        "unless --allow-actions (a page load still moves new letters from Infrai's DLQ into the "
        "ledger, as `infrai-jobs dlq` does); each action runs the same code as its command "
        "and is recorded in claim_history with the operator's name (OPERATOR, else the login "
        "name).",
    )
    parser.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"default {DEFAULT_PORT}; 0 picks a free one"
    )
    parser.add_argument(
        "--bind",
        default="127.0.0.1",
        metavar="ADDRESS",
        help="the address to listen on (default 127.0.0.1). Any other address lets whoever "
        "reaches it over plain HTTP read the ledger with the token: a warning is printed",
    )
    parser.add_argument(
        "--hostname",
        default="",
        metavar="NAME",
        help="off loopback, the name or address your browser reaches the console by: the URL "
        "printed names it, and requests naming anything else are refused. Required with a "
        "--bind on every address (0.0.0.0, ::); else the --bind address",
    )
    parser.add_argument(
        "--allow-actions",
        action="store_true",
        help="allow redrive, discard, resolve, release, probe, run-now and cancel from the page "
        "(POSTs carrying this start's token)",
    )
    add_jobs_path(parser, "a code root holding the `jobs` package whose keys and probes to use")
    args = parser.parse_args(list(argv))
    if not 0 <= args.port <= 65535:
        parser.error("--port must be between 0 and 65535")
    refusal = _bind_refusal(args.bind, args.hostname)
    if refusal:
        parser.error(refusal)
    return args


def _bind_refusal(bind: str, hostname: str) -> str:
    """Why ``--bind`` and ``--hostname`` cannot go together, or ""."""
    if hostname and is_loopback(bind):
        return (
            f"--hostname is for a console reachable beyond this machine; on {bind} it answers "
            "to 127.0.0.1, localhost and [::1]"
        )
    if hostname:
        refusal = hostname_refusal(hostname)
        return f"--hostname: {refusal}" if refusal else ""
    if is_wildcard(bind):
        return (
            f"--bind {bind or '(empty)'} listens on every address of this machine, and the "
            "console cannot tell which one your browser will use: give --hostname NAME, the "
            "name or address you will open it at (the URL it prints names it, and requests "
            "naming anything else are refused), or --bind that address"
        )
    return ""


def build(args: argparse.Namespace) -> tuple[ConsoleServer, Guard, Callable[[], None]]:
    """The server (bound, not yet serving), its guard and what closes its clients."""
    settings = with_secrets(DrainSettings.from_env()).settings
    if not settings.infrai_base_url:
        raise ConfigurationError(
            "`infrai-jobs console` needs INFRAI_BASE_URL: point it at Infrai (or a running "
            "`infrai-jobs emulator`)"
        )
    url = ledger_url(settings)
    client = make_queue_client(settings)
    try:
        ledger = ConsoleLedger(url)
        # Before the URL is printed: a ledger that cannot be reached is one line, not a page.
        ledger.list_claims(limit=1)
        backend = CommandBackend(
            ops_context(settings, args.jobs_path, lambda: client),
            ledger,
            client,
            watched=AlertSettings.from_env().watched_queues,
        )
        late = _Late()
        server = ConsoleServer(args.bind, args.port, late)
    except BaseException:
        client.close()
        raise
    guard = Guard(
        token=new_token(),
        port=server.server_port,
        bind=args.bind,
        allow_actions=args.allow_actions,
        hostname=args.hostname,
    )
    late.app = create_app(backend, guard)
    return server, guard, client.close


def page_url(guard: Guard) -> str:
    """The URL to open: where the console listens (its ``--hostname`` off loopback)."""
    return f"{guard.own_origin}/?token={guard.token}"


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    if not is_loopback(args.bind):
        print(
            f"warning: --bind {args.bind}: the console is reachable beyond this machine, over "
            "plain HTTP; anyone who gets the URL below can read the ledger"
            + (" and act on it" if args.allow_actions else ""),
            file=sys.stderr,
            flush=True,
        )
    server, guard, close = build(args)
    try:
        mode = (
            f"actions allowed, recorded in claim_history as {server_actor()}"
            if guard.allow_actions
            else "read-only (--allow-actions to act)"
        )
        print(f"console: {mode}; Ctrl-C stops it", file=sys.stderr, flush=True)
        # Once, on stdout: the one place this start's token is shown.
        print(page_url(guard), flush=True)
        server.serve_forever()
    except KeyboardInterrupt:
        print("console: stopped", file=sys.stderr)
    finally:
        server.server_close()
        close()
    return 0


def server_actor() -> str:
    from infrai_local.operator.verbs import default_actor  # noqa: PLC0415 - read when acting

    return default_actor()
