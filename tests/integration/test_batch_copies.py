"""Copies of one key in one batch, property-tested on the real ledger and on the fake.

The invariant: a batch never acks every message of a key while that key's claim stays
``running`` and unflagged, unless a message outside the batch holds a live claim (its own
message drives the retries). Otherwise the job is stranded: no message left in the queue or the
DLQ, nothing flagged, no alert. Whichever copy holds the claim, and in whatever order the copies
arrive, the holder is judged as its own redelivery and the other copies follow it.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from drainkit import QUEUE as DRAIN_QUEUE
from drainkit import Harness, harness
from fakes import InMemoryLedger
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from job_modes import fail_as_asked

from infrai_jobs.drain.batch import MessageResult, process_batch
from infrai_jobs.drain.model import DrainConfig, DrainSummary
from infrai_jobs.jobs.keys import payload_fingerprint
from infrai_jobs.jobs.registry import Effect, JobContext, JobRegistry, JsonValue, Payload
from infrai_jobs.queue.models import QueueMessage
from infrai_jobs.work.admin import WorkStore
from infrai_jobs.work.ledger import PostgresLedger
from infrai_jobs.work.ports import LedgerPort
from infrai_jobs.work.states import ClaimRow
from infrai_local.migrations import apply_migrations

QUEUE = "copies"
LIVE_SECONDS = 120  # a seeded live lease: far beyond the batch's run
EXPIRED_SECONDS = -30

# The claim a key may already have when its copies arrive. "member" states are held by one of
# the batch's own messages (drawn below); "outside" ones by a message that is not in the batch.
CLAIM_STATES = (
    "none",
    "live_member",
    "live_outside",
    "expired_member",
    "expired_outside",
    "done",
    "failed",
    "flagged_member",
    "flagged_outside",
)
BEHAVIOURS = ("ok", "transient", "permanent", "uncertain")
SEED_CLAIM = """
INSERT INTO job_claims (idem_key, state, message_id, job, effect, claim_token, lease_until,
                        payload_sha256, error, result)
VALUES (%(key)s, %(state)s, %(message_id)s, %(job)s, %(effect)s, %(token)s, %(lease_until)s,
        %(fingerprint)s, %(error)s, %(result)s)
"""
JOB_OF = {
    Effect.DATABASE: "copies.database",
    Effect.EXTERNAL: "copies.external",
    Effect.EXTERNAL_IDEMPOTENT: "copies.idempotent",
}


@dataclass
class Case:
    effect: Effect
    copies: int
    order: list[int]  # the consume's order of the copies 0..copies-1
    state: str
    holder: int  # which copy holds a "member" claim
    behaviour: str


cases = st.builds(
    Case,
    effect=st.sampled_from(list(Effect)),
    copies=st.integers(1, 3),
    order=st.permutations(range(3)),
    state=st.sampled_from(CLAIM_STATES),
    holder=st.integers(0, 2),
    behaviour=st.sampled_from(BEHAVIOURS),
)


class Ledgers:
    """One ledger under test, seeded the way another worker or an earlier delivery left it."""

    def __init__(
        self, ledger: LedgerPort, now: Callable[[], float], seed: Callable[..., None]
    ) -> None:
        self.ledger = ledger
        self.now = now
        self.seed = seed
        self.runs: list[str] = []

    def registry(self) -> JobRegistry:
        registry = JobRegistry()

        def handler(payload: Payload, ctx: JobContext) -> JsonValue:
            self.runs.append(ctx.message_id)
            fail_as_asked(payload, "behaviour")
            return {"ran": ctx.message_id}

        for effect, name in JOB_OF.items():
            registry.job(name, effect=effect, identity=("id",))(handler)
        return registry


@pytest.fixture(params=["postgres", "fake"])
def ledgers(request: pytest.FixtureRequest) -> Iterator[Ledgers]:
    if request.param == "fake":
        fake = InMemoryLedger()

        def seed_fake(key: str, **row: Any) -> None:
            fake.seed(key, **row)

        yield Ledgers(fake, fake.clock.now, seed_fake)
        return
    database_url: str = request.getfixturevalue("database_url")
    with psycopg.connect(database_url, autocommit=True) as conn:
        apply_migrations(conn)
    ledger = PostgresLedger(database_url)

    def seed_postgres(key: str, **row: Any) -> None:
        result = row.get("result")
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(
                SEED_CLAIM,
                {
                    "key": key,
                    "token": uuid.uuid4(),
                    "lease_until": row.get("lease_until"),
                    "error": row.get("error"),
                    "result": None if result is None else psycopg.types.json.Jsonb(result),
                    **{name: row[name] for name in ("state", "message_id", "job", "effect")},
                    "fingerprint": row["fingerprint"],
                },
            )

    try:
        yield Ledgers(ledger, time.time, seed_postgres)
    finally:
        ledger.close()


def _seed_claim(kit: Ledgers, case: Case, key: str, payload: Payload, ids: list[str]) -> None:
    if case.state == "none":
        return
    holder = ids[case.holder % case.copies] if case.state.endswith("_member") else "qmsg_outside"
    seconds = EXPIRED_SECONDS if case.state.startswith("expired") else LIVE_SECONDS
    lease: datetime = datetime.fromtimestamp(kit.now(), tz=UTC) + timedelta(seconds=seconds)
    state = case.state if case.state in {"done", "failed"} else "running"
    kit.seed(
        key,
        state=state,
        message_id=holder,
        job=JOB_OF[case.effect],
        effect=case.effect.value,
        fingerprint=payload_fingerprint(payload),
        lease_until=lease if state == "running" else None,
        error="flagged earlier" if case.state.startswith("flagged") or state == "failed" else None,
        result={"earlier": True} if state == "done" else None,
    )


def _process(kit: Ledgers, case: Case) -> tuple[str, list[MessageResult], list[str]]:
    key_id = uuid.uuid4().hex
    payload = {"job": JOB_OF[case.effect], "id": key_id, "behaviour": case.behaviour}
    key = f"{JOB_OF[case.effect]}:{key_id}"
    ids = [f"qmsg_{key_id[:8]}_{n}" for n in range(case.copies)]
    _seed_claim(kit, case, key, payload, ids)
    order = [n for n in case.order if n < case.copies]
    batch = [QueueMessage(ids[n], QUEUE, payload, 2, None, ids[n]) for n in order]
    kit.runs.clear()
    results = process_batch(
        batch, kit.ledger, kit.registry(), kit.now() + 60, DrainConfig(queue=QUEUE), clock=kit.now
    )
    return key, results, ids


@settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(case=cases)
def test_no_batch_acks_every_copy_of_a_key_whose_claim_is_left_running(
    ledgers: Ledgers, case: Case
) -> None:
    # Given one to three copies of a key, in any order, and the key's claim in any state
    # When the batch is processed
    key, results, ids = _process(ledgers, case)
    row: ClaimRow | None = ledgers.ledger.get(key)

    # Then the copies ran the work at most once (a database job's effect may run again only
    # after its first attempt rolled back whole, so only the other effects are counted)
    if case.effect is not Effect.DATABASE:
        assert len(ledgers.runs) <= 1, (case, results)
    # And unless a live claim outside the batch carries the work, acking every copy means the
    # claim is settled, released or flagged: never running and unflagged with no message left
    stranded = (
        all(r.ack for r in results)
        and row is not None
        and row.state == "running"
        and row.error is None
    )
    assert not stranded or case.state == "live_outside", (case, [str(r) for r in results], row)
    # And a message holding the claim is never mirrored as a copy of another. (An expired
    # key-passing claim is no longer held: whichever copy comes first takes it over, rightly.)
    taken_over = case.state == "expired_member" and case.effect is Effect.EXTERNAL_IDEMPOTENT
    if case.state.endswith("_member") and not taken_over:
        holder = ids[case.holder % case.copies]
        (held,) = (r for r in results if r.message.message_id == holder)
        assert "copy of" not in held.detail, (case, held)


# --- The fault-injection run's story, through the drain and the emulator ------------------------

SHORT_VISIBILITY = 30  # the queue's real visibility timeout; the drain is told 300 s


@pytest.fixture
def kit(database_url: str) -> Iterator[Harness]:
    with harness(database_url, visibility=SHORT_VISIBILITY) as h:
        calls: list[str] = []

        @h.registry.job("test.idem", effect=Effect.EXTERNAL_IDEMPOTENT, identity=("id",))
        def send_with_key(payload: Payload, ctx: JobContext) -> JsonValue:
            calls.append(ctx.message_id)
            return {"sent_by": ctx.message_id}

        h.idem_calls = calls  # type: ignore[attr-defined]
        yield h


def _owner_died_and_came_back_early(kit: Harness, payload: dict[str, str]) -> tuple[str, str]:
    """Publish the job twice (A, then B); B's drain claimed it and died mid-call; both come back
    while B's lease is still live, because the queue hides them for 30 s, not 300."""
    first, second = kit.publish(payload, times=2)
    assert len(kit.client.consume(DRAIN_QUEUE)) == 2
    derived = kit.registry.derive(payload)
    kit.sql(
        "INSERT INTO job_claims (idem_key, state, message_id, job, effect, claim_token,"
        " lease_until, payload_sha256) VALUES (%s, 'running', %s, %s, %s, gen_random_uuid(),"
        " now() + interval '120 seconds', %s)",
        (
            derived.idem_key,
            second,
            derived.definition.name,
            derived.definition.effect.value,
            derived.fingerprint,
        ),
    )
    kit.advance(SHORT_VISIBILITY + 1)
    return first, second


def _both_drained(
    kit: Harness, caplog: pytest.LogCaptureFixture, payload: dict[str, str]
) -> tuple[str, str, DrainSummary]:
    """``_owner_died_and_came_back_early``, then one drain consuming both copies, its log kept:
    A's and B's message ids, and the drain's summary."""
    first, second = _owner_died_and_came_back_early(kit, payload)
    with caplog.at_level(logging.INFO, logger="infrai_jobs"):
        summary = kit.drain()
    return first, second, summary


def _mismatch_logged(caplog: pytest.LogCaptureFixture, message_id: str) -> logging.LogRecord:
    (record,) = [r for r in caplog.records if getattr(r, "action", "") == "visibility_mismatch"]
    assert record.levelno == logging.ERROR
    assert record.message_id == message_id  # type: ignore[attr-defined]
    assert record.visibility_timeout_seconds == 300  # type: ignore[attr-defined]
    assert 0 <= record.redelivered_after_seconds < 120  # type: ignore[attr-defined]
    return record


@pytest.mark.parametrize(
    ("job", "outcomes", "state"),
    [
        # An irreversible job: B is judged as its own redelivery (stuck, flagged) and A follows
        # it; nothing is acked, so both messages are still in the queue, on their way to the DLQ
        ("test.ext", {"stuck": 1, "batch_duplicate": 1}, "running"),
        # A key-passing job: B takes its own claim over and runs the call once (with the same
        # key); A follows it, and both are acked
        ("test.idem", {"done": 1, "duplicate_in_flight": 1}, "done"),
    ],
)
def test_an_owner_back_beside_its_copy_is_judged_as_its_own_redelivery_not_stranded(
    kit: Harness,
    caplog: pytest.LogCaptureFixture,
    job: str,
    outcomes: dict[str, int],
    state: str,
) -> None:
    # Given a job whose owner B died mid-call and came back early, A first in the batch
    # When a drain consumes both
    first, second, summary = _both_drained(kit, caplog, {"job": job, "id": "owner-early"})
    # Then B is judged as its own redelivery and A follows it: both acked, or (stuck) neither
    stuck = state == "running"
    assert summary.outcomes == outcomes
    assert summary.acked == (0 if stuck else 2)
    row = kit.row(f"{job}:owner-early")
    assert row is not None
    assert (row.state, row.message_id) == (state, second)
    # And only a claim left running is flagged, while a key-passing call ran once, B's
    assert ("redelivered while its own claim" in (row.error or "")) is stuck
    assert kit.idem_calls == ([] if stuck else [second])  # type: ignore[attr-defined]
    # And the mismatch is logged at ERROR with both numbers and counted
    _mismatch_logged(caplog, second)
    assert summary.visibility_mismatches == 1
    assert kit.client.stats(DRAIN_QUEUE).in_flight_count == (2 if stuck else 0)
    assert first != second


def test_the_mismatch_line_and_both_copies_lines_carry_the_producers_correlation_id(
    kit: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    # Given an irreversible job whose producer set a correlation id, its owner back early
    payload = {"job": "test.ext", "id": "owner-correlated", "_correlation_id": "order-55"}
    # When a drain consumes both
    first, second, _ = _both_drained(kit, caplog, payload)
    # Then the visibility mismatch line carries it, and so does every line about either copy
    assert _mismatch_logged(caplog, second).message_correlation_id == "order-55"  # type: ignore[attr-defined]
    about = [r for r in caplog.records if getattr(r, "message_id", None) in (first, second)]
    assert {r.action for r in about} >= {"visibility_mismatch", "stuck", "batch_duplicate"}  # type: ignore[attr-defined]
    assert {getattr(r, "message_correlation_id", None) for r in about} == {"order-55"}


# --- The same shape elsewhere: an ack while the key's claim stays running ---------------------


def test_an_in_flight_copy_is_acked_only_while_its_owner_message_still_carries_the_work(
    kit: Harness,
) -> None:
    # Given an irreversible job published twice: A's drain claimed it and died mid-call
    payload = {"job": "test.ext", "id": "owner-died"}
    owner, copy = kit.publish(payload, times=2)
    (received,) = kit.client.consume(DRAIN_QUEUE, max_messages=1)
    assert received.message_id == owner
    derived = kit.registry.derive(payload)
    kit.sql(
        "INSERT INTO job_claims (idem_key, state, message_id, job, effect, claim_token,"
        " lease_until, payload_sha256) VALUES (%s, 'running', %s, 'test.ext', 'external',"
        " gen_random_uuid(), now() + interval '120 seconds', %s)",
        (derived.idem_key, owner, derived.fingerprint),
    )
    # When the copy B is drained while A's claim is live
    summary = kit.drain()
    # Then B is acked as in flight: A's message, unacked, still carries the work
    assert summary.outcomes == {"duplicate_in_flight": 1}
    assert kit.client.stats(DRAIN_QUEUE).in_flight_count == 1
    # And when A's message comes back, its lease is over (a lease never outlives its message's
    # visibility window; the ledger's clock is moved by ending the lease by hand)
    kit.sql("UPDATE job_claims SET lease_until = now() - interval '1 second'")
    kit.advance(SHORT_VISIBILITY + 1)
    summary = kit.drain()
    # Then A is judged as its own redelivery: stuck, flagged, unacked, listed for a human
    assert summary.outcomes == {"stuck": 1}
    assert summary.acked == 0
    assert summary.visibility_mismatches == 0
    row = kit.row(derived.idem_key)
    assert row is not None
    assert (row.state, row.message_id) == ("running", owner)
    assert row.error is not None
    stuck = WorkStore(kit.database_url).stuck()
    assert [c.idem_key for c in stuck] == [derived.idem_key]
    assert copy != owner
