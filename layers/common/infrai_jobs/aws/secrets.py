"""Secrets in AWS: the API key from SSM; the database URL, the Redis credentials and the jobs'
secrets from Secrets Manager, fetched by the names the template sets, through Powertools
Parameters, cached (a rotated secret is picked up without a deploy; the jobs' secrets at the next
cold start). Locally the plain variables win and nothing here runs. boto3 is imported only when a
secret is fetched. No error here shows a secret."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from types import MappingProxyType
from typing import Any, Generic
from urllib.parse import quote, urlsplit, urlunsplit

from psycopg.conninfo import make_conninfo

from infrai_jobs.config.redis_url import REDIS_SCHEMES, check_redis_url, redis_lacks_auth
from infrai_jobs.config.settings import (
    DATABASE_SSLMODES,
    DEFAULT_DATABASE_SSLMODE,
    SECRET_ARN_SUFFIX,
    AnySettings,
    JobSettings,
)
from infrai_jobs.errors import ConfigurationError
from infrai_jobs.ledger.postgres import malformed_reason, parse_conninfo

SECRET_CACHE_SECONDS = 300

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SecretRefresh:
    """How a warm environment picks up a rotated secret: the queue client retries a 401 once,
    and the ledger a failed connect once, with the secret fetched again past its cache. Only a
    secret fetched by name can rotate under a running function; otherwise the hook is None."""

    api_key: Callable[[], str] | None
    database_url: Callable[[], str] | None


@dataclass(frozen=True, slots=True)
class SecretSource(Generic[AnySettings]):
    """The one source of a function's (or a CLI command's) secrets: ``resolve()`` fills in the
    ones ``settings`` name; ``refresh`` gives the hooks that fetch a rotated one again. Only
    what the function uses is fetched (``api_key=False``: it never calls Infrai; Redis only
    with ``IDEMPOTENCY_BACKEND=redis``), so its role needs no more."""

    settings: AnySettings
    api_key: bool = True

    def resolve(self) -> AnySettings:
        """The settings with every secret they name fetched, the jobs' secrets included."""
        settings, fetch = self.settings, self._fetchers(force_fetch=False)
        resolved = replace(
            settings,
            infrai_api_key=fetch.api_key() if fetch.api_key else settings.infrai_api_key,
            database_url=fetch.database_url() if fetch.database_url else settings.database_url,
        )
        if not isinstance(resolved, JobSettings):
            return resolved
        redis_url, job_secrets = resolved.redis_url, resolved.job_secrets
        if resolved.idempotency_backend == "redis" and resolved.redis_secret_arn:
            redis_url = redis_url_from_secret(_fetch(resolved.redis_secret_arn, False), redis_url)
        if any(resolved.job_secret_arns.values()):
            job_secrets = MappingProxyType(_job_secrets(resolved))
        return replace(resolved, redis_url=redis_url, job_secrets=job_secrets)

    @property
    def refresh(self) -> SecretRefresh:
        return self._fetchers(force_fetch=True)

    def _fetchers(self, *, force_fetch: bool) -> SecretRefresh:
        """A fetch for each secret named and not given in plain (a plain one wins)."""
        settings = self.settings
        api_key = database_url = None
        if self.api_key and not settings.infrai_api_key and settings.api_key_parameter:
            api_key = partial(_fetch, settings.api_key_parameter, force_fetch, ssm=True)
        if not settings.database_url and settings.database_secret_arn:
            database_url = partial(_database_url, settings, force_fetch)
        return SecretRefresh(api_key=api_key, database_url=database_url)


def _database_url(settings: AnySettings, force_fetch: bool) -> str:
    url = database_url_from_secret(
        _fetch(settings.database_secret_arn, force_fetch),
        sslmode=settings.database_sslmode,
        ca_bundle=settings.database_ca_bundle,
    )
    return make_conninfo(url, host=settings.database_host) if settings.database_host else url


def _job_secrets(settings: JobSettings) -> dict[str, str]:
    """Each job secret's value: fetched when its ARN is set, else as the settings hold it."""
    from aws_lambda_powertools.utilities.parameters.exceptions import (  # noqa: PLC0415
        GetParameterError,
    )

    values = dict(settings.job_secrets)
    for name, arn in settings.job_secret_arns.items():
        if not arn:
            continue
        try:
            values[name] = _fetch(arn, False)
        except (GetParameterError, ConfigurationError) as exc:
            jobs = ", ".join(settings.job_secret_owners.get(name, ()))
            raise ConfigurationError(
                f"{name}{SECRET_ARN_SUFFIX} (for {jobs}): the secret cannot be read: {exc}"
            ) from exc
    return values


def redis_url_from_secret(secret: str, url: str) -> str:
    """The Redis URL with the credentials a secret holds: the whole URL, JSON with
    ``password`` (and ``username`` for an ACL user), or the bare password, added to ``url``
    (``REDIS_URL``, which then carries none)."""
    text = secret.strip()
    if text.startswith(REDIS_SCHEMES):
        check_redis_url("the Redis secret's URL", text)
        if redis_lacks_auth(text):
            logger.warning(
                "the Redis secret's URL carries no password: the second layer's Redis takes "
                "commands without AUTH, so anyone who reaches it can read or drop its records",
                extra={"action": "security_opt_out"},
            )
        return text
    username, password = "", text
    if text.startswith("{"):
        document = _json(text, "the Redis secret is neither a URL, JSON nor a password")
        if not isinstance(document, dict) or not isinstance(document.get("password"), str):
            raise ConfigurationError('the Redis secret JSON has no "password" string')
        username, password = str(document.get("username") or ""), document["password"]
    if not password:
        raise ConfigurationError("the Redis secret holds an empty password")
    if not url:
        raise ConfigurationError(
            "REDIS_SECRET_ARN holds a password but REDIS_URL is empty: set REDIS_URL (template "
            "parameter RedisUrl) to the server, or put the whole URL in the secret"
        )
    check_redis_url("REDIS_URL", url)
    parts = urlsplit(url)
    credentials = f"{quote(username, safe='')}:{quote(password, safe='')}@"
    return urlunsplit(parts._replace(netloc=credentials + parts.netloc))


# sslmode values that let libpq fall back to (or start with) plain text.
WEAK_SSLMODES = frozenset({"disable", "allow", "prefer"})
# The modes that check the server's certificate, and so need the CA that signed it.
_VERIFYING_SSLMODES = frozenset({"verify-ca", "verify-full"})


def database_url_from_secret(
    secret: str, *, sslmode: str = DEFAULT_DATABASE_SSLMODE, ca_bundle: str = ""
) -> str:
    """The connection string a database secret holds (a ``postgresql://`` URL, a libpq keyword
    string, RDS secret JSON or ``{"url": ...}``), with the server verified: without its own
    ``sslmode`` it gets ``sslmode`` and, for the verifying modes, ``sslrootcert=ca_bundle``; a
    weaker mode than ``sslmode``, or one allowing plain text, is refused."""
    return _require_tls(_connection_string(secret.strip()), sslmode, ca_bundle)


def _connection_string(text: str) -> str:
    if text.startswith(("postgresql://", "postgres://")):
        return text
    if not text.startswith("{") and "=" in text:
        return text  # libpq's keyword form: "host=... dbname=... user=..."
    document = _json(
        text,
        "the database secret is neither a postgresql:// URL, a libpq connection string nor "
        "RDS secret JSON",
    )
    if not isinstance(document, dict):
        raise ConfigurationError("the database secret JSON is not an object")
    if isinstance(document.get("url"), str):
        return str(document["url"])
    if missing := [k for k in ("host", "username", "password") if not document.get(k)]:
        raise ConfigurationError(f"the database secret JSON lacks {', '.join(missing)}")
    try:
        port = int(document.get("port") or 5432)
    except (TypeError, ValueError):
        raise ConfigurationError("the database secret JSON's port is not a number") from None
    user = quote(str(document["username"]), safe="")
    password = quote(str(document["password"]), safe="")
    host = str(document["host"])
    dbname = quote(str(document.get("dbname") or document.get("database") or "postgres"), safe="")
    return f"postgresql://{user}:{password}@{host}:{port}/{dbname}"


def _json(text: str, error: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        raise ConfigurationError(error) from None


def _require_tls(url: str, minimum: str, ca_bundle: str) -> str:
    # Before make_conninfo rewrites it into keywords: once rewritten, the tail of a password
    # with an unescaped '@' would look like a host of its own, and no longer like a password.
    reason = malformed_reason(url)
    if reason and parse_conninfo(url) is not None:
        raise ConfigurationError(f"the database secret's URL is malformed: {reason}")
    if (params := parse_conninfo(url)) is None:
        # libpq's message quotes the whole string, password included: say only what is wrong.
        raise ConfigurationError("the database secret is not a valid connection string")
    mode = params.get("sslmode")
    if mode in WEAK_SSLMODES:
        raise ConfigurationError(
            f"the database secret asks for sslmode={mode}, which allows plain text; use "
            "verify-full (or set DATABASE_SSLMODE to opt out to verify-ca or require)"
        )
    if mode is not None and _strength(mode) < _strength(minimum):
        raise ConfigurationError(
            f"the database secret asks for sslmode={mode}, weaker than DATABASE_SSLMODE="
            f"{minimum} (template parameter DatabaseSslMode): remove sslmode from the secret, "
            "or opt out with that parameter"
        )
    added: dict[str, str] = {} if mode else {"sslmode": minimum}
    if (mode or minimum) in _VERIFYING_SSLMODES and not params.get("sslrootcert"):
        added["sslrootcert"] = _ca_bundle(ca_bundle, mode or minimum)
    return make_conninfo(url, **added) if added else url


def _strength(mode: str) -> int:
    """Higher is stronger; a mode libpq knows but this list does not counts as the weakest."""
    order = tuple(reversed(DATABASE_SSLMODES))
    return order.index(mode) if mode in order else -1


def _ca_bundle(path: str, mode: str) -> str:
    if not path:
        raise ConfigurationError(
            f"sslmode={mode} needs the CA bundle that signed the database's certificate: set "
            "DATABASE_CA_BUNDLE (template parameter DatabaseCaBundle) to its PEM file, e.g. "
            "AWS's RDS global bundle (docs/configuration.md says how to get it)"
        )
    if not os.path.isfile(path):
        raise ConfigurationError(
            f"DATABASE_CA_BUNDLE names {path}, which is not a file: ship the PEM with the "
            "functions (docs/configuration.md, 'The ledger's TLS')"
        )
    return path


def _fetch(name: str, force_fetch: bool, *, ssm: bool = False) -> str:
    """A Secrets Manager secret by ARN, or with ``ssm`` an SSM parameter by name, decrypted."""
    from aws_lambda_powertools.utilities import parameters  # noqa: PLC0415 - boto3 on demand

    cached: dict[str, Any] = {"max_age": SECRET_CACHE_SECONDS, "force_fetch": force_fetch}
    # A binary secret (SecretBinary) arrives as bytes whatever the stubs say.
    value: object = (
        parameters.get_parameter(name, decrypt=True, **cached)
        if ssm
        else parameters.get_secret(name, **cached)
    )
    if isinstance(value, bytes):
        value = value.decode()
    if not isinstance(value, str) or not value:
        raise ConfigurationError(f"{'SSM parameter' if ssm else 'secret'} {name} is empty")
    return value
