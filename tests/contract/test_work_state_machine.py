"""The one state machine, driven on PostgreSQL: every row of ``WORK_TRANSITIONS`` (the table in
docs/design.md) is made by the function that makes it in production, from the state the table
names to the state it names, and every change anyone but the holder makes is refused while the
holder's lease is live. The in-memory fake's part of it (the claim statement's) is held to the
same rules by tests/contract/test_ledger_contract.py."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from infrai_jobs.errors import ClaimChanged
from infrai_jobs.flow import ledger as flow
from infrai_jobs.jobs.registry import Effect
from infrai_jobs.ledger.claim_ledger import PostgresLedger
from infrai_jobs.ledger.claims import (
    WORK_TRANSITIONS,
    ClaimRequest,
    ClaimRow,
    JobRun,
    RunKind,
    Transition,
)
from infrai_jobs.ledger.postgres import CLAIM_BY_KEY
from infrai_jobs.operations.claims_admin import ClaimsAdmin, ReconcileWrite
from infrai_local.migrations import apply_migrations
from infrai_local.operator import OperatorLedger

KEY = "work:1"
ACTOR = "on-call@example.com"
NONE = "(none)"


@dataclass
class Work:
    """One migrated ledger and the production code that changes its rows."""

    conn: psycopg.Connection[Any]
    ledger: PostgresLedger
    admin: ClaimsAdmin
    operator: OperatorLedger

    def row(self, key: str = KEY) -> ClaimRow | None:
        with self.conn.cursor(row_factory=dict_row) as cur:
            found = cur.execute(CLAIM_BY_KEY, {"key": key}).fetchone()
        return ClaimRow(**found) if found else None

    def state(self, key: str = KEY) -> str:
        row = self.row(key)
        return NONE if row is None else row.state

    def request(
        self, *, message_id: str = "qmsg_me", effect: Effect = Effect.EXTERNAL
    ) -> ClaimRequest:
        return ClaimRequest(
            idem_key=KEY,
            message_id=message_id,
            job="report.render",
            effect=effect,
            fingerprint="fp",
            lease_until=datetime.now(UTC) + timedelta(minutes=5),
        )

    def claimed(self, effect: Effect = Effect.EXTERNAL) -> ClaimRequest:
        request = self.request(effect=effect)
        (decision,) = self.ledger.claim([request])
        assert decision.status.value == "won", decision.detail
        return request

    def deferred(self, *, effect: str = "external_idempotent", due: bool = True) -> None:
        work = flow.DeferredWork(KEY, "report.render", effect, {"job": "report.render"}, "qmsg_1")
        delay = 0 if due else 3600
        assert flow.defer(self.conn, work, attempts=1, error="e", delay_seconds=delay) is (
            flow.DeferOutcome.DEFERRED
        )

    def taken(self, *, effect: str = "external_idempotent", lease: float = 60) -> uuid.UUID:
        self.deferred(effect=effect)
        (job,) = flow.take_due(self.conn, 1, lease_seconds=lease)
        assert job.claim_token is not None
        return job.claim_token

    def expire(self) -> None:
        self.conn.execute(
            "UPDATE job_claims SET lease_until = now() - interval '1 second' WHERE idem_key = %s",
            (KEY,),
        )


@contextmanager
def opened(database_url: str) -> Iterator[Work]:
    with psycopg.connect(database_url, autocommit=True) as conn:
        apply_migrations(conn)
        ledger = PostgresLedger(database_url)
        try:
            yield Work(conn, ledger, ClaimsAdmin(database_url), OperatorLedger(database_url))
        finally:
            ledger.close()


@pytest.fixture
def work(database_url: str) -> Iterator[Work]:
    with opened(database_url) as work:
        yield work


# Each transition's driver: it brings the key to the transition's source state, makes the
# transition through the production function, and answers (state before, state after).
Driver = Callable[[Work], tuple[str, str]]


def _through(work: Work, prepare: Callable[[], Any], act: Callable[[], Any]) -> tuple[str, str]:
    prepare()
    before = work.state()
    act()
    return before, work.state()


def _settle(kind: RunKind) -> Driver:
    def drive(work: Work) -> tuple[str, str]:
        request = work.claimed()
        before = work.state()
        work.ledger.settle(request, JobRun(kind, result={"ref": 1}, error="E: x"))
        return before, work.state()

    return drive


def _claim_takeover(work: Work) -> tuple[str, str]:
    request = work.claimed(Effect.EXTERNAL_IDEMPOTENT)
    work.expire()
    before = work.state()
    (decision,) = work.ledger.claim(
        [work.request(message_id="qmsg_next", effect=Effect.EXTERNAL_IDEMPOTENT)]
    )
    assert decision.takeover
    assert work.row().claim_token != request.claim_token  # type: ignore[union-attr]
    return before, work.state()


def _claim_new_work(work: Work) -> tuple[str, str]:
    work.deferred(due=False)
    work.operator.cancel_deferred(KEY, actor=ACTOR)
    return _through(work, lambda: None, lambda: work.ledger.claim([work.request()]))


def _defer(work: Work) -> tuple[str, str]:
    request = work.claimed(Effect.EXTERNAL_IDEMPOTENT)
    before = work.state()
    item = flow.DeferredWork(KEY, "report.render", "external_idempotent", {"job": "r"}, "qmsg_me")
    outcome = flow.defer(
        work.conn, item, attempts=1, error="e", delay_seconds=60, claim_token=request.claim_token
    )
    assert outcome is flow.DeferOutcome.DEFERRED
    return before, work.state()


def _take_due_takeover(work: Work) -> tuple[str, str]:
    old = work.taken()
    work.expire()
    before = work.state()
    (job,) = flow.take_due(work.conn, 1, lease_seconds=60)
    assert job.claim_token != old
    return before, work.state()


def _holder(act: Callable[[Work, uuid.UUID], Any]) -> Driver:
    def drive(work: Work) -> tuple[str, str]:
        token = work.taken()
        before = work.state()
        assert act(work, token)
        return before, work.state()

    return drive


def _fail_and_hold(work: Work, token: uuid.UUID) -> bool:
    failed = flow.fail(work.conn, KEY, token, "out of attempts", queue="jobs")
    held = work.conn.execute("SELECT count(*) FROM dead_letters WHERE idem_key = %s", (KEY,))
    return failed is not None and held.fetchone() == (1,)


def _stuck_message_claim(work: Work) -> ClaimRow:
    work.claimed()
    work.expire()
    row = work.row()
    assert row is not None
    return row


def _stuck_owned_run(work: Work) -> ClaimRow:
    token = work.taken(effect="external")
    assert flow.begin(work.conn, KEY, token)
    work.expire()
    row = work.row()
    assert row is not None
    return row


def _probe(answer: str, stuck: Callable[[Work], ClaimRow], expected: ReconcileWrite) -> Driver:
    def drive(work: Work) -> tuple[str, str]:
        row = stuck(work)
        before = work.state()
        write = work.admin.apply_probe_answer(row, answer, result={"ref": 1}, actor=ACTOR, note="")
        assert write is expected
        return before, work.state()

    return drive


def _operator(change: Callable[[OperatorLedger], Any], stuck: Callable[[Work], Any]) -> Driver:
    def drive(work: Work) -> tuple[str, str]:
        stuck(work)
        before = work.state()
        change(work.operator)
        return before, work.state()

    return drive


def _failed_claim(work: Work) -> None:
    _settle(RunKind.PERMANENT)(work)


def _prune(work: Work) -> tuple[str, str]:
    for key, state in (("p:done", "done"), ("p:failed", "failed"), ("p:cancelled", "cancelled")):
        work.conn.execute(
            "INSERT INTO job_claims (idem_key, state, message_id, payload, run_after,"
            " updated_at) VALUES (%s, %s, 'q', '{}', now(), now() - interval '40 days')",
            (key, state),
        )
    work.admin.prune(older_than_days=30)
    left = work.conn.execute("SELECT count(*) FROM job_claims WHERE idem_key LIKE 'p:%%'")
    return "done, failed, cancelled", NONE if left.fetchone() == (0,) else "kept"


DRIVERS: dict[tuple[str, str, str], list[Driver]] = {
    ("claim", NONE, "running"): [lambda work: _through(work, lambda: None, work.claimed)],
    ("claim (new work)", "cancelled", "running"): [_claim_new_work],
    ("claim (takeover)", "running", "running"): [_claim_takeover],
    ("settle done", "running", "done"): [_settle(RunKind.SUCCEEDED)],
    ("settle failed", "running", "failed"): [_settle(RunKind.PERMANENT)],
    ("release (transient)", "running", NONE): [_settle(RunKind.TRANSIENT)],
    ("flag uncertain", "running", "running"): [_settle(RunKind.UNCERTAIN)],
    ("defer", "running", "deferred"): [_defer],
    ("take back a dead letter", NONE, "deferred"): [
        lambda work: _through(work, lambda: None, work.deferred)
    ],
    ("take due", "deferred", "running"): [
        lambda work: _through(
            work, work.deferred, lambda: flow.take_due(work.conn, 1, lease_seconds=60)
        )
    ],
    ("take due (takeover)", "running", "running"): [_take_due_takeover],
    ("begin", "running", "running"): [_holder(lambda w, t: flow.begin(w.conn, KEY, t))],
    ("postpone", "running", "deferred"): [
        _holder(lambda w, t: flow.postpone(w.conn, KEY, t, error="e", delay_seconds=60))
    ],
    ("finish", "running", "done"): [_holder(lambda w, t: flow.finish(w.conn, KEY, t, {"r": 1}))],
    ("fail (and hold a dead letter)", "running", "failed"): [_holder(_fail_and_hold)],
    ("reconcile done, claims resolve --done", "running", "done"): [
        _probe("done", _stuck_message_claim, ReconcileWrite.SETTLED),
        _probe("done", _stuck_owned_run, ReconcileWrite.SETTLED),
        _operator(lambda op: op.resolve(KEY, done=True, actor=ACTOR), _stuck_message_claim),
    ],
    ("claims resolve --failed", "running", "failed"): [
        _operator(lambda op: op.resolve(KEY, done=False, actor=ACTOR), _stuck_message_claim),
        _operator(lambda op: op.resolve(KEY, done=False, actor=ACTOR), _stuck_owned_run),
    ],
    ("reconcile not done, claims release", "running", NONE): [
        _probe("not_done", _stuck_message_claim, ReconcileWrite.RELEASED),
        _operator(lambda op: op.release(KEY, actor=ACTOR), _stuck_message_claim),
    ],
    ("reconcile not done, claims release", "running", "deferred"): [
        _probe("not_done", _stuck_owned_run, ReconcileWrite.RELEASED),
        _operator(lambda op: op.release(KEY, actor=ACTOR), _stuck_owned_run),
    ],
    ("claims release, redrive --reopen-failed", "failed", NONE): [
        _operator(lambda op: op.release(KEY, actor=ACTOR), _failed_claim),
        _operator(
            lambda op: op.reopen_failed(message_id="qmsg_me", fingerprint=None, actor=ACTOR),
            _failed_claim,
        ),
    ],
    ("claims run-now", "deferred", "deferred"): [
        lambda work: _through(
            work,
            lambda: work.deferred(due=False),
            lambda: work.operator.run_deferred_now(KEY, actor=ACTOR),
        )
    ],
    ("claims cancel", "deferred", "cancelled"): [
        lambda work: _through(
            work,
            lambda: work.deferred(due=False),
            lambda: work.operator.cancel_deferred(KEY, actor=ACTOR),
        )
    ],
    ("prune", "done, failed, cancelled", NONE): [_prune],
}


def _id(transition: Transition) -> str:
    return f"{transition.action}: {transition.source} -> {transition.target}"


def test_every_transition_in_the_table_has_a_driver_here() -> None:
    table = {(t.action, t.source, t.target) for t in WORK_TRANSITIONS}
    assert table == set(DRIVERS)


@pytest.mark.parametrize("transition", WORK_TRANSITIONS, ids=_id)
def test_each_transition_goes_from_its_source_to_its_target(
    database_url: str, transition: Transition
) -> None:
    for driver in DRIVERS[(transition.action, transition.source, transition.target)]:
        # Given a fresh ledger; When the transition is made by the code that makes it
        with opened(database_url) as work:
            work.conn.execute("TRUNCATE job_claims, claim_history, dead_letters")
            before, after = driver(work)
        # Then it went from the state the table names to the state it names
        assert (before, after) == (transition.source, transition.target)


# --- Nobody but the holder changes work under a live lease -------------------------------------


def _live_message_claim(work: Work) -> ClaimRow:
    work.claimed()
    row = work.row()
    assert row is not None
    return row


def _live_owned_run(work: Work) -> ClaimRow:
    token = work.taken(effect="external", lease=600)
    assert flow.begin(work.conn, KEY, token)
    row = work.row()
    assert row is not None
    return row


@pytest.mark.parametrize("live", [_live_message_claim, _live_owned_run], ids=["claim", "owned"])
def test_no_probe_operator_or_drain_changes_work_under_a_live_lease(
    work: Work, live: Callable[[Work], ClaimRow]
) -> None:
    # Given work a run holds under a live lease
    row = live(work)
    # When a probe answers done and not done, an operator resolves and releases it (with the
    # token it read), and another drain looks for due work
    for answer in ("done", "not_done"):
        write = work.admin.apply_probe_answer(row, answer, actor=ACTOR, note="")
        assert write is ReconcileWrite.LEASE_LIVE
    for change in (
        lambda: work.operator.resolve(KEY, done=True, expected_token=row.claim_token, actor=ACTOR),
        lambda: work.operator.resolve(KEY, done=False, actor=ACTOR),
        lambda: work.operator.release(KEY, expected_token=row.claim_token, actor=ACTOR),
    ):
        with pytest.raises(ClaimChanged, match="live lease"):
            change()
    assert flow.take_due(work.conn, 10, lease_seconds=60) == []
    assert flow.release(work.conn, KEY, row.claim_token, actor=ACTOR) is None
    # Then the row is exactly as its run left it, and nothing was recorded
    assert work.row() == row
    assert work.conn.execute("SELECT count(*) FROM claim_history").fetchone() == (0,)
