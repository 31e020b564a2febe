"""Secrets in AWS: SSM and Secrets Manager through Powertools Parameters (against moto), cached,
refreshed once after a rotation; and never printed."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import boto3
import psycopg
import pytest
from aws_lambda_powertools.utilities import parameters
from drainkit import QUEUE, Harness
from function_apps import load_function_app
from moto import mock_aws
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from infrai_jobs.aws.secrets import SecretSource
from infrai_jobs.config.settings import CommonSettings
from infrai_jobs.errors import InfraiError
from infrai_jobs.queue.client import InfraiClient
from infrai_jobs.work.ledger import PostgresLedger
from infrai_local.sandbox import emulator as emulator_module
from infrai_local.sandbox.queues import ensure_queue

REGION = "us-east-1"
PARAMETER = "/infrai-jobs/api-key"
SECRET = "infrai-jobs/db"


@pytest.fixture
def aws(fake_aws_credentials: str) -> Iterator[dict[str, Any]]:
    with mock_aws():
        ssm = boto3.client("ssm", region_name=REGION)
        secrets = boto3.client("secretsmanager", region_name=REGION)
        yield {"ssm": ssm, "secrets": secrets}
    parameters.clear_caches()


def _rds_secret(url: str, **override: Any) -> str:
    parts = conninfo_to_dict(url)
    document = {
        "engine": "postgres",
        "host": parts.get("host", "127.0.0.1"),
        "port": int(parts.get("port") or 5432),
        "username": parts.get("user") or "postgres",
        "password": "s3cret-Passw0rd",
        "dbname": parts.get("dbname"),
    }
    document.update(override)
    return json.dumps(document)


def _settings(secret_arn: str) -> CommonSettings:
    # These tests are about fetching and rotation, against a test server whose certificate (if
    # it has one) no CA here signed: TLS is required, not verified (the explicit opt-out).
    # tests/security/test_database_tls.py verifies a server for real.
    return CommonSettings(
        api_key_parameter=PARAMETER, database_secret_arn=secret_arn, database_sslmode="require"
    )


def test_secrets_come_from_ssm_and_secrets_manager_and_are_cached(aws: dict[str, Any]) -> None:
    # Given the API key in SSM (SecureString) and an RDS-style secret
    aws["ssm"].put_parameter(Name=PARAMETER, Value="sk_first", Type="SecureString")
    arn = aws["secrets"].create_secret(
        Name=SECRET,
        SecretString=json.dumps(
            {"host": "db.internal", "username": "jobs", "password": "p@ss", "dbname": "ledger"}
        ),
    )["ARN"]
    # When resolved
    first = SecretSource(_settings(arn)).resolve()
    # Then both values are there, the secret JSON turned into a TLS URL
    assert first.infrai_api_key == "sk_first"
    assert conninfo_to_dict(first.database_url) == {
        "user": "jobs",
        "password": "p@ss",
        "host": "db.internal",
        "port": "5432",
        "dbname": "ledger",
        "sslmode": "require",
    }
    # And after a rotation the cached values stand until a refresh is forced
    aws["ssm"].put_parameter(Name=PARAMETER, Value="sk_second", Type="SecureString", Overwrite=True)
    assert SecretSource(_settings(arn)).resolve().infrai_api_key == "sk_first"
    refresh_key = SecretSource(_settings(arn)).refresh.api_key
    assert refresh_key is not None
    assert refresh_key() == "sk_second"
    # And a function that does not need the key never asks for it
    parameters.clear_caches()
    aws["ssm"].delete_parameter(Name=PARAMETER)
    source = SecretSource(_settings(arn), api_key=False)
    assert source.resolve().infrai_api_key == ""
    assert source.refresh.api_key is None


def test_database_host_points_the_secrets_url_at_a_proxys_endpoint(aws: dict[str, Any]) -> None:
    # Given an RDS secret naming the database's own host (the proxy logs in with it), and
    # DATABASE_HOST naming the proxy's endpoint, as the template sets it with DatabaseProxy create
    proxy = "infrai-jobs-ledger.proxy-abc123.us-east-1.rds.amazonaws.com"
    secret = {"host": "ledger.abc123.us-east-1.rds.amazonaws.com", "port": 5432}
    arn = aws["secrets"].create_secret(
        Name=SECRET,
        SecretString=_rds_secret("postgresql://jobs@x/ledger", **secret),
    )["ARN"]
    source = SecretSource(replace(_settings(arn), database_host=proxy), api_key=False)
    # When a function resolves its database URL, and fetches it again after a rotation
    resolved = conninfo_to_dict(source.resolve().database_url)
    assert source.refresh.database_url is not None
    refreshed = conninfo_to_dict(source.refresh.database_url())
    # Then both go to the proxy, with the secret's port, credentials, database and TLS
    for url in (resolved, refreshed):
        assert url["host"] == proxy
        assert (url["port"], url["user"], url["dbname"]) == ("5432", "jobs", "ledger")
        assert (url["password"], url["sslmode"]) == ("s3cret-Passw0rd", "require")


def test_the_ledger_refreshes_a_rotated_database_secret_once(
    aws: dict[str, Any], database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a ledger whose cached secret points at credentials that no longer work
    with psycopg.connect(database_url, autocommit=True) as conn:
        from infrai_local.migrations import apply_migrations  # noqa: PLC0415

        apply_migrations(conn)
    stale = make_conninfo(database_url, dbname="database_rotated_away")
    arn = aws["secrets"].create_secret(Name=SECRET, SecretString=stale)["ARN"]
    settings = _settings(arn)
    source = SecretSource(settings, api_key=False)
    resolved = source.resolve()
    assert conninfo_to_dict(resolved.database_url)["dbname"] == "database_rotated_away"
    # When the secret is rotated, and the ledger's first connection fails with the old value
    aws["secrets"].put_secret_value(SecretId=arn, SecretString=database_url)
    ledger = PostgresLedger(
        resolved.database_url,
        refresh_url=source.refresh.database_url,
    )
    with caplog.at_level(logging.WARNING):
        row = ledger.get("anything")
    # Then it fetched the secret again, once, and works
    assert row is None
    assert [r.action for r in caplog.records if hasattr(r, "action")] == ["secret_refresh"]
    ledger.close()


def test_the_client_refreshes_a_rotated_api_key_once(aws: dict[str, Any]) -> None:
    # Given Infrai accepting only the new key, and SSM already rotated
    server = emulator_module.start_in_thread(api_key="sk_new")
    try:
        aws["ssm"].put_parameter(Name=PARAMETER, Value="sk_new", Type="SecureString")
        client = InfraiClient(
            server.url,
            "sk_old",
            refresh_api_key=SecretSource(
                CommonSettings(api_key_parameter=PARAMETER)
            ).refresh.api_key,
        )
        # When a call meets a 401, Then it succeeds with the key fetched again
        assert ensure_queue(client, QUEUE) is True
        # And a key that is still wrong after the refresh fails clearly, without looping
        aws["ssm"].put_parameter(
            Name=PARAMETER, Value="sk_wrong", Type="SecureString", Overwrite=True
        )
        wrong = InfraiClient(
            server.url,
            "sk_old",
            refresh_api_key=lambda: "sk_wrong",
        )
        with pytest.raises(InfraiError) as caught:
            wrong.stats(QUEUE)
        assert caught.value.status == 401
    finally:
        server.stop()


def test_no_secret_appears_in_the_output_of_a_whole_drain(
    kit: Harness, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    # Given a drain whose database URL carries a password and whose client holds the key
    password = "pw-Zz9-never-print"
    api_key = "sk_live_never_print_7Q"
    with_password = make_conninfo(kit.database_url, password=password)
    kit.ledger = PostgresLedger(with_password)
    kit.client = InfraiClient(kit.server.url, api_key)
    for n in range(12):
        kit.publish({"job": "test.db", "id": str(n), "mode": "transient" if n % 4 else "ok"})
    kit.publish({"job": "nope"})
    kit.faults(error_rate=0.2, seed=3, routes=["ack", "consume"])
    # When it runs with logging at DEBUG everywhere
    with caplog.at_level(logging.DEBUG):
        summary = kit.drain()
        kit.ledger.close()
    # Then neither secret is in any log record, any printed line, or any repr
    captured = capsys.readouterr()
    everything = "\n".join(
        [captured.out, captured.err, caplog.text, repr(kit.ledger), repr(kit.client)]
        + [json.dumps(r.__dict__, default=str) for r in caplog.records]
    )
    assert summary.consumed >= 1
    assert password not in everything
    assert api_key not in everything


def test_redrive_function_picks_up_a_rotated_api_key_in_a_warm_environment(
    aws: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given RedriveFunction warm with the key SSM held at its first invocation
    server = emulator_module.start_in_thread(api_key="sk_new")
    try:
        ensure_queue(InfraiClient(server.url, "sk_new"), QUEUE, dlq=f"{QUEUE}-dlq")
        aws["ssm"].put_parameter(Name=PARAMETER, Value="sk_old", Type="SecureString")
        for name, value in {
            "INFRAI_BASE_URL": server.url,
            "INFRAI_API_KEY_PARAMETER": PARAMETER,
            "INFRAI_QUEUE": QUEUE,
            # Its factory builds the ledger's adapter too (nothing connects to it here)
            "DATABASE_URL": "postgresql://u@127.0.0.1:9/jobs",
        }.items():
            monkeypatch.setenv(name, value)
        monkeypatch.delenv("INFRAI_API_KEY", raising=False)
        app = load_function_app("redrive")
        _, queue, _, _ = app.dependencies()
        # When the key is rotated in SSM (Infrai now takes only the new one)
        aws["ssm"].put_parameter(
            Name=PARAMETER, Value="sk_new", Type="SecureString", Overwrite=True
        )
        # Then the warm client's next call meets a 401, fetches the key again, and succeeds
        assert queue.stats(QUEUE).message_count == 0
        queue.close()
    finally:
        server.stop()


class _Actions(logging.Handler):
    """The ``action`` of every record logged to the logger it is added to."""

    def __init__(self) -> None:
        super().__init__()
        self.actions: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.actions.append(getattr(record, "action", ""))


class _Context:
    function_name = "infrai-jobs-under-test"
    function_version = "$LATEST"
    invoked_function_arn = "arn:aws:lambda:us-east-1:123456789012:function:infrai-jobs-under-test"
    memory_limit_in_mb = 512
    aws_request_id = "7c3e0b7e-1d7e-4f55-9c43-8f1d2f0c9a11"

    def get_remaining_time_in_millis(self) -> int:
        return 60_000


# Each function, warmed up (its adapters built), an event that makes it use the ledger, and the
# dead letters that event needs (a redrive touches the ledger only to reopen a moved one's claim).
WARM_FUNCTIONS = {
    "dlq_alert": (lambda app: app.check(), {}, []),
    "prune": (lambda app: app.dependencies(), {}, []),
    "redrive": (
        lambda app: app.dependencies(),
        {"reopen_failed": True, "dry_run": False},
        [{"job": "invoice.finalize", "invoice_id": "inv_1", "amount_cents": 1}],
    ),
}


@pytest.mark.parametrize("function", WARM_FUNCTIONS)
def test_a_warm_function_picks_up_a_rotated_database_secret_in_the_same_run(
    aws: dict[str, Any],
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
    function: str,
) -> None:
    # Given DlqAlertFunction (PruneFunction, RedriveFunction) warm with a database secret that
    # has since been rotated: the value it holds no longer connects
    with psycopg.connect(database_url, autocommit=True) as conn:
        from infrai_local.migrations import apply_migrations  # noqa: PLC0415

        apply_migrations(conn)
    stale = make_conninfo(database_url, dbname="database_rotated_away")
    arn = aws["secrets"].create_secret(Name=SECRET, SecretString=stale)["ARN"]
    server = emulator_module.start_in_thread(api_key="test-key")
    try:
        client = InfraiClient(server.url, "test-key")
        ensure_queue(client, QUEUE, dlq=f"{QUEUE}-dlq")
        warm_up, event, dead_letters = WARM_FUNCTIONS[function]
        for payload in dead_letters:
            client.publish(f"{QUEUE}-dlq", payload)
        for name, value in {
            "INFRAI_BASE_URL": server.url,
            "INFRAI_API_KEY": "test-key",
            "DATABASE_SECRET_ARN": arn,
            "DATABASE_SSLMODE": "require",
            "INFRAI_QUEUE": QUEUE,
            "WATCHED_QUEUES": QUEUE,
            "ALERT_TOPIC_ARN": "",
            "POWERTOOLS_METRICS_NAMESPACE": "InfraiJobs",
            "POWERTOOLS_TRACE_DISABLED": "true",
        }.items():
            monkeypatch.setenv(name, value)
        monkeypatch.delenv("DATABASE_URL", raising=False)
        app = load_function_app(function)
        warm_up(app)
        aws["secrets"].put_secret_value(SecretId=arn, SecretString=database_url)
        refreshes = _Actions()
        logging.getLogger("infrai_jobs.ledger.postgres").addHandler(refreshes)
        # When it next runs
        try:
            answer = app.lambda_handler(event, _Context())
        finally:
            logging.getLogger("infrai_jobs.ledger.postgres").removeHandler(refreshes)
        # Then that very run fetched the secret again, once, and did its work
        assert isinstance(answer, dict)
        assert refreshes.actions == ["secret_refresh"]
    finally:
        server.stop()
