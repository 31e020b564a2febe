"""HTTPS only: Infrai's base URL and the jobs' downstreams follow one rule.

Every request to Infrai carries the bearer API key, so a typo such as ``http://`` would send it
in clear text. The rule (``settings.check_web_url``): HTTPS, or plain HTTP to a loopback host
(the emulator, a provider sink, a test server); plain HTTP elsewhere only with the documented
opt-out ``INFRAI_ALLOW_PLAIN_HTTP=true``, which is then logged as a warning whenever the
settings are read (every cold start). The refusal comes before any call.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
from child_process import clean_env, run_captured

from infrai_jobs.config.settings import DrainSettings
from infrai_jobs.errors import ConfigurationError
from infrai_jobs.queue.client import InfraiClient

INFRAI_JOBS = str(Path(sys.executable).parent / "infrai-jobs")
API_KEY = "sk_live_https_only_secret_41"
MAIL = {"MAIL_URL": ("a.mail",)}


@pytest.mark.parametrize(
    "url",
    [
        "https://api.infrai.cc",
        "http://127.0.0.1:8765",
        "http://127.9.9.9:1",
        "http://localhost:8765",
        "http://[::1]:8765",
    ],
)
def test_https_and_loopback_http_base_urls_are_accepted(url: str) -> None:
    settings = DrainSettings.from_env({"INFRAI_BASE_URL": url})
    assert settings.require_base_url() == url


@pytest.mark.parametrize(
    "url", ["http://api.example.com", "http://10.0.0.7:8080", "http://127.0.0.1.example.com"]
)
def test_a_plain_http_base_url_off_loopback_is_refused(url: str) -> None:
    # Given INFRAI_BASE_URL with plain HTTP to a host that is not loopback
    # When the settings are read, Then they are refused, naming the setting and the fix
    with pytest.raises(ConfigurationError, match="INFRAI_BASE_URL uses plain HTTP") as raised:
        DrainSettings.from_env({"INFRAI_BASE_URL": url, "INFRAI_API_KEY": API_KEY})
    assert "INFRAI_ALLOW_PLAIN_HTTP=true" in str(raised.value)
    assert API_KEY not in str(raised.value)


def test_a_client_built_without_settings_applies_the_same_rule() -> None:
    # Given no settings at all, When a client is built for plain HTTP off loopback
    # Then it is refused too, before any connection exists
    with pytest.raises(ConfigurationError, match=r"plain HTTP to api\.example\.com"):
        InfraiClient("http://api.example.com", API_KEY)


def test_base_url_and_job_settings_share_one_rule() -> None:
    # Given the same plain-HTTP URL as Infrai's base URL and as a job's downstream
    url = "http://mail.example.com"
    with pytest.raises(ConfigurationError) as as_base:
        DrainSettings.from_env({"INFRAI_BASE_URL": url})
    with pytest.raises(ConfigurationError) as as_job:
        DrainSettings.from_env({"MAIL_URL": url}, job_settings=MAIL)
    # Then both are refused with the same reason, each naming its own setting
    reason = "uses plain HTTP to mail.example.com: use HTTPS"
    assert reason in str(as_base.value)
    assert reason in str(as_job.value)
    assert str(as_job.value).startswith("MAIL_URL (for a.mail)")


def test_the_opt_out_allows_plain_http_on_a_local_network_and_warns(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Given the explicit opt-out and plain-HTTP URLs on a local network
    env = {
        "INFRAI_BASE_URL": "http://192.168.1.20:8080",
        "MAIL_URL": "http://192.168.1.21",
        "INFRAI_ALLOW_PLAIN_HTTP": "true",
    }
    # When the settings are read (as at a cold start)
    with caplog.at_level(logging.WARNING, logger="infrai_jobs.config.settings"):
        settings = DrainSettings.from_env(env, job_settings=MAIL)
    # Then they are accepted, and a warning names the opt-out and the settings that use it
    assert settings.allow_plain_http is True
    assert settings.require_base_url() == "http://192.168.1.20:8080"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "INFRAI_ALLOW_PLAIN_HTTP=true" in warnings[0].getMessage()
    assert "INFRAI_BASE_URL, MAIL_URL use it" in warnings[0].getMessage()
    assert getattr(warnings[0], "action", None) == "security_opt_out"


def test_without_the_opt_out_nothing_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="infrai_jobs.config.settings"):
        DrainSettings.from_env({"INFRAI_BASE_URL": "https://api.infrai.cc"})
    assert not [r for r in caplog.records if r.name == "infrai_jobs.config.settings"]


@pytest.mark.parametrize("command", [["stats"], ["drain", "--max-batches", "1"]])
def test_the_cli_refuses_a_plain_http_base_url_before_any_call(command: list[str]) -> None:
    # Given a shell with a plain-HTTP Infrai URL (a typo of https) and a ledger URL no server
    # answers (nothing may be called before the refusal)
    env = clean_env(
        INFRAI_BASE_URL="http://api.example.com",
        INFRAI_API_KEY=API_KEY,
        DATABASE_URL="postgresql://jobs@127.0.0.1:1/jobs",
    )
    # When the command runs
    finished = run_captured([INFRAI_JOBS, *command], env=env)
    # Then it exits 2 with one line naming the setting and the fix: no traceback, no key
    assert finished.returncode == 2, finished.stderr
    lines = finished.stderr.strip().splitlines()
    assert len(lines) == 1, finished.stderr
    assert lines[0].startswith("error: INFRAI_BASE_URL uses plain HTTP to api.example.com")
    assert "Traceback" not in finished.stderr
    assert API_KEY not in finished.stderr + finished.stdout
