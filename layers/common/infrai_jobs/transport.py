"""A small HTTP/1.1 keep-alive client, just enough for Infrai's JSON API.

Why not urllib3: every ack is one request, so the client's own CPU per request bounds how many
messages a lane (and a thread-laned drain, which shares one GIL) can finish per second. urllib3
and ``http.client`` spend most of theirs on general machinery this API never needs (the
``email`` header parser, URL parsing on every call, pool keys); on this project's benchmark a
request cost about four times the CPU it costs here. A Lambda at 512 MB has about a third of a
vCPU, so that CPU is throughput.

What it does: one request per connection at a time (``send`` and ``receive`` let one thread
have several travel at once, each on its own connection), connections kept alive and reused
from a bounded idle list (LIFO, thread-safe), TLS with certificate and hostname verification through
``ssl.create_default_context()``, connect and read timeouts, ``Content-Length``, chunked and
close-delimited answers, limits on line length, header count and body size, and a deadline for
the whole answer (a server dripping bytes cannot hold a call past it). A connection goes back
to the pool only when its answer was framed exactly, with no byte left over; before reuse it is
dropped if the server has closed it (or sent something unasked) or it sat idle too long. It
never retries: whether a call may be repeated is the caller's decision (see ``queue_client``).

It does not do proxies, redirects, compression, cookies or HTTP/2: Infrai's API needs none, and
it asks for no content coding (``Accept-Encoding: identity``) and refuses one it did not ask for.
Error messages name the host and the failure, never a header.
"""

from __future__ import annotations

import contextlib
import re
import select
import socket
import ssl
import threading
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from infrai_jobs.errors import AnswerTooLarge, TransportError

MAX_LINE = 65536
MAX_HEADERS = 100
# Infrai's answers are small JSON documents (ten messages at most); this only stops a broken or
# hostile server from filling a 512 MB Lambda.
MAX_BODY = 16 * 1024 * 1024
# 1xx answers skipped before the real one; a server sending more is not answering.
MAX_INTERIM = 10
# Well under the idle timeouts of common load balancers (60 s) and API gateways; a connection
# idle longer, e.g. across a frozen Lambda, is more likely dead than alive.
DEFAULT_MAX_IDLE = 30.0
# The whole answer must arrive within this many read timeouts (the read timeout alone bounds
# each wait for bytes, not a server sending one byte at a time).
ANSWER_DEADLINE_READS = 3

_UNSAFE_HEADER = re.compile(r"[\r\n\x00]")
# No spaces or control characters in the request line: they would split or bend it.
_UNSAFE_TARGET = re.compile(r"[\x00-\x20\x7f]")
_CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]{1,16}")
_STATUS_CODE = re.compile(r"[0-9]{3}")
_LENGTH = re.compile(r"[0-9]{1,18}")
_RECV_SIZE = 65536
# Past an answer's deadline a read still takes what has already arrived, waiting this long.
_ARRIVED_WAIT = 0.001
# ... for this long at most from the first such read, so a server sending a byte at a time
# cannot stretch it.
_LATE_READS_FOR = 0.5
# A head found whole within this many buffered bytes is parsed in one go (Infrai's are ~150).
_WHOLE_HEAD_LIMIT = 8192
# Encoded header sets a pool keeps (a client uses two or three; a rotated API key adds some).
_HEADER_BLOCKS_KEPT = 16


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    # Lower-case names; repeated headers joined with ", ".
    headers: dict[str, str]
    body: bytes


class _ProtocolError(Exception):
    pass


class _OversizedAnswer(_ProtocolError):
    def __init__(self, limit: int, size: int | None = None) -> None:
        super().__init__(f"the answer is larger than {limit} bytes")
        self.size = size


class _Connection:
    """A socket and the bytes read from it but not yet parsed.

    The buffer is ours (not ``socket.makefile``) so that bytes left over after an answer are
    visible: a connection holding any is closed, never pooled, or they would be read as the
    next request's answer.
    """

    __slots__ = (
        "buffer",
        "deadline",
        "first_byte_by",
        "idle_since",
        "late_until",
        "read_timeout",
        "shortened",
        "sock",
    )

    def __init__(self, sock: socket.socket, read_timeout: float) -> None:
        self.sock = sock
        self.buffer = bytearray()
        self.idle_since = 0.0
        self.read_timeout = read_timeout
        self.deadline = 0.0
        # Set at the first read after the deadline: reads of what has arrived end then.
        self.late_until = 0.0
        # While no byte of the answer has come: when the read timeout, counted from the send,
        # ends (0 once one has).
        self.first_byte_by = 0.0
        # The socket's timeout was cut to fit the deadline (setting it is a system call, so it
        # is restored only then).
        self.shortened = False

    def close(self) -> None:
        self.sock.close()

    def looks_dropped(self) -> bool:
        """True when the server closed the connection or sent bytes nobody asked for."""
        if self.buffer:
            return True
        if isinstance(self.sock, ssl.SSLSocket) and self.sock.pending():
            return True
        try:
            # poll, not select: select refuses descriptors above 1023.
            poller = select.poll()
            poller.register(self.sock, select.POLLIN)
            return bool(poller.poll(0))
        except (OSError, ValueError):
            return True

    # --- reading, bounded by the answer's deadline ---------------------------------------------

    def fill(self) -> bool:
        """Read what the socket has into the buffer; False at the end of the stream.

        Past the deadline, only bytes that have already arrived are read: an answer that came
        while the caller was busy (a long batch) is not a timeout, a late one is.
        """
        now = time.monotonic()
        # Until the answer's first byte, the read timeout also runs from the send.
        limit = min(self.deadline, self.first_byte_by) if self.first_byte_by else self.deadline
        if now >= limit:
            if not self.late_until:
                self.late_until = now + _LATE_READS_FOR
            elif now > self.late_until:
                raise TimeoutError("the answer did not complete in time")
        remaining = max(limit - now, _ARRIVED_WAIT)
        # Setting the timeout is a system call: the socket keeps the read timeout unless the
        # time left is a tenth or more shorter (so a prompt answer costs none).
        if remaining < self.read_timeout * 0.9:
            self.sock.settimeout(remaining)
            self.shortened = True
        try:
            data = self.sock.recv(_RECV_SIZE)
        except TimeoutError:
            if time.monotonic() >= self.deadline:
                raise TimeoutError("the answer did not complete in time") from None
            raise
        if not data:
            return False
        self.first_byte_by = 0.0
        self.buffer += data
        return True

    def readline(self) -> bytes:
        """One line, its line break included; shorter (no break) only at the end of the stream."""
        start = 0
        while True:
            end = self.buffer.find(b"\n", start, MAX_LINE + 1)
            if end >= 0:
                line = bytes(self.buffer[: end + 1])
                del self.buffer[: end + 1]
                return line
            if len(self.buffer) > MAX_LINE:
                raise _ProtocolError("an answer line is longer than 64 KiB")
            start = len(self.buffer)
            if not self.fill():
                line = bytes(self.buffer)
                self.buffer.clear()
                return line

    def read(self, size: int) -> bytes:
        """Exactly ``size`` bytes, or fewer at the end of the stream."""
        while len(self.buffer) < size and self.fill():
            pass
        data = bytes(self.buffer[:size])
        del self.buffer[:size]
        return data

    def read_to_end(self, limit: int) -> bytes:
        while len(self.buffer) <= limit and self.fill():
            pass
        if len(self.buffer) > limit:
            raise _OversizedAnswer(limit)
        data = bytes(self.buffer)
        self.buffer.clear()
        return data


class Exchange:
    """A request sent on its own connection whose answer has not been read yet."""

    __slots__ = ("_conn", "method")

    def __init__(self, conn: _Connection, method: str) -> None:
        self._conn: _Connection | None = conn
        self.method = method

    def take(self) -> _Connection:
        conn, self._conn = self._conn, None
        if conn is None:
            raise RuntimeError("this exchange's answer was already read or discarded")
        return conn


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
        self._max_body = max_body
        self._idle: list[_Connection] = []
        self._lock = threading.Lock()
        self._header_blocks: dict[tuple[tuple[str, str], ...], bytes] = {}
        # A pool dropped without close() still closes its sockets (no ResourceWarning, no fd
        # leak); the finalizer holds the list, not the pool.
        weakref.finalize(self, _close_all, self._idle)

    def close(self) -> None:
        with self._lock:
            idle = self._idle[:]
            self._idle.clear()
        _close_all(idle)

    def request(
        self,
        method: str,
        path: str,
        headers: Mapping[str, str],
        body: bytes | None = None,
    ) -> Response:
        return self.receive(self.send(method, path, headers, body))

    def send(
        self,
        method: str,
        path: str,
        headers: Mapping[str, str],
        body: bytes | None = None,
    ) -> Exchange:
        """Send a request on a connection of its own and return without waiting for the answer.

        The caller must ``receive`` every exchange (or ``discard`` it): until then its
        connection is held. Several exchanges may be open at once, one per connection, so one
        thread can have a batch of requests travel together and read their answers after.
        """
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
        """Read the answer of an exchange ``send`` opened; its connection goes back to the pool
        when the answer was framed exactly, and is closed otherwise."""
        conn = exchange.take()
        method = exchange.method
        try:
            response, keep_alive = _read_response(conn, method, self._max_body)
        except _OversizedAnswer as exc:
            conn.close()
            raise AnswerTooLarge(self._describe(exc), exc.size) from exc
        except (OSError, _ProtocolError) as exc:
            conn.close()
            raise TransportError(self._describe(exc)) from exc
        except BaseException:
            conn.close()
            raise
        if keep_alive and not conn.buffer:
            self._give_back(conn)
        else:
            conn.close()
        return response

    @staticmethod
    def discard(exchange: Exchange) -> None:
        """Close an exchange's connection without reading its answer (it is not reusable)."""
        with contextlib.suppress(OSError):
            exchange.take().close()

    # --- connections --------------------------------------------------------------------------

    def _take(self) -> _Connection:
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

    def _give_back(self, conn: _Connection) -> None:
        conn.idle_since = time.monotonic()
        if conn.shortened:
            conn.sock.settimeout(self._read_timeout)
            conn.shortened = False
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
            if self._tls:
                if self._ssl_context is None:
                    # Built on first use: loading the CA bundle is not free at cold start.
                    self._ssl_context = ssl.create_default_context()
                # The handshake is part of connecting: it runs under the connect timeout.
                sock = self._ssl_context.wrap_socket(sock, server_hostname=self._host)
            sock.settimeout(self._read_timeout)
        except OSError as exc:
            sock.close()
            raise TransportError(self._describe(exc)) from exc
        return _Connection(sock, self._read_timeout)

    # --- wire format --------------------------------------------------------------------------

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
        # A client sends the same few header sets again and again: each is checked and encoded
        # once, then reused.
        key = tuple(headers.items())
        block = self._header_blocks.get(key)
        if block is None:
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


def _close_all(connections: list[_Connection]) -> None:
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


def _read_head(conn: _Connection) -> tuple[str, int, dict[str, str]]:
    """The final answer's version, status and headers; 1xx answers before it are skipped."""
    for _ in range(MAX_INTERIM + 1):
        lines = _whole_head(conn)
        if lines is None:
            line = conn.readline()
            if not line:
                raise _ProtocolError("the server closed the connection before answering")
            if not line.endswith(b"\n"):
                raise _ProtocolError("the connection closed inside the answer's status line")
            version, status = _parse_status_line(line.decode("latin-1").rstrip("\r\n"))
            headers = _read_headers(conn)
        else:
            version, status = _parse_status_line(lines[0])
            headers = _parse_headers(lines[1:])
        if status == 101:
            raise _ProtocolError("the server switched protocols, which was not asked for")
        if not 100 <= status < 200:
            return version, status, headers
    raise _ProtocolError(f"more than {MAX_INTERIM} interim (1xx) answers")


def _whole_head(conn: _Connection) -> list[str] | None:
    """The head's lines when the buffer holds all of it, in plain CRLF lines within limits, or
    None for the line-by-line reader (which also judges what is odd or too long)."""
    buffer = conn.buffer
    end = buffer.find(b"\r\n\r\n", 0, _WHOLE_HEAD_LIMIT)
    while end < 0 and len(buffer) < _WHOLE_HEAD_LIMIT:
        if _odd_head(buffer) or not conn.fill():
            return None  # the line reader judges it, or the stream ended
        end = buffer.find(b"\r\n\r\n", 0, _WHOLE_HEAD_LIMIT)
    if end < 0:
        return None
    head = buffer[:end].decode("latin-1")
    # Every line break a CRLF, as the line reader would split it; a bare LF is left to it.
    if head.count("\n") != head.count("\r\n"):
        return None
    lines = [line.rstrip("\r") for line in head.split("\r\n")]
    if len(lines) > MAX_HEADERS + 1:
        return None
    del buffer[: end + 4]
    return lines


def _read_response(conn: _Connection, method: str, max_body: int) -> tuple[Response, bool]:
    version, status, headers = _read_head(conn)
    coding = headers.get("content-encoding", "identity").strip().lower()
    if coding not in ("", "identity"):
        raise _ProtocolError(f"an answer in a content coding not asked for: {coding[:20]!r}")
    connection = headers.get("connection", "").lower()
    # HTTP/1.1 keeps the connection unless told otherwise; HTTP/1.0 only when told to.
    keep_alive = "close" not in connection if version == "HTTP/1.1" else "keep-alive" in connection
    if method == "HEAD" or status in (204, 304):
        return Response(status, headers, b""), keep_alive
    transfer = headers.get("transfer-encoding")
    if transfer is not None:
        codings = [item.strip().lower() for item in transfer.split(",")]
        if codings != ["chunked"]:
            raise _ProtocolError(f"an unsupported Transfer-Encoding: {transfer[:40]!r}")
        # With a Content-Length too the framing is ambiguous (RFC 9112 6.3): chunked wins,
        # and the connection is not trusted with another request.
        keep_alive = keep_alive and "content-length" not in headers
        return Response(status, headers, _read_chunked(conn, max_body)), keep_alive
    length = headers.get("content-length")
    if length is None:
        # Close-delimited: the body runs to the end of the connection.
        return Response(status, headers, conn.read_to_end(max_body)), False
    size = _parse_length(length)
    if size > max_body:
        raise _OversizedAnswer(max_body, size)
    body = conn.read(size)
    if len(body) != size:
        raise _ProtocolError(f"the answer was cut short ({len(body)} of {size} bytes)")
    return Response(status, headers, body), keep_alive


def _odd_head(buffer: bytearray) -> bool:
    """Whether the bytes so far already show a head the line reader must judge: a first line
    that is no status line, a blank line that is not a plain CRLF, a bare LF."""
    first_break = buffer.find(b"\n")
    if first_break < 0:
        return False
    if not buffer.startswith(b"HTTP/1."):
        return True
    return b"\n\n" in buffer or b"\n\r\n" in buffer or b"\r\r\n" in buffer


def _parse_status_line(text: str) -> tuple[str, int]:
    parts = text.split(" ", 2)
    if len(parts) < 2 or parts[0] not in ("HTTP/1.1", "HTTP/1.0"):
        raise _ProtocolError(f"not an HTTP/1.x status line: {text[:40]!r}")
    code = parts[1]
    if not _STATUS_CODE.fullmatch(code):
        raise _ProtocolError(f"not an HTTP status code: {code[:10]!r}")
    return parts[0], int(code)


def _read_headers(conn: _Connection) -> dict[str, str]:
    lines: list[str] = []
    for _ in range(MAX_HEADERS + 1):
        line = conn.readline()
        if line in (b"\r\n", b"\n"):
            return _parse_headers(lines)
        if not line.endswith(b"\n"):
            raise _ProtocolError("the connection closed inside the answer's headers")
        text = line.decode("latin-1").rstrip("\r\n")
        _split_header(text, continues=bool(lines))  # a broken line fails now, not at the end
        lines.append(text)
    raise _ProtocolError(f"the answer has more than {MAX_HEADERS} headers")


def _parse_headers(lines: list[str]) -> dict[str, str]:
    """Header lines (without line breaks) as lower-case names; repeated ones joined."""
    if len(lines) > MAX_HEADERS:
        raise _ProtocolError(f"the answer has more than {MAX_HEADERS} headers")
    headers: dict[str, str] = {}
    last = ""
    for text in lines:
        split = _split_header(text, continues=bool(last))
        if split is None:
            headers[last] += " " + text.strip()  # an obsolete folded continuation
            continue
        last, value = split
        headers[last] = f"{headers[last]}, {value}" if last in headers else value
    return headers


def _split_header(text: str, *, continues: bool) -> tuple[str, str] | None:
    """A header line as (lower-case name, value), or None for a folded continuation."""
    if text[:1] in (" ", "\t") and continues:
        return None
    name, colon, value = text.partition(":")
    if not colon or not name or name != name.strip():
        raise _ProtocolError(f"a malformed header line: {text[:40]!r}")
    return name.lower(), value.strip()


def _parse_length(value: str) -> int:
    # Repeated Content-Length headers arrive joined; they must agree.
    lengths = {item.strip() for item in value.split(",")}
    if len(lengths) != 1:
        raise _ProtocolError("the answer has conflicting Content-Length headers")
    text = lengths.pop()
    if not _LENGTH.fullmatch(text):
        raise _ProtocolError(f"an invalid Content-Length: {text[:20]!r}")
    return int(text)


def _read_chunked(conn: _Connection, max_body: int) -> bytes:
    body = bytearray()
    framing = 0  # size lines count against the limit too: extensions can be long
    while True:
        line = conn.readline()
        framing += len(line)
        if framing > max_body:
            raise _ProtocolError(f"the answer's chunk framing is larger than {max_body} bytes")
        size_text = line.split(b";", 1)[0].strip()
        if not _CHUNK_SIZE.fullmatch(size_text):
            # int(x, 16) alone would also take "0x1f", "+1f" and "1_f".
            raise _ProtocolError(f"an invalid chunk size: {size_text[:20]!r}")
        size = int(size_text, 16)
        if size == 0:
            break
        if len(body) + size > max_body:
            raise _OversizedAnswer(max_body)
        chunk = conn.read(size)
        if len(chunk) != size or conn.readline() not in (b"\r\n", b"\n"):
            raise _ProtocolError("the answer was cut short inside a chunk")
        body += chunk
    _read_headers(conn)  # trailers, ignored
    return bytes(body)
