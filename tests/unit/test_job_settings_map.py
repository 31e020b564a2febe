"""The jobs' settings and secrets' ARNs reach the functions in one variable, ``JOB_SETTINGS``
(the template's JobSettings parameter, a JSON object of strings), so a new job's setting needs
no template edit; a variable of the same name still stands in (a local run)."""

from __future__ import annotations

import json

import pytest

from infrai_jobs.config.settings import AlertSettings, DrainSettings
from infrai_jobs.errors import ConfigurationError

SETTINGS = {"MAIL_PROVIDER_URL": ("receipt.send",), "DIGEST_PROVIDER_URL": ("digest.build",)}
SECRETS = {"MAIL_API_TOKEN": ("receipt.send",)}
ARN = "arn:aws:secretsmanager:us-east-1:123456789012:secret:mail-token-AbCdEf"
DEPLOYED = {"AWS_LAMBDA_FUNCTION_NAME": "stack-drain"}
MAIL = "https://mail.example.com"


def _map(**values: object) -> dict[str, str]:
    return {"JOB_SETTINGS": json.dumps(values)}


def test_a_deployed_drain_reads_the_settings_and_secret_arns_from_the_map() -> None:
    # Given a deployed function whose only job variable is JOB_SETTINGS
    env = {
        **DEPLOYED,
        **_map(
            MAIL_PROVIDER_URL=MAIL,
            DIGEST_PROVIDER_URL="https://digest.example.com/v1",
            MAIL_API_TOKEN_SECRET_ARN=ARN,
        ),
    }
    # When the drain's settings are read
    settings = DrainSettings.from_env(env, job_settings=SETTINGS, job_secrets=SECRETS)
    # Then each declared setting has its value and the secret its ARN (fetched later, by name)
    assert settings.require_job_settings() == {
        "MAIL_PROVIDER_URL": MAIL,
        "DIGEST_PROVIDER_URL": "https://digest.example.com/v1",
    }
    assert dict(settings.job_secret_arns) == {"MAIL_API_TOKEN": ARN}
    assert dict(settings.job_secrets) == {"MAIL_API_TOKEN": ""}


def test_the_watcher_takes_only_its_probes_settings_from_the_same_map() -> None:
    # Given the map the template gives both functions, with a setting no probe needs
    env = _map(MAIL_PROVIDER_URL=MAIL, DIGEST_PROVIDER_URL="https://digest.example.com")
    # When the watcher reads the settings of the jobs with a probe
    settings = AlertSettings.from_env(env, job_settings={"MAIL_PROVIDER_URL": ("receipt.send",)})
    # Then it holds that one only
    assert dict(settings.job_settings) == {"MAIL_PROVIDER_URL": MAIL}


def test_a_variable_of_its_own_still_stands_in_locally() -> None:
    # Given a shell with the setting as its own variable and an empty map
    env = {"MAIL_PROVIDER_URL": "http://127.0.0.1:8766", **_map(MAIL_PROVIDER_URL="")}
    settings = DrainSettings.from_env(env, job_settings=SETTINGS)
    # Then the variable counts, and an unset one stays unset
    assert dict(settings.job_settings) == {
        "MAIL_PROVIDER_URL": "http://127.0.0.1:8766",
        "DIGEST_PROVIDER_URL": "",
    }


def test_the_same_value_in_both_places_is_one_setting() -> None:
    env = {"MAIL_PROVIDER_URL": MAIL, **_map(MAIL_PROVIDER_URL=MAIL)}
    settings = DrainSettings.from_env(env, job_settings=SETTINGS)
    assert settings.job_settings["MAIL_PROVIDER_URL"] == MAIL


def test_two_different_values_for_one_name_are_refused_naming_both_places() -> None:
    # Given the map and a variable of its own disagreeing on a setting
    env = {"MAIL_PROVIDER_URL": "https://other.example.com", **_map(MAIL_PROVIDER_URL=MAIL)}
    # When the settings are read, Then neither wins silently
    with pytest.raises(ConfigurationError) as raised:
        DrainSettings.from_env(env, job_settings=SETTINGS)
    message = str(raised.value)
    assert "MAIL_PROVIDER_URL and JOB_SETTINGS's MAIL_PROVIDER_URL differ" in message


@pytest.mark.parametrize(
    "raw",
    [
        "{not json",
        '["MAIL_PROVIDER_URL"]',
        '"https://mail.example.com"',
        "null",
        '{"MAIL_PROVIDER_URL": 443}',
        '{"MAIL_PROVIDER_URL": null}',
        '{"UNRELATED": {"nested": "object"}}',
    ],
    ids=["not-json", "a-list", "a-string", "null", "a-number", "a-null-value", "nested"],
)
def test_a_malformed_map_is_refused_at_the_cold_start(raw: str) -> None:
    # Given a function whose JOB_SETTINGS is not a JSON object of strings
    env = {**DEPLOYED, "JOB_SETTINGS": raw}
    # When either function that runs the jobs reads its settings, Then it says what is wrong
    for kind in (DrainSettings, AlertSettings):
        with pytest.raises(ConfigurationError, match="JOB_SETTINGS must be a JSON object"):
            kind.from_env(env, job_settings=SETTINGS)


def test_a_malformed_map_is_refused_even_with_no_job_declaring_a_setting() -> None:
    with pytest.raises(ConfigurationError, match="JOB_SETTINGS must be a JSON object"):
        DrainSettings.from_env({"JOB_SETTINGS": "{"})


@pytest.mark.parametrize(
    ("url", "refusal"),
    [
        ("http://mail.example.com", "uses plain HTTP"),
        ("https://user:pw@mail.example.com", "carries credentials"),
        ("mail.example.com", r"must be an http\(s\) URL"),
    ],
)
def test_a_mapped_setting_passes_the_same_url_check(url: str, refusal: str) -> None:
    with pytest.raises(ConfigurationError, match=refusal) as raised:
        DrainSettings.from_env(_map(MAIL_PROVIDER_URL=url), job_settings=SETTINGS)
    # naming the setting and the job that declared it, never the value
    assert "MAIL_PROVIDER_URL (for receipt.send)" in str(raised.value)
    assert "pw" not in str(raised.value)


def test_a_plain_secret_in_the_map_is_refused_in_a_deployed_function() -> None:
    # Given a deployed drain whose map carries the credential itself
    env = {**DEPLOYED, **_map(MAIL_API_TOKEN="tok-never-shown")}
    # When its settings are read, Then it refuses, pointing at the ARN, never echoing the value
    with pytest.raises(ConfigurationError) as raised:
        DrainSettings.from_env(env, job_secrets=SECRETS)
    message = str(raised.value)
    assert "MAIL_API_TOKEN_SECRET_ARN" in message
    assert "tok-never-shown" not in message


def test_a_missing_setting_is_still_refused_naming_its_job() -> None:
    settings = DrainSettings.from_env(_map(MAIL_PROVIDER_URL=MAIL), job_settings=SETTINGS)
    with pytest.raises(ConfigurationError, match=r"DIGEST_PROVIDER_URL is not set.*digest\.build"):
        settings.require_job_settings()
