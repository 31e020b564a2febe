"""A job's secrets: declared by name, read from NAME_SECRET_ARN in AWS (the plain NAME only
locally), bound into ``ctx.secrets``, and never shown in a repr or a message."""

from __future__ import annotations

import pytest

from infrai_jobs.config.settings import DrainSettings
from infrai_jobs.errors import ConfigurationError
from infrai_jobs.jobs.probes import Unknown
from infrai_jobs.jobs.registry import Effect, JobContext, JobRegistry, JsonValue, Payload

TOKEN = "tok-Zq7-never-shown"
SECRETS = {"MAIL_API_TOKEN": ("receipt.send",)}
ARN = "arn:aws:secretsmanager:us-east-1:123456789012:secret:mail-token-AbCdEf"
DEPLOYED = {"AWS_LAMBDA_FUNCTION_NAME": "stack-drain"}


def _registry() -> JobRegistry:
    registry = JobRegistry()

    def send(payload: Payload, ctx: JobContext) -> JsonValue:
        return None

    registry.job(
        "receipt.send",
        effect=Effect.EXTERNAL,
        identity=("invoice_id",),
        settings=("MAIL_PROVIDER_URL",),
        secrets=("MAIL_API_TOKEN",),
        probe=lambda payload, ctx: Unknown("not asked"),
    )(send)
    return registry


def test_a_declared_secret_reaches_the_context_and_no_repr_shows_it() -> None:
    # Given a job that declares a secret, bound with its value
    registry = _registry()
    registry.bind_settings(
        {"MAIL_PROVIDER_URL": "https://mail.example.com"}, secrets={"MAIL_API_TOKEN": TOKEN}
    )
    # When a payload is matched to it
    derived = registry.derive({"job": "receipt.send", "invoice_id": "inv_1"})
    # Then the job's secrets carry the value, and no repr of them shows it
    assert derived.secrets["MAIL_API_TOKEN"] == TOKEN
    assert dict(registry.secrets_of("receipt.send")) == {"MAIL_API_TOKEN": TOKEN}
    context = JobContext("k", "receipt.send", "m", 1, 0.0, secrets=derived.secrets)
    for shown in (repr(derived), repr(context), repr(derived.secrets), str(derived.secrets)):
        assert TOKEN not in shown
    assert "MAIL_API_TOKEN" in repr(derived.secrets)


def test_binding_without_a_declared_secret_names_it_and_its_jobs() -> None:
    registry = _registry()
    with pytest.raises(ConfigurationError, match=r"MAIL_API_TOKEN is not set.*receipt\.send"):
        registry.bind_settings({"MAIL_PROVIDER_URL": "https://mail.example.com"})


def test_a_name_declared_both_as_setting_and_secret_is_refused() -> None:
    registry = JobRegistry()
    with pytest.raises(ConfigurationError, match="both as a setting and as a secret"):
        registry.job(
            "a.job", effect=Effect.EXTERNAL, identity=("id",), settings=("X",), secrets=("X",)
        )(lambda payload, ctx: None)


def test_a_bare_string_of_secrets_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="secrets must list"):
        JobRegistry().job("a.job", effect=Effect.EXTERNAL, secrets="TOKEN")  # type: ignore[arg-type]


def test_the_watcher_drops_a_probe_whose_secret_is_missing() -> None:
    # Given a job whose probe needs a secret, and a watcher with its setting only
    registry = _registry()
    assert registry.declared_secrets(probes_only=True) == SECRETS
    # When its probe settings are bound without the secret
    unprobed = registry.bind_probe_settings({"MAIL_PROVIDER_URL": "https://mail.example.com"})
    # Then the job loses its probe and the caller is told which name it misses
    assert unprobed == {"receipt.send": ("MAIL_API_TOKEN",)}
    definition = registry.get("receipt.send")
    assert definition is not None
    assert definition.probe is None


def test_locally_the_plain_variable_stands_in_for_the_secret() -> None:
    settings = DrainSettings.from_env({"MAIL_API_TOKEN": TOKEN}, job_secrets=SECRETS)
    assert settings.require_job_secrets() == {"MAIL_API_TOKEN": TOKEN}
    assert TOKEN not in repr(settings)


def test_in_aws_the_secret_is_named_by_its_arn_and_not_read_yet() -> None:
    settings = DrainSettings.from_env(
        {**DEPLOYED, "MAIL_API_TOKEN_SECRET_ARN": ARN}, job_secrets=SECRETS
    )
    assert dict(settings.job_secret_arns) == {"MAIL_API_TOKEN": ARN}
    assert dict(settings.job_secrets) == {"MAIL_API_TOKEN": ""}


def test_a_deployed_function_refuses_the_plain_variable_without_echoing_it() -> None:
    # Given a deployed function whose environment carries the credential itself
    env = {**DEPLOYED, "MAIL_API_TOKEN": TOKEN}
    # When its settings are read, Then it refuses, naming the variables, never the value
    with pytest.raises(ConfigurationError) as raised:
        DrainSettings.from_env(env, job_secrets=SECRETS)
    message = str(raised.value)
    assert "MAIL_API_TOKEN_SECRET_ARN" in message
    assert "JobSettings" in message
    assert TOKEN not in message


def test_a_local_invocation_may_use_the_plain_variable() -> None:
    env = {**DEPLOYED, "AWS_SAM_LOCAL": "true", "MAIL_API_TOKEN": TOKEN}
    settings = DrainSettings.from_env(env, job_secrets=SECRETS)
    assert settings.require_job_secrets() == {"MAIL_API_TOKEN": TOKEN}


def test_a_value_beside_its_arn_is_refused() -> None:
    env = {"MAIL_API_TOKEN": TOKEN, "MAIL_API_TOKEN_SECRET_ARN": ARN}
    with pytest.raises(ConfigurationError, match="both set") as raised:
        DrainSettings.from_env(env, job_secrets=SECRETS)
    assert TOKEN not in str(raised.value)


def test_a_missing_secret_says_where_it_comes_from() -> None:
    settings = DrainSettings.from_env(DEPLOYED, job_secrets=SECRETS)
    with pytest.raises(ConfigurationError) as raised:
        settings.require_job_secrets()
    message = str(raised.value)
    assert "MAIL_API_TOKEN is not set" in message
    assert "receipt.send" in message
    assert "MAIL_API_TOKEN_SECRET_ARN" in message


def test_a_setting_url_with_credentials_points_at_job_secrets() -> None:
    url = f"https://user:{TOKEN}@mail.example.com"
    with pytest.raises(ConfigurationError) as raised:
        DrainSettings.from_env(
            {"MAIL_PROVIDER_URL": url}, job_settings={"MAIL_PROVIDER_URL": ("receipt.send",)}
        )
    message = str(raised.value)
    assert "carries credentials" in message
    assert "secrets=(" in message
    assert "ctx.secrets" in message
    assert "_SECRET_ARN" in message
    assert TOKEN not in message
