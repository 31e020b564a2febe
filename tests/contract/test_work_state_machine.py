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
from typing import Any

import psycopg
import pytest
from claim_requests import claim_request

from infrai_jobs.errors import ClaimChanged
from infrai_jobs.jobs.registry import Effect
from infrai_jobs.work import store as flow
from infrai_jobs.work.admin import ReconcileWrite, WorkStore
from infrai_jobs.work.ledger import PostgresLedger
from infrai_jobs.work.statements import END_LEASE
from infrai_jobs.work.states import (
    WORK_TRANSITIONS,
    ClaimRequest,
    ClaimRow,
    JobRun,
    RunKind,
    Transition,
)
from infrai_local.migrations import apply_migrations
from infrai_local.operator.verbs import OperatorLedger

KEY = "work:1"
ACTOR = "on-call@example.com"
NONE = "(none)"
# The queue's visibility timeout the rows here are judged by (the default).
VISIBILITY = 300


@dataclass
class Work:
    """One migrated ledger and the production code that changes its rows."""

    conn: psycopg.Connection[Any]
    ledger: PostgresLedger
    admin: WorkStore
    operator: OperatorLedger

    def row(self, key: str = KEY) -> ClaimRow | None:
        return flow.claim_of(self.conn, key, visibility=VISIBILITY)

    def state(self, key: str = KEY) -> str:
        row = self.row(key)
        return NONE if row is None else row.state

    def request(
        self, *, message_id: str = "qmsg_me", effect: Effect = Effect.EXTERNAL
    ) -> ClaimRequest:
        return claim_request(
            KEY, message_id=message_id, job="report.render", effect=effect, lease_seconds=300
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
        self.conn.execute(END_LEASE, {"key": KEY})


@contextmanager
def opened(database_url: str) -> Iterator[Work]:
    with psycopg.connect(database_url, autocommit=True) as conn:
        apply_migrations(conn)
        ledger = PostgresLedger(database_url)
        try:
            yield Work(conn, ledger, WorkStore(database_url), OperatorLedger(database_url))
        finally:
            ledger.close()


@pytest.fixture
def work(database_url: str) -> Iterator[Work]:
    with opened(database_url) as work:
        yield work


# Each transition's driver: it brings the key to the transition's source state, makes the
# transition through ``act`` (the method its table row names, resolved below), and answers
# (state before, state after).
Act = Callable[..., Any]
Driver = Callable[[Work, Act], tuple[str, str]]


def made_by(work: Work, method: str) -> Act:
    """The production method a table row names: ``PostgresLedger.x`` on the drain's ledger,
    ``WorkStore.x`` on the operators' store, ``store.x`` in ``infrai_jobs.work.store``."""
    owner, _, name = method.partition(".")
    target = {"PostgresLedger": work.ledger, "WorkStore": work.operator, "store": flow}[owner]
    found: Act = getattr(target, name)
    return found


def _through(work: Work, prepare: Callable[[], Any], act: Callable[[], Any]) -> tuple[str, str]:
    prepare()
    before = work.state()
    act()
    return before, work.state()


def _settle(kind: RunKind) -> Driver:
    def drive(work: Work, settle: Act) -> tuple[str, str]:
        request = work.claimed()
        before = work.state()
        settle(request, JobRun(kind, result={"ref": 1}, error="E: x"))
        return before, work.state()

    return drive


def _claim(work: Work, claim: Act) -> tuple[str, str]:
    return _through(work, lambda: None, lambda: claim([work.request()]))


def _claim_takeover(work: Work, claim: Act) -> tuple[str, str]:
    request = work.claimed(Effect.EXTERNAL_IDEMPOTENT)
    work.expire()
    before = work.state()
    (decision,) = claim([work.request(message_id="qmsg_next", effect=Effect.EXTERNAL_IDEMPOTENT)])
    assert decision.takeover
    assert work.row().claim_token != request.claim_token  # type: ignore[union-attr]
    return before, work.state()


def _claim_new_work(work: Work, claim: Act) -> tuple[str, str]:
    work.deferred(due=False)
    work.operator.cancel_deferred(KEY, actor=ACTOR)
    return _claim(work, claim)


def _flag_stuck(work: Work, flag_stuck: Act) -> tuple[str, str]:
    work.claimed()
    work.expire()
    before = work.state()
    flag_stuck({KEY: "claim lease expired while running"})
    assert work.row().error == "claim lease expired while running"  # type: ignore[union-attr]
    return before, work.state()


def _defer(work: Work, defer: Act) -> tuple[str, str]:
    request = work.claimed(Effect.EXTERNAL_IDEMPOTENT)
    before = work.state()
    item = flow.DeferredWork(KEY, "report.render", "external_idempotent", {"job": "r"}, "qmsg_me")
    outcome = defer(
        work.conn, item, attempts=1, error="e", delay_seconds=60, claim_token=request.claim_token
    )
    assert outcome is flow.DeferOutcome.DEFERRED
    return before, work.state()


def _take_back(work: Work, defer: Act) -> tuple[str, str]:
    item = flow.DeferredWork(KEY, "report.render", "external_idempotent", {"job": "r"}, "qmsg_1")
    return _through(
        work, lambda: None, lambda: defer(work.conn, item, attempts=3, error="e", delay_seconds=0)
    )


def _take_back_takeover(work: Work, release_for_take_back: Act) -> tuple[str, str]:
    work.claimed(Effect.EXTERNAL_IDEMPOTENT)
    work.expire()
    row = work.row()
    before = work.state()
    assert release_for_take_back(work.conn, row, visibility=VISIBILITY)
    return before, work.state()


def _take_due(work: Work, take_due: Act) -> tuple[str, str]:
    return _through(work, work.deferred, lambda: take_due(work.conn, 1, lease_seconds=60))


def _take_due_takeover(work: Work, take_due: Act) -> tuple[str, str]:
    old = work.taken()
    work.expire()
    before = work.state()
    (job,) = take_due(work.conn, 1, lease_seconds=60)
    assert job.claim_token != old
    return before, work.state()


def _holder(*args: Any, **kwargs: Any) -> Driver:
    def drive(work: Work, act: Act) -> tuple[str, str]:
        token = work.taken()
        before = work.state()
        assert act(work.conn, KEY, token, *args, **kwargs)
        return before, work.state()

    return drive


def _fail_and_hold(work: Work, fail: Act) -> tuple[str, str]:
    states = _holder("out of attempts", queue="jobs")(work, fail)
    held = work.conn.execute("SELECT count(*) FROM dead_letters WHERE idem_key = %s", (KEY,))
    assert held.fetchone() == (1,)
    return states


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


def _failed_claim(work: Work) -> ClaimRow:
    _settle(RunKind.PERMANENT)(work, work.ledger.settle)
    row = work.row()
    assert row is not None
    return row


def _probe(answer: str, stuck: Callable[[Work], ClaimRow], expected: ReconcileWrite) -> Driver:
    def drive(work: Work, apply_probe_answer: Act) -> tuple[str, str]:
        row = stuck(work)
        before = work.state()
        write = apply_probe_answer(row, answer, result={"ref": 1}, actor=ACTOR, note="")
        assert write is expected
        return before, work.state()

    return drive


def _operator(stuck: Callable[[Work], Any], *args: Any, **kwargs: Any) -> Driver:
    def drive(work: Work, change: Act) -> tuple[str, str]:
        stuck(work)
        before = work.state()
        change(*args, **kwargs)
        return before, work.state()

    return drive


def _waiting(work: Work) -> None:
    work.deferred(due=False)


def _prune(work: Work, prune: Act) -> tuple[str, str]:
    for key, state in (("p:done", "done"), ("p:failed", "failed"), ("p:cancelled", "cancelled")):
        work.conn.execute(
            "INSERT INTO job_claims (idem_key, state, message_id, payload, run_after,"
            " updated_at) VALUES (%s, %s, 'q', '{}', now(), now() - interval '40 days')",
            (key, state),
        )
    prune(older_than_days=30)
    left = work.conn.execute("SELECT count(*) FROM job_claims WHERE idem_key LIKE 'p:%%'")
    return "done, failed, cancelled", NONE if left.fetchone() == (0,) else "kept"


_AS_OPERATOR: dict[str, Any] = {"actor": ACTOR}
DRIVERS: dict[tuple[str, str, str], list[Driver]] = {
    ("claim", NONE, "running"): [_claim],
    ("claim (new work)", "cancelled", "running"): [_claim_new_work],
    ("claim (takeover)", "running", "running"): [_claim_takeover],
    ("flag stuck", "running", "running"): [_flag_stuck],
    ("settle done", "running", "done"): [_settle(RunKind.SUCCEEDED)],
    ("settle failed", "running", "failed"): [_settle(RunKind.PERMANENT)],
    ("release (transient)", "running", NONE): [_settle(RunKind.TRANSIENT)],
    ("flag uncertain", "running", "running"): [_settle(RunKind.UNCERTAIN)],
    ("defer", "running", "deferred"): [_defer],
    ("take back a dead letter", NONE, "deferred"): [_take_back],
    ("take back a dead letter (takeover)", "running", NONE): [_take_back_takeover],
    ("take due", "deferred", "running"): [_take_due],
    ("take due (takeover)", "running", "running"): [_take_due_takeover],
    ("begin", "running", "running"): [_holder()],
    ("flag uncertain (deferred run)", "running", "running"): [_holder("timed out")],
    ("postpone", "running", "deferred"): [_holder(error="e", delay_seconds=60)],
    ("finish", "running", "done"): [_holder({"r": 1})],
    ("fail (and hold a dead letter)", "running", "failed"): [_fail_and_hold],
    ("reconcile done", "running", "done"): [
        _probe("done", _stuck_message_claim, ReconcileWrite.SETTLED),
        _probe("done", _stuck_owned_run, ReconcileWrite.SETTLED),
    ],
    ("claims resolve --done", "running", "done"): [
        _operator(_stuck_message_claim, KEY, done=True, **_AS_OPERATOR),
        _operator(_stuck_owned_run, KEY, done=True, **_AS_OPERATOR),
    ],
    ("claims resolve --failed", "running", "failed"): [
        _operator(_stuck_message_claim, KEY, done=False, **_AS_OPERATOR),
        _operator(_stuck_owned_run, KEY, done=False, **_AS_OPERATOR),
    ],
    ("reconcile not done", "running", NONE): [
        _probe("not_done", _stuck_message_claim, ReconcileWrite.RELEASED)
    ],
    ("reconcile not done", "running", "deferred"): [
        _probe("not_done", _stuck_owned_run, ReconcileWrite.RELEASED)
    ],
    ("claims release", "running", NONE): [_operator(_stuck_message_claim, KEY, **_AS_OPERATOR)],
    ("claims release", "running", "deferred"): [_operator(_stuck_owned_run, KEY, **_AS_OPERATOR)],
    ("claims release", "failed", NONE): [_operator(_failed_claim, KEY, **_AS_OPERATOR)],
    ("redrive --reopen-failed", "failed", NONE): [
        _operator(_failed_claim, message_id="qmsg_me", fingerprint=None, actor=ACTOR, note="")
    ],
    ("claims run-now", "deferred", "deferred"): [
        _operator(_waiting, KEY, flow.Why("run_now", ACTOR))
    ],
    ("claims cancel", "deferred", "cancelled"): [
        _operator(_waiting, KEY, flow.Why("cancel", ACTOR))
    ],
    ("prune", "done, failed, cancelled", NONE): [_prune],
}


def _id(transition: Transition) -> str:
    return f"{transition.action}: {transition.source} -> {transition.target}"


def test_every_transition_in_the_table_has_a_driver_here() -> None:
    table = {(t.action, t.source, t.target) for t in WORK_TRANSITIONS}
    assert table == set(DRIVERS)


@pytest.mark.parametrize("transition", WORK_TRANSITIONS, ids=_id)
def test_each_transition_goes_from_its_source_to_its_target_by_the_method_it_names(
    database_url: str, transition: Transition
) -> None:
    for driver in DRIVERS[(transition.action, transition.source, transition.target)]:
        # Given a fresh ledger; When the transition is made by the method its row names
        with opened(database_url) as work:
            work.conn.execute("TRUNCATE job_claims, claim_history, dead_letters")
            before, after = driver(work, made_by(work, transition.method))
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
    why = flow.Why("release", ACTOR)
    assert flow.release(work.conn, row, why, visibility=VISIBILITY) is None
    # Then the row is exactly as its run left it, and nothing was recorded
    assert work.row() == row
    assert work.conn.execute("SELECT count(*) FROM claim_history").fetchone() == (0,)
