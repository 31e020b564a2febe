"""The in-memory fakes keep the contracts they stand in for: docs/infrai-api.md for the queue, the
claim rules of ``PostgresLedger`` for the ledger. Unit tests of the drain are only worth what
these fakes are worth."""

from __future__ import annotations

import threading
import uuid
from datetime import timedelta
from decimal import Decimal

import pytest

from infrai_jobs.drain.ports import Clock
from infrai_jobs.errors import InfraiError, LedgerError, LedgerUnavailable, QueueMessageNotFound
from infrai_jobs.jobs.registry import Effect
from infrai_jobs.ledger.claims import (
    ClaimRequest,
    ClaimStatus,
    JobRun,
    RunKind,
    SettleStatus,
    utc_from_epoch,
)
from infrai_jobs.ledger.ports import LedgerPort
from infrai_jobs.queue.ports import QueuePort
from infrai_local.fakes import FakeClock, InMemoryLedger, InMemoryQueue

QUEUE = "billing-jobs"
DLQ = "billing-jobs-dlq"
VISIBILITY = 300
FP = "a" * 64
OTHER_FP = "b" * 64


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def queue(clock: FakeClock) -> InMemoryQueue:
    fake = InMemoryQueue(clock)
    fake.ensure_queue(QUEUE, dlq=DLQ)
    return fake


@pytest.fixture
def ledger(clock: FakeClock) -> InMemoryLedger:
    return InMemoryLedger(clock)


def test_the_fakes_are_typed_as_the_ports_they_replace(clock: FakeClock) -> None:
    # Given the fakes bound to the Protocol types (mypy checks these assignments)
    queue: QueuePort = InMemoryQueue(clock)
    ledger: LedgerPort = InMemoryLedger(clock)
    as_clock: Clock = clock
    # Then they are usable through the ports alone
    assert queue.publish_price().usd_per_message == Decimal("0.00002")
    assert ledger.claim([]) == []
    assert as_clock.now() == clock()


# --- the clock --------------------------------------------------------------------------------


def test_the_clock_moves_only_forward_and_only_by_hand(clock: FakeClock) -> None:
    # Given a fake clock, read both ways
    start = clock.now()
    assert clock() == start
    # When a test moves it
    moved = clock.advance(1.5)
    # Then it moved by exactly that, and it refuses to go back
    assert moved == start + 1.5
    assert clock.utcnow().timestamp() == start + 1.5
    with pytest.raises(ValueError, match="forward"):
        clock.advance(-1)


# --- the queue --------------------------------------------------------------------------------


def test_two_publishes_of_one_body_are_two_messages(queue: InMemoryQueue) -> None:
    # Given one body published twice (a producer retry)
    body = {"job": "invoice.finalize", "invoice_id": "inv_8812"}
    first = queue.publish(QUEUE, body)
    second = queue.publish(QUEUE, body)
    # Then there is no producer-side deduplication
    assert first != second
    assert first.startswith("qmsg_")
    assert len(first) == len("qmsg_") + 24
    assert queue.stats(QUEUE).available_count == 2


def test_consume_serves_oldest_first_and_hides_what_it_served(queue: InMemoryQueue) -> None:
    # Given three messages, published in order
    ids = [queue.publish(QUEUE, {"n": n}) for n in range(3)]
    # When one consume asks for two
    served = queue.consume(QUEUE, 2)
    # Then the two oldest come, in flight, first delivery, handle = id
    assert [m.message_id for m in served] == ids[:2]
    assert [m.payload for m in served] == [{"n": 0}, {"n": 1}]
    assert {(m.delivery_count, m.status, m.queue) for m in served} == {(1, "in_flight", QUEUE)}
    assert all(m.receipt_handle == m.message_id for m in served)
    assert [m.message_id for m in queue.consume(QUEUE)] == ids[2:]
    assert queue.consume(QUEUE) == []


def test_consume_is_capped_at_ten(queue: InMemoryQueue) -> None:
    # Given twelve waiting messages
    for n in range(12):
        queue.publish(QUEUE, {"n": n})
    # When a consume asks for fifty
    first = queue.consume(QUEUE, 50)
    # Then it is served as ten, and the rest waits for the next consume
    assert len(first) == 10
    assert len(queue.consume(QUEUE, 50)) == 2


def test_a_consumer_mutating_its_payload_does_not_change_the_message(
    queue: InMemoryQueue, clock: FakeClock
) -> None:
    # Given a consumed message whose payload the consumer changed
    queue.publish(QUEUE, {"n": 1})
    (message,) = queue.consume(QUEUE)
    message.payload["n"] = 2
    # When it is redelivered
    clock.advance(VISIBILITY + 1)
    (again,) = queue.consume(QUEUE)
    # Then it carries the payload as published
    assert again.payload == {"n": 1}


def test_an_unacked_message_returns_after_the_visibility_timeout(
    queue: InMemoryQueue, clock: FakeClock
) -> None:
    # Given a consumed, unacked message
    message_id = queue.publish(QUEUE, {"n": 1})
    queue.consume(QUEUE)
    # When less than the visibility timeout passes, it stays hidden
    clock.advance(VISIBILITY - 1)
    assert queue.consume(QUEUE) == []
    # Then once it lapses, it comes back as its second delivery
    clock.advance(1)
    (again,) = queue.consume(QUEUE)
    assert (again.message_id, again.delivery_count) == (message_id, 2)


def test_the_third_lapse_moves_the_message_to_the_dlq(
    queue: InMemoryQueue, clock: FakeClock
) -> None:
    # Given a message delivered three times and never acked
    message_id = queue.publish(QUEUE, {"job": "poison"})
    for delivery in (1, 2, 3):
        (message,) = queue.consume(QUEUE)
        assert message.delivery_count == delivery
        clock.advance(VISIBILITY)
    # Then there is no fourth delivery: it sits in the DLQ, its count restarting there
    assert queue.consume(QUEUE) == []
    stats = queue.stats(QUEUE)
    assert (stats.message_count, stats.dlq_count) == (0, 1)
    (dead,) = queue.consume(DLQ)
    assert (dead.message_id, dead.payload, dead.delivery_count) == (
        message_id,
        {"job": "poison"},
        1,
    )


def test_a_dlq_message_is_never_dropped(queue: InMemoryQueue, clock: FakeClock) -> None:
    # Given a message in the DLQ (a queue without a DLQ of its own)
    queue.publish(DLQ, {"n": 1})
    # When it lapses unacked more than three times
    for delivery in (1, 2, 3, 4):
        (message,) = queue.consume(DLQ)
        assert message.delivery_count == delivery
        clock.advance(VISIBILITY)
    # Then it is still there
    assert queue.stats(DLQ).message_count == 1


def test_ack_removes_the_message_and_a_second_ack_is_not_found(queue: InMemoryQueue) -> None:
    # Given a consumed message, acked once
    queue.publish(QUEUE, {"n": 1})
    (message,) = queue.consume(QUEUE)
    queue.ack(QUEUE, message.receipt_handle)
    # When it is acked again
    with pytest.raises(QueueMessageNotFound) as caught:
        queue.ack(QUEUE, message.receipt_handle)
    # Then the queue no longer holds it, and says so with the contract's code
    assert (caught.value.code, caught.value.status) == ("QUEUE_MESSAGE_NOT_FOUND", 404)
    assert queue.acked == [message.message_id]
    assert queue.stats(QUEUE).message_count == 0


def test_a_lapsed_but_held_message_can_still_be_acked(
    queue: InMemoryQueue, clock: FakeClock
) -> None:
    # Given a delivery whose visibility lapsed before its ack
    queue.publish(QUEUE, {"n": 1})
    (message,) = queue.consume(QUEUE)
    clock.advance(VISIBILITY + 10)
    # When it is acked
    queue.ack(QUEUE, message.receipt_handle)
    # Then the ack still removes it (the queue held it)
    assert queue.stats(QUEUE).message_count == 0


def test_acking_a_dead_lettered_handle_is_not_found(queue: InMemoryQueue, clock: FakeClock) -> None:
    # Given a message dead-lettered after three lapsed deliveries
    queue.publish(QUEUE, {"n": 1})
    for _ in range(3):
        (message,) = queue.consume(QUEUE)
        clock.advance(VISIBILITY)
    # When its last handle is acked on the main queue, it is not found there
    with pytest.raises(QueueMessageNotFound):
        queue.ack(QUEUE, message.receipt_handle)
    # Then it stays in the DLQ
    assert queue.stats(QUEUE).dlq_count == 1


def test_stats_count_every_state_and_age(queue: InMemoryQueue, clock: FakeClock) -> None:
    # Given one delayed, one in flight and one available message
    queue.publish(QUEUE, {"n": 0}, delay_seconds=60)
    queue.publish(QUEUE, {"n": 1})
    queue.publish(QUEUE, {"n": 2})
    queue.consume(QUEUE, 1)
    clock.advance(10.7)
    # Then the counters add up and the age is whole seconds
    stats = queue.stats(QUEUE)
    assert stats.queue == QUEUE
    assert (stats.available_count, stats.in_flight_count, stats.delayed_count) == (1, 1, 1)
    assert stats.message_count == 3
    assert (stats.dlq_count, stats.oldest_message_age_seconds) == (0, 10.0)


def test_stats_are_zero_once_the_queue_is_drained(queue: InMemoryQueue) -> None:
    # Given three messages
    for n in range(3):
        queue.publish(QUEUE, {"n": n})
    # When all are consumed and acked
    for message in queue.consume(QUEUE):
        queue.ack(QUEUE, message.receipt_handle)
    # Then every counter is zero, the age too
    stats = queue.stats(QUEUE)
    assert (
        stats.message_count,
        stats.available_count,
        stats.in_flight_count,
        stats.delayed_count,
        stats.dlq_count,
        stats.oldest_message_age_seconds,
    ) == (0, 0, 0, 0, 0, 0.0)


def test_a_delayed_message_waits_for_its_delay(queue: InMemoryQueue, clock: FakeClock) -> None:
    # Given a message published with a delay
    queue.publish(QUEUE, {"n": 1}, delay_seconds=30)
    # When consumed before and after the delay
    early = queue.consume(QUEUE)
    clock.advance(30)
    late = queue.consume(QUEUE)
    # Then it is served only after, as its first delivery
    assert early == []
    assert [m.delivery_count for m in late] == [1]


def test_bad_calls_are_refused_as_the_service_refuses_them(queue: InMemoryQueue) -> None:
    # Given a queue set up once; When called wrongly; Then the client's errors come back
    with pytest.raises(InfraiError) as unknown:
        queue.publish("no-such-queue", {"n": 1})
    assert unknown.value.code == "QUEUE_NOT_FOUND"
    with pytest.raises(InfraiError) as delay:
        queue.publish(QUEUE, {"n": 1}, delay_seconds=86_401)
    assert delay.value.code == "VALIDATION_ERROR"
    with pytest.raises(ValueError, match="max_messages"):
        queue.consume(QUEUE, 0)
    assert queue.ensure_queue(QUEUE, dlq=DLQ) is False


def test_publish_price_is_todays_discovery_price(queue: InMemoryQueue) -> None:
    # Given the fake's default price; When read
    price = queue.publish_price()
    # Then it is the notes' price, as discovery's billing object carries it
    assert price.usd_per_message == Decimal("0.00002")
    assert price.billing["price_usd"] == "0.00002"
    assert price.monthly_cost(1000) == Decimal("0.60000")


def test_a_lost_ack_answer_is_applied_but_reported_not_found(queue: InMemoryQueue) -> None:
    # Given an ack whose answer will be lost
    queue.publish(QUEUE, {"n": 1})
    (message,) = queue.consume(QUEUE)
    queue.lose_ack_answers(1)
    # When acked
    with pytest.raises(QueueMessageNotFound):
        queue.ack(QUEUE, message.receipt_handle)
    # Then the caller heard "not found", yet the message is gone
    assert queue.stats(QUEUE).message_count == 0


def test_a_failed_ack_is_not_applied(queue: InMemoryQueue) -> None:
    # Given a delivery whose next ack will fail
    queue.publish(QUEUE, {"n": 1})
    (message,) = queue.consume(QUEUE)
    queue.fail_acks(1)
    # When acked
    with pytest.raises(InfraiError) as caught:
        queue.ack(QUEUE, message.receipt_handle)
    # Then it is an unavailable service, not "not found", and the message is still held
    assert not isinstance(caught.value, QueueMessageNotFound)
    assert queue.stats(QUEUE).in_flight_count == 1
    # And the next ack goes through
    queue.ack(QUEUE, message.receipt_handle)
    assert queue.stats(QUEUE).message_count == 0


def test_acks_from_many_threads_each_remove_one_message(queue: InMemoryQueue) -> None:
    # Given ten consumed messages acked concurrently, each twice
    for n in range(10):
        queue.publish(QUEUE, {"n": n})
    handles = [m.receipt_handle for m in queue.consume(QUEUE)] * 2
    outcomes: list[str] = []

    def ack(handle: str) -> None:
        try:
            queue.ack(QUEUE, handle)
            outcomes.append("acked")
        except QueueMessageNotFound:
            outcomes.append("not_found")

    threads = [threading.Thread(target=ack, args=(h,)) for h in handles]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # Then exactly one ack per message succeeded
    assert sorted(outcomes) == ["acked"] * 10 + ["not_found"] * 10
    assert queue.stats(QUEUE).message_count == 0


# --- the ledger -------------------------------------------------------------------------------


def _request(
    ledger: InMemoryLedger,
    key: str = "job:1",
    *,
    message_id: str = "qmsg_me",
    effect: Effect = Effect.EXTERNAL,
    fingerprint: str = FP,
    lease_seconds: float = 120,
) -> ClaimRequest:
    # Database claims are never committed, so they carry no lease.
    lease = None if effect is Effect.DATABASE else ledger.clock.now() + lease_seconds
    return ClaimRequest(
        idem_key=key,
        message_id=message_id,
        job="job",
        effect=effect,
        fingerprint=fingerprint,
        lease_until=None if lease is None else utc_from_epoch(lease),
    )


def test_a_new_key_is_won_and_committed_running(ledger: InMemoryLedger) -> None:
    # Given an empty ledger; When an external job is claimed
    request = _request(ledger)
    (decision,) = ledger.claim([request])
    # Then it is won, and its row is running with the request's token, lease and fingerprint
    assert decision.status is ClaimStatus.WON
    row = ledger.get(request.idem_key)
    assert row is not None
    assert (row.state, row.message_id, row.effect, row.attempts) == (
        "running",
        "qmsg_me",
        "external",
        1,
    )
    assert (row.claim_token, row.payload_sha256, row.lease_until) == (
        request.claim_token,
        FP,
        request.lease_until,
    )


def test_a_done_key_is_a_duplicate_carrying_its_result(ledger: InMemoryLedger) -> None:
    # Given the work done; When claimed again
    ledger.seed("job:1", state="done", fingerprint=FP, result={"sent": 1})
    (decision,) = ledger.claim([_request(ledger)])
    # Then it is a duplicate, and the caller learns the stored result
    assert (decision.status, decision.result) == (ClaimStatus.DONE, {"sent": 1})


def test_a_failed_key_stays_failed(ledger: InMemoryLedger) -> None:
    # Given the work failed permanently; When claimed again
    ledger.seed("job:1", state="failed", fingerprint=FP, error="PermanentJobError: no")
    (decision,) = ledger.claim([_request(ledger)])
    # Then it stays failed, with the stored error
    assert (decision.status, decision.detail) == (ClaimStatus.FAILED, "PermanentJobError: no")


def test_a_live_claim_elsewhere_is_live(ledger: InMemoryLedger, clock: FakeClock) -> None:
    # Given another message holding the claim for five more minutes
    before = ledger.seed(
        "job:1",
        message_id="qmsg_other",
        effect=Effect.EXTERNAL,
        fingerprint=FP,
        lease_until=clock.utcnow() + timedelta(minutes=5),
        claim_token=uuid.uuid4(),
    )
    # When this message claims it
    (decision,) = ledger.claim([_request(ledger)])
    # Then the claim is live elsewhere, and untouched
    assert decision.status is ClaimStatus.LIVE
    assert ledger.get("job:1") == before


@pytest.mark.parametrize(
    ("effect", "error", "reason"),
    [
        # An irreversible job's claim whose lease ran out
        (Effect.EXTERNAL, None, "lease expired"),
        # A key-passing job's expired claim that a human was asked to look at
        (Effect.EXTERNAL_IDEMPOTENT, "effect uncertain: E: timeout", "flagged for a human"),
    ],
    ids=["expired-external-lease", "flagged-idempotent-claim"],
)
def test_an_expired_claim_for_a_human_is_stuck_and_never_taken_over(
    ledger: InMemoryLedger, clock: FakeClock, effect: Effect, error: str | None, reason: str
) -> None:
    # Given an expired claim that no other delivery may take over
    before = ledger.seed(
        "job:1",
        message_id="qmsg_dead",
        effect=effect,
        fingerprint=FP,
        lease_until=clock.utcnow() - timedelta(seconds=1),
        error=error,
    )
    # When another delivery claims it
    (decision,) = ledger.claim([_request(ledger, effect=effect)])
    # Then it is stuck for a human, with the reason, and the row is left as it was
    assert decision.status is ClaimStatus.STUCK
    assert reason in decision.detail
    assert ledger.get("job:1") == before


def test_a_notes_row_without_a_lease_expires_after_the_visibility_timeout(
    ledger: InMemoryLedger, clock: FakeClock
) -> None:
    # Given the notes' own INSERT (no effect, no lease, no fingerprint)
    ledger.seed("job:1", message_id="qmsg_node")
    # Then it is live for a visibility timeout, stuck after it
    (early,) = ledger.claim([_request(ledger)])
    clock.advance(VISIBILITY + 1)
    (late,) = ledger.claim([_request(ledger)])
    assert (early.status, late.status) == (ClaimStatus.LIVE, ClaimStatus.STUCK)


def test_our_own_redelivery_finding_our_running_row_is_stuck(ledger: InMemoryLedger) -> None:
    # Given a delivery that claimed an irreversible job and died
    ledger.claim([_request(ledger)])
    # When the same message comes back
    (decision,) = ledger.claim([_request(ledger)])
    # Then the effect may have happened: stuck
    assert decision.status is ClaimStatus.STUCK
    assert "redelivered while its own claim is still running" in decision.detail


def test_the_same_key_for_different_work_is_a_conflict(ledger: InMemoryLedger) -> None:
    # Given a key done for some work; When other work claims the key
    ledger.seed("job:1", state="done", fingerprint=FP)
    (decision,) = ledger.claim([_request(ledger, fingerprint=OTHER_FP)])
    # Then it is a conflict, never a duplicate
    assert decision.status is ClaimStatus.CONFLICT
    assert "different work" in decision.detail


def test_an_idempotent_claim_is_taken_over_after_its_lease(
    ledger: InMemoryLedger, clock: FakeClock
) -> None:
    # Given a key-passing job's claim whose holder died
    ledger.seed(
        "job:1",
        message_id="qmsg_dead",
        effect=Effect.EXTERNAL_IDEMPOTENT,
        fingerprint=FP,
        lease_until=clock.utcnow() - timedelta(seconds=1),
        claim_token=uuid.uuid4(),
    )
    # When another delivery claims it
    request = _request(ledger, effect=Effect.EXTERNAL_IDEMPOTENT)
    (decision,) = ledger.claim([request])
    # Then it wins, with the holder's history kept
    assert decision.status is ClaimStatus.WON
    row = ledger.get("job:1")
    assert row is not None
    assert (row.state, row.message_id, row.claim_token, row.attempts) == (
        "running",
        "qmsg_me",
        request.claim_token,
        2,
    )


def test_an_idempotent_claim_is_taken_over_by_its_own_message_before_its_lease(
    ledger: InMemoryLedger,
) -> None:
    # Given a key-passing job claimed by a delivery that died within its lease
    ledger.claim([_request(ledger, effect=Effect.EXTERNAL_IDEMPOTENT)])
    # When the same message comes back
    (decision,) = ledger.claim([_request(ledger, effect=Effect.EXTERNAL_IDEMPOTENT)])
    # Then it takes its own claim over
    assert decision.status is ClaimStatus.WON
    row = ledger.get("job:1")
    assert row is not None
    assert row.attempts == 2


def test_a_live_idempotent_claim_of_another_message_is_not_taken_over(
    ledger: InMemoryLedger,
) -> None:
    # Given a key-passing job's live claim by one message
    ledger.claim([_request(ledger, message_id="qmsg_a", effect=Effect.EXTERNAL_IDEMPOTENT)])
    # When another message claims it
    (decision,) = ledger.claim(
        [_request(ledger, message_id="qmsg_b", effect=Effect.EXTERNAL_IDEMPOTENT)]
    )
    # Then the holder keeps it
    assert decision.status is ClaimStatus.LIVE


def test_an_expired_idempotent_claim_for_other_work_is_a_conflict(
    ledger: InMemoryLedger, clock: FakeClock
) -> None:
    # Given an expired key-passing claim for other work
    ledger.seed(
        "job:1",
        effect=Effect.EXTERNAL_IDEMPOTENT,
        fingerprint=OTHER_FP,
        lease_until=clock.utcnow() - timedelta(seconds=1),
    )
    # When claimed
    (decision,) = ledger.claim([_request(ledger, effect=Effect.EXTERNAL_IDEMPOTENT)])
    # Then it is a conflict, not a takeover
    assert decision.status is ClaimStatus.CONFLICT


def test_a_settle_with_a_changed_token_is_lost(ledger: InMemoryLedger) -> None:
    # Given a won claim that someone else re-assigned
    request = _request(ledger)
    ledger.claim([request])
    ledger.reassign(request.idem_key)
    before = ledger.get(request.idem_key)
    # When the holder settles it
    settlement = ledger.settle(request, JobRun(RunKind.SUCCEEDED, result={"sent": True}))
    # Then nothing changes and the holder learns it lost the claim
    assert settlement.status is SettleStatus.LOST
    assert ledger.get(request.idem_key) == before


@pytest.mark.parametrize(
    ("run", "status", "row_after"),
    [
        (JobRun(RunKind.SUCCEEDED, result=[1]), SettleStatus.DONE, ("done", None)),
        (JobRun(RunKind.PERMANENT, error="E: no"), SettleStatus.FAILED, ("failed", "E: no")),
        (
            JobRun(RunKind.UNCERTAIN, error="E: timeout"),
            SettleStatus.STUCK,
            ("running", "effect uncertain: E: timeout"),
        ),
        (JobRun(RunKind.TRANSIENT, error="E: retry"), SettleStatus.RELEASED, None),
    ],
)
def test_an_external_settle_records_each_kind_of_run(
    ledger: InMemoryLedger,
    run: JobRun,
    status: SettleStatus,
    row_after: tuple[str, str | None] | None,
) -> None:
    # Given a won external claim
    request = _request(ledger)
    ledger.claim([request])
    # When its run is settled
    settlement = ledger.settle(request, run)
    # Then the row says what happened (a released claim is gone)
    assert settlement.status is status
    row = ledger.get(request.idem_key)
    assert (None if row is None else (row.state, row.error)) == row_after


def test_a_settled_claim_cannot_be_settled_again(ledger: InMemoryLedger) -> None:
    # Given a claim settled done
    request = _request(ledger)
    ledger.claim([request])
    ledger.settle(request, JobRun(RunKind.SUCCEEDED, result=1))
    # When settled again
    again = ledger.settle(request, JobRun(RunKind.PERMANENT, error="late"))
    # Then the fence (state running) refuses it, and the row keeps its outcome
    assert again.status is SettleStatus.LOST
    row = ledger.get(request.idem_key)
    assert row is not None
    assert (row.state, row.result) == ("done", 1)


def test_a_database_batch_settles_each_won_job(ledger: InMemoryLedger) -> None:
    # Given three database jobs, one already done
    ledger.seed("db:done", state="done", fingerprint=FP, result="old")
    requests = [_request(ledger, k, effect=Effect.DATABASE) for k in ("db:ok", "db:bad", "db:done")]
    outcomes = {
        "db:ok": JobRun(RunKind.SUCCEEDED, result={"ok": True}),
        "db:bad": JobRun(RunKind.PERMANENT, error="E: bad"),
    }
    ran: list[str] = []

    def runner(request: ClaimRequest, db: object) -> JobRun:
        ran.append(request.idem_key)
        assert db is None
        return outcomes[request.idem_key]

    # When run as one batch
    decisions, settlements = ledger.run_database_batch(requests, runner)
    # Then only the won jobs ran, and each settled
    assert sorted(ran) == ["db:bad", "db:ok"]
    assert {d.request.idem_key: d.status for d in decisions}["db:done"] is ClaimStatus.DONE
    assert {s.request.idem_key: s.status for s in settlements} == {
        "db:ok": SettleStatus.DONE,
        "db:bad": SettleStatus.FAILED,
    }
    assert {k: r.state for k, r in ledger.rows.items()} == {
        "db:ok": "done",
        "db:bad": "failed",
        "db:done": "done",
    }
    assert ledger.calls["run_database_batch"] == 1


def test_an_uncertain_database_job_is_released(ledger: InMemoryLedger) -> None:
    # Given a database job whose handler reports an uncertain effect; When run in a batch
    request = _request(ledger, effect=Effect.DATABASE)
    _, (settlement,) = ledger.run_database_batch(
        [request], lambda r, db: JobRun(RunKind.UNCERTAIN, error="E: ?")
    )
    # Then its claim is released: the savepoint rolled the effect back
    assert settlement.status is SettleStatus.RELEASED
    assert ledger.get(request.idem_key) is None


def test_a_database_batch_leaves_no_trace_when_it_fails(ledger: InMemoryLedger) -> None:
    # Given a batch whose second job cannot be stored (Postgres refuses NUL in jsonb)
    requests = [_request(ledger, k, effect=Effect.DATABASE) for k in ("db:a", "db:b")]

    def runner(request: ClaimRequest, db: object) -> JobRun:
        return JobRun(RunKind.SUCCEEDED, result="a\x00b" if request.idem_key == "db:b" else 1)

    # When it runs, the ledger refuses the whole transaction
    with pytest.raises(LedgerError, match="Unicode escape"):
        ledger.run_database_batch(requests, runner)
    # Then no claim of it remains
    assert ledger.rows == {}


def test_the_ledger_refuses_what_postgres_cannot_store(ledger: InMemoryLedger) -> None:
    # Given runs whose result or error Postgres refuses (PostgresLedger answered these same
    # exceptions against a real server); When each is settled; Then the settle raises and the
    # claim stays as it was
    for run, raised in [
        (JobRun(RunKind.SUCCEEDED, result={"x": "a\x00b"}), LedgerError),
        (JobRun(RunKind.SUCCEEDED, result=["\ud800"]), LedgerError),
        (JobRun(RunKind.PERMANENT, error="bad \x00 input"), LedgerError),
        (JobRun(RunKind.PERMANENT, error="bad \ud800 input"), UnicodeEncodeError),
    ]:
        request = _request(ledger, f"job:{len(ledger.rows)}")
        ledger.claim([request])
        with pytest.raises(raised):
            ledger.settle(request, run)
        row = ledger.get(request.idem_key)
        assert row is not None
        assert (row.state, row.error) == ("running", None)


def test_a_paired_surrogate_result_is_stored(ledger: InMemoryLedger) -> None:
    # Given a result holding a surrogate pair (valid in jsonb); When settled
    request = _request(ledger)
    ledger.claim([request])
    settlement = ledger.settle(request, JobRun(RunKind.SUCCEEDED, result="\ud83d\ude00"))
    # Then it is stored as the character the pair encodes
    assert settlement.status is SettleStatus.DONE
    row = ledger.get(request.idem_key)
    assert row is not None
    assert row.result == "\U0001f600"


def test_flag_stuck_annotates_only_running_rows_and_keeps_the_first_reason(
    ledger: InMemoryLedger,
) -> None:
    # Given a running and a done row
    running = ledger.seed("job:run")
    ledger.seed("job:done", state="done")
    # When both are flagged, twice
    ledger.flag_stuck({"job:run": "look at me", "job:done": "ignored", "job:none": "x"})
    ledger.flag_stuck({"job:run": "a later copy's reason"})
    # Then only the running row carries a reason, the first one
    flagged = ledger.get("job:run")
    assert flagged is not None
    assert (flagged.state, flagged.error) == ("running", "look at me")
    assert flagged.updated_at is not None
    assert flagged.claim_token == running.claim_token
    done = ledger.get("job:done")
    assert done is not None
    assert done.error is None


def test_an_uncertain_settle_ends_the_claims_lease(
    ledger: InMemoryLedger, clock: FakeClock
) -> None:
    # Given an external claim with two minutes of lease left
    request = _request(ledger, lease_seconds=120)
    ledger.claim([request])
    clock.advance(5)
    # When its effect is settled uncertain
    ledger.settle(request, JobRun(RunKind.UNCERTAIN, error="E: timeout"))
    # Then its lease ends now
    row = ledger.get(request.idem_key)
    assert row is not None
    assert row.lease_until == clock.utcnow()


def test_an_injected_failure_changes_nothing_and_passes(ledger: InMemoryLedger) -> None:
    # Given a ledger told to fail its next claim
    ledger.fail_next("claim")
    # When claimed twice
    with pytest.raises(LedgerUnavailable):
        ledger.claim([_request(ledger)])
    rows_after_failure = ledger.rows
    (decision,) = ledger.claim([_request(ledger)])
    # Then the first failed without a trace, and the second went through
    assert rows_after_failure == {}
    assert decision.status is ClaimStatus.WON


def test_duplicate_keys_in_one_claim_are_refused_like_postgres(ledger: InMemoryLedger) -> None:
    # Given one key twice in one claim; When claimed; Then refused whole, as ON CONFLICT does
    with pytest.raises(LedgerError, match="second time"):
        ledger.claim([_request(ledger), _request(ledger, message_id="qmsg_2")])
    assert ledger.rows == {}
