"""The small HTTP servers tests stand in for a provider or for Infrai with: a request handler
that answers JSON and writes no access log, and a context that serves one on 127.0.0.1 in a
thread. Importable from every test folder (pytest puts ``tests/`` on the path for its
``conftest.py``)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any


class QuietJsonHandler(BaseHTTPRequestHandler):
    """A handler whose answers are JSON; the test's output stays free of request lines."""

    def log_message(self, format: str, *args: Any) -> None:
        return

    def send_json(self, status: int, body: bytes) -> None:
        """Answer ``status`` with ``body``, JSON already encoded, and its length."""
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@contextmanager
def serving(server: HTTPServer) -> Iterator[str]:
    """``server`` (bound to 127.0.0.1) serving in a daemon thread: yields its base URL, and
    shuts it down and closes it afterwards."""
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
