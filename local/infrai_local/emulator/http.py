"""The emulator's HTTP server: a selector loop on loopback that parses requests the way
http.client would send them and answers in Infrai's envelopes, one write per answer."""

from __future__ import annotations

import contextlib
import email.parser
import email.utils
import functools
import heapq
import http.client
import io
import re
import selectors
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from decimal import Decimal
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import Any, Final
from urllib.parse import urlsplit

from infrai_jobs.queue_contract import (
    DEFAULT_PUBLISH_PRICE_USD,
)
from infrai_local.emulator.routes import (
    CONTROL_ENDPOINTS,
    Endpoint,
    bearer_token,
    match_api_route,
)
from infrai_local.emulator.state import (
    DEFAULT_VISIBILITY_TIMEOUT,
    Emulator,
    EmulatorClock,
    FaultDecision,
)
from infrai_local.queue_model import ApiError, JsonObject, encode_answer, invalid

DEFAULT_HOST: Final = "127.0.0.1"
DEFAULT_PORT: Final = 8765
MAX_BODY_BYTES: Final = 11 * 1024 * 1024
_CONTENT_LENGTH: Final = re.compile(r"[0-9]{1,20}")
# Idle keep-alive connections are closed after this long so forgotten clients cannot pile up.
_IDLE_CONNECTION_SECONDS: Final = 60.0
# Bytes a connection may pile up while one of its requests waits out injected latency.
_INBOX_WHILE_BUSY: Final = 1024 * 1024

# The stdlib reads request headers with the email package, which was the largest share of this
# server's CPU per request. The handler below reads them itself and keeps the stdlib's answers
# for everything unusual, so a client sees the same server as before, only cheaper.

# http.client's limits on request headers (its private _MAXLINE and _MAXHEADERS): a longer
# line answers 431 "Line too long"; more lines than this, counting the blank line that ends
# them, answer 431 "Too many headers".
_MAX_HEADER_LINE: Final = 65_536
_MAX_HEADER_LINES: Final = 100
_END_OF_HEADERS: Final = frozenset({b"\r\n", b"\n", b""})
# A header line the email parser reads as plain ``name: value``: a name of visible characters
# other than ':' and a value with no CR or LF inside (the email parser breaks lines at a lone
# CR as well). Any other line (folded, nameless, "From ...", a name with spaces or bytes above
# 0x7e) sends the whole block through the email parser, so it is read exactly as before.
_SIMPLE_HEADER_LINE: Final = re.compile(rb"([!-9;-~]+):[ \t]*([^\r\n]*)\r?\n?")


class RequestHeaders:
    """A request's headers by name, case-insensitive; of repeated names the first one counts
    (as ``email.message.Message.get`` answers, which the handler used before)."""

    __slots__ = ("_values",)

    def __init__(self, pairs: Iterable[tuple[str, str]] = ()) -> None:
        values: dict[str, str] = {}
        for name, value in pairs:
            values.setdefault(name.lower(), value)
        self._values = values

    def get(self, name: str, default: str | None = None) -> str | None:
        """The value of header ``name`` in any case, or ``default``."""
        return self._values.get(name.lower(), default)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in self._values

    def __repr__(self) -> str:
        # Names only: the Authorization value is a secret.
        return f"RequestHeaders({sorted(self._values)})"


def parse_header_lines(lines: Sequence[bytes]) -> RequestHeaders:
    """Headers from the raw lines ``http.client`` would have read, the blank one included.

    Plain ``name: value`` lines are split here; a block with any other line goes through the
    email parser, exactly as ``http.client.parse_headers`` feeds it.
    """
    pairs: list[tuple[str, str]] = []
    for line in lines:
        if line in _END_OF_HEADERS:
            break
        match = _SIMPLE_HEADER_LINE.fullmatch(line)
        if match is None:
            return _parse_with_email(lines)
        pairs.append((match[1].decode("latin-1"), match[2].decode("latin-1")))
    return RequestHeaders(pairs)


def _parse_with_email(lines: Sequence[bytes]) -> RequestHeaders:
    text = b"".join(lines).decode("iso-8859-1")
    message = email.parser.Parser(_class=http.client.HTTPMessage).parsestr(text)
    # Decoded as latin-1, a value never holds surrogates, so every value is a plain str.
    return RequestHeaders((name, str(value)) for name, value in message.items())


def _http_version(text: str) -> tuple[int, int] | None:
    """``HTTP/<major>.<minor>`` as numbers, or None where the stdlib answers "Bad request
    version": exactly one dot, digits only, at most 10 of them on each side."""
    if not text.startswith("HTTP/"):
        return None
    parts = text[len("HTTP/") :].split(".")
    if len(parts) != 2 or not all(part.isdigit() and len(part) <= 10 for part in parts):
        return None
    try:
        return int(parts[0]), int(parts[1])
    except ValueError:
        # isdigit() admits digits int() refuses, such as a latin-1 superscript two.
        return None


@functools.lru_cache(maxsize=4)
def _http_date(unix_second: int) -> str:
    """The Date header; the stdlib formats it anew for every answer, this once a second."""
    return email.utils.formatdate(unix_second, usegmt=True)


@functools.lru_cache(maxsize=64)
def _status_line(protocol: str, status: int) -> str:
    reason = BaseHTTPRequestHandler.responses.get(status, ("",))[0]
    return f"{protocol} {status} {reason}"


class _RequestHandler(BaseHTTPRequestHandler):
    """Parses HTTP, applies faults, formats envelopes; the state lives in the Emulator."""

    protocol_version = "HTTP/1.1"
    server_version = "infrai-emulator/0.1"
    # Set by handle_one_request (typeshed does not declare it) and parse_request; the handler
    # reads headers only through ``request_headers``, never the stdlib's ``headers``.
    raw_requestline: bytes
    request_headers: RequestHeaders
    # Set when the answer waits for injected latency: (seconds, the rest of the request).
    deferred: tuple[float, Callable[[], None]] | None = None
    # Set by the server when it already sent this request's "100 Continue".
    continue_sent: bool = False

    def handle_expect_100(self) -> bool:
        if self.continue_sent:
            return True
        return super().handle_expect_100()

    def version_string(self) -> str:
        # Not the Python version: nothing about the host belongs in a header.
        return self.server_version

    def parse_request(self) -> bool:
        """The stdlib's parse_request with a lean header reader; same limits, same answers.

        On failure an error has been answered (by the stdlib's send_error) or, for an empty
        request line, the connection is to be closed silently.
        """
        if not self._parse_request_line():
            return False
        lines = self._read_header_lines()
        if lines is None:
            return False
        self.request_headers = parse_header_lines(lines)
        connection = (self.request_headers.get("Connection") or "").lower()
        if connection == "close":
            self.close_connection = True
        elif connection == "keep-alive" and self.protocol_version >= "HTTP/1.1":
            self.close_connection = False
        expect = (self.request_headers.get("Expect") or "").lower()
        if (
            expect == "100-continue"
            and self.protocol_version >= "HTTP/1.1"
            and self.request_version >= "HTTP/1.1"
        ):
            return self.handle_expect_100()
        return True

    def _parse_request_line(self) -> bool:
        """``METHOD PATH VERSION`` (or HTTP/0.9's ``GET PATH``), judged as the stdlib does."""
        # The stdlib resets it to None; "" is as good (only send_error reads it, comparing
        # with "HEAD") and keeps the attribute a str.
        self.command = ""
        self.request_version = self.default_request_version
        self.close_connection = True
        requestline = str(self.raw_requestline, "iso-8859-1").rstrip("\r\n")
        self.requestline = requestline
        words = requestline.split()
        if not words:
            return False
        if len(words) >= 3:
            version = words[-1]
            number = _http_version(version)
            if number is None:
                self.send_error(HTTPStatus.BAD_REQUEST, f"Bad request version ({version!r})")
                return False
            if number >= (1, 1) and self.protocol_version >= "HTTP/1.1":
                self.close_connection = False
            if number >= (2, 0):
                self.send_error(
                    HTTPStatus.HTTP_VERSION_NOT_SUPPORTED,
                    f"Invalid HTTP version ({version.split('/', 1)[1]})",
                )
                return False
            self.request_version = version
        if not 2 <= len(words) <= 3:
            self.send_error(HTTPStatus.BAD_REQUEST, f"Bad request syntax ({requestline!r})")
            return False
        command, path = words[:2]
        if len(words) == 2:
            self.close_connection = True
            if command != "GET":
                self.send_error(HTTPStatus.BAD_REQUEST, f"Bad HTTP/0.9 request type ({command!r})")
                return False
        self.command = command
        # As the stdlib does (gh-87389): "//host/x" must not read as a URL without a scheme.
        self.path = "/" + path.lstrip("/") if path.startswith("//") else path
        return True

    def _read_header_lines(self) -> list[bytes] | None:
        """The header lines up to and including the blank one (or EOF), with http.client's
        limits; None after answering 431."""
        lines: list[bytes] = []
        while True:
            line = self.rfile.readline(_MAX_HEADER_LINE + 1)
            if len(line) > _MAX_HEADER_LINE:
                explain = str(http.client.LineTooLong("header line"))
                self.send_error(
                    HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "Line too long", explain
                )
                return None
            lines.append(line)
            if len(lines) > _MAX_HEADER_LINES:
                explain = f"got more than {_MAX_HEADER_LINES} headers"
                self.send_error(
                    HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "Too many headers", explain
                )
                return None
            if line in _END_OF_HEADERS:
                return lines

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
        self.run_guarded(functools.partial(self._serve, method))

    def run_guarded(self, step: Callable[[], None]) -> None:
        """Run a step of serving a request; a bug becomes a 500 instead of a hang."""
        try:
            step()
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
        if self.request_headers.get("Transfer-Encoding"):
            self.close_connection = True
            self._send_error(ApiError(411, "LENGTH_REQUIRED", "send a Content-Length body"))
            return None
        length_header = (self.request_headers.get("Content-Length") or "0").strip()
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
        token = bearer_token(self.request_headers.get("Authorization"))
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
        if decision.latency_seconds > 0:
            # The answer, and any next request on this connection, wait until the latency has
            # passed; meanwhile the server serves other connections.
            self.deferred = (
                decision.latency_seconds,
                functools.partial(self._finish_api, endpoint, method, raw, param, decision),
            )
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
        stdlib's send_response/send_header/end_headers produced."""
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


class _NeedMore(BaseException):
    """The request is not all here yet. Not an ``Exception``: the handler's bug guard must not
    turn it into a 500."""


class _Arrived(io.BytesIO):
    """What a connection has received so far, read as the handler reads a socket: a read that
    wants more than has arrived raises ``_NeedMore`` unless the client has closed its side."""

    def __init__(self, data: bytes, *, eof: bool) -> None:
        super().__init__(data)
        self._eof = eof

    def readline(self, size: int | None = -1, /) -> bytes:
        line = super().readline(size)
        limit_reached = size is not None and size >= 0 and len(line) >= size
        if not line.endswith(b"\n") and not limit_reached and not self._eof:
            raise _NeedMore
        return line

    def read(self, size: int | None = -1, /) -> bytes:
        data = super().read(size)
        if not self._eof and (size is None or size < 0 or len(data) < size):
            raise _NeedMore
        return data


class _Connection:
    """One client connection: bytes received and not yet served, bytes still to send."""

    __slots__ = (
        "address",
        "busy",
        "close_after",
        "continue_sent",
        "eof",
        "events",
        "inbox",
        "last_active",
        "outbox",
        "sock",
    )

    def __init__(self, sock: socket.socket, address: Any) -> None:
        self.sock = sock
        self.address = address
        self.inbox = bytearray()
        self.outbox = bytearray()
        self.eof = False
        # A request of this connection is being served (waiting out injected latency): the
        # next one is not read until its answer is out, as HTTP/1.1 orders them.
        self.busy = False
        self.close_after = False
        # The request waiting for its body was already told "100 Continue".
        self.continue_sent = False
        # What the selector watches this socket for (0: not registered).
        self.events = 0
        self.last_active = time.monotonic()


class EmulatorHTTPServer:
    """HTTP/1.1 with keep-alive on one thread: a selector loop over every connection.

    Requests are parsed and answered by ``_RequestHandler`` (the stdlib's request handler, fed
    from memory), and injected latency is a timer, not a sleeping thread. So a benchmark's
    hundreds of connections cost the machine one thread's worth of switching, not hundreds.
    """

    # A drain opening its lanes' connections at once must not overflow the accept queue: each
    # dropped SYN costs the client a second (the first TCP retransmission).
    request_queue_size = 128

    def __init__(
        self, address: tuple[str, int], emulator: Emulator, *, verbose: bool = False
    ) -> None:
        self.emulator = emulator
        self.verbose = verbose
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.socket.bind(address)
            self.socket.listen(self.request_queue_size)
        except OSError:
            self.socket.close()
            raise
        self.socket.setblocking(False)
        # Loopback needs no name lookup: the address is the name.
        host, port = self.socket.getsockname()[:2]
        self.server_name = str(host)
        self.server_port = int(port)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self.socket, selectors.EVENT_READ, None)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._connections: dict[int, _Connection] = {}
        self._timers: list[tuple[float, int, _Connection, _RequestHandler]] = []
        self._timer_seq = 0
        self._stop_requested = False
        self._stopped = threading.Event()
        self._stopped.set()

    @property
    def url(self) -> str:
        """The base URL clients use, with the real port when 0 was asked for."""
        host = f"[{self.server_name}]" if ":" in self.server_name else self.server_name
        return f"http://{host}:{self.server_port}"

    # --- the loop -------------------------------------------------------------------------

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        """Serve until ``shutdown()``; ``poll_interval`` bounds each wait, as in socketserver."""
        self._stopped.clear()
        try:
            next_sweep = time.monotonic() + 1.0
            while not self._stop_requested:
                now = time.monotonic()
                timeout = poll_interval
                if self._timers:
                    timeout = max(0.0, min(timeout, self._timers[0][0] - now))
                for key, events in self._selector.select(timeout):
                    try:
                        self._handle_event(key, events)
                    except Exception:  # noqa: BLE001 - a bug costs a connection, not the server
                        traceback.print_exc(file=sys.stderr)
                        if isinstance(key.data, _Connection):
                            self._close(key.data)
                self._run_due_timers()
                if time.monotonic() >= next_sweep:
                    self._close_idle()
                    next_sweep = time.monotonic() + 1.0
        finally:
            self._stop_requested = False
            self._stopped.set()

    def _handle_event(self, key: selectors.SelectorKey, events: int) -> None:
        if key.fileobj is self.socket:
            self._accept()
        elif key.fileobj is self._wake_r:
            with contextlib.suppress(OSError):
                self._wake_r.recv(4096)
        else:
            conn = key.data
            if events & selectors.EVENT_WRITE:
                self._flush(conn)
            if events & selectors.EVENT_READ and conn.sock.fileno() >= 0:
                self._receive(conn)

    def shutdown(self) -> None:
        """Stop ``serve_forever`` and wait until it has returned (call from another thread)."""
        self._stop_requested = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        self._stopped.wait()

    def close_connections(self) -> None:
        """Close every client connection (after ``shutdown``)."""
        for conn in list(self._connections.values()):
            self._close(conn)

    def server_close(self) -> None:
        self.close_connections()
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(self.socket)
        self.socket.close()
        self._wake_r.close()
        self._wake_w.close()
        self._selector.close()

    # --- connections ------------------------------------------------------------------------

    def _accept(self) -> None:
        while True:
            try:
                sock, address = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return  # e.g. out of descriptors; the client's connect will time out
            sock.setblocking(False)
            # Answers go out in one write, the stdlib's own error answers in several: with
            # Nagle on, the client's delayed ACK would stall them by ~40 ms. (Some systems
            # refuse it on a connection the peer already closed; that one just ends soon.)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Connection(sock, address)
            self._connections[sock.fileno()] = conn
            self._watch(conn)
            self.emulator.count_connection()

    def _receive(self, conn: _Connection) -> None:
        try:
            data = conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        conn.last_active = time.monotonic()
        if data:
            conn.inbox += data
            if conn.busy:
                self._watch(conn)
        else:
            conn.eof = True
            # Nothing more will arrive: stop watching for it (a closed socket stays readable).
            self._watch(conn)
        self._serve_next(conn)

    def _serve_next(self, conn: _Connection) -> None:
        """Serve the requests that have arrived complete, in order, until one waits."""
        # One copy of what arrived per round: requests pipelined behind each other are read
        # from it at a moving offset, and the served bytes are dropped once, at the end.
        arrived = bytes(conn.inbox)
        offset = 0
        try:
            while not conn.busy and not conn.close_after and conn.sock.fileno() >= 0:
                if offset >= len(arrived):
                    if conn.eof and not conn.outbox:
                        self._close(conn)
                    return
                handler = self._new_handler(conn, arrived, offset)
                try:
                    handler.handle_one_request()
                except _NeedMore:
                    self._send_interim(conn, handler)
                    return
                except Exception:  # noqa: BLE001 - a bug costs this connection, not the server
                    traceback.print_exc(file=sys.stderr)
                    self._close(conn)
                    return
                consumed = handler.rfile.tell() - offset
                if consumed <= 0:  # cannot happen (a request line was read); never spin on it
                    self._close(conn)
                    return
                offset += consumed
                conn.continue_sent = False
                if handler.deferred is not None:
                    conn.busy = True
                    seconds, _rest = handler.deferred
                    self._timer_seq += 1
                    entry = (time.monotonic() + seconds, self._timer_seq, conn, handler)
                    heapq.heappush(self._timers, entry)
                    return
                self._answered(conn, handler)
        finally:
            del conn.inbox[:offset]

    def _new_handler(self, conn: _Connection, arrived: bytes, offset: int) -> _RequestHandler:
        handler = _RequestHandler.__new__(_RequestHandler)
        handler.server = self  # type: ignore[assignment]
        handler.client_address = conn.address
        handler.request = conn.sock
        handler.rfile = _Arrived(arrived, eof=conn.eof)
        handler.rfile.seek(offset)
        handler.wfile = io.BytesIO()
        handler.close_connection = True
        handler.continue_sent = conn.continue_sent
        return handler

    def _send_interim(self, conn: _Connection, handler: _RequestHandler) -> None:
        """A request waiting for its body may have been told "100 Continue": send that now."""
        written = _written(handler)
        if written:
            conn.continue_sent = True
            conn.outbox += written
            self._flush(conn)

    def _run_due_timers(self) -> None:
        now = time.monotonic()
        while self._timers and self._timers[0][0] <= now:
            _due, _seq, conn, handler = heapq.heappop(self._timers)
            assert handler.deferred is not None
            _seconds, rest = handler.deferred
            handler.deferred = None
            if conn.sock.fileno() < 0:
                # The client went away while the request waited: Infrai would still apply a
                # request it had received; the answer has nobody to go to. (Not when stopping.)
                if not self._stop_requested:
                    handler.run_guarded(rest)
                continue
            handler.run_guarded(rest)
            conn.busy = False
            self._answered(conn, handler)
            self._serve_next(conn)

    def _answered(self, conn: _Connection, handler: _RequestHandler) -> None:
        conn.last_active = time.monotonic()  # idle time runs from the answer, not the request
        written = _written(handler)
        if written:
            conn.outbox += written
        if handler.close_connection:
            conn.close_after = True
        self._flush(conn)

    def _flush(self, conn: _Connection) -> None:
        while conn.outbox:
            try:
                sent = conn.sock.send(conn.outbox)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self._close(conn)
                return
            del conn.outbox[:sent]
        if not conn.outbox and (
            conn.close_after or (conn.eof and not conn.busy and not conn.inbox)
        ):
            # Asked to close, or the client is gone and everything it sent was answered
            # (an incomplete request at the end of the stream was answered as such).
            self._close(conn)
            return
        self._watch(conn)

    def _watch(self, conn: _Connection) -> None:
        """Watch the socket for what the connection waits for: more bytes, room to send."""
        if conn.sock.fileno() < 0:
            return
        # A connection waiting out its latency is read on (a reset is noticed) until a client
        # pipelining without end has sent a lot: then the kernel holds the rest back.
        held_back = conn.busy and len(conn.inbox) >= _INBOX_WHILE_BUSY
        events = (0 if conn.eof or held_back else selectors.EVENT_READ) | (
            selectors.EVENT_WRITE if conn.outbox else 0
        )
        if events == conn.events:
            return
        if not conn.events:
            self._selector.register(conn.sock, events, conn)
        elif not events:
            self._selector.unregister(conn.sock)
        else:
            self._selector.modify(conn.sock, events, conn)
        conn.events = events

    def _close_idle(self) -> None:
        cutoff = time.monotonic() - _IDLE_CONNECTION_SECONDS
        for conn in list(self._connections.values()):
            if not conn.busy and not conn.outbox and conn.last_active < cutoff:
                self._close(conn)

    def _close(self, conn: _Connection) -> None:
        fileno = conn.sock.fileno()
        if fileno < 0:
            return
        self._connections.pop(fileno, None)
        if conn.events:
            self._selector.unregister(conn.sock)
            conn.events = 0
        with contextlib.suppress(OSError):
            conn.sock.close()


def _written(handler: _RequestHandler) -> bytes:
    """What the handler wrote so far (its wfile is a BytesIO)."""
    wfile = handler.wfile
    assert isinstance(wfile, io.BytesIO)
    return wfile.getvalue()


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
