"""The HTTP/1.1 transport against scripted servers on loopback: framing, reuse, limits, TLS.

The emulator covers the happy path and Infrai's error rows (test_queue_client.py); these servers
answer in the ways a real origin, load balancer or broken proxy might, byte for byte.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

import pytest
from cryptography import x509
from tls_certificates import issue_certificates

from infrai_jobs.errors import (
    ConfigurationError,
    InfraiUnavailable,
    TlsVerificationFailed,
    TransportError,
    UntrustedServer,
)
from infrai_jobs.queue.client import HttpRetryPolicy, InfraiClient
from infrai_jobs.queue.transport import DEFAULT_MAX_IDLE, HttpPool, PoolOptions

API_KEY = "sk_live_transport_secret_77"
OK_JSON = (
    b'{"ok":true,"data":{"queue":"q","message_count":1,"available_count":1,'
    b'"in_flight_count":0,"delayed_count":0,"dlq_count":0,"oldest_message_age_seconds":0}}'
)

# (request head and body, connection number, request number on it) -> (bytes to send, close?)
Script = Callable[[bytes, int, int], tuple[bytes, bool]]


def answer(body: bytes = b"{}", *, status: str = "200 OK", extra: str = "") -> bytes:
    head = f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n{extra}"
    return head.encode() + f"Content-Length: {len(body)}\r\n\r\n".encode() + body


class ScriptedServer:
    """A one-thread-per-connection TCP server whose answers are scripted bytes."""

    def __init__(self, script: Script, *, tls: ssl.SSLContext | None = None) -> None:
        self.script = script
        self.tls = tls
        self.requests: list[bytes] = []
        self.connections = 0
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            number = self.connections
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn, number), daemon=True).start()

    def _serve(self, raw: socket.socket, number: int) -> None:
        try:
            conn = self.tls.wrap_socket(raw, server_side=True) if self.tls else raw
        except (OSError, ssl.SSLError):
            raw.close()
            return
        with conn, conn.makefile("rb") as rfile:
            for index in range(1000):
                try:
                    request = _read_request(rfile)
                except OSError:  # the client reset the connection (a discarded exchange)
                    return
                if request is None:
                    return
                self.requests.append(request)
                data, close = self.script(request, number, index)
                try:
                    if data:
                        conn.sendall(data)
                except OSError:
                    return
                if close:
                    return

    def stop(self) -> None:
        self._stop.set()
        self._sock.close()


def _read_request(rfile: BinaryIO) -> bytes | None:
    head = b""
    while True:
        line = rfile.readline(65537)
        if not line:
            return None
        head += line
        if line in (b"\r\n", b"\n"):
            break
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head + (rfile.read(length) if length else b"")


@pytest.fixture
def serve() -> Iterator[Callable[..., ScriptedServer]]:
    servers: list[ScriptedServer] = []

    def start(script: Script, **kwargs: object) -> ScriptedServer:
        server = ScriptedServer(script, **kwargs)  # type: ignore[arg-type]
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def pool_for(
    server: ScriptedServer, max_idle: float = DEFAULT_MAX_IDLE, **kwargs: object
) -> HttpPool:
    options: dict[str, object] = {"connect_timeout": 2.0, "read_timeout": 2.0, **kwargs}
    return HttpPool(server.url, PoolOptions(**options), max_idle=max_idle)  # type: ignore[arg-type]


def assert_get_fails(server: ScriptedServer, message: str, **pool_options: object) -> None:
    """A ``GET /`` through a new pool for ``server`` (with ``pool_options``) raises a
    ``TransportError`` matching ``message``; the pool is closed afterwards."""
    pool = pool_for(server, **pool_options)
    with pytest.raises(TransportError, match=message):
        pool.request("GET", "/", {})
    pool.close()


# --- framing -----------------------------------------------------------------------------------


def test_requests_carry_host_path_prefix_and_length_on_one_kept_alive_connection(
    serve: Callable[..., ScriptedServer],
) -> None:
    # Given a server that answers everything with a small JSON body
    server = serve(lambda request, conn, index: (answer(b'{"n":1}'), False))
    pool = HttpPool(f"{server.url}/prefix/", PoolOptions(connect_timeout=2.0, read_timeout=2.0))
    # When three requests are made in a row
    bodies = [pool.request("POST", "/v1/queue/ack", {"X-Test": "1"}, b'{"a":1}') for _ in range(3)]
    pool.close()
    # Then they reuse one connection, and each carries the base path, Host and Content-Length
    assert [b.body for b in bodies] == [b'{"n":1}'] * 3
    assert server.connections == 1
    first = server.requests[0].decode()
    assert first.startswith("POST /prefix/v1/queue/ack HTTP/1.1\r\n")
    assert f"Host: 127.0.0.1:{server.port}\r\n" in first
    assert "Content-Length: 7\r\n" in first
    assert first.endswith('\r\n\r\n{"a":1}')


def test_chunked_answers_are_joined_and_the_connection_is_reused(
    serve: Callable[..., ScriptedServer],
) -> None:
    # Given an answer in two chunks (one with an extension) and a trailer
    first, second = b'{"ok', b'":true,"data":{"x":[1,2,3]}}'
    chunked = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        + f"{len(first):x};ext=1\r\n".encode()
        + first
        + f"\r\n{len(second):x}\r\n".encode()
        + second
        + b"\r\n0\r\nX-Trailer: t\r\n\r\n"
    )
    server = serve(lambda request, conn, index: (chunked, False))
    pool = pool_for(server)
    answers = [pool.request("GET", path, {}) for path in ("/a", "/b")]
    pool.close()
    assert [a.body for a in answers] == [first + second] * 2
    assert server.connections == 1


def test_close_delimited_and_connection_close_answers_are_not_reused(
    serve: Callable[..., ScriptedServer],
) -> None:
    # Given an HTTP/1.0 answer without a length, then one that says Connection: close
    def script(request: bytes, conn: int, index: int) -> tuple[bytes, bool]:
        if conn == 0:
            return b'HTTP/1.0 200 OK\r\n\r\n{"old":true}', True
        return answer(b"{}", extra="Connection: close\r\n"), True

    server = serve(script)
    pool = pool_for(server)
    old = pool.request("GET", "/a", {})
    pool.request("GET", "/b", {})
    pool.request("GET", "/c", {})
    pool.close()
    # Then the body runs to the end of the connection, and every request opened a new one
    assert old.body == b'{"old":true}'
    assert server.connections == 3


def test_headers_are_case_insensitive_and_repeated_ones_join(
    serve: Callable[..., ScriptedServer],
) -> None:
    server = serve(
        lambda request, conn, index: (
            answer(
                b"{}",
                status="429 Too Many Requests",
                extra="RETRY-AFTER: 2\r\nX-A: 1\r\nx-a: 2\r\n",
            ),
            False,
        )
    )
    pool = pool_for(server)
    response = pool.request("GET", "/", {})
    pool.close()
    assert response.status == 429
    assert response.headers["retry-after"] == "2"
    assert response.headers["x-a"] == "1, 2"


HEAD_LINES = [
    b"HTTP/1.1 200 OK",
    b"Content-Type: application/json",
    b"X-A: 1",
    b"X-Folded: first",
    b"  second",
    b"x-a: 2",
    b"Content-Length: 2",
]


@pytest.mark.parametrize(
    "head",
    [
        b"\r\n".join(HEAD_LINES) + b"\r\n\r\n",  # whole, CRLF: parsed in one go
        b"\n".join(HEAD_LINES) + b"\n\n",  # bare LF: read line by line
        b"\r\n".join([*HEAD_LINES, b"X-Pad: " + b"p" * 9000]) + b"\r\n\r\n",  # past 8 KiB
    ],
    ids=["crlf", "bare-lf", "long-head"],
)
def test_a_head_read_whole_or_line_by_line_gives_the_same_headers(
    serve: Callable[..., ScriptedServer], head: bytes
) -> None:
    # Given the same answer head with CRLF line breaks, bare LFs, or too long to take whole
    server = serve(lambda request, conn, index: (head + b"{}", False))
    pool = pool_for(server)
    # When it is read, twice on one connection
    responses = [pool.request("GET", "/", {}) for _ in range(2)]
    pool.close()
    # Then both readers give the same status, headers and body, and keep the connection
    for response in responses:
        assert (response.status, response.body) == (200, b"{}")
        assert response.headers["x-a"] == "1, 2"
        assert response.headers["x-folded"] == "first second"
        assert response.headers["content-type"] == "application/json"
    assert server.connections == 1


# --- connections that went away ----------------------------------------------------------------


def test_a_pooled_connection_the_server_closed_is_replaced_before_reuse(
    serve: Callable[..., ScriptedServer],
) -> None:
    # Given a server that answers with keep-alive, then closes the connection anyway (an idle
    # timeout at a load balancer)
    server = serve(lambda request, conn, index: (answer(b"{}"), True))
    pool = pool_for(server)
    pool.request("GET", "/a", {})
    # Wait until the close has reached this side
    for _ in range(200):
        if pool._idle and pool._idle[0].looks_dropped():
            break
        threading.Event().wait(0.01)
    # When the next request is made, even a non-retryable one
    response = pool.request("POST", "/publish", {}, b"{}")
    pool.close()
    # Then it went over a fresh connection instead of failing on the dead one
    assert response.status == 200
    assert server.connections == 2


def test_bytes_left_over_after_an_answer_are_never_read_as_the_next_answer(
    serve: Callable[..., ScriptedServer],
) -> None:
    # Given a server that sends a stray answer right behind each real one, in the same write
    # (a 204 with a body, a wrong Content-Length, a buggy proxy)
    def script(request: bytes, conn: int, index: int) -> tuple[bytes, bool]:
        target = request.split(b" ", 2)[1]
        return answer(b'{"for":"' + target + b'"}') + answer(b'{"for":"stray"}'), False

    server = serve(script)
    pool = pool_for(server)
    # When several requests are made in a row
    bodies = [pool.request("POST", f"/r{n}", {}, b"{}").body for n in range(4)]
    pool.close()
    # Then each got its own answer: a connection with bytes left over is closed, not pooled
    assert bodies == [f'{{"for":"/r{n}"}}'.encode() for n in range(4)]
    assert server.connections == 4


def test_a_server_dripping_bytes_cannot_hold_a_call_past_its_deadline() -> None:
    # Given a server that sends its answer one byte every 0.1 s, each wait under the timeout
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    stop = threading.Event()

    def serve_drip() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            for byte in answer(b"x" * 200):
                if stop.wait(0.1):
                    return
                try:
                    conn.sendall(bytes([byte]))
                except OSError:
                    return  # the client gave up, as it should

    dripper = threading.Thread(target=serve_drip, daemon=True)
    dripper.start()
    pool = HttpPool(f"http://127.0.0.1:{port}", PoolOptions(connect_timeout=1.0, read_timeout=0.3))
    # Then the call fails on its answer's deadline (three read timeouts), not when the drip ends
    # (~30 s): a drip that ended would have been a complete answer, not this error
    with pytest.raises(TransportError, match="did not complete in time"):
        pool.request("GET", "/", {})
    stop.set()
    dripper.join()
    listener.close()


@pytest.mark.parametrize(
    ("wire", "message"),
    [
        (b"HTTP/1.1 100 Continue\r\n\r\n" * 11, "more than 10 interim"),
        (b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\n\r\n", "switched protocols"),
        (answer(b"x", extra="Content-Encoding: gzip\r\n"), "content coding not asked for"),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\nContent-Length: 2\r\n\r\n{}",
            "unsupported Transfer-Encoding",
        ),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, gzip\r\n\r\n0\r\n\r\n",
            "unsupported Transfer-Encoding",
        ),
        ("HTTP/1.1 ²³¹ OK\r\n\r\n".encode("latin-1"), "not an HTTP status code"),
        (
            b"HTTP/1.1 200 OK\r\nContent-Length: " + b"9" * 40 + b"\r\n\r\n",
            "invalid Content-Length",
        ),
    ],
)
def test_answers_the_client_did_not_ask_for_are_transport_errors(
    serve: Callable[..., ScriptedServer], wire: bytes, message: str
) -> None:
    server = serve(lambda request, conn, index: (wire, True))
    assert_get_fails(server, message)
    # And the request said it takes no content coding
    assert b"Accept-Encoding: identity\r\n" in server.requests[0]


def test_chunked_with_a_content_length_is_read_as_chunked_and_not_reused(
    serve: Callable[..., ScriptedServer],
) -> None:
    wire = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n"
        b"2\r\n{}\r\n0\r\n\r\n"
    )
    server = serve(lambda request, conn, index: (wire, False))
    pool = pool_for(server)
    bodies = [pool.request("GET", "/", {}).body for _ in range(2)]
    pool.close()
    assert bodies == [b"{}", b"{}"]
    assert server.connections == 2


def test_many_one_byte_chunks_make_one_body(serve: Callable[..., ScriptedServer]) -> None:
    payload = b'{"x":"' + b"y" * 3000 + b'"}'
    wire = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    wire += b"".join(b"1\r\n" + bytes([b]) + b"\r\n" for b in payload) + b"0\r\n\r\n"
    server = serve(lambda request, conn, index: (wire, False))
    pool = pool_for(server)
    assert pool.request("GET", "/", {}).body == payload
    pool.close()


@pytest.mark.parametrize("path", ["/a b", "/a\r\nX-Evil: 1", "/a\x00", "/caf\u00e9\u2603"])
def test_a_path_that_would_bend_the_request_line_is_refused(path: str) -> None:
    pool = HttpPool("http://127.0.0.1:9", PoolOptions(connect_timeout=1.0, read_timeout=1.0))
    with pytest.raises(ValueError, match="path") as caught:
        pool.request("GET", path, {"Authorization": f"Bearer {API_KEY}"})
    # Nothing in the error or its chain carries the request head, and so the key
    chain: list[BaseException] = []
    error: BaseException | None = caught.value
    while error is not None:
        chain.append(error)
        error = error.__cause__ or error.__context__
    assert all(API_KEY not in repr(vars(e)) + repr(e.args) for e in chain)
    assert len(chain) == 1


def test_connections_idle_longer_than_max_idle_are_not_reused(
    serve: Callable[..., ScriptedServer],
) -> None:
    server = serve(lambda request, conn, index: (answer(b"{}"), False))
    pool = pool_for(server, max_idle=0.0)
    for _ in range(3):
        pool.request("GET", "/", {})
    pool.close()
    assert server.connections == 3


def test_an_answer_dropped_mid_exchange_is_a_transport_error_and_not_reused(
    serve: Callable[..., ScriptedServer],
) -> None:
    # Given a server that reads the request and hangs up without answering, once
    server = serve(lambda request, conn, index: (b"", True) if conn == 0 else (answer(), False))
    pool = pool_for(server)
    with pytest.raises(TransportError, match="closed the connection before answering") as caught:
        pool.request("POST", "/v1/queue/publish", {"Authorization": f"Bearer {API_KEY}"}, b"{}")
    # Then the error names the host, never a header, and the next request uses a new connection
    assert f"127.0.0.1:{server.port}" in str(caught.value)
    assert API_KEY not in str(caught.value)
    assert pool.request("GET", "/", {}).status == 200
    pool.close()
    assert server.connections == 2


def test_a_server_that_never_answers_times_out(serve: Callable[..., ScriptedServer]) -> None:
    server = serve(lambda request, conn, index: (b"", False))
    assert_get_fails(server, "timed out", read_timeout=0.2)


def test_a_refused_connection_is_a_transport_error() -> None:
    with socket.create_server(("127.0.0.1", 0)) as placeholder:
        port = placeholder.getsockname()[1]
    pool = HttpPool(f"http://127.0.0.1:{port}", PoolOptions(connect_timeout=1.0, read_timeout=1.0))
    with pytest.raises(TransportError, match="ConnectionRefusedError"):
        pool.request("GET", "/", {})


# --- answers outside HTTP ---------------------------------------------------------------------


# Broken answers a server sends and then closes its connection after.
_MALFORMED_ANSWERS = [
    (b"SSH-2.0-OpenSSH_9.2\r\n\r\n", "not an HTTP/1.x status line"),
    (b"HTTP/1.1 2000 OK\r\n\r\n", "not an HTTP status code"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: -5\r\n\r\n", "invalid Content-Length"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nxy", "conflicting"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\n{}", "cut short"),
    (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0x2\r\n{}\r\n0\r\n\r\n",
        "chunk size",
    ),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1_0\r\n", "chunk size"),
    (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "malformed header"),
    (b"HTTP/1.1 200 OK\r\n" + b"X-Pad: y\r\n" * 101 + b"\r\n", "more than 100 headers"),
    (b"HTTP/1.1 200 OK\r\nX-Long: " + b"a" * 70_000 + b"\r\n\r\n", "longer than 64 KiB"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 5000\r\n\r\n" + b"a" * 5000, "larger than 1024"),
    (b"HTTP/1.1 200 OK\r\nContent-Le", "closed inside the answer's headers"),
]
# Broken heads a server sends and then keeps the connection open after.
_MALFORMED_HEADS_LEFT_OPEN = [
    (b"SSH-2.0-OpenSSH_9.2\r\n", "not an HTTP/1.x status line"),
    (b"HTTP/1.1 200 OK\r\nX-A: 1\r\n\r\r\n", "malformed header"),
]


@pytest.mark.parametrize(
    ("wire", "close", "message"),
    [(wire, True, message) for wire, message in _MALFORMED_ANSWERS]
    + [(wire, False, message) for wire, message in _MALFORMED_HEADS_LEFT_OPEN],
)
def test_malformed_answers_are_transport_errors_at_once(
    serve: Callable[..., ScriptedServer], wire: bytes, close: bool, message: str
) -> None:
    # Given a server that sends a broken answer, then closes the connection or keeps it open
    server = serve(lambda request, conn, index: (wire, close))
    # When a request is made, Then the answer is refused as soon as it shows it is broken: a pool
    # waiting for more on an open connection would end on its 30 s read timeout, with a timeout's
    # message
    assert_get_fails(server, message, max_answer_bytes=1024, read_timeout=30.0)


def test_a_header_value_with_a_line_break_is_refused_without_printing_it() -> None:
    pool = HttpPool("http://127.0.0.1:9", PoolOptions(connect_timeout=1.0, read_timeout=1.0))
    with pytest.raises(ValueError, match="'Authorization'") as caught:
        pool.request("GET", "/", {"Authorization": "Bearer abc\r\nX-Evil: 1"})
    assert "abc" not in str(caught.value)


def test_the_client_refuses_an_api_key_that_would_split_a_request() -> None:
    with pytest.raises(ConfigurationError, match="line break") as caught:
        InfraiClient("http://127.0.0.1:9", "sk_live_abc\n")
    assert "sk_live_abc" not in str(caught.value)


def test_the_client_refuses_credentials_and_bad_ports_in_the_base_url() -> None:
    with pytest.raises(ConfigurationError, match="credentials"):
        InfraiClient("https://user:pw@api.example.test", API_KEY)
    with pytest.raises(ConfigurationError, match="invalid port"):
        InfraiClient("https://api.example.test:99999", API_KEY)


# --- concurrency -------------------------------------------------------------------------------


def test_concurrent_requests_share_the_pool_safely(serve: Callable[..., ScriptedServer]) -> None:
    # Given 16 threads making 40 requests each through one pool of at most 4 idle connections
    server = serve(lambda request, conn, index: (answer(request.split(b"\r\n", 1)[0][4:]), False))
    pool = pool_for(server, maxsize=4)
    failures: list[BaseException] = []

    def worker(n: int) -> None:
        try:
            for i in range(40):
                target = f"/t{n}-{i}"
                response = pool.request("GET", target, {})
                # Then every answer belongs to its own request
                assert response.body.startswith(target.encode()), (target, response.body)
        except BaseException as exc:  # collected and asserted below
            failures.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures
    assert len(pool._idle) <= 4
    assert len(server.requests) == 640
    pool.close()
    assert pool._idle == []


def test_several_sent_requests_travel_at_once_and_are_read_in_any_order(
    serve: Callable[..., ScriptedServer],
) -> None:
    # Given a server that echoes each request's path, and a pool
    server = serve(lambda request, conn, index: (answer(request.split(b"\r\n", 1)[0][4:]), False))
    pool = pool_for(server)
    # When one thread sends five requests before reading any answer, then reads them backwards
    exchanges = [pool.send("GET", f"/t{n}", {}) for n in range(5)]
    assert len(server.requests) <= 5
    bodies = [pool.receive(exchange).body for exchange in reversed(exchanges)]
    # Then each answer belongs to its own request, each on its own connection, all kept
    assert bodies == [f"/t{n} HTTP/1.1".encode() for n in reversed(range(5))]
    assert server.connections == 5
    assert len(pool._idle) == 5
    # And the kept connections serve the next sends without reconnecting
    again = [pool.send("GET", f"/u{n}", {}) for n in range(5)]
    assert [pool.receive(e).status for e in again] == [200] * 5
    assert server.connections == 5
    # And an exchange is read once: a second read is refused
    with pytest.raises(RuntimeError, match="already read"):
        pool.receive(again[0])
    pool.close()


def test_an_answer_that_arrived_while_the_caller_was_busy_is_not_a_timeout(
    serve: Callable[..., ScriptedServer],
) -> None:
    # Given a pool whose answers must complete within 3 x 0.1 s of being sent
    server = serve(lambda request, conn, index: (answer(b'{"n":1}'), False))
    pool = pool_for(server, read_timeout=0.1)
    # When the caller sends, then works for well past that before reading
    exchange = pool.send("GET", "/slow-caller", {})
    time.sleep(1.5)
    # Then the answer waiting on the socket is read: past the deadline, what arrived counts
    assert pool.receive(exchange).body == b'{"n":1}'
    pool.close()


def test_exchanges_to_a_silent_server_read_one_after_another_expire_together(
    serve: Callable[..., ScriptedServer],
) -> None:
    # Given a server that never answers, and a read timeout of 0.5 s
    server = serve(lambda request, conn, index: (b"", False))
    pool = pool_for(server, read_timeout=0.5)
    # When twenty requests are sent together and their answers read one after another
    exchanges = [pool.send("GET", f"/t{n}", {}) for n in range(20)]
    started = time.monotonic()
    for exchange in exchanges:
        with pytest.raises(TransportError, match=r"timed out|did not complete in time"):
            pool.receive(exchange)
    # Then all of them timed out about 0.5 s after their send, not twenty timeouts in a row
    # (10 s): half of that leaves a busy machine room without blurring the two
    assert time.monotonic() - started < 5.0
    pool.close()


# --- TLS -----------------------------------------------------------------------------------------


TEST_CA = "infrai-jobs test CA"
LOOPBACK_NAMES: list[x509.GeneralName] = [
    x509.DNSName("localhost"),
    x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
]


def _tls_server(
    tmp: Path, serve: Callable[..., ScriptedServer], names: list[x509.GeneralName]
) -> tuple[ScriptedServer, Path]:
    ca_path, cert_path, key_path = issue_certificates(
        tmp, names, ca_name=TEST_CA, server_name="localhost"
    )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert_path, key_path)
    server = serve(lambda request, conn, index: (answer(OK_JSON), False), tls=context)
    return server, ca_path


@pytest.fixture
def tls_server(tmp_path: Path, serve: Callable[..., ScriptedServer]) -> tuple[ScriptedServer, Path]:
    return _tls_server(tmp_path, serve, LOOPBACK_NAMES)


def test_tls_with_a_trusted_certificate_works_and_keeps_the_connection(
    tls_server: tuple[ScriptedServer, Path],
) -> None:
    server, ca_path = tls_server
    trusted = ssl.create_default_context(cafile=str(ca_path))
    client = InfraiClient(server.url, API_KEY, pool=PoolOptions(ssl_context=trusted))
    stats = [client.stats("q") for _ in range(3)]
    client.close()
    assert [s.available_count for s in stats] == [1, 1, 1]
    assert server.connections == 1
    assert f"Authorization: Bearer {API_KEY}" in server.requests[0].decode()


def test_tls_refuses_an_untrusted_certificate_at_once_without_retrying(
    tls_server: tuple[ScriptedServer, Path],
) -> None:
    # Given the system's trust store, which does not know the test CA, and a client that
    # would retry a transient failure five times
    server, _ = tls_server
    sleeps: list[float] = []
    client = InfraiClient(
        server.url, API_KEY, retry=HttpRetryPolicy(max_attempts=5), sleep=sleeps.append
    )
    # When a retryable call is made
    with pytest.raises(UntrustedServer, match="CERTIFICATE_VERIFY_FAILED") as caught:
        client.stats("q")
    client.close()
    # Then it fails on the first handshake, final: not the retryable type, no back-off, one
    # connection, nothing sent, and the key appears nowhere in the error
    assert not isinstance(caught.value, InfraiUnavailable)
    assert caught.value.code == "TLS_VERIFICATION_FAILED"
    assert sleeps == []
    assert server.connections == 1
    assert server.requests == []
    assert API_KEY not in str(caught.value)


def test_a_certificate_for_another_host_is_final_for_the_client(
    tmp_path: Path, serve: Callable[..., ScriptedServer]
) -> None:
    # Given a CA the client trusts, a certificate it signed for another name, and retries on
    server, ca_path = _tls_server(tmp_path, serve, [x509.DNSName("api.other.test")])
    trusted = ssl.create_default_context(cafile=str(ca_path))
    sleeps: list[float] = []
    client = InfraiClient(
        server.url,
        API_KEY,
        pool=PoolOptions(ssl_context=trusted),
        retry=HttpRetryPolicy(max_attempts=5),
        sleep=sleeps.append,
    )
    # When a call is made, Then the hostname mismatch is final: one handshake, no retry
    with pytest.raises(UntrustedServer, match=r"IP address mismatch|doesn't match"):
        client.stats("q")
    client.close()
    assert sleeps == []
    assert server.connections == 1
    assert server.requests == []


def test_tls_refuses_a_certificate_for_another_host(
    tmp_path: Path, serve: Callable[..., ScriptedServer]
) -> None:
    # Given a CA the client trusts, and a certificate it signed for another name
    server, ca_path = _tls_server(tmp_path, serve, [x509.DNSName("api.other.test")])
    trusted = ssl.create_default_context(cafile=str(ca_path))
    pool = HttpPool(
        server.url, PoolOptions(connect_timeout=1.0, read_timeout=1.0, ssl_context=trusted)
    )
    # Then the handshake fails on the name, as a verification failure, and nothing is sent
    with pytest.raises(TlsVerificationFailed, match=r"IP address mismatch|doesn't match"):
        pool.request("GET", "/", {})
    assert server.requests == []


# --- The drain over TLS: lanes, keep-alive and concurrent acks through a TLS front -------------


class TlsFront:
    """TLS on 127.0.0.1 in front of a plain server, as a load balancer terminates it."""

    def __init__(self, context: ssl.SSLContext, backend_port: int) -> None:
        self.context = context
        self.backend_port = backend_port
        self.connections = 0
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                raw, _ = self._sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(raw,), daemon=True).start()

    def _serve(self, raw: socket.socket) -> None:
        try:
            front = self.context.wrap_socket(raw, server_side=True)
        except OSError:
            raw.close()
            return
        back = socket.create_connection(("127.0.0.1", self.backend_port))
        pump = threading.Thread(target=_pump, args=(back, front), daemon=True)
        pump.start()
        _pump(front, back)
        pump.join(timeout=5)
        front.close()
        back.close()

    def stop(self) -> None:
        self._sock.close()


def _pump(source: socket.socket, target: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            target.sendall(data)
    except OSError:
        pass
    with contextlib.suppress(OSError):
        target.shutdown(socket.SHUT_WR)


def test_lanes_drain_over_tls_with_kept_alive_connections(
    tmp_path: Path, database_url: str
) -> None:
    from drainkit import QUEUE, harness  # noqa: PLC0415

    from infrai_jobs.config.settings import DrainSettings  # noqa: PLC0415
    from infrai_jobs.runtime.factory import client_pool_size  # noqa: PLC0415

    ca_path, cert_path, key_path = issue_certificates(
        tmp_path, LOOPBACK_NAMES, ca_name=TEST_CA, server_name="localhost"
    )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert_path, key_path)
    with harness(database_url) as kit:
        # Given 600 jobs (a third published twice) behind a TLS front, 5 ms per call
        for n in range(600):
            kit.publish({"job": "test.db", "id": f"t{n}"}, times=2 if n % 3 == 0 else 1)
        front = TlsFront(context, kit.server.port)
        client = InfraiClient(
            front.url,
            "test-key",
            pool=PoolOptions(
                ssl_context=ssl.create_default_context(cafile=str(ca_path)),
                maxsize=client_pool_size(4),
            ),
        )
        service = kit.lane_service(DrainSettings(queue=QUEUE, drain_lanes=4), client)
        kit.faults(latency_ms=5)
        # When four lanes drain them over TLS, acks ten at a time per lane
        summary = service.run(lambda: 120_000)
        kit.faults()
        service.close()
        client.close()
        front.stop()
        # Then every job ran once and every message was acked
        assert summary.done == 600
        assert summary.acked == 800
        assert summary.stopped == "empty"
        rows = dict(kit.sql("SELECT idem_key, count(*) FROM test_effects GROUP BY idem_key"))
        assert rows == {f"test.db:t{n}": 1 for n in range(600)}
        # And the TLS connections were kept and reused: no more handshakes than the lanes can
        # have calls in flight at once
        assert 1 <= front.connections <= client_pool_size(4)
