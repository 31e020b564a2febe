"""Backlog fan-out on real PostgreSQL and the emulator: the fleet's leases under concurrency, and
real ``infrai-jobs drain`` processes fanning out on a backlog without passing the cap.

The decisions themselves are unit-tested on the fakes (``tests/unit/test_fan_out_decisions.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import uuid
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import psycopg
import pytest
from drainkit import API_KEY, COUNTING_JOBS, QUEUE, Harness, harness

from infrai_jobs.drain.fleet import PostgresDrainFleet
from infrai_jobs.errors import SchemaNotMigrated
from infrai_local.sandbox.fan_out import CLI

# Every change to drain_leases records how many drains were alive right after it. Inserts and
# renewals of a slot happen under the queue's advisory lock, so each count is exact.
PEAK_DDL = """
CREATE TABLE fleet_sizes (live int NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE FUNCTION record_fleet_size() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO fleet_sizes (live)
        SELECT count(*) FROM drain_leases WHERE lease_until >= now();
    RETURN NULL;
END $$;
CREATE TRIGGER record_fleet_size AFTER INSERT OR UPDATE ON drain_leases
    FOR EACH STATEMENT EXECUTE FUNCTION record_fleet_size();
"""


@pytest.fixture
def kit(database_url: str) -> Iterator[Harness]:
    with harness(database_url) as running:
        yield running


def _fleet(url: str) -> PostgresDrainFleet:
    return PostgresDrainFleet(url)


def _live(url: str, queue: str) -> int:
    """Drains alive now, expired leases left out."""
    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT count(*) FROM drain_leases WHERE queue = %s AND lease_until >= now()", [queue]
        ).fetchone()
    return int(row[0]) if row else 0


def test_the_fleet_counts_joins_up_to_the_cap_and_adopts_reserved_slots(kit: Harness) -> None:
    with closing(_fleet(kit.database_url)) as fleet:
        # Given two drains alive under a cap of three
        first, second = str(uuid.uuid4()), str(uuid.uuid4())
        assert fleet.join(QUEUE, first, origin="schedule", lease_seconds=30, cap=3)
        assert fleet.join(QUEUE, second, origin="schedule", lease_seconds=30, cap=3)
        # When a fan-out reserves what a backlog wants (five)
        slots = fleet.reserve(QUEUE, wanted=5, cap=3, lease_seconds=30)
        # Then only the one missing slot is reserved, and a fourth drain is refused
        assert len(slots) == 1
        assert not fleet.join(QUEUE, str(uuid.uuid4()), origin="schedule", lease_seconds=30, cap=3)
        # But the started drain adopts its reserved slot, and renewing reports the fleet's size
        assert fleet.join(QUEUE, slots[0], origin="fan_out", lease_seconds=30, cap=3)
        assert fleet.renew(QUEUE, first, lease_seconds=30) == 3
        # And a drain that leaves frees its slot; another queue has a fleet of its own
        fleet.leave(QUEUE, [second])
        assert _live(kit.database_url, QUEUE) == 2
        assert _live(kit.database_url, "other-queue") == 0


def test_a_dead_drains_expired_lease_is_not_counted(kit: Harness) -> None:
    with closing(_fleet(kit.database_url)) as fleet:
        # Given a drain whose lease has already run out (it was killed and never renewed)
        assert fleet.join(QUEUE, str(uuid.uuid4()), origin="schedule", lease_seconds=-1, cap=1)
        # When another drain joins under a cap of one
        joined = fleet.join(QUEUE, str(uuid.uuid4()), origin="schedule", lease_seconds=30, cap=1)
        # Then it takes the dead one's place
        assert joined
        assert _live(kit.database_url, QUEUE) == 1


def test_a_fleet_on_an_unmigrated_database_names_the_missing_table_in_one_line(
    database_url: str,
) -> None:
    with closing(_fleet(database_url)) as fleet:
        # Given a database never migrated: no drain_leases table
        # When a drain renews its lease
        with pytest.raises(SchemaNotMigrated) as raised:
            fleet.renew(QUEUE, str(uuid.uuid4()), lease_seconds=30)
        # Then it says which table is missing, in the server's words only (not the statement
        # quoted after them), and the command to run
        assert str(raised.value) == (
            'a drain-lease statement: the ledger database is not migrated (relation "drain_leases" '
            "does not exist): run `infrai-jobs migrate` with DATABASE_URL pointing at it"
        )


def test_drains_reserving_at_the_same_moment_never_start_more_than_the_missing_ones(
    kit: Harness,
) -> None:
    # Given two drains alive under a cap of five, and six more deciding at the same moment
    setup = _fleet(kit.database_url)
    for _ in range(2):
        setup.join(QUEUE, str(uuid.uuid4()), origin="schedule", lease_seconds=30, cap=5)
    fleets = [_fleet(kit.database_url) for _ in range(6)]
    barrier = threading.Barrier(len(fleets))
    reserved: list[list[str]] = [[] for _ in fleets]

    def decide(index: int) -> None:
        barrier.wait()
        reserved[index] = fleets[index].reserve(QUEUE, wanted=50, cap=5, lease_seconds=30)

    threads = [threading.Thread(target=decide, args=(i,)) for i in range(len(fleets))]
    # When they all reserve what the backlog wants
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    # Then exactly the three missing slots were reserved, in all
    assert sum(len(slots) for slots in reserved) == 3
    assert _live(kit.database_url, QUEUE) == 5
    for fleet in (setup, *fleets):
        fleet.close()


def _drain_process(kit: Harness, jobs: Path, **env: str) -> subprocess.Popen[str]:
    environment = {
        **os.environ,
        "INFRAI_BASE_URL": kit.server.url,
        "INFRAI_API_KEY": API_KEY,
        "INFRAI_QUEUE": QUEUE,
        "DATABASE_URL": kit.database_url,
        **env,
    }
    return subprocess.Popen(
        [*CLI, "drain", "--jobs-path", str(jobs), "--time-budget-seconds", "120"],
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _fanned_out(summary: dict[str, Any]) -> int:
    """Drains started by this drain and, recursively, by the drains it started."""
    children = summary.get("fanned_out_drains", [])
    return int(summary["fanned_out"]) + sum(_fanned_out(child) for child in children)


def _consumed(summary: dict[str, Any]) -> int:
    children = summary.get("fanned_out_drains", [])
    return int(summary["consumed"]) + sum(_consumed(child) for child in children)


@pytest.mark.slow
def test_two_drains_fanning_out_on_a_backlog_never_exceed_the_cap(
    kit: Harness, tmp_path: Path
) -> None:
    # Given 800 jobs waiting, Infrai answering in 100 ms (about 50 messages a second per
    # drain), a cap of three drains and a fan-out time of one second
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    (jobs / "__init__.py").write_text(COUNTING_JOBS)
    with psycopg.connect(kit.database_url, autocommit=True) as conn:
        conn.execute(PEAK_DDL)
    for number in range(800):
        kit.client.publish(QUEUE, {"job": "test.db", "id": number})
    kit.faults(latency_ms=100)
    # When two `infrai-jobs drain` processes start at once
    processes = [
        _drain_process(kit, tmp_path, DRAIN_MAX_CONCURRENCY="3", DRAIN_FANOUT_AFTER_SECONDS="1")
        for _ in range(2)
    ]
    outputs = [process.communicate(timeout=180) for process in processes]
    kit.faults()
    assert [p.returncode for p in processes] == [0, 0], [err[-3000:] for _, err in outputs]
    summaries = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    # Then they fanned out: more drains ran than the two started by hand
    assert sum(_fanned_out(s) for s in summaries) >= 1
    # And never were more than three drains alive at once
    sizes = [row[0] for row in kit.sql("SELECT live FROM fleet_sizes")]
    assert sizes
    assert max(sizes) <= 3
    # And every job ran exactly once, the queue is empty, and every drain gave its lease back
    effects = kit.sql("SELECT idem_key, count(*) FROM test_effects GROUP BY idem_key")
    assert len(effects) == 800
    assert {count for _, count in effects} == {1}
    assert sum(_consumed(s) for s in summaries) >= 800
    stats = kit.client.stats(QUEUE)
    assert (stats.available_count, stats.in_flight_count) == (0, 0)
    assert kit.sql("SELECT count(*) FROM drain_leases") == [(0,)]
