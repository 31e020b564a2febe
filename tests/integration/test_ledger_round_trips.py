"""The ledger's own cost, counted on the wire: libpq's trace of frontend messages.

Every ``Query`` (simple protocol) and every ``Sync`` (extended protocol) is one round trip that
waits for the server. The job's own statements are counted separately.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from drainkit import Harness, harness

from infrai_jobs.drain.batch import process_batch
from infrai_jobs.drain.model import DrainConfig
from infrai_jobs.queue.models import QueueMessage


@pytest.fixture
def kit(database_url: str) -> Iterator[Harness]:
    with harness(database_url) as h:
        h.sql("INSERT INTO invoices (id) SELECT 'inv_' || g FROM generate_series(1, 10) g")
        yield h


def _frontend_messages(conn: psycopg.Connection[Any], run: Any) -> list[tuple[str, str]]:
    """(message type, text) of every message the client sent while ``run`` ran."""
    fd, path = tempfile.mkstemp()
    try:
        conn.pgconn.trace(fd)
        run()
        conn.pgconn.untrace()
        with open(path) as trace:
            # A record starts with its timestamp; a statement's own newlines continue it.
            records = re.split(r"\n(?=\d{4}-\d\d-\d\d )", trace.read())
            lines = [record.split("\t", 4) for record in records]
    finally:
        os.close(fd)
        os.unlink(path)
    return [
        (parts[3], parts[4] if len(parts) > 4 else "")
        for parts in lines
        if len(parts) > 3 and parts[1] == "F"
    ]


def _messages(payloads: list[dict[str, object]]) -> list[QueueMessage]:
    return [
        QueueMessage(f"qmsg_{i}", "billing-jobs", p, 1, None, f"qmsg_{i}")
        for i, p in enumerate(payloads)
    ]


def test_a_batch_of_database_jobs_costs_the_ledger_two_round_trips(kit: Harness) -> None:
    # Given a batch of ten invoice jobs and a warm ledger connection
    kit.ledger.get("warm-up")
    conn = kit.ledger._conn  # the test reads the wire of the ledger's own connection
    assert conn is not None
    batch = _messages(
        [
            {"job": "invoice.finalize", "invoice_id": f"inv_{n}", "amount_cents": n}
            for n in range(1, 11)
        ]
    )
    # When the batch is processed
    results: list[Any] = []
    sent = _frontend_messages(
        conn,
        lambda: results.extend(
            process_batch(batch, kit.ledger, kit.registry, 2e9, DrainConfig(queue="billing-jobs"))
        ),
    )
    # Then all ten are done
    assert [r.outcome.value for r in results] == ["done"] * 10
    # And the ledger spoke to the server twice: BEGIN with the claim, the settle with COMMIT
    queries = [text.strip().strip('"') for kind, text in sent if kind == "Query"]
    assert len(queries) == 2
    assert queries[0].startswith("BEGIN;")
    assert "INSERT INTO job_claims" in queries[0]
    assert queries[1].lstrip().startswith("UPDATE job_claims")
    assert queries[1].endswith("COMMIT")
    # And every other statement sent was the job's own UPDATE
    parsed = [text for kind, text in sent if kind == "Parse"]
    assert parsed
    assert all("UPDATE invoices" in text for text in parsed)


def test_a_failing_job_reruns_the_batch_with_savepoints_and_spares_its_neighbours(
    kit: Harness,
) -> None:
    # Given a batch where the last job fails
    batch = _messages(
        [{"job": "test.db", "id": str(n)} for n in range(4)]
        + [{"job": "test.db", "id": "bad", "mode": "transient"}]
    )
    # When processed
    results = process_batch(batch, kit.ledger, kit.registry, 2e9, DrainConfig(queue="billing-jobs"))
    # Then its neighbours are done exactly once, and the failure left nothing behind
    assert [r.outcome.value for r in results] == ["done"] * 4 + ["retry"]
    assert [kit.effects(f"test.db:{n}") for n in range(4)] == [1, 1, 1, 1]
    assert kit.effects("test.db:bad") == 0
    assert kit.row("test.db:bad") is None
