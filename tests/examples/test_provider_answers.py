"""A provider's answer is read with a bound (``LazyPool.max_answer_bytes``, 1 MiB), for every
job that calls through the layer's pool: an answer over it is never held whole. By the rule that
sorts a provider's answers, an answer that cannot be read is a lost answer: the irreversible
receipt's claim stays stuck for a human or its probe (the mail may be sent), the idempotent
digest is retried, and a probe's lookup is an unknown answer that leaves the claim as it is.
Real PostgreSQL, the emulator, and a stand-in provider over HTTP answering 5 MB."""

from __future__ import annotations

import contextlib
import gzip
import json
import tracemalloc
from collections.abc import Iterator
from http.server import ThreadingHTTPServer

import pytest
import urllib3
from drainkit import FUNCTIONS_CODE, OPERATOR, Harness, harness
from stub_servers import QuietJsonHandler, serving
from test_reconcile import DIGEST, RECEIPT, seed_dead_worker_claim

import jobs
from infrai_jobs.jobs.http_pool import LazyPool
from infrai_jobs.operations.reconcile import Reconciler
from infrai_jobs.work.admin import WorkStore
from infrai_local.operator.verbs import reconcile_one

# Five megabytes of JSON, as a long search listing or a misbehaving provider might answer; read
# whole, it would settle a send, a digest and the receipt probe's search alike.
RECEIPT_MAIL = {"id": "m_1", "invoice_id": "inv_1", "template": "receipt", "to": "a@example.com"}
HUGE = json.dumps({"id": "m_1", "messages": [RECEIPT_MAIL], "padding": "x" * 5_000_000}).encode()
SMALL = b'{"id": "m_1", "messages": []}'


class _Provider(QuietJsonHandler):
    """Answers every call 200: ``/huge...`` with ``HUGE``, ``/empty...`` with nothing, else
    ``SMALL``; a path ending in ``.gz`` gets its answer gzip-compressed."""

    def do_GET(self) -> None:
        name = self.path.lstrip("/")
        body = HUGE if name.startswith("huge") else b"" if name.startswith("empty") else SMALL
        self.send_response(200)
        if name.endswith(".gz"):
            body = gzip.compress(body)
            self.send_header("Content-Encoding", "gzip")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        # The client may stop reading at its bound, as it should: not this server's error.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self.wfile.write(body)

    do_POST = do_GET


@pytest.fixture(scope="module")
def provider() -> Iterator[str]:
    with serving(ThreadingHTTPServer(("127.0.0.1", 0), _Provider)) as url:
        yield url


@pytest.fixture
def kit(database_url: str) -> Iterator[Harness]:
    """The harness running the team's example jobs (``functions/jobs``)."""
    with harness(database_url, jobs=jobs.build_registry, code_root=FUNCTIONS_CODE) as example_kit:
        yield example_kit


def _point_jobs_at(kit: Harness, url: str) -> None:
    kit.registry.bind_settings(dict.fromkeys(kit.registry.declared_settings(), url))


@pytest.mark.parametrize("path", ["/huge", "/huge.gz"])
def test_an_answer_over_the_bound_is_refused_without_being_held_whole(
    provider: str, path: str
) -> None:
    # Given a provider answering 5 MB, plainly or compressed to a few kilobytes
    pool = LazyPool(connect_s=2.0, read_s=10.0)
    pool.warm()
    # When the pool reads its answer
    tracemalloc.start()
    try:
        with pytest.raises(urllib3.exceptions.ProtocolError, match="answer over 1,048,576 bytes"):
            pool.request("GET", provider + path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # Then it is refused as an answer cut short, and never held whole in memory
    assert peak < len(HUGE) // 2


@pytest.mark.parametrize(
    ("path", "data"), [("/small", SMALL), ("/small.gz", SMALL), ("/empty", b"")]
)
def test_an_answer_within_the_bound_reads_as_a_preloaded_one(
    provider: str, path: str, data: bytes
) -> None:
    # Given a provider answering within the bound (decompressed by the pool, or empty)
    pool = LazyPool(connect_s=2.0, read_s=10.0)
    # When it is read twice over one pool
    for _ in range(2):
        response = pool.request("GET", provider + path)
        # Then status, headers and body read as before: ``data`` is the decoded body every time
        assert (response.status, response.data, response.data) == (200, data, data)
        assert response.headers["Content-Type"] == "application/json"
    assert pool.request("GET", provider + "/small").json() == json.loads(SMALL)


def test_a_pool_given_its_own_bound_reads_to_it(provider: str) -> None:
    # Given a pool bounded below the small answer's length, and one bounded at it exactly
    below = LazyPool(connect_s=2.0, read_s=10.0, max_answer_bytes=len(SMALL) - 1)
    at = LazyPool(connect_s=2.0, read_s=10.0, max_answer_bytes=len(SMALL))
    # When / Then the first refuses it, naming its bound, and the second reads it whole
    with pytest.raises(urllib3.exceptions.ProtocolError, match=f"answer over {len(SMALL) - 1} "):
        below.request("GET", provider + "/small")
    assert at.request("GET", provider + "/small").data == SMALL


def test_a_receipt_whose_answer_is_too_large_is_left_stuck_not_retried(
    kit: Harness, provider: str
) -> None:
    # Given the mail provider answering a send with 5 MB (the mail may well be sent)
    _point_jobs_at(kit, provider + "/huge")
    key = kit.registry.derive(RECEIPT).idem_key
    kit.publish(RECEIPT)
    # When the drain runs the receipt
    summary = kit.drain()
    # Then it is uncertain, never retried: the claim stays running, flagged for a human
    assert (summary.done, summary.retried) == (0, 0)
    row = kit.row(key)
    assert row is not None
    assert row.state == "running"
    assert "mail provider call ended without an answer" in (row.error or "")
    assert "answer over 1,048,576 bytes" in (row.error or "")


def test_a_digest_whose_answer_is_too_large_is_retried(kit: Harness, provider: str) -> None:
    # Given the digest provider (it takes our key, so a repeat is harmless) answering 5 MB
    _point_jobs_at(kit, provider + "/huge")
    kit.publish(DIGEST)
    # When the drain runs the digest
    summary = kit.drain()
    # Then it is retried as an answer lost, neither done nor held for a human
    assert (summary.done, summary.retried) == (0, 1)


def test_a_probe_whose_lookup_is_too_large_answers_unknown(kit: Harness, provider: str) -> None:
    # Given a stuck receipt, and a mail provider whose search answers 5 MB
    key = seed_dead_worker_claim(kit, RECEIPT)
    _point_jobs_at(kit, provider + "/huge")
    # When the claim is reconciled
    reconciler = Reconciler(WorkStore(kit.database_url), kit.registry, actor=OPERATOR)
    ((outcome),) = reconcile_one(reconciler, key).outcomes
    # Then the probe's answer is unknown, and the claim stays stuck for a human
    assert (outcome.answer, outcome.action) == ("unknown", "unchanged")
    row = kit.row(key)
    assert row is not None
    assert row.state == "running"
