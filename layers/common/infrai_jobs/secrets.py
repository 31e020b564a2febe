"""Secrets in AWS: the API key from SSM, the database URL from Secrets Manager, both cached.

Locally the plain env vars (``INFRAI_API_KEY``, ``DATABASE_URL``) win and nothing here runs. In
AWS the template sets only the *names* (``INFRAI_API_KEY_PARAMETER``, ``DATABASE_SECRET_ARN``);
the values are fetched through Powertools Parameters, cached for ``max_age`` seconds, so a
rotated secret is picked up without a deploy. boto3 is imported only when a secret is fetched.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any
from urllib.parse import quote

from psycopg.conninfo import make_conninfo

from infrai_jobs.errors import ConfigurationError
from infrai_jobs.postgres import malformed_reason, parse_conninfo
from infrai_jobs.settings import Settings

SECRET_CACHE_SECONDS = 300


def resolve_secrets(
    settings: Settings,
    *,
    api_key: bool = True,
    database: bool = True,
    force_fetch: bool = False,
) -> Settings:
    """Fill in the API key and database URL from AWS when only their names are configured.

    A function fetches only what it uses (``api_key``/``database``), so its role needs no more.
    """
    key = settings.infrai_api_key
    if api_key and not key and settings.api_key_parameter:
        key = _fetch_parameter(settings.api_key_parameter, force_fetch=force_fetch)
    database_url = settings.database_url
    if database and not database_url and settings.database_secret_arn:
        database_url = database_url_from_secret(
            _fetch_secret(settings.database_secret_arn, force_fetch=force_fetch)
        )
    return replace(settings, infrai_api_key=key, database_url=database_url)


# sslmode values that let libpq fall back to (or start with) plain text.
WEAK_SSLMODES = frozenset({"disable", "allow", "prefer"})


def database_url_from_secret(secret: str) -> str:
    """The connection string a database secret holds, with TLS required.

    Accepted shapes: a ``postgresql://`` URL, a libpq keyword string, or JSON (an RDS-managed
    secret's ``host``/``username``/``password``/``port``/``dbname``, or ``{"url": ...}``). In
    AWS the ledger is reached over the network, so a secret without an ``sslmode`` gets
    ``sslmode=require``, and one asking for a mode that allows plain text is refused.
    """
    return _require_tls(_connection_string(secret.strip()))


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
    return f"postgresql://{user}:{password}@{host}:{port}/{dbname}?sslmode=require"


def _require_tls(url: str) -> str:
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
    if mode is None:
        return make_conninfo(url, sslmode="require")
    if mode in WEAK_SSLMODES:
        raise ConfigurationError(
            f"the database secret asks for sslmode={mode}, which allows plain text; use "
            "require, verify-ca or verify-full"
        )
    return url


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
