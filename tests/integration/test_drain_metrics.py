"""Every outcome of docs/design.md's table reaches CloudWatch as its own EMF metric."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from aws_lambda_powertools import Metrics
from drainkit import QUEUE, Harness

from infrai_jobs.jobs.registry import Effect, JobContext, JsonValue, Payload
from infrai_jobs.runtime.observability import DRAIN_METRICS, OUTCOME_METRICS, record_drain


def _seed(
    kit: Harness,
    payload: dict[str, object],
    *,
    state: str,
    lease: datetime | None,
    effect: str,
    message_id: str = "qmsg_other",
) -> None:
    kit.sql(
        "INSERT INTO job_claims (idem_key, state, message_id, effect, claim_token, lease_until,"
        " payload_sha256) VALUES (%s, %s, %s, %s, gen_random_uuid(), %s, %s)",
        (
            kit.registry.derive(payload).idem_key,
            state,
            message_id,
            effect,
            lease,
            kit.registry.derive(payload).fingerprint,
        ),
    )


def test_each_outcome_emits_its_metric(kit: Harness, capsys: pytest.CaptureFixture[str]) -> None:
    now = datetime.now(UTC)

    def hijack(payload: Payload, ctx: JobContext) -> JsonValue:
        kit.sql(
            "UPDATE job_claims SET claim_token = %s WHERE idem_key = %s",
            (uuid.uuid4(), ctx.idem_key),
        )
        return None

    kit.registry.job("test.hijacked", effect=Effect.EXTERNAL, identity=("id",))(hijack)
    # Given one message for every row of the outcome table
    kit.publish({"job": "test.db", "id": "done-before"})
    kit.drain()
    kit.publish({"job": "test.db", "id": "failed-before", "mode": "permanent"})
    kit.drain()
    live = {"job": "receipt.send", "invoice_id": "live", "email": "a@example.com"}
    _seed(kit, live, state="running", lease=now + timedelta(hours=1), effect="external")
    expired = {"job": "receipt.send", "invoice_id": "expired", "email": "b@example.com"}
    _seed(kit, expired, state="running", lease=now - timedelta(hours=1), effect="external")
    taken = {"job": "digest.build", "tenant_id": "t", "period": "p"}
    _seed(kit, taken, state="running", lease=now - timedelta(hours=1), effect="external_idempotent")
    for payload in [
        {"job": "test.db", "id": "new"},  # done
        {"job": "test.db", "id": "done-before"},  # duplicate
        live,  # in_flight
        {"job": "test.db", "id": "new"},  # batch copy of "new"
    ]:
        kit.publish(payload)
    kit.drain()  # a batch of its own, so the copies below land in the next one
    for payload in [
        {"job": "test.db", "id": "flaky", "mode": "transient"},  # retry
        {"job": "test.db", "id": "perm", "mode": "permanent"},  # failed
        {"job": "test.db", "id": "failed-before", "mode": "permanent"},  # duplicate_failed
        expired,  # stuck
        {"job": "test.db", "id": "done-before", "extra": 1},  # conflict
        {"job": "no.such.job"},  # rejected
        {"job": "test.hijacked", "id": "1"},  # claim_lost
        taken,  # done through a lease takeover
    ]:
        kit.publish(payload)
    kit.faults(drop_response_rate=1.0, routes=["ack"])
    # When the queue is drained and the summary recorded as metrics
    summary = kit.drain()
    kit.faults()
    metrics = Metrics(namespace="InfraiJobsTest", service="drain")
    record_drain(metrics, QUEUE, summary, second_layer_hits=0)
    metrics.flush_metrics()
    (document,) = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line]
    # Then every outcome of this drain, and every total, is in the EMF document
    expected = {
        "OutcomeRetry": 1,
        "OutcomeFailed": 1,
        "OutcomeStuck": 1,
        "OutcomePayloadMismatch": 1,
        "OutcomeRejected": 1,
        "OutcomeClaimLost": 1,
        "OutcomeDuplicateFailed": 1,
        "OutcomeDone": 1,
        "LeaseTakeovers": 1,
    }
    for name, value in expected.items():
        assert document[name] == [float(value)], name
    assert document["AcksLost"] == [float(summary.ack_lost)]
    assert summary.ack_lost >= 1
    names = {m["Name"] for m in document["_aws"]["CloudWatchMetrics"][0]["Metrics"]}
    assert set(OUTCOME_METRICS.values()) | set(DRAIN_METRICS.values()) <= names
    assert document["_aws"]["CloudWatchMetrics"][0]["Dimensions"] == [["queue", "service"]]
