"""One HTTP/1.1 connection of ``infrai_jobs.queue.transport``'s pool, and reading an answer off
it within limits (line length, header count, body size) and within the answer's deadline."""

from __future__ import annotations

import re
import select
import socket
import ssl
import time
from dataclasses import dataclass, field

from infrai_jobs.errors import AnswerTooLarge, ProtocolError

MAX_LINE = 65536
MAX_HEADERS = 100
# 1xx answers skipped before the real one; a server sending more is not answering.
MAX_INTERIM = 10
_CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]{1,16}")
_STATUS_CODE = re.compile(r"[0-9]{3}")
_LENGTH = re.compile(r"[0-9]{1,18}")
_RECV_SIZE = 65536
# Past the deadline a read still takes what has arrived, waiting this long, for at most
# _LATE_READS_FOR after the first such read (so a server dripping bytes cannot stretch it).
_ARRIVED_WAIT = 0.001
_LATE_READS_FOR = 0.5
# A head found whole within this many buffered bytes is parsed in one go (Infrai's are ~150).
_WHOLE_HEAD_LIMIT = 8192


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    # Lower-case names; repeated headers joined with ", ".
    headers: dict[str, str]
    body: bytes


@dataclass(eq=False, slots=True)
class Connection:
    """A socket and the bytes read from it but not yet parsed. The buffer is ours (not
    ``socket.makefile``) so that bytes left over after an answer are visible: a connection
    holding any is closed, never pooled, or they would be read as the next request's answer."""

    sock: socket.socket
    read_timeout: float
    buffer: bytearray = field(default_factory=bytearray)
    idle_since: float = 0.0
    deadline: float = 0.0
    # Set at the first read after the deadline: reads of what has arrived end then.
    late_until: float = 0.0
    # Until the answer's first byte: when the read timeout, counted from the send, ends.
    first_byte_by: float = 0.0
    # The socket's timeout was cut to fit the deadline (restored only then: a system call).
    shortened: bool = False

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

    def fill(self) -> bool:
        """Read what the socket has into the buffer; False at the end of the stream. Past the
        deadline, only bytes already arrived are read: an answer that came while the caller was
        busy (a long batch) is not a timeout, a late one is."""
        now = time.monotonic()
        # Until the answer's first byte, the read timeout also runs from the send.
        limit = min(self.deadline, self.first_byte_by) if self.first_byte_by else self.deadline
        if now >= limit:
            if not self.late_until:
                self.late_until = now + _LATE_READS_FOR
            elif now > self.late_until:
                raise TimeoutError("the answer did not complete in time")
        remaining = max(limit - now, _ARRIVED_WAIT)
        # A system call: only when the time left is a tenth or more under the read timeout.
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
                return self._take(end + 1)
            if len(self.buffer) > MAX_LINE:
                raise ProtocolError("an answer line is longer than 64 KiB")
            start = len(self.buffer)
            if not self.fill():
                return self._take(len(self.buffer))

    def read(self, size: int) -> bytes:
        """Exactly ``size`` bytes, or fewer at the end of the stream."""
        while len(self.buffer) < size and self.fill():
            pass
        return self._take(size)

    def read_to_end(self, limit: int) -> bytes:
        while len(self.buffer) <= limit and self.fill():
            pass
        if len(self.buffer) > limit:
            raise AnswerTooLarge(f"the answer is larger than {limit} bytes")
        return self._take(len(self.buffer))

    def _take(self, size: int) -> bytes:
        data = bytes(self.buffer[:size])
        del self.buffer[:size]
        return data


def read_head(conn: Connection) -> tuple[str, int, dict[str, str]]:
    """The final answer's version, status and headers; 1xx answers before it are skipped."""
    for _ in range(MAX_INTERIM + 1):
        if (lines := whole_head(conn)) is None:
            if not (line := conn.readline()):
                raise ProtocolError("the server closed the connection before answering")
            if not line.endswith(b"\n"):
                raise ProtocolError("the connection closed inside the answer's status line")
            version, status = _parse_status_line(line.decode("latin-1").rstrip("\r\n"))
            headers = _read_headers(conn)
        else:
            version, status = _parse_status_line(lines[0])
            headers = _parse_headers(lines[1:])
        if status == 101:
            raise ProtocolError("the server switched protocols, which was not asked for")
        if not 100 <= status < 200:
            return version, status, headers
    raise ProtocolError(f"more than {MAX_INTERIM} interim (1xx) answers")


def whole_head(conn: Connection) -> list[str] | None:
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


def read_response(conn: Connection, method: str, max_body: int) -> tuple[Response, bool]:
    version, status, headers = read_head(conn)
    coding = headers.get("content-encoding", "identity").strip().lower()
    if coding not in ("", "identity"):
        raise ProtocolError(f"an answer in a content coding not asked for: {coding[:20]!r}")
    connection = headers.get("connection", "").lower()
    # HTTP/1.1 keeps the connection unless told otherwise; HTTP/1.0 only when told to.
    keep_alive = "close" not in connection if version == "HTTP/1.1" else "keep-alive" in connection
    if method == "HEAD" or status in (204, 304):
        return Response(status, headers, b""), keep_alive
    if (transfer := headers.get("transfer-encoding")) is not None:
        codings = [item.strip().lower() for item in transfer.split(",")]
        if codings != ["chunked"]:
            raise ProtocolError(f"an unsupported Transfer-Encoding: {transfer[:40]!r}")
        # With a Content-Length too the framing is ambiguous (RFC 9112 6.3): chunked wins,
        # and the connection is not trusted with another request.
        keep_alive = keep_alive and "content-length" not in headers
        return Response(status, headers, _read_chunked(conn, max_body)), keep_alive
    if (length := headers.get("content-length")) is None:
        # Close-delimited: the body runs to the end of the connection.
        return Response(status, headers, conn.read_to_end(max_body)), False
    size = _parse_length(length)
    if size > max_body:
        raise AnswerTooLarge(f"the answer is larger than {max_body} bytes", size)
    body = conn.read(size)
    if len(body) != size:
        raise ProtocolError(f"the answer was cut short ({len(body)} of {size} bytes)")
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
        raise ProtocolError(f"not an HTTP/1.x status line: {text[:40]!r}")
    code = parts[1]
    if not _STATUS_CODE.fullmatch(code):
        raise ProtocolError(f"not an HTTP status code: {code[:10]!r}")
    return parts[0], int(code)


def _read_headers(conn: Connection) -> dict[str, str]:
    lines: list[str] = []
    for _ in range(MAX_HEADERS + 1):
        line = conn.readline()
        if line in (b"\r\n", b"\n"):
            return _parse_headers(lines)
        if not line.endswith(b"\n"):
            raise ProtocolError("the connection closed inside the answer's headers")
        text = line.decode("latin-1").rstrip("\r\n")
        _split_header(text, continues=bool(lines))  # a broken line fails now, not at the end
        lines.append(text)
    raise ProtocolError(f"the answer has more than {MAX_HEADERS} headers")


def _parse_headers(lines: list[str]) -> dict[str, str]:
    """Header lines (without line breaks) as lower-case names; repeated ones joined."""
    if len(lines) > MAX_HEADERS:
        raise ProtocolError(f"the answer has more than {MAX_HEADERS} headers")
    headers: dict[str, str] = {}
    last = ""
    for text in lines:
        if (split := _split_header(text, continues=bool(last))) is None:
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
        raise ProtocolError(f"a malformed header line: {text[:40]!r}")
    return name.lower(), value.strip()


def _parse_length(value: str) -> int:
    # Repeated Content-Length headers arrive joined; they must agree.
    lengths = {item.strip() for item in value.split(",")}
    if len(lengths) != 1:
        raise ProtocolError("the answer has conflicting Content-Length headers")
    text = lengths.pop()
    if not _LENGTH.fullmatch(text):
        raise ProtocolError(f"an invalid Content-Length: {text[:20]!r}")
    return int(text)


def _read_chunked(conn: Connection, max_body: int) -> bytes:
    body = bytearray()
    framing = 0  # size lines count against the limit too: extensions can be long
    while True:
        line = conn.readline()
        framing += len(line)
        if framing > max_body:
            raise ProtocolError(f"the answer's chunk framing is larger than {max_body} bytes")
        size_text = line.split(b";", 1)[0].strip()
        if not _CHUNK_SIZE.fullmatch(size_text):
            # int(x, 16) alone would also take "0x1f", "+1f" and "1_f".
            raise ProtocolError(f"an invalid chunk size: {size_text[:20]!r}")
        size = int(size_text, 16)
        if size == 0:
            break
        if len(body) + size > max_body:
            raise AnswerTooLarge(f"the answer is larger than {max_body} bytes")
        chunk = conn.read(size)
        if len(chunk) != size or conn.readline() not in (b"\r\n", b"\n"):
            raise ProtocolError("the answer was cut short inside a chunk")
        body += chunk
    _read_headers(conn)  # trailers, ignored
    return bytes(body)
