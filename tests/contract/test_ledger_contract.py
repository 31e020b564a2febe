"""One contract, two implementations: the in-memory fake and the Postgres claim ledger.

Every claim scenario runs against ``InMemoryLedger`` (the fake unit tests use) and against
``PostgresLedger`` on a real server. The layer states the claim rules once, in the claim
statement's SQL; the fake copies them in Python. This suite is what keeps the copy equal to the
SQL: where the two disagree, the SQL is right and the fake is fixed.

No clock is moved: an expired or a live lease is a row written an hour before or after now (the
fake's clock, the database's ``now()``), so the same scenario reads the same on both.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, LiteralString

import psycopg
import pytest
from claim_requests import FP, KEY, claim_request
from fakes import FakeClock, InMemoryLedger
from psycopg.types.json import Jsonb

from infrai_jobs.errors import LedgerError
from infrai_jobs.jobs.registry import Effect, JsonValue
from infrai_jobs.work.ledger import PostgresLedger
from infrai_jobs.work.outcomes import CLAIM_OUTCOMES, Outcome
from infrai_jobs.work.states import (
    ClaimDecision,
    ClaimRequest,
    ClaimRow,
    ClaimStatus,
    JobRun,
    RunKind,
    Settlement,
    SettleStatus,
)
from infrai_local.migrations import apply_migrations

VISIBILITY = 30
OTHER_FP = "b" * 64
HOUR = 3600.0
EXPIRED = "claim lease expired while running: the effect may have happened"

_SEED: LiteralString = """
INSERT INTO job_claims (idem_key, state, message_id, job, effect, payload_sha256, claim_token,
                        attempts, error, result, lease_until, claimed_at, payload, run_after)
VALUES (%(key)s, %(state)s, %(message_id)s, %(job)s, %(effect)s, %(fingerprint)s, %(token)s,
        %(attempts)s, %(error)s, %(result)s,
        now() + make_interval(secs => %(lease_in)s::float8),
        now() - make_interval(secs => %(claimed_ago)s::float8),
        CASE WHEN %(owned)s THEN '{"job": "job"}'::jsonb END,
        CASE WHEN %(owned)s THEN now() END)
"""
_REASSIGN: LiteralString = (
    "UPDATE job_claims SET claim_token = %(token)s, updated_at = now() WHERE idem_key = %(key)s"
)


@dataclass
class Backend:
    """A claim ledger as the drain sees it, with what a scenario needs around it: the ledger's
    own ``now()``, a row written as another worker or an operator left it, and a claim handed
    to someone else."""

    ledger: InMemoryLedger | PostgresLedger
    now: Callable[[], datetime]
    write_row: Callable[[dict[str, Any]], None]
    give_away: Callable[[str], object]

    def seed(
        self,
        key: str = KEY,
        *,
        state: str = "running",
        message_id: str = "qmsg_other",
        effect: Effect | None = Effect.EXTERNAL,
        fingerprint: str | None = FP,
        lease_in: float | None = None,
        claimed_ago: float = 0.0,
        error: str | None = None,
        result: JsonValue = None,
        owned: bool = False,
    ) -> ClaimRow:
        """Write a row; ``lease_in`` seconds from now (negative: over), ``claimed_ago`` seconds
        before now; ``owned``: work the ledger owns (deferred). Answers the row as the ledger
        reads it back."""
        self.write_row(
            {
                "key": key,
                "state": state,
                "message_id": message_id,
                "job": "job",
                "effect": None if effect is None else effect.value,
                "fingerprint": fingerprint,
                "token": None if state == "deferred" else uuid.uuid4(),
                "attempts": 1,
                "owned": owned,
                "error": error,
                "result": result,
                "lease_in": lease_in,
                "claimed_ago": claimed_ago,
            }
        )
        row = self.ledger.get(key)
        assert row is not None
        return row

    def claim_one(self, request: ClaimRequest) -> ClaimDecision:
        (decision,) = self.ledger.claim([request])
        return decision

    def row(self, key: str = KEY) -> ClaimRow | None:
        return self.ledger.get(key)


def _fake_backend() -> Backend:
    clock = FakeClock()
    fake = InMemoryLedger(clock, visibility_timeout=VISIBILITY)

    def write_row(values: dict[str, Any]) -> None:
        now = clock.utcnow()
        lease_in = values["lease_in"]
        fake.seed(
            values["key"],
            state=values["state"],
            message_id=values["message_id"],
            job=values["job"],
            effect=values["effect"],
            fingerprint=values["fingerprint"],
            claim_token=values["token"],
            attempts=values["attempts"],
            error=values["error"],
            result=values["result"],
            lease_until=None if lease_in is None else now + timedelta(seconds=lease_in),
            claimed_at=now - timedelta(seconds=values["claimed_ago"]),
            run_after=now if values["owned"] else None,
            payload={"job": "job"} if values["owned"] else None,
        )

    return Backend(fake, clock.utcnow, write_row, fake.reassign)


@contextmanager
def _postgres_backend(database_url: str) -> Iterator[Backend]:
    with psycopg.connect(database_url, autocommit=True) as conn:
        apply_migrations(conn)
        ledger = PostgresLedger(database_url, visibility_timeout=VISIBILITY)

        def now() -> datetime:
            row = conn.execute("SELECT now()").fetchone()
            assert row is not None
            current: datetime = row[0]
            return current

        def write_row(values: dict[str, Any]) -> None:
            result = values["result"]
            conn.execute(_SEED, {**values, "result": None if result is None else Jsonb(result)})

        def give_away(key: str) -> None:
            conn.execute(_REASSIGN, {"key": key, "token": uuid.uuid4()})

        try:
            yield Backend(ledger, now, write_row, give_away)
        finally:
            ledger.close()


@pytest.fixture(params=["in-memory fake", "postgres"])
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    if request.param == "in-memory fake":
        yield _fake_backend()
        return
    database_url = request.getfixturevalue("database_url")
    with _postgres_backend(database_url) as real:
        yield real


def _seconds(delta: timedelta | None) -> float | None:
    return None if delta is None else delta.total_seconds()


def _not_run(request: ClaimRequest, db: object) -> JobRun:
    raise AssertionError(f"{request.idem_key} must not run")


# --- claim --------------------------------------------------------------------------------------


def test_a_new_key_is_won_and_committed_running(backend: Backend) -> None:
    # Given an empty ledger; When an external job is claimed
    request = claim_request()
    decision = backend.claim_one(request)
    # Then it is won, and its row is running with the request's token, lease and fingerprint
    assert (decision.status, decision.takeover, decision.holder) == (ClaimStatus.WON, False, None)
    row = backend.row()
    assert row is not None
    assert (row.state, row.message_id, row.job, row.effect, row.attempts, row.error) == (
        "running",
        "qmsg_me",
        "job",
        "external",
        1,
        None,
    )
    assert (row.claim_token, row.payload_sha256) == (request.claim_token, FP)
    # The lease asked for, counted from the claim on the ledger's clock
    assert row.lease_until is not None
    assert row.updated_at is not None
    assert _seconds(row.lease_until - row.updated_at) == request.lease_seconds
    assert row.updated_at == row.claimed_at


def test_a_done_key_is_a_duplicate_carrying_its_result(backend: Backend) -> None:
    # Given the work done; When claimed again
    before = backend.seed(state="done", result={"sent": 1})
    decision = backend.claim_one(claim_request())
    # Then it is a duplicate, the caller learns the stored result, and nothing changes
    assert (decision.status, decision.result, decision.holder) == (
        ClaimStatus.DONE,
        {"sent": 1},
        "qmsg_other",
    )
    assert backend.row() == before


def test_a_failed_key_stays_failed(backend: Backend) -> None:
    # Given the work failed permanently; When claimed again
    before = backend.seed(state="failed", error="PermanentJobError: no")
    decision = backend.claim_one(claim_request())
    # Then it stays failed, with the stored error
    assert (decision.status, decision.detail) == (ClaimStatus.FAILED, "PermanentJobError: no")
    assert backend.row() == before


# --- in flight, expired, taken over ---------------------------------------------------------


@pytest.mark.parametrize("effect", list(Effect), ids=lambda e: e.value)
def test_a_live_claim_of_another_message_is_in_flight_whatever_the_effect(
    backend: Backend, effect: Effect
) -> None:
    # Given another message holding the claim for an hour more
    before = backend.seed(effect=effect, lease_in=HOUR)
    # When this message claims it (a database job through its batch)
    request = claim_request(effect=effect)
    if effect is Effect.DATABASE:
        (decision,), settlements = backend.ledger.run_database_batch([request], _not_run)
        assert settlements == []
    else:
        decision = backend.claim_one(request)
    # Then the claim is live elsewhere, and untouched
    assert (decision.status, decision.holder) == (ClaimStatus.LIVE, "qmsg_other")
    assert decision.redelivered_early_after is None
    assert backend.row() == before


@pytest.mark.parametrize(
    ("effect", "status", "detail"),
    [
        # Never committed running by the ledger itself; a row like this is never taken over
        (Effect.DATABASE, ClaimStatus.STUCK, EXPIRED),
        # An irreversible call may have happened: a human decides
        (Effect.EXTERNAL, ClaimStatus.STUCK, EXPIRED),
        # The downstream takes our key: the call is repeated under it
        (Effect.EXTERNAL_IDEMPOTENT, ClaimStatus.WON, "took over an expired claim (attempt 2)"),
    ],
    ids=lambda v: v.value if isinstance(v, Effect) else None,
)
def test_an_expired_claim_is_taken_over_only_for_a_key_passing_effect(
    backend: Backend, effect: Effect, status: ClaimStatus, detail: str
) -> None:
    # Given a claim whose holder died an hour ago, for the same work
    before = backend.seed(effect=effect, message_id="qmsg_dead", lease_in=-HOUR, claimed_ago=HOUR)
    # When another delivery claims it (a database job through its batch)
    request = claim_request(effect=effect)
    if effect is Effect.DATABASE:
        (decision,), _ = backend.ledger.run_database_batch([request], _not_run)
    else:
        decision = backend.claim_one(request)
    # Then the outcome table's row for the class
    assert (decision.status, decision.detail, decision.holder) == (status, detail, "qmsg_dead")
    row = backend.row()
    assert row is not None
    if status is ClaimStatus.STUCK:
        assert row == before
        return
    # And a takeover keeps the row's history, under the new holder and token
    assert decision.takeover is True
    assert (row.state, row.message_id, row.claim_token, row.attempts, row.error) == (
        "running",
        "qmsg_me",
        request.claim_token,
        2,
        None,
    )
    assert (row.claimed_at, row.payload_sha256, row.effect) == (
        before.claimed_at,
        FP,
        "external_idempotent",
    )
    assert row.lease_until is not None
    assert row.updated_at is not None
    assert _seconds(row.lease_until - row.updated_at) == request.lease_seconds


def test_an_expired_claim_flagged_for_a_human_is_never_taken_over(backend: Backend) -> None:
    # Given a key-passing job's expired claim that a human was asked to look at
    before = backend.seed(
        effect=Effect.EXTERNAL_IDEMPOTENT,
        lease_in=-HOUR,
        claimed_ago=HOUR,
        error="effect uncertain: E: timeout",
    )
    # When another delivery claims it
    decision = backend.claim_one(claim_request(effect=Effect.EXTERNAL_IDEMPOTENT))
    # Then it stays stuck for the human, the row as it was
    assert decision.status is ClaimStatus.STUCK
    assert "flagged for a human" in decision.detail
    assert backend.row() == before


def test_a_notes_row_without_a_lease_expires_after_the_visibility_timeout(
    backend: Backend,
) -> None:
    # Given the notes' own INSERT (no effect, no lease, no fingerprint): one just claimed, one
    # claimed longer ago than the visibility timeout
    backend.seed("job:new", effect=None, fingerprint=None)
    backend.seed("job:old", effect=None, fingerprint=None, claimed_ago=VISIBILITY + 60)
    # When claimed; Then the first is live, the second stuck (never taken over)
    fresh = backend.claim_one(claim_request("job:new", effect=Effect.EXTERNAL_IDEMPOTENT))
    old = backend.claim_one(claim_request("job:old", effect=Effect.EXTERNAL_IDEMPOTENT))
    assert (fresh.status, old.status) == (ClaimStatus.LIVE, ClaimStatus.STUCK)


def test_our_own_redelivery_finding_our_running_row_is_stuck(backend: Backend) -> None:
    # Given a delivery that claimed an irreversible job and died
    backend.claim_one(claim_request())
    before = backend.row()
    # When the same message comes back within the lease
    decision = backend.claim_one(claim_request())
    # Then the effect may have happened: stuck, and seen as an early redelivery
    assert decision.status is ClaimStatus.STUCK
    assert "redelivered while its own claim is still running" in decision.detail
    assert decision.redelivered_early_after is not None
    assert decision.redelivered_early_after >= 0
    assert backend.row() == before


def test_an_idempotent_claim_is_taken_over_by_its_own_message_within_its_lease(
    backend: Backend,
) -> None:
    # Given a key-passing job claimed by a delivery that died within its lease
    backend.claim_one(claim_request(effect=Effect.EXTERNAL_IDEMPOTENT))
    # When the same message comes back
    again = claim_request(effect=Effect.EXTERNAL_IDEMPOTENT)
    decision = backend.claim_one(again)
    # Then it takes its own claim over, noticed as an early redelivery
    assert (decision.status, decision.takeover) == (ClaimStatus.WON, True)
    assert decision.redelivered_early_after is not None
    row = backend.row()
    assert row is not None
    assert (row.attempts, row.claim_token) == (2, again.claim_token)


# --- conflict ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("state", "effect", "lease_in"),
    [
        ("done", Effect.EXTERNAL, None),
        ("running", Effect.EXTERNAL_IDEMPOTENT, -HOUR),  # would be a takeover for the same work
    ],
    ids=["done", "expired-idempotent"],
)
def test_the_same_key_for_different_work_is_a_conflict(
    backend: Backend, state: str, effect: Effect, lease_in: float | None
) -> None:
    # Given a key held for some work; When other work (another fingerprint) claims the key
    before = backend.seed(state=state, effect=effect, lease_in=lease_in, claimed_ago=HOUR)
    decision = backend.claim_one(claim_request(effect=effect, fingerprint=OTHER_FP))
    # Then it is a conflict, never a duplicate nor a takeover, and the row is left as it was
    assert decision.status is ClaimStatus.CONFLICT
    assert "different work" in decision.detail
    assert backend.row() == before


def test_duplicate_keys_in_one_claim_are_refused_whole(backend: Backend) -> None:
    # Given one key twice in one claim; When claimed; Then refused whole, as ON CONFLICT does
    with pytest.raises(LedgerError, match="second time"):
        backend.ledger.claim([claim_request(), claim_request(message_id="qmsg_2")])
    assert backend.row() is None


# --- the lease bound ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("lease_seconds", "visibility_left", "stored"),
    [
        (HOUR, None, VISIBILITY),  # a long budget: cut to the whole visibility timeout
        (HOUR, 5.0, 5.0),  # cut to what the message has left
        (HOUR, 10 * VISIBILITY, VISIBILITY),  # never more than the whole timeout
        (HOUR, -3.0, 0.0),  # a window already over: the lease is over at once
    ],
    ids=["whole-timeout", "visibility-left", "left-above-timeout", "left-negative"],
)
def test_a_lease_never_outlives_the_messages_visibility_window(
    backend: Backend, lease_seconds: float, visibility_left: float | None, stored: float
) -> None:
    # Given a claim asking for a lease far beyond the visibility window
    request = claim_request(lease_seconds=lease_seconds, visibility_left=visibility_left)
    # When claimed
    backend.claim_one(request)
    # Then the stored lease ends when the window does, counted from the claim
    row = backend.row()
    assert row is not None
    assert row.lease_until is not None
    assert row.updated_at is not None
    assert _seconds(row.lease_until - row.updated_at) == stored


def test_a_lease_shorter_than_the_window_is_kept(backend: Backend) -> None:
    # Given a claim asking for ten seconds; When claimed
    request = claim_request(lease_seconds=10)
    backend.claim_one(request)
    # Then the lease is the one asked for, counted from the claim
    row = backend.row()
    assert row is not None
    assert row.lease_until is not None
    assert row.updated_at is not None
    assert _seconds(row.lease_until - row.updated_at) == request.lease_seconds


def test_a_taken_over_lease_is_bounded_too(backend: Backend) -> None:
    # Given an expired key-passing claim; When taken over asking for an hour
    backend.seed(effect=Effect.EXTERNAL_IDEMPOTENT, lease_in=-HOUR, claimed_ago=HOUR)
    backend.claim_one(claim_request(effect=Effect.EXTERNAL_IDEMPOTENT, lease_seconds=HOUR))
    # Then the new lease ends with the visibility window as well
    row = backend.row()
    assert row is not None
    assert row.lease_until is not None
    assert row.updated_at is not None
    assert _seconds(row.lease_until - row.updated_at) == VISIBILITY


# --- settling, fenced -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("run", "status", "row_after"),
    [
        (JobRun(RunKind.SUCCEEDED, result=[1]), SettleStatus.DONE, ("done", None, [1])),
        (
            JobRun(RunKind.PERMANENT, error="E: no"),
            SettleStatus.FAILED,
            ("failed", "E: no", None),
        ),
        (
            JobRun(RunKind.UNCERTAIN, error="E: timeout"),
            SettleStatus.STUCK,
            ("running", "effect uncertain: E: timeout", None),
        ),
        (JobRun(RunKind.TRANSIENT, error="E: retry"), SettleStatus.RELEASED, None),
    ],
    ids=["succeeded", "permanent", "uncertain", "transient"],
)
def test_an_external_settle_records_each_kind_of_run(
    backend: Backend,
    run: JobRun,
    status: SettleStatus,
    row_after: tuple[str, str | None, JsonValue] | None,
) -> None:
    # Given a won external claim
    request = claim_request()
    backend.claim_one(request)
    # When its run is settled
    settlement = backend.ledger.settle(request, run)
    # Then the row says what happened (a released claim is gone)
    assert (settlement.status, settlement.run) == (status, run)
    row = backend.row()
    assert (None if row is None else (row.state, row.error, row.result)) == row_after


def test_an_uncertain_settle_ends_the_claims_lease(backend: Backend) -> None:
    # Given an external claim with twenty seconds of lease; When settled uncertain
    request = claim_request(lease_seconds=20)
    backend.claim_one(request)
    backend.ledger.settle(request, JobRun(RunKind.UNCERTAIN, error="E: timeout"))
    # Then its lease ends at the settle
    row = backend.row()
    assert row is not None
    assert row.updated_at is not None
    assert row.lease_until == row.updated_at


def test_a_released_claim_is_won_afresh(backend: Backend) -> None:
    # Given a claim released after a transient failure
    request = claim_request()
    backend.claim_one(request)
    backend.ledger.settle(request, JobRun(RunKind.TRANSIENT, error="E: retry"))
    # When the redelivery claims it
    retry = claim_request()
    decision = backend.claim_one(retry)
    # Then it wins a new claim, as if the first had never been
    assert (decision.status, decision.takeover, decision.holder) == (ClaimStatus.WON, False, None)
    row = backend.row()
    assert row is not None
    assert (row.attempts, row.claim_token) == (1, retry.claim_token)


@pytest.mark.parametrize(
    "kind", [k for k in RunKind if k is not RunKind.DEFERRED], ids=lambda k: k.value
)
def test_a_settle_by_a_holder_who_lost_the_claim_changes_nothing(
    backend: Backend, kind: RunKind
) -> None:
    # Given a won claim that someone else was handed (an operator, a takeover)
    request = claim_request()
    backend.claim_one(request)
    backend.give_away(request.idem_key)
    before = backend.row()
    # When the old holder settles it
    settlement = backend.ledger.settle(request, JobRun(kind, result=1, error="E: x"))
    # Then nothing changes, and the holder learns it lost the claim
    assert settlement.status is SettleStatus.LOST
    assert backend.row() == before


def test_a_deferred_run_settles_nothing_more(backend: Backend) -> None:
    # Given a won claim whose run flow control deferred (the deferral itself turned the claim
    # into waiting work, fenced by its token) and that was since handed to someone else
    request = claim_request()
    backend.claim_one(request)
    backend.give_away(request.idem_key)
    before = backend.row()
    # When the deferred run settles
    settlement = backend.ledger.settle(request, JobRun(RunKind.DEFERRED, error="deferred"))
    # Then nothing changes, and the outcome is deferred: the message may be acked
    assert settlement.status is SettleStatus.DEFERRED
    assert backend.row() == before


@pytest.mark.parametrize("effect", [Effect.EXTERNAL, Effect.EXTERNAL_IDEMPOTENT])
@pytest.mark.parametrize(
    ("state", "lease_in"), [("deferred", None), ("running", HOUR), ("running", -HOUR)]
)
def test_a_copy_of_work_the_ledger_owns_is_a_duplicate_never_claimed_or_taken_over(
    backend: Backend, effect: Effect, state: str, lease_in: float | None
) -> None:
    # Given work the ledger owns: waiting, or taken by a drain (its lease live or over)
    before = backend.seed(effect=effect, state=state, lease_in=lease_in, owned=True)
    # When a copy of its message is claimed, even by the message the work came from
    for message_id in ("qmsg_me", before.message_id):
        decision = backend.claim_one(claim_request(effect=effect, message_id=message_id))
        # Then it is a duplicate of deferred work (acked), and the row is unchanged
        assert decision.status is ClaimStatus.DEFERRED, decision.detail
        assert CLAIM_OUTCOMES[decision.status] is Outcome.DEFERRED
        assert decision.redelivered_early_after is None
        assert backend.row() == before


def test_work_an_operator_cancelled_is_new_work_to_a_later_message(backend: Backend) -> None:
    # Given deferred work an operator cancelled
    backend.seed(state="cancelled", owned=True, fingerprint="fp-old")
    # When a new message with its key is claimed
    decision = backend.claim_one(claim_request(fingerprint=FP))
    # Then it wins as a first claim, and the row is a message's claim again
    assert decision.status is ClaimStatus.WON
    assert not decision.takeover
    row = backend.row()
    assert row is not None
    assert (row.state, row.attempts, row.owned, row.payload, row.payload_sha256) == (
        "running",
        1,
        False,
        None,
        FP,
    )


def test_a_claim_taken_over_is_lost_to_its_old_holder(backend: Backend) -> None:
    # Given a key-passing claim whose lease ran out, taken over by another delivery
    backend.seed(effect=Effect.EXTERNAL_IDEMPOTENT, lease_in=-HOUR, claimed_ago=HOUR)
    old_holder = ClaimRequest(
        idem_key=KEY,
        message_id="qmsg_other",
        job="job",
        effect=Effect.EXTERNAL_IDEMPOTENT,
        fingerprint=FP,
        claim_token=uuid.UUID(int=1),
    )
    taker = claim_request(effect=Effect.EXTERNAL_IDEMPOTENT)
    assert backend.claim_one(taker).status is ClaimStatus.WON
    # When the old holder comes back and settles; Then it lost the claim, the taker keeps it
    late = backend.ledger.settle(old_holder, JobRun(RunKind.SUCCEEDED, result="late"))
    assert late.status is SettleStatus.LOST
    done = backend.ledger.settle(taker, JobRun(RunKind.SUCCEEDED, result="taker"))
    assert done.status is SettleStatus.DONE
    row = backend.row()
    assert row is not None
    assert (row.state, row.message_id, row.result) == ("done", "qmsg_me", "taker")


def test_a_settled_or_released_claim_cannot_be_settled_again(backend: Backend) -> None:
    # Given one claim settled done and one released
    done, released = claim_request("job:done"), claim_request("job:released")
    backend.ledger.claim([done, released])
    backend.ledger.settle(done, JobRun(RunKind.SUCCEEDED, result=1))
    backend.ledger.settle(released, JobRun(RunKind.TRANSIENT, error="E: retry"))
    # When each is settled again
    again = [
        backend.ledger.settle(done, JobRun(RunKind.PERMANENT, error="late")),
        backend.ledger.settle(released, JobRun(RunKind.SUCCEEDED, result=2)),
    ]
    # Then the fence (token and state running) refuses both, and the rows keep their outcome
    assert [s.status for s in again] == [SettleStatus.LOST, SettleStatus.LOST]
    row = backend.row("job:done")
    assert row is not None
    assert (row.state, row.result) == ("done", 1)
    assert backend.row("job:released") is None


def test_flag_stuck_annotates_only_running_rows_and_keeps_the_first_reason(
    backend: Backend,
) -> None:
    # Given a running and a done row
    running = backend.seed("job:run")
    backend.seed("job:done", state="done")
    # When both are flagged, twice (and a key without a row)
    backend.ledger.flag_stuck({"job:run": "look at me", "job:done": "ignored", "job:none": "x"})
    backend.ledger.flag_stuck({"job:run": "a later copy's reason"})
    # Then only the running row carries a reason, the first one; its claim is still the same
    flagged = backend.row("job:run")
    assert flagged is not None
    assert (flagged.state, flagged.error) == ("running", "look at me")
    assert flagged.updated_at is not None
    assert flagged.claim_token == running.claim_token
    done = backend.row("job:done")
    assert done is not None
    assert done.error is None
    assert backend.row("job:none") is None


# --- database batches -------------------------------------------------------------------------


def test_a_database_batch_settles_each_won_job(backend: Backend) -> None:
    # Given three database jobs, one already done
    backend.seed("db:done", state="done", effect=Effect.DATABASE, result="old")
    requests = [claim_request(k, effect=Effect.DATABASE) for k in ("db:ok", "db:bad", "db:done")]
    outcomes = {
        "db:ok": JobRun(RunKind.SUCCEEDED, result={"ok": True}),
        "db:bad": JobRun(RunKind.PERMANENT, error="E: bad"),
    }
    ran: list[str] = []

    def runner(request: ClaimRequest, db: object) -> JobRun:
        ran.append(request.idem_key)
        return outcomes[request.idem_key]

    # When run as one batch
    decisions, settlements = backend.ledger.run_database_batch(requests, runner)
    # Then only the won jobs ran (Postgres runs the batch a second time, a savepoint per job,
    # once a job failed in the first attempt), and each settled
    assert set(ran) == {"db:bad", "db:ok"}
    assert {d.request.idem_key: d.status for d in decisions} == {
        "db:ok": ClaimStatus.WON,
        "db:bad": ClaimStatus.WON,
        "db:done": ClaimStatus.DONE,
    }
    assert {s.request.idem_key: s.status for s in settlements} == {
        "db:ok": SettleStatus.DONE,
        "db:bad": SettleStatus.FAILED,
    }
    rows = {k: backend.row(k) for k in ("db:ok", "db:bad", "db:done")}
    assert {k: (r.state, r.result, r.error) for k, r in rows.items() if r} == {
        "db:ok": ("done", {"ok": True}, None),
        "db:bad": ("failed", None, "E: bad"),
        "db:done": ("done", "old", None),
    }


@pytest.mark.parametrize("kind", [RunKind.UNCERTAIN, RunKind.TRANSIENT], ids=lambda k: k.value)
def test_a_database_job_that_may_retry_is_released(backend: Backend, kind: RunKind) -> None:
    # Given a database job whose handler failed or reports an uncertain effect; When run in a
    # batch
    request = claim_request(effect=Effect.DATABASE)
    _, settlements = backend.ledger.run_database_batch(
        [request], lambda r, db: JobRun(kind, error="E: ?")
    )
    # Then its claim is released: the savepoint rolled the effect back, nothing is uncertain
    assert [s.status for s in settlements] == [SettleStatus.RELEASED]
    assert backend.row(request.idem_key) is None


def test_a_database_batch_leaves_no_trace_when_it_fails(backend: Backend) -> None:
    # Given a batch whose second job cannot be stored (Postgres refuses NUL in jsonb)
    requests = [claim_request(k, effect=Effect.DATABASE) for k in ("db:a", "db:b")]

    def runner(request: ClaimRequest, db: object) -> JobRun:
        return JobRun(RunKind.SUCCEEDED, result="a\x00b" if request.idem_key == "db:b" else 1)

    # When it runs, the ledger refuses the whole transaction
    with pytest.raises(LedgerError, match="Unicode escape"):
        backend.ledger.run_database_batch(requests, runner)
    # Then no claim of it remains, and the redelivery wins afresh
    assert (backend.row("db:a"), backend.row("db:b")) == (None, None)
    (decision,), _ = backend.ledger.run_database_batch(
        [claim_request("db:a", effect=Effect.DATABASE)], lambda r, db: JobRun(RunKind.SUCCEEDED)
    )
    assert (decision.status, decision.takeover) == (ClaimStatus.WON, False)


# --- what Postgres refuses to store -----------------------------------------------------------


@pytest.mark.parametrize(
    ("run", "raised"),
    [
        (JobRun(RunKind.SUCCEEDED, result={"x": "a\x00b"}), LedgerError),
        (JobRun(RunKind.SUCCEEDED, result=["\ud800"]), LedgerError),
        (JobRun(RunKind.PERMANENT, error="bad \x00 input"), LedgerError),
        (JobRun(RunKind.PERMANENT, error="bad \ud800 input"), UnicodeEncodeError),
    ],
    ids=["nul-in-result", "lone-surrogate-in-result", "nul-in-error", "lone-surrogate-in-error"],
)
def test_a_settle_postgres_refuses_raises_and_changes_nothing(
    backend: Backend, run: JobRun, raised: type[Exception]
) -> None:
    # Given a won claim
    request = claim_request()
    backend.claim_one(request)
    before = backend.row()
    # When settled with a value Postgres cannot store; Then it raises, the claim as it was
    with pytest.raises(raised):
        backend.ledger.settle(request, run)
    assert backend.row() == before


def test_a_paired_surrogate_result_is_stored_as_its_character(backend: Backend) -> None:
    # Given a result holding a surrogate pair (valid in jsonb); When settled
    request = claim_request()
    backend.claim_one(request)
    settlement: Settlement = backend.ledger.settle(
        request, JobRun(RunKind.SUCCEEDED, result="\ud83d\ude00")
    )
    # Then it is stored as the character the pair encodes
    assert settlement.status is SettleStatus.DONE
    row = backend.row()
    assert row is not None
    assert row.result == "\U0001f600"
