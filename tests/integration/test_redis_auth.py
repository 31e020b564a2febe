"""The Redis/Valkey second layer authenticates, with credentials from a secret, over TLS.

The template's ``RedisUrl`` carries no credentials (an environment variable is plain text to
anyone who can read the function); ``RedisSecretArn`` names a Secrets Manager secret holding the
password, ``{"username", "password"}`` for an ACL user, or the whole URL. ``redis://`` is refused
for any host but loopback: the password and the records would cross the network in clear.

The server here is a real ``redis-server`` started with ``--requirepass`` on a free loopback
port; where only ``REDIS_URL`` is given (CI's server), an ACL user with a password of this test's
own stands in, and is deleted afterwards.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import traceback
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import boto3
import pytest
import redis
from aws_lambda_powertools.utilities import parameters
from moto import mock_aws
from redis_server import wait_for_redis

from infrai_jobs.aws.second_layer import SecondLayer, redis_store
from infrai_jobs.aws.secrets import SecretSource, redis_url_from_secret
from infrai_jobs.config.settings import DrainSettings
from infrai_jobs.errors import ConfigurationError
from infrai_jobs.runtime.factory import make_effect_guard

PASSWORD = f"redis-Secret-{uuid.uuid4().hex[:12]}"
REGION = "us-east-1"
REQUIRE_PASSWORD = ("--requirepass", PASSWORD)
NO_PERSISTENCE = ("--save", "", "--appendonly", "no")


@dataclass(frozen=True)
class AuthenticatedRedis:
    url: str  # no credentials
    username: str  # "" for the default user (requirepass)

    def secret(self, password: str = PASSWORD) -> str:
        if self.username:
            return json.dumps({"username": self.username, "password": password})
        return password


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope="module")
def authenticated_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AuthenticatedRedis]:
    server = shutil.which("redis-server")
    if server is None:
        yield from _acl_user_on_the_shared_server()
        return
    port = _free_port()
    process = subprocess.Popen(
        [
            server,
            "--bind",
            "127.0.0.1",
            "--port",
            str(port),
            "--requirepass",
            PASSWORD,
            "--save",
            "",
            "--appendonly",
            "no",
        ],
        cwd=tmp_path_factory.mktemp("redis-auth"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_redis(f"redis://:{PASSWORD}@127.0.0.1:{port}/0", process)
        yield AuthenticatedRedis(url=f"redis://127.0.0.1:{port}/0", username="")
    finally:
        process.terminate()
        process.wait(timeout=10)


def _acl_user_on_the_shared_server() -> Iterator[AuthenticatedRedis]:
    url = os.environ.get("REDIS_URL", "").strip()
    if not url:
        pytest.fail("no redis-server to start and no REDIS_URL: apt-get install redis-server")
    admin = redis.Redis.from_url(url)
    username = f"infrai-jobs-auth-{uuid.uuid4().hex[:8]}"
    admin.acl_setuser(
        username, enabled=True, passwords=[f"+{PASSWORD}"], keys=["*"], commands=["+@all"]
    )
    try:
        yield AuthenticatedRedis(url=url, username=username)
    finally:
        admin.acl_deluser(username)
        admin.close()


def _guard(url: str) -> SecondLayer:
    settings = DrainSettings(idempotency_backend="redis", redis_url=url)
    guard = make_effect_guard(settings)
    assert isinstance(guard, SecondLayer)
    guard.start_invocation(_MinuteLeft().get_remaining_time_in_millis)
    return guard


class _MinuteLeft:
    """What the drain registers from its Lambda context: the time left in the invocation."""

    def get_remaining_time_in_millis(self) -> int:
        return 60_000


def _run_twice(guard: SecondLayer) -> list[str]:
    effects: list[str] = []
    key = f"auth.test:{uuid.uuid4().hex}"
    for _ in range(2):
        guard.run(key, "fingerprint", lambda: effects.append("sent") or {"ok": True})
    return effects


def test_the_password_from_the_secret_authenticates_the_second_layer(
    authenticated_redis: AuthenticatedRedis,
) -> None:
    # Given REDIS_URL without credentials, and the secret's password (or ACL user)
    url = redis_url_from_secret(authenticated_redis.secret(), authenticated_redis.url)
    # When the second layer guards the same effect twice
    effects = _run_twice(_guard(url))
    # Then it reached the server as that user: the effect ran once, the replay was a hit
    assert effects == ["sent"]
    client = redis.Redis.from_url(url)
    try:
        assert client.acl_whoami() == (authenticated_redis.username or "default")
    finally:
        client.close()


def test_without_the_password_the_server_refuses(
    authenticated_redis: AuthenticatedRedis,
) -> None:
    # Given the secret's password is wrong
    url = redis_url_from_secret(
        authenticated_redis.secret("not-the-password"), authenticated_redis.url
    )
    client = redis.Redis.from_url(url)
    # When the store's client talks to the server, Then authentication fails
    with pytest.raises(redis.AuthenticationError) as raised:
        client.ping()
    client.close()
    said = "".join(traceback.format_exception(raised.value))
    assert PASSWORD not in said


def test_the_secret_arrives_through_secrets_manager_in_aws(
    authenticated_redis: AuthenticatedRedis, fake_aws_credentials: str
) -> None:
    # Given the template's environment: REDIS_URL without credentials, REDIS_SECRET_ARN naming
    # the secret (Secrets Manager answered by moto)
    with mock_aws():
        secrets = boto3.client("secretsmanager", region_name=REGION)
        arn = secrets.create_secret(
            Name="infrai-jobs/redis", SecretString=authenticated_redis.secret()
        )["ARN"]
        settings = DrainSettings.from_env(
            {
                "IDEMPOTENCY_BACKEND": "redis",
                "REDIS_URL": authenticated_redis.url,
                "REDIS_SECRET_ARN": arn,
            }
        )
        # When the drain resolves its secrets at cold start
        resolved = SecretSource(settings, api_key=False).resolve()
    parameters.clear_caches()
    # Then the second layer authenticates with them, and the settings never show them
    assert _run_twice(_guard(resolved.redis_url)) == ["sent"]
    assert PASSWORD not in repr(resolved)


@pytest.mark.parametrize(
    "url",
    ["redis://cache.internal:6379/0", "redis://10.0.0.5:6379", "redis://:pw@cache.example.com"],
)
def test_plain_redis_to_a_host_that_is_not_loopback_is_refused(url: str) -> None:
    with pytest.raises(ConfigurationError, match="use rediss://") as raised:
        DrainSettings.from_env({"IDEMPOTENCY_BACKEND": "redis", "REDIS_URL": url})
    assert ":pw@" not in str(raised.value)


@pytest.mark.parametrize(
    "url", ["rediss://cache.example.com:6379/0", "redis://127.0.0.1:6379/0", "unix:///tmp/r.sock"]
)
def test_tls_loopback_and_unix_socket_urls_are_accepted(url: str) -> None:
    settings = DrainSettings.from_env({"IDEMPOTENCY_BACKEND": "redis", "REDIS_URL": url})
    assert settings.redis_url == url


def test_a_secret_holding_a_plain_url_to_a_remote_host_is_refused_without_showing_it() -> None:
    with pytest.raises(ConfigurationError, match="use rediss://") as raised:
        redis_url_from_secret("redis://:hunter2@cache.example.com:6379", "")
    assert "hunter2" not in str(raised.value)


def test_a_secret_holding_the_whole_tls_url_is_used_as_is() -> None:
    url = "rediss://app:s3cret@cache.example.com:6379/0"
    assert redis_url_from_secret(url, "") == url


def test_a_password_is_quoted_into_the_url() -> None:
    url = redis_url_from_secret(
        json.dumps({"username": "app", "password": "p@ss/w:rd"}),
        "rediss://cache.example.com:6379/0",
    )
    assert url == "rediss://app:p%40ss%2Fw%3Ard@cache.example.com:6379/0"
    assert redis.connection.parse_url(url)["password"] == "p@ss/w:rd"


def test_credentials_in_redis_url_and_a_secret_together_are_refused() -> None:
    with pytest.raises(ConfigurationError, match="keep the password in the secret only"):
        DrainSettings.from_env(
            {
                "IDEMPOTENCY_BACKEND": "redis",
                "REDIS_URL": "rediss://:pw@cache.example.com",
                "REDIS_SECRET_ARN": "arn:aws:secretsmanager:eu-west-1:123456789012:secret:r-AbCdEf",
            }
        )


def test_a_store_built_from_a_url_keeps_no_password_in_its_repr(
    authenticated_redis: AuthenticatedRedis,
) -> None:
    url = redis_url_from_secret(authenticated_redis.secret(), authenticated_redis.url)
    assert PASSWORD not in repr(redis_store(url))
