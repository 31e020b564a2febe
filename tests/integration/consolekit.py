"""A ledger with something for each of the console's views, the console itself in a child
process (``infrai-jobs console --port 0``) on the drain harness's emulator and ledger, a client
speaking raw HTTP, and a provider that holds its answer until the test lets it go."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import threading
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

import urllib3
from drainkit import QUEUE, Harness, start_cli
from stub_servers import QuietJsonHandler, serving

from infrai_jobs.jobs.keys import payload_fingerprint

RECEIPTS = [
    {"job": "receipt.send", "invoice_id": f"inv_console_{name}", "email": f"{name}@example.com"}
    for name in ("a", "b")
]
STUCK_RECEIPT = {"job": "receipt.send", "invoice_id": "inv_console_stuck", "email": "s@example.com"}


@dataclass(frozen=True)
class Seeded:
    dead_letter_ids: list[str]
    stuck_key: str
    deferred_key: str


def seed(kit: Harness) -> Seeded:
    """Two receipts Infrai dead-lettered (three deliveries unacked), a receipt whose worker
    died inside the call (running, lease over, flagged), and a deferred job waiting an hour."""
    ids = [kit.publish(payload)[0] for payload in RECEIPTS]
    for _ in range(3):
        assert len(kit.client.consume(QUEUE, 10)) == len(RECEIPTS)
        kit.advance()
    assert kit.client.stats(QUEUE).dlq_count == len(RECEIPTS)
    derived = kit.registry.derive(STUCK_RECEIPT)
    kit.sql(
        "INSERT INTO job_claims (idem_key, state, message_id, job, effect, claim_token, "
        "lease_until, payload_sha256, error, claimed_at, updated_at) "
        "VALUES (%s, 'running', 'msg-of-a-dead-worker', %s, %s, %s, now() - interval '10 minutes',"
        " %s, 'claim lease expired while running: the effect may have happened', "
        "now() - interval '20 minutes', now() - interval '20 minutes')",
        (
            derived.idem_key,
            derived.definition.name,
            derived.definition.effect.value,
            uuid.uuid4(),
            payload_fingerprint(STUCK_RECEIPT),
        ),
    )
    key = kit.defer("console-deferred")
    return Seeded(ids, derived.idem_key, key)


@dataclass
class RunningConsole:
    url: str  # as printed, with the token
    process: subprocess.Popen[str]

    @property
    def base(self) -> str:
        return self.url.split("/?", 1)[0]

    @property
    def token(self) -> str:
        return self.url.rsplit("token=", 1)[1]

    @property
    def address(self) -> tuple[str, int]:
        """Where the printed URL connects (its host without brackets, its port)."""
        parts = urlsplit(self.url)
        assert parts.hostname is not None, self.url
        assert parts.port is not None, self.url
        return parts.hostname, parts.port

    def stop(self) -> str:
        """Stop it (by its PID) and return what it wrote on stderr."""
        if self.process.returncode is None:
            self.process.terminate()
        _, err = self.process.communicate(timeout=10)
        return err or ""


@contextmanager
def console(kit: Harness, *flags: str, **env: str) -> Iterator[RunningConsole]:
    """``infrai-jobs console --port 0 FLAGS`` until the block ends (stopped by its PID)."""
    process = start_cli(kit, "console", "--port", "0", *flags, **env)
    running = None
    try:
        assert process.stdout is not None
        url = process.stdout.readline().strip()
        assert url.startswith("http://"), (url, process.stderr and process.stderr.read())
        running = RunningConsole(url, process)
        yield running
    finally:
        if running is not None:
            running.stop()
        else:
            process.terminate()
            process.communicate(timeout=10)


def raw_exchange(running: RunningConsole, request: bytes) -> bytes:
    """Send ``request`` as it is on a connection of its own; what the console answers until it
    closes the connection (30 s at most: a console that never answers fails the test)."""
    with socket.create_connection(running.address, timeout=30) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


@dataclass
class HeldProvider:
    """A mail provider whose search (``GET /v1/mail``) answers only when the test says so:
    ``arrived`` is set once a search is waiting, ``release`` lets every search answer with one
    receipt sent (``MESSAGE_ID``)."""

    MESSAGE_ID = "held-mail-1"

    arrived: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    url: str = ""

    def answer(self) -> dict[str, Any]:
        return {"messages": [{"id": self.MESSAGE_ID, "template": "receipt"}]}


@contextmanager
def held_provider() -> Iterator[HeldProvider]:
    held = HeldProvider()

    class Handler(QuietJsonHandler):
        def do_GET(self) -> None:
            held.arrived.set()
            held.release.wait(timeout=60)
            self.send_json(200, json.dumps(held.answer()).encode())

    with serving(ThreadingHTTPServer(("127.0.0.1", 0), Handler)) as url:
        held.url = url
        try:
            yield held
        finally:
            held.release.set()


class Session:
    """A browser's cookie jar, by hand: the token traded for the console's cookie once."""

    def __init__(self, running: RunningConsole, timeout: float | None = None) -> None:
        self.running = running
        # A timeout, where a test needs one, turns a console that never answers into a failure
        # (and is not retried).
        retries = False if timeout is not None else None
        self.http = urllib3.PoolManager(timeout=timeout, retries=retries)
        first = self.http.request("GET", running.url, redirect=False)
        assert first.status == 303, first.status
        self.cookie = first.headers["Set-Cookie"].split(";", 1)[0]

    def get(self, path: str, fields: Sequence[tuple[str, str]] = ()) -> urllib3.BaseHTTPResponse:
        return self.http.request(
            "GET", self.running.base + path, fields=list(fields), headers={"Cookie": self.cookie}
        )

    def post(
        self, path: str, fields: list[tuple[str, str]], **headers: str
    ) -> urllib3.BaseHTTPResponse:
        return self.http.request(
            "POST",
            self.running.base + path,
            fields=fields,
            encode_multipart=False,
            headers={"Cookie": self.cookie, **headers},
        )


def count_on(html: str, card: str) -> int:
    match = re.search(rf'id="count-{card}"[^>]*>\s*<span class="n">(\d+)</span>', html)
    assert match is not None, html
    return int(match.group(1))
