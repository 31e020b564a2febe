"""``infrai-jobs console``: serve the operator console until Ctrl-C.

It reads the settings the on-call commands read (``DATABASE_URL``, ``INFRAI_*``), refuses to
start without a real ledger and queue, and listens on 127.0.0.1 unless ``--bind`` names another
address (with a warning). The URL it prints once carries this start's token.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from werkzeug.serving import BaseWSGIServer, WSGIRequestHandler, make_server

from infrai_jobs.config.settings import AlertSettings, DrainSettings
from infrai_jobs.errors import ConfigurationError
from infrai_jobs.runtime.factory import ledger_url, make_queue_client, with_secrets
from infrai_local.cli import ops_context
from infrai_local.cli_ops import add_jobs_path
from infrai_local.console.commands import CommandBackend, ConsoleLedger
from infrai_local.console.guard import Guard, is_loopback, new_token
from infrai_local.console.views import create_app

DEFAULT_PORT = 8780

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


class _QuietHandler(WSGIRequestHandler):
    """One line per request on stderr, without the query string: the first one carries the
    token."""

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        path = self.path.split("?", 1)[0]
        print(f"console: {self.command} {path} {code}", file=sys.stderr, flush=True)


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
        "answers, deferred work, one key's history, a chart of outcomes. Read-only unless "
        "--allow-actions; each action runs the same code as its command and is recorded in "
        "claim_history with the operator's name (OPERATOR, else the login name).",
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
        "--allow-actions",
        action="store_true",
        help="allow redrive, discard, resolve, release, probe, run-now and cancel from the page "
        "(POSTs carrying this start's token)",
    )
    add_jobs_path(parser, "a code root holding the `jobs` package whose keys and probes to use")
    args = parser.parse_args(list(argv))
    if not 0 <= args.port <= 65535:
        parser.error("--port must be between 0 and 65535")
    return args


def build(args: argparse.Namespace) -> tuple[BaseWSGIServer, Guard, Callable[[], None]]:
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
        server = make_server(args.bind, args.port, late, request_handler=_QuietHandler)
    except BaseException:
        client.close()
        raise
    guard = Guard(
        token=new_token(),
        port=server.server_port,
        bind=args.bind,
        allow_actions=args.allow_actions,
    )
    late.app = create_app(backend, guard)
    return server, guard, client.close


def page_url(guard: Guard) -> str:
    host = "127.0.0.1" if is_loopback(guard.bind) else guard.bind
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{guard.port}/?token={guard.token}"


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
    from infrai_local.operator import default_actor  # noqa: PLC0415 - read when acting

    return default_actor()
