"""A small HTTP/1.1 keep-alive client, just enough for Infrai's JSON API.

Why not urllib3: every ack is one request, so the client's own CPU per request bounds how many
messages a lane (and a thread-laned drain, which shares one GIL) can finish per second. urllib3
and ``http.client`` spend most of theirs on general machinery this API never needs (the
``email`` header parser, URL parsing on every call, pool keys); on this project's benchmark a
request cost about four times the CPU it costs here. A Lambda at 512 MB has about a third of a
vCPU, so that CPU is throughput.

What it does: one request per connection at a time, connections kept alive and reused from a
bounded idle list (LIFO, thread-safe), TLS with certificate and hostname verification through
``ssl.create_default_context()``, connect and read timeouts, ``Content-Length``, chunked and
close-delimited answers, and limits on line length, header count and body size. A pooled
connection idle for a second or more is dropped before reuse when the server has closed it (or
sent something unasked), and one idle too long is dropped unasked. It never retries: whether a
call may be repeated is the caller's decision (see ``queue_client``).

It does not do proxies, redirects, compression, cookies or HTTP/2: Infrai's API needs none.
Error messages name the host and the failure, never a header.
"""

from __future__ import annotations

import re
import select
import socket
import ssl
import threading
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import BinaryIO
from urllib.parse import urlsplit

MAX_LINE = 65536
MAX_HEADERS = 100
MAX_BODY = 32 * 1024 * 1024
# Well under the idle timeouts of common load balancers (60 s) and API gateways; a connection
# idle longer, e.g. across a frozen Lambda, is more likely dead than alive.
DEFAULT_MAX_IDLE = 30.0
# A connection back in the pool for less than this is reused without asking the kernel whether
# the server closed it. Servers close idle connections after seconds (5 s and up), not within
# one; and the check is a syscall that drops and retakes the GIL, which with many lanes costs
# more than the request's own parsing (8 lanes drained about 10% faster without it).
DEFAULT_CHECK_AFTER_IDLE = 1.0

_UNSAFE_HEADER = re.compile(r"[\r\n\x00]")
_CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]{1,16}")


class TransportError(Exception):
    """The exchange failed below HTTP: connect, TLS, timeout, a dropped or malformed answer."""


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    # Lower-case names; repeated headers joined with ", ".
    headers: dict[str, str]
    body: bytes


class _ProtocolError(Exception):
    pass


class _Connection:
    __slots__ = ("idle_since", "rfile", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.rfile: BinaryIO = sock.makefile("rb")
        self.idle_since = 0.0

    def close(self) -> None:
        try:
            self.rfile.close()
        finally:
            self.sock.close()

    def looks_dropped(self) -> bool:
        """True when the server closed the connection or sent bytes nobody asked for."""
        if isinstance(self.sock, ssl.SSLSocket) and self.sock.pending():
            return True
        try:
            # poll, not select: select refuses descriptors above 1023.
            poller = select.poll()
            poller.register(self.sock, select.POLLIN)
            return bool(poller.poll(0))
        except (OSError, ValueError):
            return True


class HttpPool:
    """Keep-alive connections to one origin (scheme, host, port)."""

    def __init__(
        self,
        base_url: str,
        *,
        connect_timeout: float,
        read_timeout: float,
        maxsize: int = 16,
        ssl_context: ssl.SSLContext | None = None,
        max_idle: float = DEFAULT_MAX_IDLE,
        check_after_idle: float = DEFAULT_CHECK_AFTER_IDLE,
        max_body: int = MAX_BODY,
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{base_url!r} is not an http(s) URL with a host")
        if parts.username is not None or parts.password is not None:
            raise ValueError("the URL carries credentials; pass them as headers instead")
        try:
            port = parts.port
        except ValueError as exc:
            raise ValueError(f"{base_url!r} has an invalid port") from exc
        self._tls = parts.scheme == "https"
        self._host = parts.hostname
        self._port = port or (443 if self._tls else 80)
        default_port = (self._tls and self._port == 443) or (not self._tls and self._port == 80)
        host_for_header = f"[{self._host}]" if ":" in self._host else self._host
        self._host_header = host_for_header if default_port else f"{host_for_header}:{self._port}"
        self._prefix = parts.path.rstrip("/")
        self._where = f"{parts.scheme}://{self._host_header}"
        self._connect_timeout = connect_timeout
        self._read_timeout = read_timeout
        self._maxsize = maxsize
        self._ssl_context = ssl_context
        self._max_idle = max_idle
        self._check_after_idle = check_after_idle
        self._max_body = max_body
        self._idle: list[_Connection] = []
        self._lock = threading.Lock()
        # A pool dropped without close() still closes its sockets (no ResourceWarning, no fd
        # leak); the finalizer holds the list, not the pool.
        weakref.finalize(self, _close_all, self._idle)

    @property
    def where(self) -> str:
        return self._where

    def close(self) -> None:
        with self._lock:
            idle = self._idle[:]
            self._idle.clear()
        for conn in idle:
            conn.close()

    def request(
        self,
        method: str,
        path: str,
        headers: Mapping[str, str],
        body: bytes | None = None,
    ) -> Response:
        head = self._encode_head(method, path, headers, body)
        conn = self._take()
        try:
            conn.sock.sendall(head + body if body else head)
            response, keep_alive = _read_response(conn.rfile, method, self._max_body)
        except (OSError, _ProtocolError) as exc:
            conn.close()
            raise TransportError(self._describe(exc)) from exc
        except BaseException:
            conn.close()
            raise
        if keep_alive:
            self._give_back(conn)
        else:
            conn.close()
        return response

    # --- connections --------------------------------------------------------------------------

    def _take(self) -> _Connection:
        now = time.monotonic()
        while True:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                return self._connect()
            idle = now - conn.idle_since
            if idle > self._max_idle or (idle >= self._check_after_idle and conn.looks_dropped()):
                conn.close()
                continue
            return conn

    def _give_back(self, conn: _Connection) -> None:
        conn.idle_since = time.monotonic()
        with self._lock:
            if len(self._idle) < self._maxsize:
                self._idle.append(conn)
                return
        conn.close()

    def _connect(self) -> _Connection:
        try:
            sock = socket.create_connection((self._host, self._port), self._connect_timeout)
        except OSError as exc:
            raise TransportError(self._describe(exc)) from exc
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(self._read_timeout)
            if self._tls:
                if self._ssl_context is None:
                    # Built on first use: loading the CA bundle is not free at cold start.
                    self._ssl_context = ssl.create_default_context()
                sock = self._ssl_context.wrap_socket(sock, server_hostname=self._host)
        except OSError as exc:
            sock.close()
            raise TransportError(self._describe(exc)) from exc
        return _Connection(sock)

    # --- wire format --------------------------------------------------------------------------

    def _encode_head(
        self, method: str, path: str, headers: Mapping[str, str], body: bytes | None
    ) -> bytes:
        lines = [f"{method} {self._prefix}{path} HTTP/1.1", f"Host: {self._host_header}"]
        for name, value in headers.items():
            if _UNSAFE_HEADER.search(name) or _UNSAFE_HEADER.search(value) or ":" in name:
                # The value may be a secret: name the header, never print the value.
                raise ValueError(f"header {name!r} contains a line break, NUL or colon")
            lines.append(f"{name}: {value}")
        if body is not None:
            lines.append(f"Content-Length: {len(body)}")
        elif method not in ("GET", "HEAD"):
            lines.append("Content-Length: 0")
        lines.append("\r\n")
        try:
            return "\r\n".join(lines).encode("latin-1")
        except UnicodeEncodeError:
            raise ValueError("a header or the path is not latin-1 text") from None

    def _describe(self, exc: BaseException) -> str:
        if isinstance(exc, TimeoutError | socket.timeout):
            what = "timed out"
        else:
            what = str(exc) or "no detail"
        return f"{type(exc).__name__}: {what} ({self._where})"


def _close_all(connections: list[_Connection]) -> None:
    while connections:
        connections.pop().close()


def _read_line(rfile: BinaryIO) -> bytes:
    line = rfile.readline(MAX_LINE + 1)
    if len(line) > MAX_LINE:
        raise _ProtocolError("an answer line is longer than 64 KiB")
    return line


def _read_response(rfile: BinaryIO, method: str, max_body: int) -> tuple[Response, bool]:
    while True:
        line = _read_line(rfile)
        if not line:
            raise _ProtocolError("the server closed the connection before answering")
        if not line.endswith(b"\n"):
            raise _ProtocolError("the connection closed inside the answer's status line")
        version, status = _parse_status_line(line)
        headers = _read_headers(rfile)
        if 100 <= status < 200:
            continue  # 100 Continue and friends precede the real answer
        break
    connection = headers.get("connection", "").lower()
    # HTTP/1.1 keeps the connection unless told otherwise; HTTP/1.0 only when told to.
    keep_alive = "close" not in connection if version == "HTTP/1.1" else "keep-alive" in connection
    if method == "HEAD" or status in (204, 304):
        return Response(status, headers, b""), keep_alive
    if "chunked" in headers.get("transfer-encoding", "").lower():
        return Response(status, headers, _read_chunked(rfile, max_body)), keep_alive
    length = headers.get("content-length")
    if length is None:
        # Close-delimited: the body runs to the end of the connection.
        body = rfile.read(max_body + 1)
        if len(body) > max_body:
            raise _ProtocolError(f"the answer is larger than {max_body} bytes")
        return Response(status, headers, body), False
    size = _parse_length(length)
    if size > max_body:
        raise _ProtocolError(f"the answer is larger than {max_body} bytes")
    body = rfile.read(size)
    if len(body) != size:
        raise _ProtocolError(f"the answer was cut short ({len(body)} of {size} bytes)")
    return Response(status, headers, body), keep_alive


def _parse_status_line(line: bytes) -> tuple[str, int]:
    parts = line.decode("latin-1").rstrip("\r\n").split(" ", 2)
    if len(parts) < 2 or parts[0] not in ("HTTP/1.1", "HTTP/1.0"):
        raise _ProtocolError(f"not an HTTP/1.x status line: {line[:40]!r}")
    code = parts[1]
    if len(code) != 3 or not code.isdigit():
        raise _ProtocolError(f"not an HTTP status code: {code[:10]!r}")
    return parts[0], int(code)


def _read_headers(rfile: BinaryIO) -> dict[str, str]:
    headers: dict[str, str] = {}
    last = ""
    for _ in range(MAX_HEADERS + 1):
        line = _read_line(rfile)
        if line in (b"\r\n", b"\n"):
            return headers
        if not line.endswith(b"\n"):
            raise _ProtocolError("the connection closed inside the answer's headers")
        text = line.decode("latin-1").rstrip("\r\n")
        if text[:1] in (" ", "\t") and last:
            headers[last] += " " + text.strip()  # an obsolete folded continuation
            continue
        name, colon, value = text.partition(":")
        if not colon or not name or name != name.strip():
            raise _ProtocolError(f"a malformed header line: {text[:40]!r}")
        last = name.lower()
        value = value.strip()
        headers[last] = f"{headers[last]}, {value}" if last in headers else value
    raise _ProtocolError(f"the answer has more than {MAX_HEADERS} headers")


def _parse_length(value: str) -> int:
    # Repeated Content-Length headers arrive joined; they must agree.
    lengths = {item.strip() for item in value.split(",")}
    if len(lengths) != 1:
        raise _ProtocolError("the answer has conflicting Content-Length headers")
    text = lengths.pop()
    if not text.isdigit() or not text.isascii():
        raise _ProtocolError(f"an invalid Content-Length: {text[:20]!r}")
    return int(text)


def _read_chunked(rfile: BinaryIO, max_body: int) -> bytes:
    parts: list[bytes] = []
    total = 0
    while True:
        line = _read_line(rfile)
        size_text = line.split(b";", 1)[0].strip()
        if not _CHUNK_SIZE.fullmatch(size_text):
            # int(x, 16) alone would also take "0x1f", "+1f" and "1_f".
            raise _ProtocolError(f"an invalid chunk size: {size_text[:20]!r}")
        size = int(size_text, 16)
        if size == 0:
            break
        total += size
        if total > max_body:
            raise _ProtocolError(f"the answer is larger than {max_body} bytes")
        chunk = rfile.read(size)
        if len(chunk) != size or _read_line(rfile) not in (b"\r\n", b"\n"):
            raise _ProtocolError("the answer was cut short inside a chunk")
        parts.append(chunk)
    _read_headers(rfile)  # trailers, ignored
    return b"".join(parts)
