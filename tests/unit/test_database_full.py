"""A database at its connection limit is not a database down: the refusal is classified in one
place (``ledger.postgres``), the drain waits for its first connection within a bounded share of
its time, sheds the lanes it cannot open, and says so as a warning and a count, never an error.
"""

from __future__ import annotations

import logging
from typing import Any

import psycopg
import pytest
from fakes import FakeClock, InMemoryLedger, InMemoryQueue

from infrai_jobs.config.settings import DrainSettings
from infrai_jobs.errors import DatabaseBusy, LedgerUnavailable
from infrai_jobs.jobs.registry import Effect, JobContext, JobRegistry, JsonValue, Payload
from infrai_jobs.ledger.postgres import connect_to_ledger, ledger_error
from infrai_jobs.runtime.drain_service import (
    CONNECT_WAIT_SECONDS,
    DrainService,
    drain_features,
)

QUEUE = "billing-jobs"
URL = "postgresql://drain:Hunter2secret@db.example.com:5432/ledger"

# What PostgreSQL, PgBouncer and RDS Proxy answer when they are full, as libpq reports them.
FULL = [
    'connection failed: FATAL:  too many connections for role "drain"',
    "connection failed: FATAL:  sorry, too many clients already",
    "connection failed: FATAL:  remaining connection slots are reserved for non-replication "
    "superuser connections",
    'connection failed: FATAL:  too many connections for database "ledger"',
    "connection failed: ERROR:  no more connections allowed (max_client_conn)",
    "consuming input failed: ERROR:  query_wait_timeout",
    "connection failed: FATAL:  Timed-out waiting to acquire database connection",
]
DOWN = [
    'connection failed: connection to server at "10.0.0.5", port 5432 failed: Connection refused',
    'connection failed: FATAL:  password authentication failed for user "drain"',
    "connection failed: FATAL:  the database system is shutting down",
    "connection failed: timeout expired",
]


def refused(exc: psycopg.Error, monkeypatch: pytest.MonkeyPatch) -> LedgerUnavailable:
    """What ``connect_to_ledger`` raises when the driver refuses to connect with ``exc``."""

    def refuse(*args: Any, **kwargs: Any) -> psycopg.Connection[Any]:
        raise exc

    monkeypatch.setattr(psycopg, "connect", refuse)
    with pytest.raises(LedgerUnavailable) as raised:
        connect_to_ledger(URL)
    return raised.value


@pytest.mark.parametrize("text", FULL)
def test_a_refusal_for_being_full_is_database_busy_and_keeps_the_password_out(
    text: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given the driver's error for a full server, pooler or proxy
    exc = psycopg.OperationalError(f"{text} (password Hunter2secret)")
    # When it is translated, on connecting and on a statement
    for translated in (refused(exc, monkeypatch), ledger_error(exc, "claiming", URL)):
        # Then it is DatabaseBusy, still a LedgerUnavailable to everything that catches that
        assert isinstance(translated, DatabaseBusy)
        assert isinstance(translated, LedgerUnavailable)
        assert "Hunter2secret" not in str(translated)


@pytest.mark.parametrize("text", DOWN)
def test_a_database_down_or_refusing_the_login_is_not_busy(
    text: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for translated in (
        refused(psycopg.OperationalError(text), monkeypatch),
        ledger_error(psycopg.OperationalError(text), "claiming", URL),
    ):
        assert isinstance(translated, LedgerUnavailable)
        assert not isinstance(translated, DatabaseBusy)


def test_sqlstate_53300_is_busy_whatever_the_words() -> None:
    class TooManyConnections(psycopg.OperationalError):
        sqlstate = "53300"

    assert isinstance(ledger_error(TooManyConnections("plus de connexions"), "", URL), DatabaseBusy)


class FullLedger(InMemoryLedger):
    """The in-memory ledger behind a database that refuses the next ``refusals`` connections
    as full (every one when None), or as down (``busy=False``)."""

    def __init__(self, clock: FakeClock, refusals: int | None, *, busy: bool = True) -> None:
        super().__init__(clock)
        self.refusals, self.busy, self.tries = refusals, busy, 0

    def ping(self) -> None:
        self.tries += 1
        if self.refusals is None or self.tries <= self.refusals:
            error = DatabaseBusy if self.busy else LedgerUnavailable
            raise error('cannot connect: FATAL:  too many connections for role "drain"')
        super().ping()


class Invocation:
    """A drain invocation on the fakes with ``seconds`` left, its sleeps on the fake clock."""

    def __init__(self, ledger: FullLedger, clock: FakeClock, lanes: list[FullLedger]) -> None:
        self.clock, self.queue = clock, InMemoryQueue(clock)
        self.queue.ensure_queue(QUEUE, dlq=f"{QUEUE}-dlq")
        self.ran: list[str] = []
        registry = JobRegistry()

        @registry.job("test.db", effect=Effect.DATABASE, identity=("id",))
        def db_job(payload: Payload, ctx: JobContext) -> JsonValue:
            self.ran.append(ctx.idem_key)
            return None

        settings = DrainSettings(queue=QUEUE, drain_lanes=len(lanes) + 1)
        extra = iter(lanes)
        self.service = DrainService(
            settings=settings,
            queue=self.queue,
            ledger=ledger,  # type: ignore[arg-type]
            registry=registry,
            features=drain_features(settings, make_lane_ledger=lambda: next(extra)),
            sleep=clock.advance,
        )

    def run(self, seconds: float) -> tuple[dict[str, object], float]:
        """The summary, and the seconds the invocation spent."""
        started = self.clock.now()
        deadline = started + seconds
        summary = self.service.run(lambda: int((deadline - self.clock.now()) * 1000))
        return summary.as_dict(), self.clock.now() - started


def test_a_drain_waits_for_a_full_database_and_then_drains(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Given a database that refuses the drain's first three connections as full
    clock = FakeClock()
    kit = Invocation(FullLedger(clock, refusals=3), clock, lanes=[])
    kit.queue.publish_raw(QUEUE, {"job": "test.db", "id": 1})
    # When a drain with 120 s left runs
    with caplog.at_level(logging.INFO, logger="infrai_jobs"):
        summary, spent = kit.run(120)
    # Then it waited (said once, as a warning), connected, and ran the job
    assert summary["done"] == 1
    assert summary["database_full"] == 0
    assert kit.ran == ["test.db:1"]
    assert 0 < spent < 30
    waits = [r for r in caplog.records if getattr(r, "action", "") == "connection_wait"]
    assert [r.levelno for r in waits] == [logging.WARNING]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.parametrize(
    ("seconds", "share"), [(120, 30.0), (40, 10.0), (900, CONNECT_WAIT_SECONDS)]
)
def test_a_database_still_full_ends_the_drain_normally_within_a_quarter_of_its_time(
    seconds: float, share: float, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a database that refuses every connection as full, and a message waiting
    clock = FakeClock()
    kit = Invocation(FullLedger(clock, refusals=None), clock, lanes=[])
    kit.queue.publish_raw(QUEUE, {"job": "test.db", "id": 1})
    # When a drain runs
    with caplog.at_level(logging.INFO, logger="infrai_jobs"):
        summary, spent = kit.run(seconds)
    # Then it returns (no error) within its share of the time, having received nothing
    assert summary["stopped"] == "database_full"
    assert summary["database_full"] == 1
    assert summary["consumed"] == 0
    assert spent <= share
    # And the message still waits with all its deliveries
    assert kit.queue.stats(QUEUE).available_count == 1
    # And the log says so as warnings, with stable action words, never as an error
    actions = [getattr(r, "action", "") for r in caplog.records if r.levelno == logging.WARNING]
    assert actions == ["connection_wait", "database_full"]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_database_down_is_still_an_error_that_pages_and_is_not_waited_for() -> None:
    # Given a database that is down, not full
    clock = FakeClock()
    ledger = FullLedger(clock, refusals=None, busy=False)
    kit = Invocation(ledger, clock, lanes=[])
    # When a drain runs, Then it raises at once, as before
    with pytest.raises(LedgerUnavailable) as raised:
        kit.run(120)
    assert not isinstance(raised.value, DatabaseBusy)
    assert "received nothing" in str(raised.value)
    assert ledger.tries == 1


def test_lanes_the_database_refuses_are_shed_before_any_lane_consumes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Given four lanes, the database refusing two of the three extra lanes' connections
    clock = FakeClock()
    lanes = [FullLedger(clock, refusals=None), FullLedger(clock, 0), FullLedger(clock, None)]
    kit = Invocation(FullLedger(clock, refusals=0), clock, lanes=lanes)
    for n in range(30):
        kit.queue.publish_raw(QUEUE, {"job": "test.db", "id": n})
    # When the drain runs
    with caplog.at_level(logging.INFO, logger="infrai_jobs"):
        summary, _ = kit.run(120)
    # Then it ran every job with the two lanes it could open, and counted the two it shed
    assert summary["done"] == 30
    assert summary["lanes_shed"] == 2
    assert summary["stopped"] == "empty"
    # And the shed lanes never consumed: they were refused before anything was received
    assert [lane.tries for lane in lanes] == [1, 2, 1]
    shed = [r for r in caplog.records if getattr(r, "action", "") == "lanes_shed"]
    assert [(r.levelno, getattr(r, "lanes_shed", 0)) for r in shed] == [(logging.WARNING, 2)]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_fleet_lease_refused_as_full_stops_the_drain_as_full_not_as_an_outage() -> None:
    from fakes import InMemoryDrainFleet  # noqa: PLC0415

    class FullFleet(InMemoryDrainFleet):
        def join(self, queue: str, drain_id: str, **kwargs: Any) -> bool:
            raise DatabaseBusy("cannot connect: FATAL:  sorry, too many clients already")

    # Given a drain with fan-out on, whose fleet lease's connection the database refuses as full
    clock = FakeClock()
    kit = Invocation(FullLedger(clock, refusals=0), clock, lanes=[])
    settings = DrainSettings(queue=QUEUE, drain_max_concurrency=2)
    kit.service.features = drain_features(
        settings, make_lane_ledger=lambda: kit.service.ledger, fleet=FullFleet(clock)
    )
    kit.queue.publish_raw(QUEUE, {"job": "test.db", "id": 1})
    # When it runs, Then it stops as full, having received nothing, without raising
    summary, _ = kit.run(120)
    assert (summary["stopped"], summary["database_full"], summary["consumed"]) == (
        "database_full",
        1,
        0,
    )
