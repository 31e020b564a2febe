"""``infrai-jobs emulator`` and ``python -m infrai_local.sandbox.emulator``: serve until stopped."""

from __future__ import annotations

import argparse
import contextlib
import math
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from decimal import Decimal
from types import FrameType
from typing import TextIO

from infrai_jobs.config.redis_url import is_loopback_host
from infrai_local.sandbox.emulator.http import DEFAULT_HOST, DEFAULT_PORT, start_in_thread
from infrai_local.sandbox.emulator.state import (
    DEFAULT_VISIBILITY_TIMEOUT,
    price_text,
)
from infrai_local.sandbox.queue_model import DEFAULT_PUBLISH_PRICE_USD, ApiError


def serve(
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    api_key: str | None = None,
    visibility_timeout: float = DEFAULT_VISIBILITY_TIMEOUT,
    *,
    publish_price_usd: str | Decimal = DEFAULT_PUBLISH_PRICE_USD,
    verbose: bool = False,
    out: TextIO | None = None,
) -> None:
    """Serve in the foreground until SIGINT or SIGTERM.

    The URL is the first line written to ``out`` (stdout), flushed at once, because callers
    that start the emulator with port 0 read it to learn the port.
    """
    stop = threading.Event()
    running = start_in_thread(
        host,
        port,
        api_key=api_key,
        visibility_timeout=visibility_timeout,
        publish_price_usd=publish_price_usd,
        verbose=verbose,
    )
    with running, _stop_on_signals(stop):
        print(running.url, file=out or sys.stdout, flush=True)
        auth = "only the --api-key token" if api_key else "any bearer token"
        print(f"infrai emulator: serving {running.url}, accepting {auth}", file=sys.stderr)
        if not api_key and not _loopback_only(host):
            print(exposed_warning(host), file=sys.stderr, flush=True)
        while not stop.wait(timeout=1.0):
            pass


def _loopback_only(host: str) -> bool:
    """Whether ``host`` binds loopback only ("0.0.0.0", "::" and a LAN address do not)."""
    return is_loopback_host(host)


def exposed_warning(host: str) -> str:
    """The loud line for an emulator reachable beyond this machine that takes any token."""
    return (
        f"WARNING: the emulator listens on {host}, beyond loopback, and accepts ANY bearer "
        "token: anyone who can reach this port can publish, consume and ack. Give --api-key "
        "TOKEN to accept one token only, or serve on 127.0.0.1"
    )


@contextlib.contextmanager
def _stop_on_signals(stop: threading.Event) -> Iterator[None]:
    """Turn SIGINT/SIGTERM into a clean stop; only the main thread may install handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handle(_signum: int, _frame: FrameType | None) -> None:
        # Set from another thread: the handler runs on the main thread, which may be inside
        # ``stop.wait`` holding the Event's lock (not reentrant), and would wait on itself.
        threading.Thread(target=stop.set, daemon=True).start()

    previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError("must be a number of seconds above 0")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError("must be from 0 to 65535 (0 picks a free port)")
    return value


def build_parser(prog: str = "infrai-jobs emulator") -> argparse.ArgumentParser:
    """The command line of ``infrai-jobs emulator`` and
    ``python -m infrai_local.sandbox.emulator``."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Serve a local Infrai queue (the contract in docs/infrai-api.md) until Ctrl-C. "
        "Prints the URL it serves on as its first line.",
    )
    parser.add_argument("--host", default=DEFAULT_HOST, help="default: %(default)s")
    parser.add_argument(
        "--port",
        type=_port,
        default=DEFAULT_PORT,
        help="0 picks a free port (default: %(default)s)",
    )
    parser.add_argument(
        "--api-key", default=None, help="accept only this bearer token (default: any non-empty)"
    )
    parser.add_argument(
        "--visibility-timeout",
        type=_positive_seconds,
        default=DEFAULT_VISIBILITY_TIMEOUT,
        metavar="SECONDS",
        help="visibility timeout of new queues (default: %(default)g)",
    )
    parser.add_argument(
        "--publish-price",
        default=DEFAULT_PUBLISH_PRICE_USD,
        metavar="USD",
        help="per-message publish price that discovery reports (default: %(default)s)",
    )
    parser.add_argument("--verbose", action="store_true", help="log every request to stderr")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parse ``argv`` (without the program name), serve, exit 0 on a signal."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        price = price_text(args.publish_price)
    except ApiError as error:
        parser.error(f"--publish-price: {error.message}")
    try:
        serve(
            args.host,
            args.port,
            api_key=args.api_key,
            visibility_timeout=args.visibility_timeout,
            publish_price_usd=price,
            verbose=args.verbose,
        )
    except OSError as error:
        print(
            f"infrai emulator: cannot serve on {args.host}:{args.port}: {error.strerror or error}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
