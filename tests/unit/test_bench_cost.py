"""The cost of a million jobs is arithmetic over a run's figures and the template's sizing."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import cost


def test_the_drains_sizing_is_read_from_the_template() -> None:
    shape = cost.DrainShape.from_template()
    # The values a deploy gets when it overrides nothing: if the template moves them, this
    # fails rather than the report quietly pricing a function that no longer exists
    assert shape == cost.DrainShape(memory_mb=512, timeout_s=240, batch_budget_ms=20000)


def test_a_lane_within_its_cpu_share_is_priced_at_its_measured_rate() -> None:
    shape = cost.DrainShape(memory_mb=1024, timeout_s=110, batch_budget_ms=10000)
    document = {
        "lanes": {"scaling": [{"lanes": 1, "messages_per_s": 500.0, "process_cpu_pct": 20}]}
    }
    [row] = cost.per_million(document, shape, cost.PRICES)["lanes"]
    # 2,000 s of drain at 1 GB; invocations of 100 useful seconds each
    assert row["gb_seconds"] == 2000.0
    assert row["requests"] == 20
    assert row["cpu_bound"] is False
    assert row["arm64_usd"] == pytest.approx(2000 * 0.0000133334 + 20 * 0.2 / 1e6, abs=1e-4)


def test_a_lane_that_needs_more_cpu_than_its_memory_buys_is_slowed_in_proportion() -> None:
    shape = cost.DrainShape(memory_mb=1769 // 2, timeout_s=240, batch_budget_ms=20000)
    document = {
        "lanes": {"scaling": [{"lanes": 4, "messages_per_s": 1000.0, "process_cpu_pct": 100}]}
    }
    [row] = cost.per_million(document, shape, cost.PRICES)["lanes"]
    assert row["cpu_bound"] is True
    assert row["messages_per_s"] == pytest.approx(500, rel=0.01)


def test_the_outbox_saves_the_publishes_of_retried_intents() -> None:
    document = {"lanes": {"scaling": [{"lanes": 1, "messages_per_s": 400.0}]}}
    prices = {**cost.PRICES, "infrai_publish": 0.00002, "producer_retry_rate": 0.1}
    result = cost.per_million(document, cost.DrainShape(512, 240, 20000), prices)
    assert result["infrai_publish_usd"] == 20.0
    assert result["outbox_saves"]["retried_intents"] == 100_000
    assert result["outbox_saves"]["publish_usd"] == 2.0
