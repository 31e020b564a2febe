"""A job's own settings: declared by the job, read at the edge, bound before anything runs."""

from __future__ import annotations

import pytest

from infrai_jobs.config.settings import DrainSettings
from infrai_jobs.errors import ConfigurationError
from infrai_jobs.jobs.registry import Effect, JobContext, JobRegistry, JsonValue, Payload
from infrai_local.sandbox import LEDGER_ENDPOINT, QUEUE_ENDPOINT, configured_endpoints, stand_ins


def echo_settings(payload: Payload, ctx: JobContext) -> JsonValue:
    return dict(ctx.settings)


def registry_with_two_jobs() -> JobRegistry:
    registry = JobRegistry()
    registry.job("a.mail", effect=Effect.EXTERNAL, identity=("id",), settings=("MAIL_URL",))(
        echo_settings
    )
    registry.job(
        "b.both", effect=Effect.EXTERNAL, identity=("id",), settings=("MAIL_URL", "CRM_URL")
    )(echo_settings)
    return registry


def test_a_bound_job_sees_only_the_settings_it_declared() -> None:
    # Given two jobs, one declaring MAIL_URL, the other MAIL_URL and CRM_URL
    registry = registry_with_two_jobs()
    # When the values are bound (with one more the environment happened to hold)
    registry.bind_settings(
        {"MAIL_URL": "https://mail.test", "CRM_URL": "https://crm.test", "OTHER": "x"}
    )
    # Then each job's payload is derived with its own settings only
    assert dict(registry.derive({"job": "a.mail", "id": "1"}).settings) == {
        "MAIL_URL": "https://mail.test"
    }
    assert dict(registry.derive({"job": "b.both", "id": "1"}).settings) == {
        "MAIL_URL": "https://mail.test",
        "CRM_URL": "https://crm.test",
    }


def test_binding_without_a_declared_setting_names_it_and_its_jobs() -> None:
    registry = registry_with_two_jobs()
    with pytest.raises(ConfigurationError) as raised:
        registry.bind_settings({"MAIL_URL": "https://mail.test"})
    assert str(raised.value) == "CRM_URL is not set, and job(s) b.both need it"


def test_the_edge_reads_only_the_declared_settings() -> None:
    # Given an environment with the declared setting and an undeclared one
    env = {"MAIL_URL": " https://mail.test ", "CRM_URL": "https://crm.test"}
    # When the settings are read for jobs that declared MAIL_URL only
    settings = DrainSettings.from_env(env, job_settings={"MAIL_URL": ("a.mail",)})
    # Then only it is read (trimmed), and it counts as a configured endpoint
    assert dict(settings.job_settings) == {"MAIL_URL": "https://mail.test"}
    assert configured_endpoints(settings)["MAIL_URL"] is True
    assert "CRM_URL" not in configured_endpoints(settings)


@pytest.mark.parametrize(
    "url", ["http://127.0.0.1:8766", "http://localhost:1", "http://[::1]:2", "https://x.test"]
)
def test_https_or_loopback_http_is_accepted(url: str) -> None:
    settings = DrainSettings.from_env({"MAIL_URL": url}, job_settings={"MAIL_URL": ("a.mail",)})
    assert settings.require_job_settings() == {"MAIL_URL": url}


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("http://mail.example.com", "plain HTTP to mail.example.com"),
        ("ftp://mail.example.com", r"must be an http\(s\) URL"),
        ("mail.example.com", r"must be an http\(s\) URL"),
    ],
)
def test_a_setting_that_is_not_https_off_loopback_is_refused_by_name(
    url: str, problem: str
) -> None:
    with pytest.raises(ConfigurationError, match=problem) as raised:
        DrainSettings.from_env({"MAIL_URL": url}, job_settings={"MAIL_URL": ("a.mail",)})
    assert "MAIL_URL (for a.mail)" in str(raised.value)


def test_an_unset_setting_is_a_missing_endpoint_naming_its_job() -> None:
    # Given a real queue and ledger, and a job setting left unset
    settings = DrainSettings.from_env(
        {"INFRAI_BASE_URL": "https://api.infrai.test", "DATABASE_URL": "postgresql://h/db"},
        job_settings={"MAIL_URL": ("a.mail", "b.both")},
    )
    # When a command asks which stand-ins to use
    with pytest.raises(ConfigurationError) as raised:
        stand_ins(
            configured_endpoints(settings),
            (QUEUE_ENDPOINT, LEDGER_ENDPOINT, *settings.job_settings),
            who="the test",
            job_setting_owners=settings.job_setting_owners,
        )
    # Then none: the missing setting is named, with the jobs that call it
    message = str(raised.value)
    assert message.startswith("MAIL_URL is not set, but INFRAI_BASE_URL and DATABASE_URL are")
    assert "MAIL_URL (the downstream a.mail, b.both calls" in message
    # And the function's own check says the same before anything is built
    with pytest.raises(ConfigurationError, match=r"MAIL_URL is not set, and job\(s\) a.mail"):
        settings.require_job_settings()


def test_with_nothing_real_configured_every_job_setting_is_stood_in() -> None:
    settings = DrainSettings.from_env({}, job_settings={"MAIL_URL": ("a",), "CRM_URL": ("b",)})
    plan = stand_ins(
        configured_endpoints(settings),
        (QUEUE_ENDPOINT, LEDGER_ENDPOINT, *settings.job_settings),
        who="the test",
    )
    assert plan == (QUEUE_ENDPOINT, LEDGER_ENDPOINT, "MAIL_URL", "CRM_URL")
