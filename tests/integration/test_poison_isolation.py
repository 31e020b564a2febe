"""A message whose consume answer cannot be read costs its own deliveries, never its neighbours'.

Real PostgreSQL, the emulator over HTTP, the example jobs of all three effect classes. Each test
here failed on the code before poison isolation: the neighbours of the unreadable message were
dead-lettered without ever running.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from drainkit import API_KEY, DLQ, QUEUE, Harness, harness

from infrai_jobs.queue.client import InfraiClient

# Ordinary jobs of the three effect classes, the neighbours an unreadable message must spare.
NEIGHBOURS: list[dict[str, Any]] = [
    {"job": "invoice.finalize", "invoice_id": "inv_p1", "amount_cents": 100},
    {"job": "receipt.send", "invoice_id": "inv_p2", "email": "a@example.com"},
    {"job": "digest.build", "tenant_id": "t_p3", "period": "2026-11"},
    {"job": "invoice.finalize", "invoice_id": "inv_p4", "amount_cents": 400},
    {"job": "receipt.send", "invoice_id": "inv_p5", "email": "b@example.com"},
    {"job": "digest.build", "tenant_id": "t_p6", "period": "2026-11"},
    {"job": "invoice.finalize", "invoice_id": "inv_p7", "amount_cents": 700},
    {"job": "receipt.send", "invoice_id": "inv_p8", "email": "c@example.com"},
    {"job": "digest.build", "tenant_id": "t_p9", "period": "2026-11"},
]
NEIGHBOUR_KEYS = [
    "invoice.finalize:inv_p1",
    "receipt.send:inv_p2",
    "digest.build:t_p3:2026-11",
    "invoice.finalize:inv_p4",
    "receipt.send:inv_p5",
    "digest.build:t_p6:2026-11",
    "invoice.finalize:inv_p7",
    "receipt.send:inv_p8",
    "digest.build:t_p9:2026-11",
]
SMALL_ANSWER_LIMIT = 64 * 1024


@pytest.fixture
def kit(database_url: str) -> Iterator[Harness]:
    with harness(database_url) as h:
        h.sql("INSERT INTO invoices (id) VALUES ('inv_p1'), ('inv_p4'), ('inv_p7')")
        yield h


@pytest.fixture
def small_kit(database_url: str) -> Iterator[Harness]:
    """A client that reads consume answers of 64 KiB at most: a 100 KB message is unreadable
    in any batch, and even alone."""
    with harness(database_url, max_answer_bytes=SMALL_ANSWER_LIMIT) as h:
        h.sql("INSERT INTO invoices (id) VALUES ('inv_p1'), ('inv_p4'), ('inv_p7')")
        yield h


def publish_raw(kit: Harness, body_json: bytes) -> tuple[int, dict[str, Any]]:
    """Publish a body given as JSON text, as any producer may send it (UTF-8, any nesting)."""
    request = b'{"queue":"' + QUEUE.encode() + b'","body":' + body_json + b"}"
    response = kit.control.request(
        "POST",
        f"{kit.server.url}/v1/queue/publish",
        body=request,
        headers={"Authorization": "Bearer test-key", "Content-Type": "application/json"},
    )
    return response.status, json.loads(response.data)


def publish_around(kit: Harness, publish_middle: Any) -> Any:
    """Four neighbours, the middle message, five neighbours: one batch of ten."""
    for payload in NEIGHBOURS[:4]:
        kit.publish(payload)
    middle = publish_middle()
    for payload in NEIGHBOURS[4:]:
        kit.publish(payload)
    return middle


def assert_neighbours_done_once(kit: Harness) -> None:
    rows = {key: kit.row(key) for key in NEIGHBOUR_KEYS}
    assert {key: row.state if row else None for key, row in rows.items()} == dict.fromkeys(
        NEIGHBOUR_KEYS, "done"
    )
    sink = kit.sink.state.snapshot()
    assert sink["mail_effects"] == 3
    assert sink["digest_effects"] == 3


def test_a_body_nested_too_deeply_to_serve_is_refused_at_publish_and_spares_its_batch(
    kit: Harness,
) -> None:
    # Given a body nested 977 levels deep, published between nine ordinary jobs
    deep = b'{"job":"test.db","id":"deep","x":' + b"[" * 976 + b"]" * 976 + b"}"
    status, answer = publish_around(kit, lambda: publish_raw(kit, deep))
    # Then the queue refused it, saying why, rather than accept what no consume can serve
    assert status == 400
    assert answer["error"]["code"] == "VALIDATION_ERROR"
    assert "nested 977 levels deep" in answer["error"]["message"]
    # And when drained, every neighbour ran once and was acked; nothing is left or dead
    summary = kit.drain()
    assert (summary.done, summary.acked, summary.answers_lost) == (9, 9, 0)
    assert_neighbours_done_once(kit)
    stats = kit.client.stats(QUEUE)
    assert (stats.message_count, stats.dlq_count) == (0, 0)


def test_a_six_megabyte_non_ascii_body_is_served_as_utf8_with_its_batch(kit: Harness) -> None:
    # Given a 6 MB body of non-ASCII text (18 MB if every character were \u-escaped)
    blob = "é" * (3 * 1024 * 1024)
    body = json.dumps({"job": "test.db", "id": "wide", "blob": blob}, ensure_ascii=False)
    status, _ = publish_around(kit, lambda: publish_raw(kit, body.encode("utf-8")))
    assert status == 200
    # When drained
    summary = kit.drain()
    # Then the batch of ten was read whole: all ten ran once and were acked
    assert summary.outcomes == {"done": 10}, summary.as_dict()
    assert (summary.consumed, summary.done, summary.acked) == (10, 10, 10)
    assert (summary.batches, summary.answers_lost) == (1, 0)
    assert_neighbours_done_once(kit)
    assert kit.effects("test.db:wide") == 1


def test_an_unreadable_message_walks_to_the_dlq_alone(
    small_kit: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    kit = small_kit
    caplog.set_level(logging.WARNING, logger="infrai_jobs")
    # Given a 100 KB message, too large for this client's answers even alone, among nine jobs
    big = {"job": "test.db", "id": "big", "b": "y" * 100_000}
    big_id = publish_around(kit, lambda: kit.publish(big)[0])
    # When drained: the batch's answer is too large, so all ten spent a delivery unseen
    first = kit.drain()
    assert (first.answers_lost, first.consumed, first.stopped) == (1, 0, "empty")
    lost = [r for r in caplog.records if getattr(r, "action", "") == "consume_answer_lost"]
    assert [(r.levelno, r.code, r.max_messages) for r in lost] == [
        (logging.WARNING, "ANSWER_TOO_LARGE", 10)
    ]
    # And the queue is now consumed one message at a time, by every drain, for a while
    window = kit.sql("SELECT extract(epoch FROM single_until - now()) FROM consume_isolation")
    assert 0 < window[0][0] <= 600
    # When the ten come back and are drained again
    caplog.clear()
    kit.advance()
    second = kit.drain()
    # Then the nine neighbours ran, each received alone, and the unreadable one was isolated
    assert (second.done, second.acked, second.batches) == (9, 9, 9)
    assert (second.answers_lost, second.unreadable) == (1, 1)
    isolated = [r for r in caplog.records if getattr(r, "action", "") == "unreadable_message"]
    assert len(isolated) == 1
    assert isolated[0].levelno == logging.ERROR
    assert (isolated[0].queue, isolated[0].max_messages) == (QUEUE, 1)
    assert isolated[0].size_bytes > SMALL_ANSWER_LIMIT
    assert_neighbours_done_once(kit)
    # When its third delivery fails too
    kit.advance()
    third = kit.drain()
    assert (third.unreadable, third.consumed) == (1, 0)
    kit.advance()
    # Then it alone is in the DLQ, with its id, and nothing else is left
    stats = kit.client.stats(QUEUE)
    assert (stats.message_count, stats.dlq_count) == (0, 1)
    reader = InfraiClient(kit.server.url, API_KEY)
    try:
        assert [m.message_id for m in reader.consume(DLQ, 10)] == [big_id]
    finally:
        reader.close()
    assert kit.row("test.db:big") is None


def test_the_client_publishes_non_ascii_text_at_its_utf8_size(kit: Harness) -> None:
    # Given a 6 MB body of non-ASCII text: 18 MB if sent with \u escapes, over publish's limit
    body = {"job": "test.db", "id": "wide-client", "blob": "é" * (3 * 1024 * 1024)}
    # When the client publishes it, Then the queue takes it, and a drain runs it
    kit.client.publish(QUEUE, body)
    assert kit.drain().done == 1
    assert kit.effects("test.db:wide-client") == 1
    # And text UTF-8 cannot carry (a lone surrogate) still travels, escaped
    kit.client.publish(QUEUE, {"job": "test.db", "id": "lone", "s": "\ud800"})
    assert kit.drain().consumed == 1
