"""The emulator's HTTP server: the standard library's ``ThreadingHTTPServer`` on loopback, one
thread per connection, answering in Infrai's envelopes, one write per answer.

The stdlib reads requests (request line, headers, ``Expect: 100-continue``, keep-alive, its own
400/414/431/501/505 pages); this module reads bodies, applies faults and formats answers.
"""

from __future__ import annotations

import contextlib
import email.utils
import functools
import re
import socket
import socketserver
import sys
import threading
import time
import traceback
from collections.abc import Mapping
from decimal import Decimal
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Final
from urllib.parse import urlsplit

from infrai_local.sandbox.emulator.routes import (
    CONTROL_ENDPOINTS,
    Endpoint,
    bearer_token,
    match_api_route,
)
from infrai_local.sandbox.emulator.state import (
    DEFAULT_VISIBILITY_TIMEOUT,
    Emulator,
    EmulatorClock,
    FaultDecision,
)
from infrai_local.sandbox.queue_model import (
    DEFAULT_PUBLISH_PRICE_USD,
    ApiError,
    JsonObject,
    encode_answer,
    invalid,
)

DEFAULT_HOST: Final = "127.0.0.1"
DEFAULT_PORT: Final = 8765
MAX_BODY_BYTES: Final = 11 * 1024 * 1024
_CONTENT_LENGTH: Final = re.compile(r"[0-9]{1,20}")
# A connection that sends nothing for this long (from its last answer) is closed, so forgotten
# keep-alive clients cannot pile up threads.
_IDLE_CONNECTION_SECONDS: Final = 60.0


@functools.lru_cache(maxsize=4)
def _http_date(unix_second: int) -> str:
    """The Date header; the stdlib formats it anew for every answer, this once a second."""
    return email.utils.formatdate(unix_second, usegmt=True)


@functools.lru_cache(maxsize=64)
def _status_line(protocol: str, status: int) -> str:
    reason = BaseHTTPRequestHandler.responses.get(status, ("",))[0]
    return f"{protocol} {status} {reason}"


class _RequestHandler(BaseHTTPRequestHandler):
    """Reads bodies, applies faults, formats envelopes; the state lives in the Emulator."""

    protocol_version = "HTTP/1.1"
    server_version = "infrai-emulator/0.1"
    # Answers go out in one write, the stdlib's own error pages in several: with Nagle on, the
    # client's delayed ACK would stall them by ~40 ms.
    disable_nagle_algorithm = True

    def setup(self) -> None:
        super().setup()
        # Read at each connection, so a test can shorten it. The stdlib ends a connection
        # whose next request line does not come in time (quietly: log_message is off).
        self.connection.settimeout(_IDLE_CONNECTION_SECONDS)

    def version_string(self) -> str:
        # Not the Python version: nothing about the host belongs in a header.
        return self.server_version

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_PATCH(self) -> None:
        self._dispatch("PATCH")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def log_message(self, format: str, *args: Any) -> None:
        # Quiet unless --verbose. The request line never holds the token (it is a header).
        if self._http_server.verbose:
            super().log_message(format, *args)

    @property
    def _http_server(self) -> EmulatorHTTPServer:
        server = self.server
        assert isinstance(server, EmulatorHTTPServer)
        return server

    @property
    def _emulator(self) -> Emulator:
        return self._http_server.emulator

    def _dispatch(self, method: str) -> None:
        """Serve one request; a bug becomes a 500 instead of a hang."""
        try:
            self._serve(method)
        except OSError:
            # The client went away or timed out mid-request; nothing left to answer.
            self.close_connection = True
        except Exception:  # noqa: BLE001 - the one place a bug becomes a 500 instead of a hang
            traceback.print_exc(file=sys.stderr)
            self.close_connection = True
            with contextlib.suppress(OSError):
                self._send_error(ApiError(500, "INTERNAL", "emulator bug; see its stderr"))

    def _serve(self, method: str) -> None:
        raw = self._read_body()
        if raw is None:
            return
        path = urlsplit(self.path).path
        if path.startswith("/_emulator/"):
            self._serve_control(method, path, raw)
        elif path == "/v1" or path.startswith("/v1/"):
            self._serve_api(method, path, raw)
        else:
            self._send_error(ApiError(404, "NOT_FOUND", f"no route {method} {path}"))

    def _read_body(self) -> bytes | None:
        """The request body, or None after answering a body we will not read."""
        if self.headers.get("Transfer-Encoding"):
            self.close_connection = True
            self._send_error(ApiError(411, "LENGTH_REQUIRED", "send a Content-Length body"))
            return None
        length_header = (self.headers.get("Content-Length") or "0").strip()
        if not _CONTENT_LENGTH.fullmatch(length_header):
            self.close_connection = True
            self._send_error(invalid("Content-Length must be a non-negative integer"))
            return None
        length = int(length_header)
        if length > MAX_BODY_BYTES:
            # Not reading it leaves the connection unusable, so it is closed after the answer.
            self.close_connection = True
            self._send_error(
                ApiError(413, "PAYLOAD_TOO_LARGE", f"request body over {MAX_BODY_BYTES} bytes")
            )
            return None
        return self.rfile.read(length) if length else b""

    def _serve_control(self, method: str, path: str, raw: bytes) -> None:
        endpoint = CONTROL_ENDPOINTS.get(path)
        if endpoint is None:
            self._send_error(ApiError(404, "NOT_FOUND", f"no route {method} {path}"))
            return
        self._send_answer(*self._apply(endpoint, method, raw, ""))

    def _serve_api(self, method: str, path: str, raw: bytes) -> None:
        matched = match_api_route(path)
        self._emulator.count_request(matched[0].name if matched else "unmatched")
        token = bearer_token(self.headers.get("Authorization"))
        if not self._emulator.accepts_token(token):
            # The message is fixed text: whatever token was sent is never echoed.
            self._send_error(ApiError(401, "UNAUTHORIZED", "missing or invalid bearer token"))
            return
        if matched is None:
            self._send_error(ApiError(404, "NOT_FOUND", f"no route {method} {path}"))
            return
        endpoint, param = matched
        if method not in endpoint.handlers:
            self._send_answer(*self._apply(endpoint, method, raw, param))
            return
        decision = self._emulator.decide_faults(endpoint.name)
        # The answer, and any next request on this connection, wait until the latency has
        # passed; other connections have threads of their own. A stopping server answers
        # nothing more, and a call still waiting is not applied.
        if decision.latency_seconds > 0 and self._http_server.stopping.wait(
            decision.latency_seconds
        ):
            self.close_connection = True
            return
        self._finish_api(endpoint, method, raw, param, decision)

    def _finish_api(
        self, endpoint: Endpoint, method: str, raw: bytes, param: str, decision: FaultDecision
    ) -> None:
        if self._answer_injected_fault(decision):
            return
        answer = self._apply(endpoint, method, raw, param)
        if decision.drop_response and answer[0] == 200:
            # The call was applied; the client must not learn it (a lost response).
            self._emulator.record_dropped_response()
            self.close_connection = True
            return
        self._send_answer(*answer)

    def _answer_injected_fault(self, decision: FaultDecision) -> bool:
        """Answer an injected 500 or 429 without applying the call; True if one was sent."""
        if decision.error:
            self._send_error(ApiError(500, "INTERNAL", "injected fault: internal error"))
            return True
        if decision.rate_limited:
            seconds = decision.retry_after_seconds
            self._send_error(
                ApiError(429, "RATE_LIMITED", f"rate limited; retry after {seconds} s"),
                headers={"Retry-After": str(seconds)},
            )
            return True
        return False

    def _apply(
        self, endpoint: Endpoint, method: str, raw: bytes, param: str
    ) -> tuple[int, JsonObject, dict[str, str]]:
        """Run a route; an ApiError becomes its envelope."""
        handler = endpoint.handlers.get(method)
        if handler is None:
            error = ApiError(405, "METHOD_NOT_ALLOWED", f"{method} is not allowed here")
            return error.status, error.envelope(), {"Allow": endpoint.allowed()}
        try:
            return 200, {"ok": True, "data": handler(self._emulator, raw, param)}, {}
        except ApiError as error:
            return error.status, error.envelope(), {}

    def _send_error(self, error: ApiError, headers: Mapping[str, str] | None = None) -> None:
        self._send_answer(error.status, error.envelope(), headers or {})

    def _send_answer(self, status: int, document: JsonObject, headers: Mapping[str, str]) -> None:
        """Status line, headers and body in one write (one syscall), with the bytes the
        stdlib's send_response/send_header/end_headers would send in several."""
        body = encode_answer(document)
        if self._http_server.verbose:
            self.log_request(status)
        if self.request_version == "HTTP/0.9":
            # Such a request gets the body alone: HTTP/0.9 has no status line or headers.
            self.wfile.write(body)
            return
        lines = [
            _status_line(self.protocol_version, status),
            f"Server: {self.version_string()}",
            f"Date: {_http_date(int(time.time()))}",
            "Content-Type: application/json",
            f"Content-Length: {len(body)}",
        ]
        lines.extend(f"{name}: {value}" for name, value in headers.items())
        if self.close_connection:
            lines.append("Connection: close")
        lines.append("\r\n")
        self.wfile.write("\r\n".join(lines).encode("latin-1") + body)


class EmulatorHTTPServer(ThreadingHTTPServer):
    """HTTP/1.1 with keep-alive, a daemon thread per connection; injected latency waits in
    the connection's own thread, so other connections are served meanwhile."""

    daemon_threads = True
    # A drain opening its lanes' connections at once must not overflow the accept queue: each
    # dropped SYN costs the client a second (the first TCP retransmission).
    request_queue_size = 128

    def __init__(
        self, address: tuple[str, int], emulator: Emulator, *, verbose: bool = False
    ) -> None:
        self.emulator = emulator
        self.verbose = verbose
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        # Set when stopping: requests waiting out injected latency give up.
        self.stopping = threading.Event()
        self._open: set[socket.socket] = set()
        self._open_lock = threading.Lock()
        super().__init__(address, _RequestHandler)

    def server_bind(self) -> None:
        # Not HTTPServer's: loopback needs no name lookup, the address is the name.
        socketserver.TCPServer.server_bind(self)
        host, port = self.socket.getsockname()[:2]
        self.server_name = str(host)
        self.server_port = int(port)

    @property
    def url(self) -> str:
        """The base URL clients use, with the real port when 0 was asked for."""
        host = f"[{self.server_name}]" if ":" in self.server_name else self.server_name
        return f"http://{host}:{self.server_port}"

    def process_request(self, request: Any, client_address: Any) -> None:
        self.emulator.count_connection()
        with self._open_lock:
            self._open.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._open_lock:
            self._open.discard(request)
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that went away costs its connection, quietly; a bug costs its connection,
        # with a traceback, never the server.
        if isinstance(sys.exc_info()[1], OSError):
            return
        traceback.print_exc(file=sys.stderr)

    def shutdown(self) -> None:
        """Stop ``serve_forever`` and wait until it has returned (call from another thread)."""
        self.stopping.set()
        super().shutdown()

    def close_connections(self) -> None:
        """End every client connection (after ``shutdown``); their threads then finish."""
        with self._open_lock:
            open_sockets = list(self._open)
        for sock in open_sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def server_close(self) -> None:
        super().server_close()
        self.close_connections()


class RunningEmulator:
    """An emulator serving in a background thread; ``stop()`` (or ``with``) ends it."""

    def __init__(self, server: EmulatorHTTPServer, thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread
        self._stopped = False

    @property
    def emulator(self) -> Emulator:
        """The state behind the server, for in-process inspection and control."""
        return self._server.emulator

    @property
    def host(self) -> str:
        return self._server.server_name

    @property
    def port(self) -> int:
        return self._server.server_port

    @property
    def url(self) -> str:
        """e.g. ``http://127.0.0.1:8765`` (no trailing slash)."""
        return self._server.url

    def stop(self) -> None:
        """Stop serving, end open connections and wait for the serving thread; idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self._server.shutdown()
        self._server.server_close()  # closes the connections too
        self._thread.join(timeout=5)

    def __enter__(self) -> RunningEmulator:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"RunningEmulator(url={self.url!r})"


def start_in_thread(
    host: str = DEFAULT_HOST,
    port: int = 0,
    *,
    api_key: str | None = None,
    visibility_timeout: float = DEFAULT_VISIBILITY_TIMEOUT,
    publish_price_usd: str | Decimal = DEFAULT_PUBLISH_PRICE_USD,
    clock: EmulatorClock | None = None,
    verbose: bool = False,
) -> RunningEmulator:
    """Serve a fresh emulator from a daemon thread; port 0 picks a free port (see ``.url``)."""
    emulator = Emulator(
        api_key=api_key,
        visibility_timeout=visibility_timeout,
        publish_price_usd=publish_price_usd,
        clock=clock,
    )
    server = EmulatorHTTPServer((host, port), emulator, verbose=verbose)
    thread = threading.Thread(
        target=server.serve_forever,
        kwargs={"poll_interval": 0.05},
        name=f"infrai-emulator-{server.server_port}",
        daemon=True,
    )
    thread.start()
    return RunningEmulator(server, thread)
