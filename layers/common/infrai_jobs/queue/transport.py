"""A small HTTP/1.1 keep-alive client, just enough for Infrai's JSON API. Why not urllib3: every
ack is one request, so CPU per request bounds a lane's throughput (a 512 MB Lambda has a third of
a vCPU), and here a request costs about a quarter of urllib3's (bench/transport.md). A connection
is pooled again only when its answer was framed exactly; the whole answer has a deadline; it
never retries (the caller decides). No proxies, redirects, compression, cookies or HTTP/2. Error
messages name the host and the failure, never a header."""

from __future__ import annotations

import re
import socket
import ssl
import threading
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from infrai_jobs.config.settings import DEFAULT_MAX_ANSWER_BYTES
from infrai_jobs.errors import AnswerTooLarge, ProtocolError, TlsVerificationFailed, TransportError
from infrai_jobs.queue.http_wire import Connection, Response, read_response

# Under load balancers' idle timeouts (60 s): idle longer (a frozen Lambda), likely dead.
DEFAULT_MAX_IDLE = 30.0
# The whole answer must arrive within this many read timeouts (each bounds one wait for bytes).
ANSWER_DEADLINE_READS = 3

_UNSAFE_HEADER = re.compile(r"[\r\n\x00]")
# No spaces or control characters in the request line: they would split or bend it.
_UNSAFE_TARGET = re.compile(r"[\x00-\x20\x7f]")
# Encoded header sets a pool keeps (a client uses two or three; a rotated API key adds some).
_HEADER_BLOCKS_KEPT = 16


class Exchange:
    """A request sent on its own connection whose answer has not been read yet."""

    __slots__ = ("_conn", "method")

    def __init__(self, conn: Connection, method: str) -> None:
        self._conn: Connection | None = conn
        self.method = method

    def take(self) -> Connection:
        conn, self._conn = self._conn, None
        if conn is None:
            raise RuntimeError("this exchange's answer was already read")
        return conn


@dataclass(frozen=True, slots=True)
class PoolOptions:
    """How an HTTP pool connects: its timeouts, its size (concurrent callers beyond it get
    short-lived connections), the TLS context, and the largest answer it reads."""

    connect_timeout: float = 3.05
    read_timeout: float = 10.0
    maxsize: int = 16
    ssl_context: ssl.SSLContext | None = None
    max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES


class HttpPool:
    """Keep-alive connections to one origin (scheme, host, port)."""

    def __init__(
        self, base_url: str, options: PoolOptions, *, max_idle: float = DEFAULT_MAX_IDLE
    ) -> None:
        # The client checked scheme, host and credentials (check_web_url); the port is left.
        parts = urlsplit(base_url)
        try:
            port = parts.port
        except ValueError as exc:
            raise ValueError(f"{base_url!r} has an invalid port") from exc
        self._tls = parts.scheme == "https"
        self._host = parts.hostname or ""
        default_port = 443 if self._tls else 80
        self._port = port or default_port
        host_for_header = f"[{self._host}]" if ":" in self._host else self._host
        self._host_header = (
            host_for_header if self._port == default_port else f"{host_for_header}:{self._port}"
        )
        self._prefix = parts.path.rstrip("/")
        self._where = f"{parts.scheme}://{self._host_header}"
        self._options = options
        self._read_timeout = options.read_timeout
        self._ssl_context = options.ssl_context  # built on first use when None
        self._max_idle = max_idle
        self._idle: list[Connection] = []
        self._lock = threading.Lock()
        self._header_blocks: dict[tuple[tuple[str, str], ...], bytes] = {}
        # A pool dropped unclosed still closes its sockets; the finalizer holds the list, not it.
        weakref.finalize(self, _close_all, self._idle)

    def close(self) -> None:
        with self._lock:
            idle = self._idle[:]
            self._idle.clear()
        _close_all(idle)

    def request(
        self, method: str, path: str, headers: Mapping[str, str], body: bytes | None = None
    ) -> Response:
        return self.receive(self.send(method, path, headers, body))

    def send(
        self, method: str, path: str, headers: Mapping[str, str], body: bytes | None = None
    ) -> Exchange:
        """Send a request on a connection of its own without waiting for the answer; the caller
        must ``receive`` every exchange, as it holds its connection until then. One thread may
        have several open at once, a batch of requests travelling together."""
        head = self._encode_head(method, path, headers, body)
        conn = self._take()
        try:
            conn.sock.sendall(head + body if body else head)
        except BaseException as exc:
            conn.close()
            if isinstance(exc, OSError):
                raise TransportError(self._describe(exc)) from exc
            raise
        # From the send: exchanges read one after another all expire by the same time.
        now = time.monotonic()
        conn.deadline = now + self._read_timeout * ANSWER_DEADLINE_READS
        conn.first_byte_by = now + self._read_timeout
        conn.late_until = 0.0
        return Exchange(conn, method)

    def receive(self, exchange: Exchange) -> Response:
        """Read an exchange's answer; its connection is pooled again only if framed exactly."""
        conn = exchange.take()
        try:
            response, keep_alive = read_response(
                conn, exchange.method, self._options.max_answer_bytes
            )
        except BaseException as exc:
            conn.close()
            if isinstance(exc, AnswerTooLarge):
                raise AnswerTooLarge(self._describe(exc), exc.size) from exc
            if isinstance(exc, OSError | ProtocolError):
                raise TransportError(self._describe(exc)) from exc
            raise
        if keep_alive and not conn.buffer:
            self._give_back(conn)
        else:
            conn.close()
        return response

    def _take(self) -> Connection:
        now = time.monotonic()
        while True:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                return self._connect()
            if now - conn.idle_since > self._max_idle or conn.looks_dropped():
                conn.close()
                continue
            return conn

    def _give_back(self, conn: Connection) -> None:
        conn.idle_since = time.monotonic()
        if conn.shortened:
            conn.sock.settimeout(self._read_timeout)
            conn.shortened = False
        with self._lock:
            if len(self._idle) < self._options.maxsize:
                self._idle.append(conn)
                return
        conn.close()

    def _connect(self) -> Connection:
        try:
            sock = socket.create_connection((self._host, self._port), self._options.connect_timeout)
        except OSError as exc:
            raise TransportError(self._describe(exc)) from exc
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls:
                if self._ssl_context is None:
                    # Built on first use: loading the CA bundle is not free at cold start.
                    self._ssl_context = ssl.create_default_context()
                # The handshake is part of connecting: it runs under the connect timeout.
                sock = self._ssl_context.wrap_socket(sock, server_hostname=self._host)
            sock.settimeout(self._read_timeout)
        except ssl.SSLCertVerificationError as exc:
            sock.close()
            raise TlsVerificationFailed(self._describe(exc)) from exc
        except OSError as exc:
            sock.close()
            raise TransportError(self._describe(exc)) from exc
        return Connection(sock, self._read_timeout)

    def _encode_head(
        self, method: str, path: str, headers: Mapping[str, str], body: bytes | None
    ) -> bytes:
        target = f"{self._prefix}{path}"
        if _UNSAFE_TARGET.search(method) or _UNSAFE_TARGET.search(target):
            raise ValueError("the method or path contains a space or control character")
        parts = [
            _latin1(f"{method} {target} HTTP/1.1\r\nHost: {self._host_header}\r\n", "the path"),
            b"Accept-Encoding: identity\r\n",
        ]
        # A client sends the same few header sets: each is checked and encoded once.
        key = tuple(headers.items())
        if (block := self._header_blocks.get(key)) is None:
            block = _encode_headers(key)
            if len(self._header_blocks) >= _HEADER_BLOCKS_KEPT:
                self._header_blocks.clear()
            self._header_blocks[key] = block
        parts.append(block)
        if body is not None:
            parts.append(b"Content-Length: %d\r\n" % len(body))
        elif method not in ("GET", "HEAD"):
            parts.append(b"Content-Length: 0\r\n")
        parts.append(b"\r\n")
        return b"".join(parts)

    def _describe(self, exc: BaseException) -> str:
        what = str(exc) or ("timed out" if isinstance(exc, TimeoutError) else "no detail")
        return f"{type(exc).__name__}: {what} ({self._where})"


def _encode_headers(items: tuple[tuple[str, str], ...]) -> bytes:
    parts = []
    for name, value in items:
        if _UNSAFE_HEADER.search(name) or _UNSAFE_HEADER.search(value) or ":" in name:
            # The value may be a secret: name the header, never print the value.
            raise ValueError(f"header {name!r} contains a line break, NUL or colon")
        parts.append(_latin1(f"{name}: {value}\r\n", f"header {name!r}"))
    return b"".join(parts)


def _close_all(connections: list[Connection]) -> None:
    while connections:
        connections.pop().close()


def _latin1(text: str, what: str) -> bytes:
    try:
        return text.encode("latin-1")
    except UnicodeEncodeError:
        pass
    # Raised outside the handler: the encode error holds the whole text, a secret perhaps, and
    # would ride along as this exception's context.
    raise ValueError(f"{what} is not latin-1 text")
