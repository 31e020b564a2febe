"""The drain's summary, its metrics and its log levels come from one table and stay in step."""

from __future__ import annotations

import logging
from dataclasses import fields

from infrai_jobs.drain.model import (
    FEATURE_COUNTERS,
    OUTCOME_BUCKETS,
    DrainSummary,
    merge_summaries,
)
from infrai_jobs.runtime.observability import DRAIN_METRICS, OUTCOME_METRICS
from infrai_jobs.work.outcomes import ACKED_OUTCOMES, OUTCOME_RULES, Outcome
from infrai_local.operator.drain_report import report_line, summary_lines

ATTENTION = {
    Outcome.RETRY,
    Outcome.FAILED,
    Outcome.STUCK,
    Outcome.CONFLICT,
    Outcome.REJECTED,
    Outcome.CLAIM_LOST,
    Outcome.LEDGER_UNAVAILABLE,
}


def _counts(summary: DrainSummary) -> dict[str, int]:
    return {k: v for k, v in summary.as_dict().items() if isinstance(v, int)}


def _one_of_everything() -> DrainSummary:
    """A lane's summary with one message per summary total, and every other count at 1."""
    core = {f.name for f in fields(DrainSummary)} - {"outcomes", "counters", "stopped"}
    summary = DrainSummary(**dict.fromkeys(core, 1))
    for bucket in OUTCOME_BUCKETS:
        outcome = next(o for o, rule in OUTCOME_RULES.items() if rule.bucket == bucket)
        summary.outcomes[outcome.value] += 1
    summary.counters.update(dict.fromkeys(FEATURE_COUNTERS, 1))
    return summary


def test_every_count_of_the_summary_is_a_metric_and_merges_across_lanes() -> None:
    # Given a lane's summary with every count that has a metric at 1
    one = _one_of_everything()
    assert set(_counts(one).values()) == {1}
    # Then each count in its JSON is a metric, in the metrics' order, and every outcome has
    # its own
    assert list(_counts(one)) == list(DRAIN_METRICS)
    assert set(OUTCOME_METRICS) == {o.value for o in Outcome}
    # And two lanes merged add up, count for count
    merged = merge_summaries([one, one])
    assert _counts(merged) == dict.fromkeys(_counts(one), 2)


def test_the_summary_keeps_its_keys_whichever_features_are_off() -> None:
    # Given an empty summary: no feature on, nothing drained
    # When it is reported
    reported = DrainSummary().as_dict()
    # Then every count is there at 0, the features' included, then the outcomes and the reason
    assert list(reported) == [*DRAIN_METRICS, "outcomes", "stopped"]
    assert _counts(DrainSummary()) == dict.fromkeys(DRAIN_METRICS, 0)


def test_every_outcome_has_a_bucket_and_what_needs_a_look_is_warning_or_error() -> None:
    assert set(OUTCOME_RULES) == set(Outcome)
    for outcome, rule in OUTCOME_RULES.items():
        assert rule.bucket in _counts(DrainSummary()), outcome
        if outcome in ATTENTION:
            assert rule.level >= logging.WARNING, outcome
        if outcome in ACKED_OUTCOMES:
            assert rule.level == logging.INFO, outcome
    assert OUTCOME_RULES[Outcome.RETRY].bucket == "retried"
    assert OUTCOME_RULES[Outcome.FAILED].bucket == "failed"


def test_a_problem_line_names_outcome_key_message_delivery_and_reason() -> None:
    record = logging.LogRecord(
        "infrai_jobs.drain.loop", logging.WARNING, "", 0, "message %s", ("retry",), None
    )
    record.__dict__.update(
        action="retry",
        idem_key="test.db:a",
        message_id="qmsg_1",
        delivery_count=2,
        job="test.db",
        acked=False,
        detail="RuntimeError: down\n  for now",
    )
    assert report_line(record) == (
        "retry              key=test.db:a message_id=qmsg_1 delivery=2 "
        "reason=RuntimeError: down for now"
    )


def test_a_warning_about_no_one_message_keeps_its_sentence_and_fields() -> None:
    record = logging.LogRecord(
        "infrai_jobs.queue.client", logging.WARNING, "", 0, "retrying an Infrai call", (), None
    )
    record.__dict__.update(action="http_retry", call="ack", code="INTERNAL", attempt=1)
    assert report_line(record) == (
        "http_retry         call=ack code=INTERNAL attempt=1 (retrying an Infrai call)"
    )


def test_the_summary_in_words_tells_retries_from_failures() -> None:
    summary = DrainSummary(consumed=4, batches=1, stopped="empty")
    summary.outcomes.update({"done": 1, "retry": 2, "failed": 1})
    first, *notes = summary_lines(summary)
    assert "1 done, 0 duplicate(s), 2 retried, 1 failed, 0 parked" in first
    assert any("2 retried: the handler raised" in n for n in notes)
    assert any("1 failed or parked" in n for n in notes)


def test_every_outcome_keeps_one_label_in_the_summary_and_the_outcomes() -> None:
    # Given the outcome table
    for outcome, rule in OUTCOME_RULES.items():
        # When an outcome counts under the summary's duplicates
        # Then its own label says it is a duplicate (of what), as its metric's name does
        if rule.bucket == "duplicates":
            assert outcome.value.startswith("duplicate_"), outcome
            assert rule.metric == "Outcome" + outcome.value.title().replace("_", ""), outcome
    # And when a drain's summary holds a copy acked behind a live claim and a parked copy
    summary = DrainSummary(consumed=3, batches=1, acked=2)
    summary.outcomes.update(
        {
            Outcome.DONE.value: 1,
            Outcome.IN_FLIGHT.value: 1,
            Outcome.BATCH_DUPLICATE.value: 1,
        }
    )
    first, *_ = summary_lines(summary)
    # Then the words name each total's outcomes by the labels of the JSON's "outcomes"
    assert "1 duplicate(s) (1 duplicate_in_flight)" in first
    assert "1 parked (1 batch_duplicate)" in first
    assert summary.as_dict()["outcomes"] == {
        "batch_duplicate": 1,
        "done": 1,
        "duplicate_in_flight": 1,
    }


def test_the_summary_in_words_shows_deferred_work_whenever_there_is_any() -> None:
    # Given a drain whose ten messages were all deferred by flow control, and acked
    deferring = DrainSummary(consumed=10, batches=1, acked=10)
    deferring.outcomes.update({"deferred": 10})
    # When it is put in words
    first, *notes = summary_lines(deferring)
    # Then the first line counts them beside the other totals, and a note says who runs them
    assert "0 done, 0 duplicate(s), 0 retried, 0 failed, 0 parked, 10 deferred; 10 acked" in first
    assert any("10 deferred: the ledger holds them" in n for n in notes)


def test_the_summary_in_words_counts_the_deferred_runs_and_rate_limit_waits() -> None:
    # Given a drain that consumed nothing but ran three due deferred jobs (two done, one out of
    # attempts) and waited twice for a rate limit
    summary = DrainSummary(consumed=0, batches=1, stopped="empty")
    summary.counters.update(
        {"deferred_ran": 3, "deferred_done": 2, "deferred_failed": 1, "rate_limit_waits": 2}
    )
    # When it is put in words
    lines = summary_lines(summary)
    # Then the deferred runs and the waits are told, not hidden behind "0 done"
    assert any(
        "3 deferred job(s) run from the ledger: 2 done, 1 failed for good" in line for line in lines
    )
    assert any("2 rate-limit wait(s)" in line for line in lines)


def test_the_summary_in_words_says_nothing_of_deferral_when_there_was_none() -> None:
    summary = DrainSummary(consumed=1, batches=1, acked=1)
    summary.outcomes.update({"done": 1})
    assert not any("deferred" in line or "rate-limit" in line for line in summary_lines(summary))
