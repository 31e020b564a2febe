"""Secrets in AWS: the API key from SSM, the database URL from Secrets Manager, both cached.

Locally the plain env vars (``INFRAI_API_KEY``, ``DATABASE_URL``) win and nothing here runs. In
AWS the template sets only the *names* (``INFRAI_API_KEY_PARAMETER``, ``DATABASE_SECRET_ARN``);
the values are fetched through Powertools Parameters, cached for ``max_age`` seconds, so a
rotated secret is picked up without a deploy. boto3 is imported only when a secret is fetched.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

from psycopg.conninfo import make_conninfo

from infrai_jobs.config.settings import (
    DATABASE_SSLMODES,
    DEFAULT_DATABASE_SSLMODE,
    Settings,
    check_redis_url,
)
from infrai_jobs.errors import ConfigurationError
from infrai_jobs.ledger.postgres import malformed_reason, parse_conninfo

_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")

SECRET_CACHE_SECONDS = 300


def resolve_secrets(
    settings: Settings,
    *,
    api_key: bool = True,
    database: bool = True,
    force_fetch: bool = False,
) -> Settings:
    """Fill in the API key and database URL from AWS when only their names are configured, and
    the Redis second layer's credentials when its secret is named.

    A function fetches only what it uses (``api_key``/``database``; the Redis secret only with
    ``IDEMPOTENCY_BACKEND=redis``), so its role needs no more.
    """
    key = settings.infrai_api_key
    if api_key and not key and settings.api_key_parameter:
        key = _fetch_parameter(settings.api_key_parameter, force_fetch=force_fetch)
    database_url = settings.database_url
    if database and not database_url and settings.database_secret_arn:
        database_url = database_url_from_secret(
            _fetch_secret(settings.database_secret_arn, force_fetch=force_fetch),
            sslmode=settings.database_sslmode,
            ca_bundle=settings.database_ca_bundle,
        )
    redis_url = settings.redis_url
    if settings.idempotency_backend == "redis" and settings.redis_secret_arn:
        redis_url = redis_url_from_secret(
            _fetch_secret(settings.redis_secret_arn, force_fetch=force_fetch), settings.redis_url
        )
    return replace(settings, infrai_api_key=key, database_url=database_url, redis_url=redis_url)


def redis_url_from_secret(secret: str, url: str) -> str:
    """The Redis/Valkey URL with the credentials a secret holds: the whole URL
    (``rediss://...``), JSON with ``password`` (and ``username`` for an ACL user), or the bare
    password, added to ``url`` (``REDIS_URL``, which then carries none). Either way the URL
    must be ``rediss://`` unless its host is loopback. No error shows the secret."""
    text = secret.strip()
    if text.startswith(_REDIS_SCHEMES):
        check_redis_url("the Redis secret's URL", text)
        return text
    username, password = "", text
    if text.startswith("{"):
        try:
            document: Any = json.loads(text)
        except ValueError:
            raise ConfigurationError(
                "the Redis secret is neither a URL, JSON nor a password"
            ) from None
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
    """The connection string a database secret holds, with the server verified.

    Accepted shapes: a ``postgresql://`` URL, a libpq keyword string, or JSON (an RDS-managed
    secret's ``host``/``username``/``password``/``port``/``dbname``, or ``{"url": ...}``). In
    AWS the ledger is reached over the network, so a secret without an ``sslmode`` gets
    ``sslmode`` (``DATABASE_SSLMODE``, verify-full unless opted out) and, for the verifying
    modes, ``sslrootcert=ca_bundle`` (``DATABASE_CA_BUNDLE``). A secret asking for a weaker mode
    than that, or for one that allows plain text, is refused.
    """
    return _require_tls(_connection_string(secret.strip()), sslmode, ca_bundle)


def _connection_string(text: str) -> str:
    if text.startswith(("postgresql://", "postgres://")):
        return text
    if not text.startswith("{") and "=" in text:
        return text  # libpq's keyword form: "host=... dbname=... user=..."
    try:
        document: Any = json.loads(text)
    except ValueError:
        raise ConfigurationError(
            "the database secret is neither a postgresql:// URL, a libpq connection string nor "
            "RDS secret JSON"
        ) from None
    if not isinstance(document, dict):
        raise ConfigurationError("the database secret JSON is not an object")
    if isinstance(document.get("url"), str):
        return str(document["url"])
    missing = [k for k in ("host", "username", "password") if not document.get(k)]
    if missing:
        raise ConfigurationError(f"the database secret JSON lacks {', '.join(missing)}")
    raw_port = document.get("port") or 5432
    try:
        port = int(raw_port)
    except (TypeError, ValueError):
        raise ConfigurationError(
            "the database secret JSON has a port that is not a number"
        ) from None
    user = quote(str(document["username"]), safe="")
    password = quote(str(document["password"]), safe="")
    host = str(document["host"])
    dbname = quote(str(document.get("dbname") or document.get("database") or "postgres"), safe="")
    return f"postgresql://{user}:{password}@{host}:{port}/{dbname}"


def _require_tls(url: str, minimum: str, ca_bundle: str) -> str:
    # Before make_conninfo rewrites it into keywords: once rewritten, the tail of a password
    # with an unescaped '@' would look like a host of its own, and no longer like a password.
    reason = malformed_reason(url)
    if reason and parse_conninfo(url) is not None:
        raise ConfigurationError(f"the database secret's URL is malformed: {reason}")
    params = parse_conninfo(url)
    if params is None:
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


def _fetch_parameter(name: str, *, force_fetch: bool) -> str:
    from aws_lambda_powertools.utilities import parameters  # noqa: PLC0415 - boto3 on demand

    value = parameters.get_parameter(
        name, decrypt=True, max_age=SECRET_CACHE_SECONDS, force_fetch=force_fetch
    )
    if not isinstance(value, str) or not value:
        raise ConfigurationError(f"SSM parameter {name} is empty")
    return value


def _fetch_secret(arn: str, *, force_fetch: bool) -> str:
    from aws_lambda_powertools.utilities import parameters  # noqa: PLC0415 - boto3 on demand

    # A binary secret (SecretBinary) arrives as bytes whatever the stubs say.
    value: object = parameters.get_secret(
        arn, max_age=SECRET_CACHE_SECONDS, force_fetch=force_fetch
    )
    if isinstance(value, bytes):
        value = value.decode()
    if not isinstance(value, str) or not value:
        raise ConfigurationError(f"secret {arn} is empty")
    return value
