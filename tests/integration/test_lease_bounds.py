"""A claim's lease never outlives its message's visibility window (the ledger's invariant).

Real PostgreSQL and the emulator over HTTP, with a visibility timeout of a few seconds so the
lease's end can be waited for: the emulator's clock can be moved, the database's cannot.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from drainkit import DLQ, QUEUE, Harness, harness

from infrai_jobs.drain.loop import drain
from infrai_jobs.drain.model import DrainConfig
from infrai_jobs.jobs.registry import Effect, JobContext, JsonValue, Payload
from infrai_jobs.operations.dead_letters import DeadLetterStore
from infrai_jobs.operations.redrive import RedriveRequest, redrive
from infrai_jobs.work.admin import WorkStore

VISIBILITY = 4
KEY = "test.idem:d1"


class Killed(BaseException):
    """The process dying inside the downstream call: nothing in the drain catches it."""


@pytest.fixture
def kit(database_url: str) -> Iterator[Harness]:
    with harness(database_url, visibility=VISIBILITY) as h:
        h.sql("CREATE TABLE idem_effects (idem_key text NOT NULL)")
        yield h


def register_dying_job(kit: Harness, effect: Effect, deaths: int) -> list[str]:
    """``test.idem``: its first ``deaths`` calls die mid-call; later ones record the effect."""
    calls: list[str] = []

    @kit.registry.job("test.idem", effect=effect, identity=("id",))
    def handler(payload: Payload, ctx: JobContext) -> JsonValue:
        calls.append(ctx.message_id)
        if len(calls) <= deaths:
            raise Killed
        kit.sql("INSERT INTO idem_effects VALUES (%s)", (ctx.idem_key,))
        return {"built": payload["id"]}

    return calls


def drain_with(kit: Harness, **config: Any) -> Any:
    """A drain with a long budget and grace, as a CLI drain with --time-budget-seconds 3600 and
    LEASE_GRACE_SECONDS=600 would run."""
    return drain(
        kit.client,
        kit.ledger,
        kit.registry,
        DrainConfig(
            queue=QUEUE,
            lease_grace_seconds=600,
            visibility_timeout_seconds=VISIBILITY,
            **config,
        ),
        lambda: 3_600_000,
    )


def lease_seconds_after_claim(kit: Harness) -> float:
    ((seconds,),) = kit.sql(
        "SELECT extract(epoch FROM lease_until - coalesce(updated_at, claimed_at))::float8 "
        "FROM job_claims WHERE idem_key = %s",
        (KEY,),
    )
    return float(seconds)


def wait_for_lease_end(kit: Harness, within: float) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        ((over,),) = kit.sql(
            "SELECT lease_until < now() FROM job_claims WHERE idem_key = %s", (KEY,)
        )
        if over:
            return
        time.sleep(0.1)
    pytest.fail(f"the lease of {KEY} outlived the {VISIBILITY} s visibility window")


def test_a_redrive_behind_a_dead_owners_lease_takes_the_claim_over(kit: Harness) -> None:
    # Given a key-passing job whose first three deliveries each die inside the downstream call,
    # drained with a budget and grace far beyond the queue's visibility timeout
    calls = register_dying_job(kit, Effect.EXTERNAL_IDEMPOTENT, deaths=3)
    (message_id,) = kit.publish({"job": "test.idem", "id": "d1"})
    for _ in range(3):
        with pytest.raises(Killed):
            drain_with(kit)
        # Then each claim's lease ends within the message's visibility window
        assert 0 <= lease_seconds_after_claim(kit) <= VISIBILITY
        kit.advance(VISIBILITY + 1)
    kit.advance(VISIBILITY + 1)
    assert kit.client.stats(QUEUE).dlq_count == 1
    # And once dead-lettered, the message has left no live claim behind
    wait_for_lease_end(kit, within=VISIBILITY + 2)
    # When an operator redrives it and the next drain runs
    store = DeadLetterStore(WorkStore(kit.database_url))
    moved = redrive(
        kit.client,
        store,
        RedriveRequest(source=DLQ, target=QUEUE, max_messages=10, actor="on-call"),
    )
    assert moved.published == 1
    summary = drain_with(kit)
    # Then the copy took the claim over and did the work, once, under the same key
    assert (summary.done, summary.takeovers, summary.acked) == (1, 1, 1)
    row = kit.row(KEY)
    assert row is not None
    assert row.state == "done"
    assert kit.sql("SELECT count(*) FROM idem_effects")[0][0] == 1
    assert len(calls) == 4
    assert calls[3] != message_id
    # And nothing is left anywhere
    stats = kit.client.stats(QUEUE)
    assert (stats.message_count, stats.dlq_count) == (0, 0)


def test_a_redriven_copy_of_an_irreversible_job_behind_a_dead_owner_is_stuck_not_acked(
    kit: Harness,
) -> None:
    # Given an irreversible job whose one delivery died inside its call, under a long budget
    register_dying_job(kit, Effect.EXTERNAL, deaths=1)
    kit.publish({"job": "test.idem", "id": "d1"})
    with pytest.raises(Killed):
        drain_with(kit)
    assert 0 <= lease_seconds_after_claim(kit) <= VISIBILITY
    # When its visibility lapses and a copy of the work arrives (a producer retry, a redrive)
    wait_for_lease_end(kit, within=VISIBILITY + 2)
    kit.advance(VISIBILITY + 1)
    kit.publish({"job": "test.idem", "id": "d1"})
    summary = drain_with(kit)
    # Then neither delivery is acked (they came in one batch: the second follows the first):
    # the claim is stuck, flagged for a human, never re-run
    assert summary.outcomes == {"stuck": 1, "batch_duplicate": 1}
    assert summary.acked == 0
    row = kit.row(KEY)
    assert row is not None
    assert (row.state, bool(row.error)) == ("running", True)
    assert kit.sql("SELECT count(*) FROM idem_effects")[0][0] == 0
