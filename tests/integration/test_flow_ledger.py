"""Flow control in the ledger, on a real PostgreSQL: migration 7, deferred work taken once across
drains, rate limits on the database's clock, concurrency slots that cannot leak."""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from claim_requests import claim_request
from drainkit import migrate_by_hand

from infrai_jobs.errors import ClaimChanged, ClaimNotFound
from infrai_jobs.flow import limits
from infrai_jobs.flow.policies import RateLimit
from infrai_jobs.jobs.registry import Effect
from infrai_jobs.work import store as flow
from infrai_jobs.work.ledger import PostgresLedger
from infrai_jobs.work.statements import STUCK_CLAIM
from infrai_jobs.work.states import ClaimRow, ClaimStatus, JobRun, RunKind
from infrai_jobs.work.store import DeferOutcome, DeferredWork
from infrai_local.migrations import LEDGER_MIGRATIONS, apply_migrations
from infrai_local.operator.verbs import OperatorLedger

OPERATOR = "on-call@example.com"


@pytest.fixture
def ledger_url(database_url: str) -> str:
    with psycopg.connect(database_url, autocommit=True) as conn:
        apply_migrations(conn)
    return database_url


@pytest.fixture
def operator(ledger_url: str) -> OperatorLedger:
    """The command line's changes to deferred work (run-now, cancel)."""
    return OperatorLedger(ledger_url)


@pytest.fixture
def conn(ledger_url: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(ledger_url, autocommit=True) as connection:
        yield connection


def _work(
    key: str, *, job: str = "report.render", effect: str = "external_idempotent"
) -> DeferredWork:
    return DeferredWork(
        idem_key=key,
        job=job,
        effect=effect,
        payload={"job": job, "tenant_id": "t1", "n": key},
        message_id=f"qmsg_{key}",
        fingerprint=f"fp-{key}",
        queue="jobs",
    )


def _claim(conn: psycopg.Connection[Any], key: str) -> uuid.UUID:
    token = uuid.uuid4()
    conn.execute(
        "INSERT INTO job_claims (idem_key, state, message_id, job, effect, claim_token,"
        " lease_until) VALUES (%s, 'running', %s, 'report.render', 'external_idempotent', %s,"
        " now() + interval '5 minutes')",
        (key, f"qmsg_{key}", token),
    )
    return token


def _expire_lease(conn: psycopg.Connection[Any], key: str) -> None:
    # What a drain killed mid-run leaves once its lease has run out.
    conn.execute(
        "UPDATE job_claims SET lease_until = now() - interval '1 second' WHERE idem_key = %s",
        (key,),
    )


def _in_threads(count: int, target: Callable[[int], Any]) -> list[Any]:
    """Run ``target(i)`` in ``count`` threads released together; re-raise the first failure."""
    barrier = threading.Barrier(count)
    results: list[Any] = [None] * count
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            barrier.wait(timeout=30)
            results[index] = target(index)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "a thread did not finish"
    if errors:
        raise errors[0]
    return results


# --- Migration 7 ------------------------------------------------------------------------------


def test_flow_control_migration_only_adds_to_a_ledger_at_version_6(database_url: str) -> None:
    # Given a ledger at version 6 holding a claim the notes' worker wrote
    with psycopg.connect(database_url, autocommit=True) as conn, conn.transaction():
        migrate_by_hand(conn, up_to=6)
        conn.execute(
            "INSERT INTO job_claims (idem_key, state, message_id) VALUES ('k1', 'done', 'q1')"
        )
    # When migrated
    with psycopg.connect(database_url, autocommit=True) as conn:
        applied = [m.version for m in apply_migrations(conn)]
    # Then only flow control (and what came after it) was applied, and the claim is kept
    assert applied == [m.version for m in LEDGER_MIGRATIONS[6:]]
    assert LEDGER_MIGRATIONS[6].name == "flow control"
    with psycopg.connect(database_url, autocommit=True) as conn:
        assert conn.execute("SELECT idem_key, state FROM job_claims").fetchall() == [("k1", "done")]
        # And the notes' worker's own statements still work, word for word
        conn.execute(
            "INSERT INTO job_claims (idem_key, state, message_id) VALUES ('k2', 'running', 'q2')"
            " ON CONFLICT (idem_key) DO NOTHING RETURNING idem_key"
        )
        conn.execute("UPDATE job_claims SET state = 'done', result = '{}' WHERE idem_key = 'k2'")
        conn.execute(
            "INSERT INTO job_claims (idem_key, state, message_id) VALUES ('k3', 'running', 'q3')"
        )
        conn.execute("DELETE FROM job_claims WHERE idem_key = 'k3' AND state = 'running'")
        assert conn.execute("SELECT count(*) FROM job_claims").fetchone() == (2,)
        # And the new tables are there, empty
        for table in ("deferred_jobs", "flow_rate_starts", "flow_concurrency_slots"):
            assert conn.execute(f"SELECT count(*) FROM {table}").fetchone() == (0,)
        # And a second run applies nothing
        assert apply_migrations(conn) == []


# --- Migration 10: one state machine ------------------------------------------------------------

# What a drain of the previous version sends to defer an attempt (its claim is released first,
# in the same transaction), and to take due work: its own statements, word for word in effect.
_OLD_DEFER = """
INSERT INTO deferred_jobs AS d (idem_key, job, effect, payload, payload_sha256, message_id,
                                queue, attempts, last_error, run_after)
VALUES (%(key)s, 'report.render', 'external_idempotent', '{"job": "report.render"}', 'fp',
        %(key)s, 'jobs', 1, 'provider 503', clock_timestamp())
ON CONFLICT (idem_key) DO UPDATE SET state = 'deferred' WHERE d.state IN ('done', 'failed')
RETURNING idem_key
"""
_OLD_TAKE_DUE = """
SELECT idem_key FROM deferred_jobs
WHERE state = 'deferred' AND run_after <= clock_timestamp() FOR UPDATE SKIP LOCKED
"""


def test_the_one_state_machine_migration_moves_deferred_work_and_catches_old_drains(
    database_url: str,
) -> None:
    # Given a ledger at version 9 with deferred work waiting, one running under a lease, one
    # finished (its settled claim beside it), and a claim of the notes' worker
    token = uuid.uuid4()
    with psycopg.connect(database_url, autocommit=True) as conn, conn.transaction():
        migrate_by_hand(conn, up_to=9)
        conn.execute(
            "INSERT INTO deferred_jobs (idem_key, job, effect, payload, payload_sha256,"
            " message_id, queue, state, attempts, last_error, run_after, lease_token,"
            " lease_until) VALUES"
            " ('wait', 'report.render', 'external', '{\"n\": 1}', 'fp1', 'q1', 'jobs',"
            "  'deferred', 2, 'e', now() + interval '1 hour', NULL, NULL),"
            " ('run', 'report.render', 'external_idempotent', '{\"n\": 2}', 'fp2', 'q2', 'jobs',"
            "  'running', 3, 'e', now(), %s, now() + interval '5 minutes'),"
            " ('fin', 'report.render', 'external', '{\"n\": 3}', 'fp3', 'q3', 'jobs',"
            "  'done', 1, NULL, now(), NULL, NULL)",
            (token,),
        )
        conn.execute(
            "INSERT INTO job_claims (idem_key, state, message_id, result) VALUES"
            " ('fin', 'done', 'q3', '{\"ref\": 3}'), ('notes', 'done', 'q4', NULL)"
        )
    # When migrated
    with psycopg.connect(database_url, autocommit=True) as conn:
        applied = [m.version for m in apply_migrations(conn)]
        assert applied[0] == 10
        # Then the waiting and running work are claims the ledger owns, the running one with
        # its token and lease, and the finished one's claim is as it was
        rows = {
            row.idem_key: row
            for row in (_row(conn, key) for key in ("wait", "run", "fin", "notes"))
        }
        assert (rows["wait"].state, rows["wait"].attempts, rows["wait"].payload) == (
            "deferred",
            2,
            {"n": 1},
        )
        assert rows["wait"].owned
        assert (rows["run"].state, rows["run"].claim_token, rows["run"].owned) == (
            "running",
            token,
            True,
        )
        assert (rows["fin"].state, rows["fin"].result, rows["fin"].owned) == (
            "done",
            {"ref": 3},
            False,
        )
        assert rows["notes"].state == "done"
        assert conn.execute("SELECT count(*) FROM deferred_jobs").fetchone() == (0,)
        # And a drain of the previous version that defers an attempt lands in job_claims: its
        # insert reads as "already deferred" (a duplicate it acks), and it finds nothing due
        with conn.transaction():
            answered = conn.execute(_OLD_DEFER, {"key": "old"}).fetchall()
        assert answered == []
        old = _row(conn, "old")
        assert (old.state, old.owned, old.last_error) == ("deferred", True, "provider 503")
        assert conn.execute(_OLD_TAKE_DUE).fetchall() == []
        # And this version's drain takes it, once
        assert [job.idem_key for job in flow.take_due(conn, 10, lease_seconds=60)] == ["old"]
        # And the notes' worker's own insert sees a deferred key as taken
        assert (
            conn.execute(
                "INSERT INTO job_claims (idem_key, state, message_id) VALUES ('wait', 'running',"
                " 'q9') ON CONFLICT (idem_key) DO NOTHING RETURNING idem_key"
            ).fetchall()
            == []
        )
        # And a second run applies nothing
        assert apply_migrations(conn) == []


# --- Deferring --------------------------------------------------------------------------------


def _row(conn: psycopg.Connection[Any], key: str) -> ClaimRow:
    found = flow.claim_of(conn, key, visibility=300)
    assert found is not None, f"no row for {key}"
    return found


def test_deferring_turns_the_claim_into_work_the_ledger_owns(
    conn: psycopg.Connection[Any],
) -> None:
    # Given an attempt holding its claim
    token = _claim(conn, "k1")
    # When it defers the job in the transaction that settles it
    with conn.transaction():
        outcome = flow.defer(
            conn, _work("k1"), attempts=2, error="provider 503", delay_seconds=30, claim_token=token
        )
    # Then the same row waits, with no token or lease, holding everything a later run needs
    assert outcome is DeferOutcome.DEFERRED
    assert conn.execute("SELECT count(*) FROM job_claims").fetchone() == (1,)
    row = conn.execute(
        "SELECT job, effect, payload, message_id, queue, state, attempts, last_error, error,"
        " claim_token, lease_until, run_after - now() > interval '25 seconds' FROM job_claims"
    ).fetchone()
    assert row == (
        "report.render",
        "external_idempotent",
        {"job": "report.render", "tenant_id": "t1", "n": "k1"},
        "qmsg_k1",
        "jobs",
        "deferred",
        2,
        "provider 503",
        None,
        None,
        None,
        True,
    )
    assert _row(conn, "k1").owned
    # And work for a key a row holds is never deferred over it
    assert flow.defer(conn, _work("k1"), attempts=1, error="again", delay_seconds=0) is (
        DeferOutcome.ALREADY_HELD
    )
    assert conn.execute("SELECT attempts, last_error FROM job_claims").fetchone() == (
        2,
        "provider 503",
    )


def test_a_deferral_whose_claim_was_lost_changes_nothing(conn: psycopg.Connection[Any]) -> None:
    # Given a claim another delivery took over (a new token)
    _claim(conn, "k1")
    # When the old holder tries to defer with its token
    outcome = flow.defer(
        conn, _work("k1"), attempts=1, error="e", delay_seconds=1, claim_token=uuid.uuid4()
    )
    # Then it is told so, and the claim is as it was
    assert outcome is DeferOutcome.CLAIM_LOST
    assert conn.execute("SELECT state, run_after FROM job_claims").fetchall() == [("running", None)]


def test_due_jobs_are_taken_oldest_due_first_and_only_once(
    conn: psycopg.Connection[Any], operator: OperatorLedger
) -> None:
    # Given two due jobs and one due in an hour
    flow.defer(conn, _work("later"), attempts=1, error="e", delay_seconds=3600)
    flow.defer(conn, _work("second"), attempts=1, error="e", delay_seconds=0)
    conn.execute(
        "UPDATE job_claims SET run_after = now() - interval '10 seconds' WHERE idem_key = 'second'"
    )
    flow.defer(conn, _work("first"), attempts=3, error="e", delay_seconds=0)
    conn.execute(
        "UPDATE job_claims SET run_after = now() - interval '1 minute' WHERE idem_key = 'first'"
    )
    # When a drain takes what is due
    taken = flow.take_due(conn, 10, lease_seconds=120)
    # Then it gets the due ones, the longest due first, each under a token and lease, attempts
    # counted
    assert [job.idem_key for job in taken] == ["first", "second"]
    assert [job.attempts for job in taken] == [4, 2]
    assert all(job.state == "running" and job.claim_token and job.lease_until for job in taken)
    assert taken[0].payload == {"job": "report.render", "tenant_id": "t1", "n": "first"}
    # And a second drain finds nothing to take while their leases live
    assert flow.take_due(conn, 10, lease_seconds=120) == []
    # And only the jobs named are taken when a drain names its jobs
    operator.run_deferred_now("later", actor=OPERATOR)
    assert flow.take_due(conn, 10, lease_seconds=120, jobs=["other.job"]) == []
    assert [job.idem_key for job in flow.take_due(conn, 10, lease_seconds=120)] == ["later"]


def test_two_drains_racing_never_take_the_same_job(ledger_url: str) -> None:
    # Given 120 due deferred jobs
    with psycopg.connect(ledger_url, autocommit=True) as conn:
        for n in range(120):
            flow.defer(conn, _work(f"k{n:03d}"), attempts=1, error="e", delay_seconds=0)

    # When four drains, each on its own connection, take small batches until none is left
    def drain(_: int) -> list[str]:
        keys: list[str] = []
        with psycopg.connect(ledger_url, autocommit=True) as conn:
            while batch := flow.take_due(conn, 3, lease_seconds=300):
                keys.extend(job.idem_key for job in batch)
        return keys

    taken = _in_threads(4, drain)
    # Then every job was taken exactly once
    every = [key for keys in taken for key in keys]
    assert sorted(every) == [f"k{n:03d}" for n in range(120)]
    assert len(set(every)) == len(every)


def test_an_expired_lease_is_taken_over_except_for_an_external_job(
    conn: psycopg.Connection[Any],
) -> None:
    # Given a key-passing job and an external one, both taken by a drain that then died, the
    # external one after its run began
    flow.defer(conn, _work("idem"), attempts=1, error="e", delay_seconds=0)
    flow.defer(conn, _work("ext", effect="external"), attempts=1, error="e", delay_seconds=0)
    first = {job.idem_key: job for job in flow.take_due(conn, 10, lease_seconds=300)}
    ext_token = first["ext"].claim_token
    assert ext_token is not None
    assert flow.begin(conn, "ext", ext_token)
    _expire_lease(conn, "idem")
    _expire_lease(conn, "ext")
    # When another drain looks for due work
    again = flow.take_due(conn, 10, lease_seconds=300)
    # Then it takes over the key-passing job under a new token, never the external one
    assert [job.idem_key for job in again] == ["idem"]
    assert again[0].claim_token != first["idem"].claim_token
    assert again[0].attempts == 3
    # And the dead drain's token no longer settles anything
    old = first["idem"].claim_token
    assert old is not None
    assert flow.finish(conn, "idem", old, {"ref": "x"}) is None
    # And the external run is stuck for a human, by the one stuck rule
    assert _row(conn, "ext").state == "running"
    stuck = conn.execute(
        "SELECT idem_key FROM job_claims WHERE " + STUCK_CLAIM,
        {"threshold": 900, "visibility": 300},
    ).fetchall()
    assert stuck == [("ext",)]


def test_finishing_settles_the_one_row_and_records_it(conn: psycopg.Connection[Any]) -> None:
    # Given a taken deferred job
    flow.defer(conn, _work("k1"), attempts=1, error="e", delay_seconds=0)
    (job,) = flow.take_due(conn, 1, lease_seconds=60)
    assert job.claim_token is not None
    # When it succeeds, inside the caller's transaction
    with conn.transaction():
        assert flow.finish(conn, "k1", job.claim_token, {"ref": "r-1"})
    # Then its row is done: any later copy of its message is a duplicate of done
    assert conn.execute(
        "SELECT state, result, message_id, job, payload_sha256, attempts FROM job_claims"
    ).fetchone() == ("done", {"ref": "r-1"}, "qmsg_k1", "report.render", "fp-k1", 2)
    # And the history records the change, before and after
    action, actor, before, after = conn.execute(
        "SELECT action, actor, before->>'state', after->>'state' FROM claim_history"
    ).fetchone() or (None, None, None, None)
    assert (action, actor, before, after) == ("deferred_done", "drain", "running", "done")
    # And finishing it twice changes nothing
    assert flow.finish(conn, "k1", job.claim_token, {"ref": "r-2"}) is None


def test_failing_and_postponing_a_taken_job(conn: psycopg.Connection[Any]) -> None:
    flow.defer(conn, _work("k1"), attempts=1, error="e1", delay_seconds=0)
    flow.defer(conn, _work("k2"), attempts=1, error="e1", delay_seconds=0)
    taken = {job.idem_key: job for job in flow.take_due(conn, 2, lease_seconds=60)}
    token1, token2 = taken["k1"].claim_token, taken["k2"].claim_token
    assert token1 is not None
    assert token2 is not None
    # When one attempt fails again with attempts left, and the other runs out of attempts
    assert flow.postpone(conn, "k1", token1, error="e2", delay_seconds=3600)
    assert flow.fail(conn, "k2", token2, "out of attempts: provider 503")
    # Then the first waits again with its error, not due, its token and lease gone
    assert conn.execute(
        "SELECT state, last_error, claim_token, run_after > now() + interval '50 minutes'"
        " FROM job_claims WHERE idem_key = 'k1'"
    ).fetchone() == ("deferred", "e2", None, True)
    assert flow.take_due(conn, 10, lease_seconds=60) == []
    # And the second is failed with its reason, and recorded
    assert conn.execute(
        "SELECT state, error, last_error FROM job_claims WHERE idem_key = 'k2'"
    ).fetchone() == ("failed", "out of attempts: provider 503", "out of attempts: provider 503")
    assert conn.execute("SELECT action FROM claim_history WHERE idem_key = 'k2'").fetchall() == [
        ("deferred_failed",)
    ]
    # And a postpone with a stale token changes nothing
    assert not flow.postpone(conn, "k1", token1, error="e3", delay_seconds=0)


def test_operators_run_now_or_cancel_waiting_work_recorded_in_the_history(
    conn: psycopg.Connection[Any], operator: OperatorLedger
) -> None:
    flow.defer(conn, _work("k1"), attempts=1, error="e", delay_seconds=3600)
    flow.defer(conn, _work("k2"), attempts=1, error="e", delay_seconds=3600)
    # When an operator runs one now and cancels the other
    ran = operator.run_deferred_now("k1", actor=OPERATOR, note="provider is back")
    cancelled = operator.cancel_deferred("k2", actor=OPERATOR, note="customer left")
    # Then the first is due and taken by the next drain, the second never runs
    assert ran.state == "deferred"
    assert cancelled.state == "cancelled"
    assert [job.idem_key for job in flow.take_due(conn, 10, lease_seconds=60)] == ["k1"]
    assert conn.execute("SELECT idem_key, state FROM job_claims ORDER BY idem_key").fetchall() == [
        ("k1", "running"),
        ("k2", "cancelled"),
    ]
    # And each action is in the history with who did it and why
    assert conn.execute(
        "SELECT idem_key, action, actor, note, before->>'state', after->>'state'"
        " FROM claim_history ORDER BY id"
    ).fetchall() == [
        ("k1", "run_now", OPERATOR, "provider is back", "deferred", "deferred"),
        ("k2", "cancel", OPERATOR, "customer left", "deferred", "cancelled"),
    ]
    # And a running or unknown job is refused with the reason, nothing recorded
    with pytest.raises(ClaimChanged, match="running"):
        operator.cancel_deferred("k1", actor=OPERATOR)
    with pytest.raises(ClaimNotFound, match="nope"):
        operator.run_deferred_now("nope", actor=OPERATOR)
    assert conn.execute("SELECT count(*) FROM claim_history").fetchone() == (2,)


def test_a_cancelled_key_is_free_for_new_work_but_not_for_a_stale_take_back(
    conn: psycopg.Connection[Any], operator: OperatorLedger
) -> None:
    flow.defer(conn, _work("k1"), attempts=4, error="old", delay_seconds=3600)
    operator.cancel_deferred("k1", actor=OPERATOR)
    # When the cancelled work is offered to the ledger again without a claim (a take-back)
    outcome = flow.defer(conn, _work("k1"), attempts=1, error="new", delay_seconds=0)
    # Then it is not: the row stays cancelled
    assert outcome is DeferOutcome.ALREADY_HELD
    assert _row(conn, "k1").state == "cancelled"
    # And a new message's claim takes the key afresh, as new work
    ledger = PostgresLedger(conn.info.dsn)
    try:
        request = claim_request(
            "k1",
            message_id="qmsg_new",
            job="report.render",
            effect=Effect.EXTERNAL_IDEMPOTENT,
            fingerprint="fp-new",
            lease_seconds=300,
        )
        (decision,) = ledger.claim([request])
    finally:
        ledger.close()
    assert decision.status is ClaimStatus.WON
    assert not decision.takeover
    fresh = _row(conn, "k1")
    assert (fresh.state, fresh.attempts, fresh.payload, fresh.run_after, fresh.message_id) == (
        "running",
        1,
        None,
        None,
        "qmsg_new",
    )


def test_the_backlog_and_its_oldest_age(
    conn: psycopg.Connection[Any], operator: OperatorLedger
) -> None:
    assert flow.deferred_stats(conn) == (0, 0.0)
    for key in ("k1", "k2", "k3"):
        flow.defer(conn, _work(key), attempts=1, error="e", delay_seconds=3600)
    conn.execute(
        "UPDATE job_claims SET deferred_at = now() - interval '10 minutes' WHERE idem_key = 'k2'"
    )
    operator.cancel_deferred("k3", actor=OPERATOR)
    backlog, oldest = flow.deferred_stats(conn)
    assert backlog == 2
    assert 600 <= oldest < 3600


# --- Rate limits ------------------------------------------------------------------------------


def _reserve(
    conn: psycopg.Connection[Any], job: str, limit: RateLimit, *, max_wait: float
) -> tuple[bool, float]:
    """A rate-limited start alone (a job with no concurrency key): reserved, and the wait."""
    token = uuid.uuid4()
    admission = limits.admit(
        conn, job, token=token, idem_key=f"{job}:{token}", holder="m", rate=limit, max_wait=max_wait
    )
    assert admission.slot_free
    return admission.start_fits, admission.wait


def test_a_start_is_reserved_a_spacing_after_the_last_or_refused_past_the_wait_allowed(
    conn: psycopg.Connection[Any],
) -> None:
    limit = RateLimit(per_minute=3)  # one start every 20 s
    # Given a first start, reserved for now
    assert _reserve(conn, "report.render", limit, max_wait=0) == (True, 0.0)
    # When a second asks with a minute to spare, and a third with only 10 s
    second = _reserve(conn, "report.render", limit, max_wait=60)
    third = _reserve(conn, "report.render", limit, max_wait=10)
    # Then the second is reserved 20 s after the first; the third, which would wait 40 s, is
    # refused with that wait, and nothing was recorded for it
    assert second[0]
    assert 19 < second[1] <= 20
    assert not third[0]
    assert 39 < third[1] <= 40
    rows = conn.execute(
        "SELECT started_at FROM flow_rate_starts WHERE job = 'report.render' ORDER BY started_at"
    ).fetchall()
    assert len(rows) == 2
    assert (rows[1][0] - rows[0][0]).total_seconds() == 20
    # And another job's limit is its own
    assert _reserve(conn, "other.job", limit, max_wait=0) == (True, 0.0)


def test_no_window_ever_holds_more_starts_than_the_limit_across_drains(ledger_url: str) -> None:
    limit = RateLimit(per_second=8)
    starts_each = 8

    # When four drains, each on its own connection, start jobs as fast as the limit lets them
    def drain(_: int) -> int:
        started = refused = 0
        with psycopg.connect(ledger_url, autocommit=True) as conn:
            while started < starts_each:
                reserved, wait = _reserve(conn, "report.render", limit, max_wait=0.5)
                if not reserved:
                    refused += 1
                    time.sleep(wait)
                    continue
                time.sleep(wait)
                started += 1
        return refused

    _in_threads(4, drain)
    # Then every start is recorded once, on the database's clock
    with psycopg.connect(ledger_url, autocommit=True) as conn:
        starts = [
            row[0]
            for row in conn.execute(
                "SELECT started_at FROM flow_rate_starts WHERE job = 'report.render'"
                " ORDER BY started_at"
            )
        ]
    assert len(starts) == 4 * starts_each
    # And no one-second window, wherever it begins, holds more than the limit
    busiest = max(
        sum(1 for other in starts if start <= other < start + timedelta(seconds=1))
        for start in starts
    )
    assert busiest <= limit.limit
    # And every two starts are at least the limit's spacing apart, on the database's clock
    gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(starts)]
    assert min(gaps) >= limit.spacing_seconds


# --- Concurrency keys -------------------------------------------------------------------------


def _running_claim(conn: psycopg.Connection[Any], seconds: float) -> tuple[str, uuid.UUID]:
    """A running claim whose lease ends in ``seconds`` (a slot's holder); its key and token."""
    token = uuid.uuid4()
    key = f"report.render:{token}"
    conn.execute(
        "INSERT INTO job_claims (idem_key, state, message_id, job, effect, claim_token, "
        "lease_until) VALUES (%s, 'running', 'm', 'report.render', 'external', %s, "
        "now() + make_interval(secs => %s))",
        (key, token, seconds),
    )
    return key, token


def _take(
    conn: psycopg.Connection[Any],
    key: str,
    token: uuid.UUID,
    value: str = '["t1"]',
    *,
    max_running: int = 2,
    rate: RateLimit | None = None,
) -> limits.Admission:
    return limits.admit(
        conn,
        "report.render",
        token=token,
        idem_key=key,
        holder=str(token),
        concurrency=(value, max_running),
        rate=rate,
    )


def _slot_count(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT count(*) FROM flow_concurrency_slots").fetchone()
    return int(row[0]) if row else -1


def test_slots_per_key_value_expire_with_their_lease_and_free_when_their_claim_settles(
    conn: psycopg.Connection[Any],
) -> None:
    runs = {name: _running_claim(conn, 300) for name in ("first", "second", "third", "fourth")}
    first, second, third = (runs[name][1] for name in ("first", "second", "third"))
    keys = {token: key for key, token in runs.values()}

    def take(token: uuid.UUID, value: str = '["t1"]') -> bool:
        return all(_take(conn, keys[token], token, value)[:2])

    # Given a key value whose two slots are taken
    assert take(first)
    assert take(second)
    # Then a third run of that value is refused, another value is not limited by it
    assert not take(third)
    assert take(third, '["t2"]')
    conn.execute("DELETE FROM flow_concurrency_slots WHERE token = %s", (third,))
    # And the holder taking its slot again only renews it
    assert take(first)
    assert not take(third)
    # When a holder's drain is killed and its lease runs out
    conn.execute(
        "UPDATE flow_concurrency_slots SET lease_until = now() - interval '1 second'"
        " WHERE token = %s",
        (first,),
    )
    # Then its slot is free again
    assert take(third)
    # And a run's slot is free as soon as its claim is settled, by the settling statement
    assert flow.finish(conn, keys[second], second, {"ok": True}) is not None
    assert conn.execute(
        "SELECT count(*) FROM flow_concurrency_slots WHERE token = %s", (second,)
    ).fetchone() == (0,)
    assert take(runs["fourth"][1])
    # And a run whose lease is already over, or whose row holds another token, takes nothing
    late_key, late = _running_claim(conn, -1)
    assert not _take(conn, late_key, late, '["t3"]').slot_free
    assert not _take(conn, late_key, uuid.uuid4(), '["t3"]').slot_free


@pytest.mark.parametrize(
    "settle",
    [
        pytest.param(lambda c, k, t: flow.finish(c, k, t, None), id="done"),
        pytest.param(lambda c, k, t: flow.fail(c, k, t, "e"), id="failed"),
        pytest.param(lambda c, k, t: flow.flag_uncertain(c, k, t, "e"), id="uncertain"),
        pytest.param(
            lambda c, k, t: flow.defer(
                c, _work(k), attempts=1, error="e", delay_seconds=60, claim_token=t
            ),
            id="deferred",
        ),
    ],
)
def test_every_way_a_run_ends_frees_its_slot_in_the_same_statement(
    conn: psycopg.Connection[Any], settle: Callable[[Any, str, uuid.UUID], object]
) -> None:
    # Given a run holding the one slot of its key value
    key, token = _running_claim(conn, 300)
    assert all(_take(conn, key, token, max_running=1)[:2])
    # When its claim is settled, one way or another
    settle(conn, key, token)
    # Then the slot is gone and the next run of that value takes it
    assert _slot_count(conn) == 0
    other_key, other = _running_claim(conn, 300)
    assert all(_take(conn, other_key, other, max_running=1)[:2])


@pytest.mark.parametrize(
    "kind", [RunKind.SUCCEEDED, RunKind.PERMANENT, RunKind.UNCERTAIN, RunKind.TRANSIENT]
)
def test_a_delivery_s_settle_frees_the_slot_its_run_held(
    conn: psycopg.Connection[Any], kind: RunKind
) -> None:
    # Given a delivery's claim whose run took the one slot of its key value
    ledger = PostgresLedger(conn.info.dsn)
    try:
        request = claim_request("slot:1", job="report.render", lease_seconds=300)
        (decision,) = ledger.claim([request])
        assert decision.status is ClaimStatus.WON
        assert all(_take(conn, "slot:1", request.claim_token, max_running=1)[:2])
        # When the drain settles it, however its run ended
        ledger.settle(request, JobRun(kind, error="e", held_slot=True))
    finally:
        ledger.close()
    # Then the slot went with that same statement: the key value's next run takes it
    assert _slot_count(conn) == 0
    other_key, other = _running_claim(conn, 300)
    assert all(_take(conn, other_key, other, max_running=1)[:2])


def test_a_slot_and_a_start_are_taken_together_or_not_at_all(
    conn: psycopg.Connection[Any],
) -> None:
    limit = RateLimit(per_minute=3)  # one start every 20 s
    runs = [_running_claim(conn, 300) for _ in range(3)]
    # Given a run that took its key value's one slot and the rate's next start
    assert _take(conn, *runs[0], max_running=1, rate=limit) == (True, True, 0.0)
    # When a second run of that value asks: the key is full, so no start is reserved for it
    assert not _take(conn, *runs[1], max_running=1, rate=limit).slot_free
    # And when a run of another value asks but the next start is 20 s away (it may wait none)
    held_back = _take(conn, *runs[2], '["t2"]', max_running=1, rate=limit)
    # Then it is refused with that wait, and takes no slot
    assert held_back.slot_free
    assert not held_back.start_fits
    assert 19 < held_back.wait <= 20
    assert _slot_count(conn) == 1
    starts = conn.execute("SELECT count(*) FROM flow_rate_starts").fetchone()
    assert starts == (1,)


def test_slots_never_exceed_the_limit_across_drains(ledger_url: str) -> None:
    max_running, rounds = 2, 15
    guard = threading.Lock()
    running = 0
    most = 0
    held_in_db: list[int] = []

    # When six drains, each on its own connection, run jobs of one tenant as slots allow
    def drain(index: int) -> int:
        nonlocal running, most
        ran = 0
        with psycopg.connect(ledger_url, autocommit=True) as conn:
            while ran < rounds:
                key, token = _running_claim(conn, 300)
                if not _take(conn, key, token, max_running=max_running).slot_free:
                    time.sleep(0.001)
                    continue
                with guard:
                    running += 1
                    most = max(most, running)
                row = conn.execute("SELECT count(*) FROM flow_concurrency_slots").fetchone()
                held_in_db.append(int(row[0]) if row else -1)
                with guard:
                    running -= 1
                flow.finish(conn, key, token, None)
                ran += 1
        return ran

    ran = _in_threads(6, drain)
    # Then every drain ran its jobs, and never more than the limit at once
    assert ran == [rounds] * 6
    assert 1 <= most <= max_running
    assert max(held_in_db) <= max_running
    with psycopg.connect(ledger_url, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM flow_concurrency_slots").fetchone() == (0,)
