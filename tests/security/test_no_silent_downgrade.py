"""No silent downgrade: weaker TLS or auth is refused, or logged as an opt-out at every read.

- A Redis URL that turns the server's certificate or host-name check off
  (``ssl_cert_reqs=none``, ``ssl_check_hostname=false``, ...) is refused, in ``REDIS_URL`` and in
  the URL a Redis secret holds: nothing the second layer talks to needs it.
- A Redis off loopback without a password (no AUTH) is allowed, since ElastiCache can run so
  inside a VPC, but logged as a security opt-out every time the settings or the secret are read.
- A provider URL (a job's declared setting) or Infrai's base URL with credentials in it is
  refused: the environment is readable by whoever may read the function's configuration.
"""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path

import pytest

from infrai_jobs.aws.secrets import redis_url_from_secret
from infrai_jobs.config.settings import AlertSettings, DrainSettings, check_web_url
from infrai_jobs.errors import ConfigurationError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from test_template import load_template
from test_url_parameters import url_parameters

MAIL = {"MAIL_PROVIDER_URL": ("receipt.send",)}
PASSWORD = "s3cr3t-auth-token-77"


def _opt_outs(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if getattr(r, "action", "") == "security_opt_out"
    ]


@pytest.mark.parametrize(
    "query",
    [
        "ssl_cert_reqs=none",
        "ssl_cert_reqs=optional",
        "ssl_cert_reqs=NONE",
        "ssl_check_hostname=false",
        "ssl_check_hostname=0",
        "ssl_exclude_verify_flags=VERIFY_X509_STRICT",
        "db=0&ssl_cert_reqs=none",
    ],
)
def test_a_redis_url_that_weakens_tls_is_refused(query: str) -> None:
    # Given REDIS_URL to a TLS server, with a query parameter that turns a check off
    url = f"rediss://:{PASSWORD}@cache.example.com:6379/0?{query}"
    # When the drain's settings are read, Then they are refused, naming the parameter only
    with pytest.raises(ConfigurationError, match="weakens the TLS check") as raised:
        DrainSettings.from_env({"IDEMPOTENCY_BACKEND": "redis", "REDIS_URL": url})
    assert query.rsplit("&", maxsplit=1)[-1].split("=", maxsplit=1)[0] in str(raised.value)
    assert PASSWORD not in str(raised.value)


def test_a_redis_secret_whose_url_weakens_tls_is_refused() -> None:
    # Given a Redis secret holding the whole URL, with the certificate check off
    secret = f"rediss://default:{PASSWORD}@cache.example.com:6379?ssl_cert_reqs=none"
    # When the secret is read, Then it is refused, without showing the secret
    with pytest.raises(ConfigurationError, match="ssl_cert_reqs=none") as raised:
        redis_url_from_secret(secret, "")
    assert PASSWORD not in str(raised.value)


@pytest.mark.parametrize(
    "query", ["", "?ssl_cert_reqs=required", "?ssl_check_hostname=true", "?db=2"]
)
def test_a_redis_url_that_keeps_every_check_is_accepted(query: str) -> None:
    url = f"rediss://:{PASSWORD}@cache.example.com:6379{query}"
    settings = DrainSettings.from_env({"IDEMPOTENCY_BACKEND": "redis", "REDIS_URL": url})
    assert settings.redis_url == url


def test_redis_without_auth_is_logged_as_an_opt_out_at_every_read(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Given a TLS Redis off loopback with no password, and no secret that would add one
    env = {"IDEMPOTENCY_BACKEND": "redis", "REDIS_URL": "rediss://cache.example.com:6379"}
    caplog.set_level(logging.WARNING)
    # When the settings are read twice (two cold starts)
    DrainSettings.from_env(env)
    DrainSettings.from_env(env)
    # Then each read logs the opt-out, saying how to turn AUTH on
    warnings = [w for w in _opt_outs(caplog) if "without AUTH" in w]
    assert len(warnings) == 2
    assert "REDIS_SECRET_ARN" in warnings[0]


@pytest.mark.parametrize(
    "env",
    [
        {"REDIS_URL": f"rediss://:{PASSWORD}@cache.example.com:6379"},
        {
            "REDIS_URL": "rediss://cache.example.com:6379",
            "REDIS_SECRET_ARN": "arn:aws:secretsmanager:eu-west-1:123456789012:secret:r-AbC123",
        },
        {"REDIS_URL": "redis://127.0.0.1:6379"},
    ],
)
def test_redis_with_a_password_a_secret_or_on_loopback_logs_no_opt_out(
    env: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    DrainSettings.from_env({"IDEMPOTENCY_BACKEND": "redis", **env})
    assert _opt_outs(caplog) == []


def test_a_redis_secret_url_without_a_password_is_logged_as_an_opt_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Given a Redis secret that holds a whole URL without a password
    caplog.set_level(logging.WARNING)
    # When it is read, Then it is used, and the missing AUTH is logged as an opt-out
    assert redis_url_from_secret("rediss://cache.example.com:6379", "") == (
        "rediss://cache.example.com:6379"
    )
    assert any("without AUTH" in w for w in _opt_outs(caplog))


@pytest.mark.parametrize(
    "url",
    [
        "https://user:tok@mail.example.com/send",
        "https://tok@mail.example.com",
        "https://:tok@mail.example.com",
        "http://user:tok@127.0.0.1:9000",
    ],
)
def test_a_provider_url_with_credentials_is_refused(url: str) -> None:
    # Given a job's provider URL with a user or password before the host
    for kind in (DrainSettings, AlertSettings):
        # When the drain's or the watcher's settings read it
        with pytest.raises(ConfigurationError, match="carries credentials") as raised:
            kind.from_env({"MAIL_PROVIDER_URL": url}, job_settings=MAIL)
        # Then the refusal names the setting, points at a secret, and never shows the token
        assert "MAIL_PROVIDER_URL" in str(raised.value)
        assert "secret" in str(raised.value)
        assert "tok" not in str(raised.value)


def test_an_infrai_base_url_with_credentials_is_refused_when_read() -> None:
    with pytest.raises(ConfigurationError, match="INFRAI_BASE_URL carries credentials"):
        DrainSettings.from_env({"INFRAI_BASE_URL": "https://key:sk_live_1@api.infrai.cc"})


# Every web URL parameter, however it is named (test_url_parameters finds them).
URL_PARAMETERS = tuple(
    name
    for name, spec in url_parameters(load_template()).items()
    if "https" in spec.get("AllowedPattern", "")
)
SAMPLE_URLS = [
    "https://api.infrai.cc",
    "https://mail.example.com/v1/send?region=eu",
    "http://127.0.0.1:8765",
    "http://localhost:9000/x",
    "http://[::1]:8765",
    "http://api.example.com",
    "http://10.0.0.7:8080",
    "http://127.0.0.1.example.com",
    "https://user:tok@mail.example.com",
    "https://tok@mail.example.com",
    "ftp://files.example.com",
]


def _code_accepts(url: str) -> bool:
    try:
        check_web_url("URL", url, allow_plain_http=False, example="https://example.com")
    except ConfigurationError:
        return False
    return True


@pytest.mark.parametrize("parameter", URL_PARAMETERS)
def test_the_templates_url_patterns_accept_exactly_what_the_code_accepts(parameter: str) -> None:
    # Given a URL parameter of the template and CloudFormation's reading of its pattern (the
    # whole value must match)
    pattern = re.compile(load_template()["Parameters"][parameter]["AllowedPattern"])
    for url in SAMPLE_URLS:
        # Then a deploy refuses each URL the functions would refuse at their cold start: plain
        # HTTP off loopback, credentials, another scheme
        assert bool(pattern.fullmatch(url)) == _code_accepts(url), (parameter, url)
    # And no parameter lets the functions' plain-HTTP opt-out in
    assert "AllowPlainHttp" not in load_template()["Parameters"]
