"""A job's secret in AWS: fetched from Secrets Manager (moto) by the ARN NAME_SECRET_ARN names,
once at the drain's cold start, handed to the handler in ``ctx.secrets``, and never printed."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from aws_lambda_powertools.utilities import parameters
from drainkit import API_KEY, QUEUE, Harness
from moto import mock_aws

from infrai_jobs.config.settings import DrainSettings
from infrai_jobs.errors import ConfigurationError
from infrai_jobs.jobs.registry import Effect, JobContext, JsonValue, Payload
from infrai_jobs.runtime.drain_service import DrainService

TOKEN = "prov-tok-9Xq-never-print"
JOB = "test.secret"


@pytest.fixture
def secrets_manager(fake_aws_credentials: str) -> Iterator[Any]:
    with mock_aws():
        yield boto3.client("secretsmanager", region_name=fake_aws_credentials)
    parameters.clear_caches()


def _add_secret_job(kit: Harness) -> list[str]:
    seen: list[str] = []

    def call_provider(payload: Payload, ctx: JobContext) -> JsonValue:
        seen.append(ctx.secrets["TEST_PROVIDER_TOKEN"])
        # A handler that logs its context shows the secret's name, not its value.
        logging.getLogger("test.secret").info("context %r, secrets %r", ctx, ctx.secrets)
        return {"ok": True}

    kit.registry.job(
        JOB, effect=Effect.EXTERNAL, identity=("id",), secrets=("TEST_PROVIDER_TOKEN",)
    )(call_provider)
    return seen


def _deployed_settings(kit: Harness, arn: str) -> DrainSettings:
    """DrainFunction's settings in AWS: the secret named by its ARN, nothing plain."""
    env = {
        "AWS_LAMBDA_FUNCTION_NAME": "stack-drain",
        "INFRAI_BASE_URL": kit.server.url,
        "INFRAI_API_KEY": API_KEY,
        "INFRAI_QUEUE": QUEUE,
        "DATABASE_URL": kit.database_url,
        "TEST_PROVIDER_TOKEN_SECRET_ARN": arn,
        **dict.fromkeys(kit.registry.declared_settings(), kit.sink.url),
    }
    return DrainSettings.from_env(
        env,
        job_settings=kit.registry.declared_settings(),
        job_secrets=kit.registry.declared_secrets(),
    )


def test_the_secret_reaches_the_handler_and_never_the_output(
    kit: Harness,
    secrets_manager: Any,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Given a job declaring a secret, stored in Secrets Manager and named by its ARN
    seen = _add_secret_job(kit)
    arn = secrets_manager.create_secret(Name="provider-token", SecretString=TOKEN)["ARN"]
    kit.publish({"job": JOB, "id": "1"})
    # When DrainFunction's service is built from its settings and drains, the package logging
    # at DEBUG (as LogLevel DEBUG sets it; botocore's own wire log stays off, as in Lambda)
    with caplog.at_level(logging.DEBUG, "infrai_jobs"), caplog.at_level(logging.INFO, JOB):
        service = DrainService.from_settings(_deployed_settings(kit, arn), kit.registry)
        summary = service.run(lambda: 120_000)
        service.close()
    # Then the handler got the secret's value
    assert summary.outcomes == {"done": 1}
    assert seen == [TOKEN]
    # And the value is in no log record, printed line, or repr of the service's settings
    captured = capsys.readouterr()
    everything = "\n".join(
        [captured.out, captured.err, caplog.text, repr(service.settings)]
        + [json.dumps(r.__dict__, default=str) for r in caplog.records]
    )
    assert "TEST_PROVIDER_TOKEN" in caplog.text
    assert TOKEN not in everything


def test_an_unreadable_secret_stops_the_drain_before_it_receives(
    kit: Harness, secrets_manager: Any
) -> None:
    # Given a job's secret named by the ARN of a secret that does not exist
    _add_secret_job(kit)
    arn = "arn:aws:secretsmanager:us-east-1:123456789012:secret:gone-AbCdEf"
    kit.publish({"job": JOB, "id": "2"})
    # When DrainFunction's service is built, Then it is a configuration error naming the
    # variable and the job
    with pytest.raises(ConfigurationError) as raised:
        DrainService.from_settings(_deployed_settings(kit, arn), kit.registry)
    message = str(raised.value)
    assert message.startswith("TEST_PROVIDER_TOKEN_SECRET_ARN (for test.secret)")
    assert "cannot be read" in message
    # And nothing was received: the message still waits
    assert kit.client.stats(QUEUE).message_count == 1
