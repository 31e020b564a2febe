"""What the many-drains and lane benchmarks report is arithmetic over the runs' own records: the
claim latency, what a mode's drains did together, and each lane count's share per lane."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import lane_processes
import many_drains


def test_claim_latency_runs_from_the_last_read_before_the_claim() -> None:
    # Given an invoice read twice before its claim (a duplicate publish) and once after it,
    # and an invoice read once
    receives = [("inv_1", 10.000), ("inv_1", 10.040), ("inv_2", 10.100), ("inv_1", 10.500)]
    claims = {"inv_1": 10.050, "inv_2": 10.130}
    # When the latencies are worked out
    latencies, unmatched = many_drains.claim_latencies_ms(receives, claims)
    # Then each counts from its last read before the claim, and none is left without a read
    assert latencies == pytest.approx([10.0, 30.0])
    assert unmatched == 0


def test_a_claim_no_drain_read_first_is_counted_apart() -> None:
    latencies, unmatched = many_drains.claim_latencies_ms([("inv_1", 11.0)], {"inv_1": 10.0})
    assert latencies == []
    assert unmatched == 1


def _output(consumed: int, *, stopped: str = "empty", shed: int = 0, waits: int = 0) -> Any:
    return {
        "summary": {
            "consumed": consumed,
            "done": consumed,
            "duplicates": 0,
            "retried": 0,
            "failed": 0,
            "stopped": stopped,
            "database_full": int(stopped == "database_full"),
            "lanes_shed": shed,
        },
        "started": 100.0,
        "ended": 102.0,
        "cpu_s": 0.5,
        "actions": {"connection_wait": waits} if waits else {},
        "receives": [],
    }


def test_a_modes_figures_count_waits_sheds_full_drains_and_errors() -> None:
    # Given four drains of two lanes: one drained with a lane shed, one drained after waiting,
    # one gave up as full after waiting, and one exited with an error
    drains = [
        many_drains.drain_record(0, 0, _output(300, shed=1)),
        many_drains.drain_record(1, 0, _output(100, waits=1)),
        many_drains.drain_record(2, 0, _output(0, stopped="database_full", waits=1)),
        many_drains.drain_record(3, 1, None),
    ]
    # When the mode's figures are worked out over a 4 s run
    figures = many_drains.mode_figures(drains, lanes=2, wall_s=4.0)
    # Then each kind of drain is counted once, and throughput counts the drains that drained
    assert figures["drains_exited_with_error"] == 1
    assert figures["drains_that_waited"] == 2
    assert figures["drains_gave_up_full"] == 1
    assert figures["lanes_shed"] == 1
    assert (figures["drains_that_consumed"], figures["lanes_that_ran"]) == (2, 3)
    assert figures["messages_per_s"] == 100.0
    assert figures["per_drain_messages_per_s"] == {"median": 100.0, "min": 50.0, "max": 150.0}


def test_the_table_has_a_column_per_mode_and_a_row_per_figure() -> None:
    mode = {
        "figures": many_drains.mode_figures([many_drains.drain_record(0, 0, _output(10))], 2, 1),
        "claim_latency_ms": {"p50": 1.0, "p99": 2.0, "max": 3.0},
        "cpu": {
            "drains_s": 0.5,
            "emulator_s": 0.2,
            "postgres_s": 0.1,
            "machine_busy_pct": 40.0,
            "background_busy_pct": 3.0,
        },
        "verified": {"effects_once": 7, "unique_jobs": 7, "dead_lettered": 0, "queue_left": 0},
    }
    mode["verified"]["ok"] = True
    rows = many_drains.table_rows({"modes": {"direct": mode, "pgbouncer": mode}})
    assert rows[0] == ["", "direct", "pgbouncer"]
    assert all(len(row) == 3 for row in rows)
    assert ["jobs done exactly once", "7 of 7", "7 of 7"] in rows
    cpu = "0.5 / 0.2 / 0.1 / -"
    assert ["CPU s: drains / emulator / PostgreSQL / PgBouncer", cpu, cpu] in rows


def test_each_lane_count_is_set_against_one_lane_of_its_own_mode() -> None:
    # Given two rounds of one and four lanes as threads, and one round of four as processes
    runs = [
        {"mode": "threads", "lanes": 1, "messages_per_s": 400.0, "machine_busy_pct": 20.0},
        {"mode": "threads", "lanes": 1, "messages_per_s": 380.0, "machine_busy_pct": 30.0},
        {"mode": "threads", "lanes": 4, "messages_per_s": 1200.0, "machine_busy_pct": 90.0},
        {"mode": "threads", "lanes": 4, "messages_per_s": 1300.0, "machine_busy_pct": 100.0},
        {"mode": "processes", "lanes": 4, "messages_per_s": 1000.0, "cpu_ms_per_message": 1.0},
    ]
    for run in runs:
        run["verified"] = True
    # When they are summarised on a machine of two CPUs
    rows = {(r["mode"], r["lanes"]): r for r in lane_processes.lane_rows(runs, nproc=2)}
    # Then the medians are compared with one lane of the same mode, per lane too
    four = rows["threads", 4]
    assert (four["messages_per_s"], four["speedup"], four["per_lane"]) == (1250.0, 3.21, 0.802)
    assert four["machine_cpu_ms_per_message"] == pytest.approx(1.52)
    assert rows["processes", 4]["speedup"] is None  # no one-lane run of processes
    assert rows["processes", 4]["cpu_pct"] == 100.0  # 1 ms per message at 1,000 per second
    # And the CPUs are named as the limit: at 1.52 ms a message two CPUs carry about 1,316/s,
    # below the 1,404/s that 0.9 per lane needs
    verdict = lane_processes.cpu_verdict(list(rows.values()), 2, 0.9)
    assert "The CPUs are what stops it here" in verdict
