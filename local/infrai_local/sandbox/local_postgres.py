"""``infrai-jobs postgres``: an embedded PostgreSQL that stays up, for trying things by hand.

The other commands start a throwaway server only in a sandbox and only for their own run; a
walkthrough needs one that outlives them. This serves the same embedded server (unix socket
only, in a private temporary directory) until Ctrl-C or SIGTERM, prints its URL first, and can
write it to a file once it accepts connections. Its data is removed when it stops.
"""

from __future__ import annotations

import argparse
import signal
import threading
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from infrai_local.sandbox.embedded_db import EmbeddedPostgres, check_database_url


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="infrai-jobs postgres",
        description="Serve an embedded PostgreSQL until Ctrl-C or SIGTERM; prints its "
        "DATABASE_URL first. Its data is removed when it stops.",
    )
    parser.add_argument(
        "--url-file",
        type=Path,
        help="also write the URL to this file once the server answers (removed at stop)",
    )
    args = parser.parse_args(argv)
    stop = threading.Event()

    def on_signal(_signum: int, _frame: FrameType | None) -> None:
        # From another thread, as the emulator's handler does: this thread may hold the
        # Event's lock inside ``stop.wait``, and setting it here would wait on itself.
        threading.Thread(target=stop.set, daemon=True).start()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    server = EmbeddedPostgres()
    try:
        url = server.start()
        check_database_url(url)
        print(url, flush=True)
        if args.url_file is not None:
            args.url_file.parent.mkdir(parents=True, exist_ok=True)
            partial = args.url_file.with_name(args.url_file.name + ".partial")
            partial.write_text(url + "\n")
            partial.replace(args.url_file)  # whole or absent, never half written
        while not stop.wait(1.0):
            pass
    finally:
        server.stop()
        if args.url_file is not None:
            args.url_file.unlink(missing_ok=True)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
