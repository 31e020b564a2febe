"""The second layer (Powertools idempotency) behind the ledger, through whole drains.

Real PostgreSQL and the emulator over HTTP (drainkit), with the store either DynamoDB (moto's
``mock_aws``, the table created as the template declares it) or a real Redis: ``REDIS_URL`` when
set, else a ``redis-server`` started on a free loopback port (the ``redis_url`` fixture of
tests/integration/conftest.py); with neither, the tests fail and say so. Every Redis key these
tests write carries a prefix of their own, and only those keys are deleted afterwards: a shared
Redis is never flushed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import boto3
import pytest
import redis
import urllib3
from cfnlint.decode import cfn_yaml  # type: ignore[import-untyped]
from drainkit import API_KEY, QUEUE, Harness, RecordingAlerter
from moto import mock_aws

from infrai_jobs.aws.second_layer import (
    KEY_PREFIX,
    SecondLayer,
    dynamodb_store,
    record_expiry_seconds,
    redis_store,
)
from infrai_jobs.config.settings import AlertSettings, DrainSettings
from infrai_jobs.drain.features import SecondLayerFeature
from infrai_jobs.drain.loop import drain
from infrai_jobs.drain.model import DrainConfig, DrainFeature
from infrai_jobs.errors import ConfigurationError, EffectUncertain, SecondLayerUnavailable
from infrai_jobs.jobs.registry import Effect, JobContext, JsonValue, Payload
from infrai_jobs.operations.reconcile import Reconciler
from infrai_jobs.queue.client import HttpRetryPolicy, InfraiClient
from infrai_jobs.runtime.drain_service import DrainService
from infrai_jobs.runtime.factory import make_alert_check, make_effect_guard
from infrai_jobs.work.admin import WorkStore
from infrai_jobs.work.ledger import PostgresLedger
from infrai_local.operator.verbs import still_stuck

ROOT = Path(__file__).resolve().parents[2]
RECEIPT = {"job": "receipt.send", "invoice_id": "inv_1", "email": "a@example.com"}
RECEIPT_KEY = "receipt.send:inv_1"
TABLE = "infrai-jobs-idempotency-test"
# What Lambda would report as the time left; in-progress records expire after it.
INVOCATION_MS = 120_000
EXPIRY = record_expiry_seconds(30)


class FakeLambdaContext:
    def get_remaining_time_in_millis(self) -> int:
        return INVOCATION_MS


# --- Stores -----------------------------------------------------------------------------------


@dataclass
class Backend:
    """One second-layer store; every round trip to it is appended to ``calls``."""

    name: str
    guard: SecondLayer
    calls: list[str] = field(default_factory=list)

    @property
    def features(self) -> tuple[SecondLayerFeature]:
        """The drain's features with this store's second layer on."""
        return (SecondLayerFeature(self.guard),)


def fake_aws_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_SESSION_TOKEN": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(name, value)


def create_table_as_the_template_does(client: Any, name: str) -> None:
    template = cfn_yaml.load(str(ROOT / "framework.yaml"))
    props = json.loads(json.dumps(template["Resources"]["IdempotencyTable"]["Properties"]))
    client.create_table(
        TableName=name,
        BillingMode=props["BillingMode"],
        AttributeDefinitions=props["AttributeDefinitions"],
        KeySchema=props["KeySchema"],
    )
    client.update_time_to_live(
        TableName=name, TimeToLiveSpecification=props["TimeToLiveSpecification"]
    )


class CountingRedis:
    """A Redis client that records each command Powertools sends (it uses only these three)."""

    def __init__(self, client: redis.Redis, calls: list[str]) -> None:
        self.client = client
        self.calls = calls

    def get(self, name: str) -> Any:
        self.calls.append("GET")
        return self.client.get(name)

    def set(self, name: str, value: str, ex: int | None = None, nx: bool = False) -> Any:
        self.calls.append("SET NX" if nx else "SET")
        return self.client.set(name, value, ex=ex, nx=nx)

    def delete(self, *names: str) -> Any:
        self.calls.append("DEL")
        return self.client.delete(*names)


@pytest.fixture(params=["dynamodb", "redis"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Backend]:
    calls: list[str] = []
    if request.param == "dynamodb":
        fake_aws_credentials(monkeypatch)
        with mock_aws():
            client = boto3.client("dynamodb")
            create_table_as_the_template_does(client, TABLE)
            client.meta.events.register(
                "before-call.dynamodb", lambda model, **_: calls.append(model.name)
            )
            guard = SecondLayer(dynamodb_store(TABLE, client=client), expires_after_seconds=EXPIRY)
            guard.start_invocation(FakeLambdaContext().get_remaining_time_in_millis)
            yield Backend("dynamodb", guard, calls)
        return
    # A prefix of this test's own: its keys never meet another run's on a shared server.
    prefix = f"{KEY_PREFIX}-test-{uuid.uuid4().hex}"
    client = redis.Redis.from_url(request.getfixturevalue("redis_url"))
    store = redis_store(client=CountingRedis(client, calls))
    guard = SecondLayer(store, expires_after_seconds=EXPIRY, key_prefix=prefix)
    guard.start_invocation(FakeLambdaContext().get_remaining_time_in_millis)
    try:
        yield Backend("redis", guard, calls)
    finally:
        for key in client.scan_iter(match=f"{prefix}#*"):
            client.delete(key)
        client.close()


def forget_ledger_row(kit: Harness, key: str) -> None:
    """What a restore from an older backup, or a prune that came too early, does to a claim."""
    kit.sql("DELETE FROM job_claims WHERE idem_key = %s", (key,))


def record_id(idem_key: str, prefix: str = KEY_PREFIX) -> str:
    """The store's key for a job: the fixed prefix and the SHA-256 of the key as JSON."""
    return f"{prefix}#{hashlib.sha256(json.dumps(idem_key).encode()).hexdigest()}"


def mails(kit: Harness) -> int:
    count: int = kit.sink.state.snapshot()["mail_effects"]
    return count


# --- What the second layer protects against ----------------------------------------------------


def test_a_lost_ledger_row_does_not_repeat_the_effect(
    kit: Harness, backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a receipt sent once through the second layer
    kit.publish(RECEIPT)
    first = kit.drain(features=backend.features)
    assert first.outcomes == {"done": 1}
    sent = kit.row(RECEIPT_KEY)
    assert sent is not None
    assert mails(kit) == 1
    # When its ledger row is lost and the producer's retry arrives
    forget_ledger_row(kit, RECEIPT_KEY)
    kit.publish(RECEIPT)
    caplog.set_level(logging.INFO, logger="infrai_jobs")
    again = kit.drain(features=backend.features)
    # Then no second mail is sent: the claim is done with the first call's result, and acked
    assert mails(kit) == 1
    row = kit.assert_settled(again, RECEIPT_KEY, outcome="done", acked=1, state="done")
    assert row.result == sent.result
    # And the replay is visible: counted, and logged with the key
    assert backend.guard.take_hits() == 1
    assert backend.guard.take_hits() == 0
    hits = [r for r in caplog.records if getattr(r, "action", "") == "second_layer_hit"]
    assert [getattr(r, "idem_key", None) for r in hits] == [RECEIPT_KEY]


def test_an_uncertain_effect_is_not_retried_through_the_second_layer(
    kit: Harness, backend: Backend
) -> None:
    # Given an external job whose call may or may not have happened: stuck, effect once
    kit.publish({"job": "test.ext", "id": "x", "mode": "uncertain"})
    assert kit.drain(features=backend.features).outcomes == {"stuck": 1}
    assert kit.external_effects("test.ext:x") == 1
    # When its ledger row is lost and the message is delivered again
    forget_ledger_row(kit, "test.ext:x")
    kit.advance()
    summary = kit.drain(features=backend.features)
    # Then it stays stuck for a human, unacked, and the effect did not run again
    row = kit.assert_settled(summary, "test.ext:x", outcome="stuck", acked=0, state="running")
    assert kit.external_effects("test.ext:x") == 1
    assert "replayed by the second layer" in (row.error or "")
    assert backend.guard.take_hits() == 1


def test_concurrent_duplicates_run_the_effect_once(
    kit: Harness, backend: Backend, database_url: str
) -> None:
    # Given an external job whose call is still running when its ledger row is lost
    entered, release = threading.Event(), threading.Event()

    def slow_mail(payload: Payload, ctx: JobContext) -> JsonValue:
        kit.sql("INSERT INTO test_external_effects VALUES (%s)", (ctx.idem_key,))
        entered.set()
        assert release.wait(30), "the test never released the first call"
        return {"sent": payload["id"]}

    kit.registry.job("test.slow", effect=Effect.EXTERNAL, identity=("id",))(slow_mail)
    kit.publish({"job": "test.slow", "id": "1"})
    first: dict[str, Any] = {}
    runner = threading.Thread(
        target=lambda: first.update(kit.drain(features=backend.features).as_dict())
    )
    runner.start()
    try:
        assert entered.wait(30), "the first drain never reached the effect"
        forget_ledger_row(kit, "test.slow:1")
        kit.publish({"job": "test.slow", "id": "1"})
        # When a second drain, with its own connections, claims the copy meanwhile
        client = InfraiClient(kit.server.url, "test-key", retry=HttpRetryPolicy(base_delay=0.01))
        ledger = PostgresLedger(database_url)
        try:
            config = DrainConfig(queue=QUEUE, features=backend.features)
            second = drain(client, ledger, kit.registry, config, lambda: INVOCATION_MS)
        finally:
            ledger.close()
            client.close()
    finally:
        release.set()
        runner.join(60)
    # Then the second copy did not run the effect: its claim was released for a retry
    assert second.outcomes == {"retry": 1}
    # And the first call finished, but its claim was gone, so it was not acked either
    assert first["outcomes"] == {"claim_lost": 1}
    # And once both are redelivered, the job is done from the recorded result, effect once
    kit.advance()
    final = kit.drain(features=backend.features)
    assert final.outcomes == {"done": 1, "duplicate_in_flight": 1}
    assert kit.client.stats(QUEUE).message_count == 0
    assert kit.external_effects("test.slow:1") == 1
    row = kit.row("test.slow:1")
    assert row is not None
    assert (row.state, row.result) == ("done", {"sent": "1"})


def test_same_key_different_work_fails_permanently_without_the_effect(
    kit: Harness, backend: Backend
) -> None:
    # Given a receipt sent to one address, whose ledger row was then lost
    kit.publish(RECEIPT)
    kit.drain(features=backend.features)
    forget_ledger_row(kit, RECEIPT_KEY)
    # When the same invoice's receipt arrives for another address (same key, other work)
    kit.publish({**RECEIPT, "email": "b@example.com"})
    summary = kit.drain(features=backend.features)
    # Then nothing is sent; the claim fails with the reason and the message goes to the DLQ
    assert mails(kit) == 1
    row = kit.assert_settled(summary, RECEIPT_KEY, outcome="failed", acked=0, state="failed")
    assert "second layer: same key, different work" in (row.error or "")


def test_a_transient_failure_leaves_no_record_so_the_retry_runs(
    kit: Harness, backend: Backend
) -> None:
    # Given a job that failed before its effect (the handler's transient error)
    kit.publish({"job": "test.ext", "id": "t", "mode": "transient"})
    assert kit.drain(features=backend.features).outcomes == {"retry": 1}
    # When it is retried and succeeds
    kit.publish({"job": "test.ext", "id": "t"})
    summary = kit.drain(features=backend.features)
    # Then it ran: Powertools dropped its record when the first call raised
    assert summary.outcomes.get("done") == 1
    assert kit.external_effects("test.ext:t") == 1
    assert backend.guard.take_hits() == 0


def test_an_operator_can_forget_an_uncertain_record_to_retry_the_job(
    kit: Harness, backend: Backend
) -> None:
    # Given a receipt whose first call timed out (uncertain), then succeeds when called again
    calls: list[str] = []

    def flaky_mail(payload: Payload, ctx: JobContext) -> JsonValue:
        calls.append(ctx.idem_key)
        if len(calls) == 1:
            raise EffectUncertain("mail provider timed out")
        return {"sent": payload["id"]}

    kit.registry.job("test.flaky", effect=Effect.EXTERNAL, identity=("id",))(flaky_mail)
    kit.publish({"job": "test.flaky", "id": "1"})
    assert kit.drain(features=backend.features).outcomes == {"stuck": 1}
    # When an operator checked the provider, releases the claim and forgets the record
    forget_ledger_row(kit, "test.flaky:1")
    backend.guard.forget("test.flaky:1")
    kit.advance()
    summary = kit.drain(features=backend.features)
    # Then the redelivery runs the job again and it is done
    assert summary.outcomes == {"done": 1}
    assert len(calls) == 2


def uncertain_receipt(kit: Harness, invoice: str, features: Sequence[DrainFeature]) -> None:
    """A receipt for ``invoice`` drained while its provider answers 503 without sending:
    uncertain, stuck, stored so by the second layer's ``features``; then its lease runs out."""
    control = urllib3.PoolManager()
    faults = f"{kit.sink.url}/_sink/faults"
    control.request("POST", faults, json={"fail_rate": 1.0})
    kit.publish({"job": "receipt.send", "invoice_id": invoice, "email": "ada@example.com"})
    assert kit.drain(features=features).outcomes == {"stuck": 1}
    control.request("POST", faults, json={})
    kit.sql("UPDATE job_claims SET lease_until = now() - interval '1 minute'")


def test_a_reconcile_release_drops_the_uncertain_record_so_the_retry_runs(
    kit: Harness, backend: Backend, database_url: str
) -> None:
    # Given a receipt whose provider answered 503 without sending: uncertain, stored as such,
    # and time passes: the lease of the delivery that flagged it is over
    uncertain_receipt(kit, "inv_503", backend.features)

    # When a reconcile pass, given the second layer's forget (as the CLI is), asks the provider
    reconciler = Reconciler(
        WorkStore(database_url), kit.registry, actor="on-call", forget=backend.guard.forget
    )
    report = reconciler.run_all(threshold_seconds=900)

    # Then the provider has no trace of it: the claim is released and the record dropped, so
    # the redelivery sends the receipt once instead of being parked stuck again
    assert [(o.answer, o.action) for o in report.outcomes] == [("not_done", "released")]
    kit.advance()
    assert kit.drain(features=backend.features).outcomes == {"done": 1}
    assert kit.sink.state.snapshot()["mails"] == {"inv_503": 1}


def test_the_watchers_reconcile_drops_the_record_so_its_release_is_not_parked_again(
    kit: Harness, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given the drain's second layer on DynamoDB (the table as the template creates it)
    fake_aws_credentials(monkeypatch)
    with mock_aws():
        client = boto3.client("dynamodb")
        create_table_as_the_template_does(client, TABLE)
        guard = SecondLayer(dynamodb_store(TABLE, client=client), expires_after_seconds=EXPIRY)
        guard.start_invocation(FakeLambdaContext().get_remaining_time_in_millis)
        features = (SecondLayerFeature(guard),)
        # ... and a receipt whose provider answered 503 without sending: uncertain, stored so
        uncertain_receipt(kit, "inv_w503", features)

        # When the watcher's check runs, built as DlqAlertFunction builds it from the
        # environment the template gives it
        settings = AlertSettings.from_env(
            {
                "INFRAI_BASE_URL": kit.server.url,
                "INFRAI_API_KEY": API_KEY,
                "DATABASE_URL": database_url,
                "IDEMPOTENCY_BACKEND": "dynamodb",
                "IDEMPOTENCY_TABLE": TABLE,
                "MAIL_PROVIDER_URL": kit.sink.url,
            },
            job_settings=kit.registry.declared_settings(probes_only=True),
        )
        report = make_alert_check(settings, RecordingAlerter(), registry=kit.registry).run([QUEUE])

        # Then its probe's "not done" released the claim and dropped the record, so the next
        # delivery sends the receipt once instead of being parked stuck again
        assert report.reconciled is not None
        assert [(o.answer, o.action) for o in report.reconciled.outcomes] == [
            ("not_done", "released")
        ]
        kit.advance()
        assert kit.drain(features=features).outcomes == {"done": 1}
        assert kit.sink.state.snapshot()["mails"] == {"inv_w503": 1}


def test_a_reconcile_that_cannot_drop_the_record_leaves_the_claim_stuck(
    kit: Harness, backend: Backend, database_url: str
) -> None:
    # Given an uncertain receipt, stored as such, whose lease is over
    uncertain_receipt(kit, "inv_s503", backend.features)

    # When a reconcile pass hears "not done" but the store cannot be reached
    def unreachable(key: str) -> None:
        raise SecondLayerUnavailable(f"second layer: could not forget {key}: store down")

    reconciler = Reconciler(WorkStore(database_url), kit.registry, actor="w", forget=unreachable)
    report = reconciler.run_all(threshold_seconds=900)

    # Then the claim is not released in the ledger alone: it stays running, still stuck
    assert [(o.answer, o.action) for o in report.outcomes] == [("not_done", "unchanged")]
    assert len(still_stuck(report)) == 1
    row = kit.row("receipt.send:inv_s503")
    assert row is not None
    assert row.state == "running"


# --- What it costs ----------------------------------------------------------------------------

# Round trips to the store per guarded job, as docs/design.md states them.
EXPECTED_CALLS = {
    "dynamodb": {
        "first": ["PutItem", "UpdateItem"],
        "replay": ["PutItem"],  # the conditional put returns the stored item on failure
        "raised": ["PutItem", "DeleteItem"],
    },
    "redis": {
        "first": ["SET NX", "SET"],
        "replay": ["SET NX", "GET", "GET"],
        "raised": ["SET NX", "DEL"],
    },
}


def test_round_trips_to_the_store_per_guarded_job(kit: Harness, backend: Backend) -> None:
    # Given a receipt job, and a job whose handler fails
    kit.publish(RECEIPT)
    # When the receipt runs once through the second layer, once more after its ledger row is
    # lost, and then the failing job runs
    measured: dict[str, list[str]] = {}
    kit.drain(features=backend.features)
    measured["first"] = list(backend.calls)
    backend.calls.clear()
    forget_ledger_row(kit, RECEIPT_KEY)
    kit.publish(RECEIPT)
    kit.drain(features=backend.features)
    measured["replay"] = list(backend.calls)
    backend.calls.clear()
    kit.publish({"job": "test.ext", "id": "t", "mode": "transient"})
    kit.drain(features=backend.features)
    measured["raised"] = list(backend.calls)
    # Then each costs the round trips docs/design.md states
    assert measured == EXPECTED_CALLS[backend.name]


def test_database_jobs_never_touch_the_store(kit: Harness, backend: Backend) -> None:
    # Given a database job (exactly once inside the ledger's own transaction)
    kit.publish({"job": "test.db", "id": "a"})
    # When it is drained with the second layer on
    summary = kit.drain(features=backend.features)
    # Then it is done without a single round trip to the store
    assert summary.outcomes == {"done": 1}
    assert backend.calls == []


# --- Wiring: settings, factory, the drain service ---------------------------------------------


def test_the_second_layer_is_off_by_default() -> None:
    # Given settings from an environment that does not mention it
    settings = DrainSettings.from_env({})
    # When the factory is asked for a guard
    # Then there is none
    assert settings.idempotency_backend == "off"
    assert make_effect_guard(settings) is None


@pytest.mark.parametrize(
    ("environment", "message"),
    [
        ({"IDEMPOTENCY_BACKEND": "memcached"}, "is not one of off, dynamodb, redis"),
        ({"IDEMPOTENCY_BACKEND": "dynamodb"}, "needs IDEMPOTENCY_TABLE"),
        ({"IDEMPOTENCY_BACKEND": "redis"}, "needs REDIS_URL"),
        (
            {"IDEMPOTENCY_BACKEND": "redis", "REDIS_URL": "http://user:hunter2@cache:6379"},
            "REDIS_URL must start with redis://",
        ),
    ],
)
def test_a_misconfigured_second_layer_is_refused_with_the_fix(
    environment: dict[str, str], message: str
) -> None:
    # Given an environment that turns the second layer on wrongly
    # When settings are read
    with pytest.raises(ConfigurationError) as refused:
        DrainSettings.from_env(environment)
    # Then the error names the setting and the fix, never a password
    assert message in str(refused.value)
    assert "hunter2" not in str(refused.value)


def test_a_redis_url_is_kept_out_of_the_settings_repr(redis_url: str) -> None:
    settings = DrainSettings.from_env({"IDEMPOTENCY_BACKEND": "redis", "REDIS_URL": redis_url})
    assert settings.redis_url == redis_url
    assert redis_url not in repr(settings)


@pytest.mark.parametrize("backend_name", ["dynamodb", "redis"])
def test_the_drain_service_wires_the_factory_guard_and_the_time_budget(
    kit: Harness, backend_name: str, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given settings that turn the second layer on, and the guard the factory builds from them
    fake_aws_credentials(monkeypatch)
    with mock_aws():
        boto3_client = boto3.client("dynamodb")
        create_table_as_the_template_does(boto3_client, TABLE)
        settings = DrainSettings.from_env(
            {
                "IDEMPOTENCY_BACKEND": backend_name,
                "IDEMPOTENCY_TABLE": TABLE,
                "REDIS_URL": redis_url,
            }
        )
        guard = make_effect_guard(settings)
        assert isinstance(guard, SecondLayer)
        service = DrainService(
            settings, kit.client, kit.ledger, kit.registry, [SecondLayerFeature(guard)]
        )
        key = f"receipt.send:{uuid.uuid4().hex}"
        payload = {**RECEIPT, "invoice_id": key.split(":", 1)[1]}
        # When a job is drained through the service twice, its ledger row lost in between
        # (no context registered by hand: the service registers its time budget, and without
        # it Powertools' warning would fail the call under pytest's warnings-as-errors)
        kit.publish(payload)
        assert service.run(lambda: INVOCATION_MS).outcomes == {"done": 1}
        forget_ledger_row(kit, key)
        kit.publish(payload)
        assert service.run(lambda: INVOCATION_MS).outcomes == {"done": 1}
        # Then the second run was a hit, counted for the invocation's metric
        assert service.take_second_layer_hits() == 1
        assert mails(kit) == 1
        # And the record sits under the fixed prefix, whatever the function is called
        if backend_name == "dynamodb":
            item = boto3_client.get_item(TableName=TABLE, Key={"id": {"S": record_id(key)}})
            stored = item["Item"]
            # And its in-progress state would have expired with the invocation's deadline
            expires_ms = int(stored["in_progress_expiration"]["N"])
            assert 0 < expires_ms - time.time() * 1000 <= INVOCATION_MS
            assert int(stored["expiration"]["N"]) > time.time() + 30 * 86_400
        else:
            raw = redis.Redis.from_url(redis_url)
            try:
                assert raw.ttl(record_id(key)) > 30 * 86_400
                raw.delete(record_id(key))
            finally:
                raw.close()
