"""The alert decision table: rising edge, unchanged, reminder, falling, resolution."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from infrai_jobs.operations.alerting import (
    AlertState,
    AlertThresholds,
    Observation,
    Signal,
    StuckClaims,
    Verdict,
    compose,
    decide,
)

NOW = datetime(2026, 11, 29, 9, 0, tzinfo=UTC)
HOUR = 3600


@pytest.mark.parametrize(
    ("previous", "value", "expected"),
    [
        (AlertState(0, None), 0, Verdict.QUIET),
        (AlertState(0, None), 1, Verdict.ALERT),
        (AlertState(1, NOW - timedelta(minutes=5)), 3, Verdict.ALERT),
        (AlertState(3, NOW - timedelta(minutes=5)), 3, Verdict.QUIET),
        (AlertState(3, NOW - timedelta(hours=2)), 3, Verdict.REMIND),
        (AlertState(3, NOW - timedelta(minutes=5)), 2, Verdict.QUIET),
        (AlertState(3, NOW - timedelta(minutes=5)), 0, Verdict.RESOLVED),
        # A value seen before any alert was sent (e.g. publishing failed) is alerted now.
        (AlertState(2, None), 2, Verdict.REMIND),
    ],
)
def test_decide(previous: AlertState, value: int, expected: Verdict) -> None:
    assert decide(previous, value, NOW, HOUR) is expected


def test_subjects_fit_sns_and_resolved_messages_carry_no_next_steps() -> None:
    long_queue = "q" * 120
    subject, _ = compose(
        Verdict.ALERT,
        Observation(long_queue, Signal.DLQ, 5),
        before=0,
        stuck=StuckClaims(0, 0.0),
        thresholds=AlertThresholds(),
    )
    assert len(subject) <= 100
    subject, message = compose(
        Verdict.RESOLVED,
        Observation("ledger", Signal.STUCK, 0),
        before=2,
        stuck=StuckClaims(0, 0.0),
        thresholds=AlertThresholds(),
    )
    assert subject == "[infrai-jobs] RESOLVED: no stuck claims"
    assert "Next:" not in message
