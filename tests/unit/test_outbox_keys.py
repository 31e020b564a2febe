"""The outbox keys a row as the drain will key its message: the registry's rule for a job it
knows (schema included), else the producer's key; pure, no database."""

from __future__ import annotations

import pytest

from infrai_jobs.errors import InvalidPayload, KeyDerivationError, OutboxError
from infrai_jobs.jobs.registry import Effect, JobContext, JobRegistry, JsonValue, Payload
from infrai_jobs.outbox.writer import outbox_key


def registry() -> JobRegistry:
    jobs = JobRegistry()

    @jobs.job(
        "refund.issue",
        effect=Effect.DATABASE,
        identity=("refund_id",),
        fields={"refund_id": str, "amount_cents": int},
    )
    def issue(payload: Payload, ctx: JobContext) -> JsonValue:
        return None

    return jobs


def test_a_known_job_is_keyed_and_checked_exactly_as_the_drain_derives_it() -> None:
    jobs = registry()
    payload = {"job": "refund.issue", "refund_id": "r_1", "amount_cents": 5}
    body, key, job = outbox_key(payload, key=None, registry=jobs)
    assert key == jobs.derive(payload).idem_key == "refund.issue:r_1"
    assert (body, job) == (payload, "refund.issue")
    # A field of the wrong type is the drain's own refusal
    with pytest.raises(InvalidPayload, match="amount_cents"):
        outbox_key({**payload, "amount_cents": "5"}, key=None, registry=jobs)


def test_key_is_sent_as_the_producers_key_so_the_drain_agrees() -> None:
    jobs = registry()
    payload = {"job": "refund.issue", "refund_id": "r_1", "amount_cents": 5}
    body, key, _ = outbox_key(payload, key="refund-request-77", registry=jobs)
    assert key == "refund-request-77"
    assert body["_idempotency_key"] == "refund-request-77"
    # The drain, reading the published body, derives that very key
    assert jobs.derive(body).idem_key == key
    # And the caller's payload is left as it was
    assert "_idempotency_key" not in payload


def test_an_unknown_job_needs_a_key_and_a_contradicting_key_is_refused() -> None:
    body, key, job = outbox_key(
        {"job": "node.worker", "_idempotency_key": "n-1"}, key=None, registry=None
    )
    assert (key, job) == ("n-1", "node.worker")
    with pytest.raises(KeyDerivationError, match="registry="):
        outbox_key({"job": "node.worker"}, key=None, registry=None)
    with pytest.raises(KeyDerivationError, match="unknown job"):
        outbox_key({"job": "refund.isue", "refund_id": "r"}, key=None, registry=registry())
    with pytest.raises(OutboxError, match="differs"):
        outbox_key({"job": "x", "_idempotency_key": "a"}, key="b", registry=None)
    with pytest.raises(KeyDerivationError, match="not a JSON object"):
        outbox_key(["job"], key=None, registry=None)  # type: ignore[arg-type]
    assert body["_idempotency_key"] == "n-1"
