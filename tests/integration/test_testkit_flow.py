"""The test kit runs the drain DrainFunction runs: a job's declared retry policy defers its
failure past Infrai's deliveries in the kit as in ``infrai-jobs drain``, and the kit has the
assertion for it. Fixture jobs of the test's own, on the kit's real PostgreSQL and emulator.
"""

from __future__ import annotations

import pytest

from infrai_jobs.jobs.policy import RetryPolicy
from infrai_jobs.jobs.registry import Effect, JobContext, JobRegistry, JsonValue, Payload
from infrai_local.testkit import JobKit, JobKitError

FLAKY = {"job": "kit.flaky", "id": "f1"}
PLAIN = {"job": "kit.plain", "id": "p1"}


def _call(payload: Payload, ctx: JobContext) -> JsonValue:
    return {"called": payload["id"]}


@pytest.fixture
def job_kit_registry() -> JobRegistry:
    registry = JobRegistry()
    registry.job(
        "kit.flaky",
        effect=Effect.EXTERNAL_IDEMPOTENT,
        identity=("id",),
        retry=RetryPolicy(attempts=5, first_delay_seconds=1, max_delay_seconds=1),
    )(_call)
    registry.job("kit.plain", effect=Effect.EXTERNAL_IDEMPOTENT, identity=("id",))(_call)
    return registry


def test_a_retry_policy_jobs_failure_is_deferred_in_the_kit_as_in_the_drain(
    job_kit: JobKit,
) -> None:
    # Given a job whose retry policy outlasts Infrai's three deliveries
    # When the kit is asked to see it retried into the DLQ
    with pytest.raises(JobKitError) as refused:
        job_kit.assert_retried_then_dead_lettered(FLAKY, raising=RuntimeError("down"))
    # Then it does not hold: the production drain deferred it, and the kit says so
    assert "deferred" in str(refused.value)
    assert job_kit.queue_counts() == (0, 0)


def test_the_kit_asserts_deferral_then_done(job_kit: JobKit) -> None:
    # Given the same job failing for its three deliveries, then its provider recovering
    # When the kit drains it, Then it is deferred (acked, never dead-lettered) and, when due,
    # runs once and is done
    claim = job_kit.assert_deferred_then_done(FLAKY, raising=RuntimeError("down"))
    assert claim.state == "done"
    assert job_kit.completed[job_kit.key(FLAKY)] == 1


def test_deferral_is_refused_for_a_job_without_a_retry_policy(job_kit: JobKit) -> None:
    # Given a job with no policy: its failures walk to the DLQ in three deliveries
    with pytest.raises(JobKitError) as refused:
        job_kit.assert_deferred_then_done(PLAIN, raising=RuntimeError("down"))
    assert "retry policy" in str(refused.value)
    # And the assertion that fits it holds
    job_kit.assert_retried_then_dead_lettered({**PLAIN, "id": "p2"}, raising=RuntimeError("x"))
