"""A ledger with something for each of the console's views, and the console itself in a child
process (``infrai-jobs console --port 0``) on the drain harness's emulator and ledger."""

from __future__ import annotations

import re
import subprocess
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import urllib3
from drainkit import QUEUE, Harness, start_cli

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


@contextmanager
def console(kit: Harness, *flags: str) -> Iterator[RunningConsole]:
    """``infrai-jobs console --port 0 FLAGS`` until the block ends (stopped by its PID)."""
    process = start_cli(kit, "console", "--port", "0", *flags)
    try:
        assert process.stdout is not None
        url = process.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), (url, process.stderr and process.stderr.read())
        yield RunningConsole(url, process)
    finally:
        process.terminate()
        process.wait(timeout=10)
        for stream in (process.stdout, process.stderr):
            if stream is not None:
                stream.close()


class Session:
    """A browser's cookie jar, by hand: the token traded for the console's cookie once."""

    def __init__(self, running: RunningConsole) -> None:
        self.running = running
        self.http = urllib3.PoolManager()
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
