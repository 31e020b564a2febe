"""Settings, read once at the edge into frozen, validated objects, one type per function: the only
module that reads the package's settings from the environment (Powertools' own aside). Each setting
is declared once, as its field (``setting(variable, default, parse)``; what each means is
docs/configuration.md's); checks spanning several fields live apart (``_check_second_layer``). The
jobs' settings are exactly those they declared (``from_env(job_settings=..., job_secrets=...)``),
from ``JOB_SETTINGS``'s JSON object; a secret by its ``NAME_SECRET_ARN`` (``NAME``: a stand-in).
Every URL called over HTTP is HTTPS or plain HTTP to loopback (``check_web_url``); ``DATABASE_URL``
is checked where the ledger's connector is built, so reading settings never loads the driver."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal, Self, TypeVar, get_args
from urllib.parse import urlsplit

from infrai_jobs.config.redis_url import check_redis_url, is_loopback_host, redis_lacks_auth
from infrai_jobs.config.table import (
    TRUE_WORDS,
    Parse,
    Reading,
    Setting,
    parse_bool,
    parse_choice,
    parse_int,
    parse_text,
    parse_verbatim,
    setting,
    settings_table,
)
from infrai_jobs.errors import ConfigurationError, unset_for_jobs
from infrai_jobs.queue_contract import DEFAULT_VISIBILITY_TIMEOUT_SECONDS

DEFAULT_BASE_URL = "https://api.infrai.cc"
DEFAULT_QUEUE = "billing-jobs"
MAX_DRAIN_LANES = 16
# Infrai's answers are small; this stops a broken or hostile server filling a 512 MB Lambda.
DEFAULT_MAX_ANSWER_BYTES = 16 * 1024 * 1024
# Lambda's own ceiling on one function's concurrency in a default account.
MAX_DRAIN_CONCURRENCY = 1000
# Idle polling faster than this would spend Infrai's consume rate limit on an empty queue.
MIN_IDLE_POLL_MS = 50
ALLOW_PLAIN_HTTP_ENV = "INFRAI_ALLOW_PLAIN_HTTP"
SECRET_ARN_SUFFIX = "_SECRET_ARN"  # noqa: S105 - a variable name's suffix, not a secret
JOB_SETTINGS_ENV = "JOB_SETTINGS"  # The JobSettings parameter: the jobs' settings, as JSON.

# The ledger's TLS in AWS, strongest first: verify-full checks the certificate and the host name,
# verify-ca the certificate only, require neither (an explicit, logged opt-out each).
DATABASE_SSLMODES = ("verify-full", "verify-ca", "require")
DEFAULT_DATABASE_SSLMODE = "verify-full"

AnySettings = TypeVar("AnySettings", bound="CommonSettings")

IdempotencyBackend = Literal["off", "dynamodb", "redis"]
Declared = Mapping[str, Sequence[str]]  # A declared setting's or secret's name: its jobs.

_logger = logging.getLogger(__name__)


def _web_url(example: str) -> Parse:
    def parse(row: Setting, raw: str | None, reading: Reading) -> str:
        if url := parse_text(row, raw, reading):
            allow_plain_http = bool(reading.value("allow_plain_http"))
            check_web_url(row.variable, url, allow_plain_http=allow_plain_http, example=example)
        return url

    return parse


def _queue(row: Setting, raw: str | None, reading: Reading) -> str:
    if not (queue := parse_text(row, raw, reading)):
        raise ConfigurationError(f"{row.variable} is empty; set it to the queue to drain")
    return queue


def _dlq(row: Setting, raw: str | None, reading: Reading) -> str:
    queue = str(reading.value("queue"))
    dlq = f"{queue}-dlq" if raw is None else raw.strip()
    if dlq == queue:
        raise ConfigurationError("INFRAI_DLQ must differ from INFRAI_QUEUE")
    return dlq


def _queue_names(row: Setting, raw: str | None, reading: Reading) -> tuple[str, ...]:
    """Comma-separated names, each once; none means the drained queue."""
    names = (name.strip() for name in (raw or "").split(","))
    return tuple(dict.fromkeys(name for name in names if name)) or (reading.value("queue"),)


def _in_task_root(row: Setting, raw: str | None, reading: Reading) -> str:
    """A relative path as Lambda sees it: under the function's code (LAMBDA_TASK_ROOT)."""
    path = parse_text(row, raw, reading)
    root = reading.env.get("LAMBDA_TASK_ROOT", "")
    if not path or os.path.isabs(path) or not root:
        return path
    return os.path.join(root, path)


_SSLMODE = parse_choice(
    DATABASE_SSLMODES, why=": modes that allow plain text are never used for the ledger in AWS"
)
_LANES = parse_int(
    minimum=1,
    maximum=MAX_DRAIN_LANES,
    why_maximum="; add concurrent invocations instead (overlapping schedules are safe)",
)
_MAX_CONCURRENCY = parse_int(
    minimum=0, maximum=MAX_DRAIN_CONCURRENCY, why_maximum=", Lambda's default concurrency limit"
)


def _off_or_polite_poll(variable: str, poll_ms: int) -> None:
    if 0 < poll_ms < MIN_IDLE_POLL_MS:
        raise ConfigurationError(
            f"{variable}={poll_ms} is below {MIN_IDLE_POLL_MS}: every poll is a consume call, "
            "and Infrai rate-limits them (0 turns polling off)"
        )


def _retention_days() -> int:
    # A function, not a shared field object: the prune and the second layer each declare the
    # field, and dataclasses writes each field's name and type into its field object.
    return setting("LEDGER_RETENTION_DAYS", 30, parse_int(minimum=1))


@dataclass(frozen=True, slots=True)
class CommonSettings:
    """What every function reads: how to reach Infrai and the ledger, and the queue's names."""

    # Empty means "not configured": local commands then start an emulator; handlers refuse.
    infrai_base_url: str = setting("INFRAI_BASE_URL", "", _web_url(DEFAULT_BASE_URL))
    infrai_api_key: str = setting("INFRAI_API_KEY", "", parse_verbatim, secret=True)
    queue: str = setting("INFRAI_QUEUE", DEFAULT_QUEUE, _queue)
    dlq: str = setting("INFRAI_DLQ", f"{DEFAULT_QUEUE}-dlq", _dlq)
    database_url: str = setting("DATABASE_URL", "", parse_verbatim, secret=True)
    # In AWS the secrets are named, and fetched by infrai_jobs.aws.secrets.
    api_key_parameter: str = setting("INFRAI_API_KEY_PARAMETER", "", parse_text)
    database_secret_arn: str = setting("DATABASE_SECRET_ARN", "", parse_text)
    max_answer_bytes: int = setting(
        "INFRAI_MAX_ANSWER_BYTES", DEFAULT_MAX_ANSWER_BYTES, parse_int(minimum=65_536)
    )
    publish_retries: bool = setting("INFRAI_PUBLISH_RETRIES", False, parse_bool)
    allow_plain_http: bool = setting(ALLOW_PLAIN_HTTP_ENV, False, parse_bool)
    database_sslmode: str = setting("DATABASE_SSLMODE", DEFAULT_DATABASE_SSLMODE, _SSLMODE)
    database_ca_bundle: str = setting("DATABASE_CA_BUNDLE", "", _in_task_root)
    database_host: str = setting("DATABASE_HOST", "", parse_text)
    database_prepared_statements: bool = setting("DATABASE_PREPARED_STATEMENTS", False, parse_bool)
    visibility_timeout_seconds: int = setting(
        "INFRAI_VISIBILITY_TIMEOUT_SECONDS",
        DEFAULT_VISIBILITY_TIMEOUT_SECONDS,
        parse_int(minimum=1),
    )

    @classmethod
    def from_env(
        cls,
        environ: Mapping[str, str] | None = None,
        *,
        job_settings: Declared | None = None,
        job_secrets: Declared | None = None,
    ) -> Self:
        """These settings, read from ``environ`` (``os.environ`` by default): only their table's
        variables, each checked (a bad value is a ``ConfigurationError`` naming its variable);
        every secure default they turn off is logged. ``JobSettings`` also read the settings and
        secrets the registered jobs declared (``JobRegistry.declared_settings()``,
        ``declared_secrets()``); whether an unset one is an error is for the command or the
        function to say."""
        env = os.environ if environ is None else environ
        table = settings_table(cls)
        reading = Reading(env, table)
        values = {row.field_name: reading.value(row.field_name) for row in table}
        if issubclass(cls, JobSettings):
            allow_plain_http = bool(values["allow_plain_http"])
            values.update(_job_fields(env, job_settings or {}, job_secrets or {}, allow_plain_http))
        settings = cls(**values)
        if isinstance(settings, JobSettings):
            _check_second_layer(settings)
        for warning in settings.security_opt_outs():
            _logger.warning(warning, extra={"action": "security_opt_out"})
        return settings

    def security_opt_outs(self) -> list[str]:
        """One sentence per secure default these settings turn off, logged as a warning each
        time they are read (every cold start)."""
        opt_outs = []
        if self.allow_plain_http:
            # The jobs' declared URLs too, when these are JobSettings.
            urls = {"INFRAI_BASE_URL": self.infrai_base_url, **getattr(self, "job_settings", {})}
            plain = [name for name, url in urls.items() if url and _is_plain_http_off_loopback(url)]
            opt_outs.append(
                f"{ALLOW_PLAIN_HTTP_ENV}=true: plain HTTP is allowed to hosts that are not "
                "loopback, so an API key or a job's data may cross the network unencrypted"
                + (f" ({', '.join(plain)} use it)" if plain else "")
            )
        if self.database_secret_arn and self.database_sslmode != DEFAULT_DATABASE_SSLMODE:
            unchecked = "host name" if self.database_sslmode == "verify-ca" else "certificate"
            opt_outs.append(
                f"DATABASE_SSLMODE={self.database_sslmode}: the ledger connection does not "
                f"verify the server's {unchecked}, so a man in the middle could read it "
                "(verify-full is the default)"
            )
        return opt_outs

    def require_base_url(self) -> str:
        return _required(self.infrai_base_url, "INFRAI_BASE_URL")

    def require_api_key(self) -> str:
        return _required(self.infrai_api_key, "INFRAI_API_KEY")

    def require_database_url(self) -> str:
        return _required(self.database_url, "DATABASE_URL")


def _empty() -> Mapping[str, Any]:
    return MappingProxyType({})


@dataclass(frozen=True, slots=True)
class JobSettings(CommonSettings):
    """Common settings plus the settings the registered jobs declared (the drain's jobs run
    with them; the watcher's probes ask their providers)."""

    # Each declared setting's value ("" when unset) and secret's ARN and value (locally the
    # plain NAME; in AWS filled in by aws.secrets), and the jobs that declared each.
    job_settings: Mapping[str, str] = field(default_factory=_empty)
    job_setting_owners: Mapping[str, tuple[str, ...]] = field(default_factory=_empty)
    job_secret_arns: Mapping[str, str] = field(default_factory=_empty)
    job_secrets: Mapping[str, str] = field(default_factory=_empty, repr=False)
    job_secret_owners: Mapping[str, tuple[str, ...]] = field(default_factory=_empty)
    idempotency_backend: IdempotencyBackend = setting(
        "IDEMPOTENCY_BACKEND", "off", parse_choice(get_args(IdempotencyBackend), lower=True)
    )
    idempotency_table: str = setting("IDEMPOTENCY_TABLE", "", parse_text)
    # May carry a password locally; in AWS the password is in the secret REDIS_SECRET_ARN names.
    redis_url: str = setting("REDIS_URL", "", parse_text, secret=True)
    redis_secret_arn: str = setting("REDIS_SECRET_ARN", "", parse_text)
    retention_days: int = _retention_days()

    def security_opt_outs(self) -> list[str]:
        opt_outs = CommonSettings.security_opt_outs(self)
        redis_without_secret = self.idempotency_backend == "redis" and not self.redis_secret_arn
        if redis_without_secret and redis_lacks_auth(self.redis_url):
            opt_outs.append(
                "REDIS_URL carries no password and REDIS_SECRET_ARN is not set: the second "
                "layer's Redis takes commands without AUTH, so anyone who reaches it can read or "
                "drop its records (name the AUTH token's secret with REDIS_SECRET_ARN)"
            )
        return opt_outs

    def require_job_settings(self) -> dict[str, str]:
        """The jobs' declared settings, every one set, else an error naming each unset one."""
        if unset := unset_for_jobs(self.job_setting_owners, self.job_settings):
            advice = "set each to its downstream's URL (or a running `infrai-jobs provider-sink`)"
            raise ConfigurationError(f"{unset}: {advice}")
        return dict(self.job_settings)

    def require_job_secrets(self) -> dict[str, str]:
        """The jobs' declared secrets (``aws.secrets`` fetched the named ones), every one set."""
        each = (
            f": in AWS, name its Secrets Manager secret with {{name}}{SECRET_ARN_SUFFIX} (in the "
            "JobSettings parameter); locally, export {name}"
        )
        if unset := unset_for_jobs(self.job_secret_owners, self.job_secrets, each):
            raise ConfigurationError(unset)
        return dict(self.job_secrets)


@dataclass(frozen=True, slots=True)
class DrainSettings(JobSettings):
    """DrainFunction's (and ``infrai-jobs drain``'s, and the operator tools' second layer)."""

    batch_budget_ms: int = setting("DRAIN_BATCH_BUDGET_MS", 20_000, parse_int(minimum=100))
    lease_grace_seconds: int = setting("LEASE_GRACE_SECONDS", 60, parse_int(minimum=0))
    drain_lanes: int = setting("DRAIN_LANES", 1, _LANES)
    drain_idle_poll_ms: int = setting(
        "DRAIN_IDLE_POLL_MS", 0, parse_int(minimum=0, check=_off_or_polite_poll)
    )
    drain_idle_window_seconds: int = setting("DRAIN_IDLE_WINDOW_SECONDS", 0, parse_int(minimum=0))
    drain_max_concurrency: int = setting("DRAIN_MAX_CONCURRENCY", 0, _MAX_CONCURRENCY)
    drain_fan_out_after_seconds: int = setting(
        "DRAIN_FANOUT_AFTER_SECONDS", 30, parse_int(minimum=1)
    )
    drain_function_name: str = setting("AWS_LAMBDA_FUNCTION_NAME", "", parse_text)
    local_invocation: bool = setting("AWS_SAM_LOCAL", False, parse_bool)
    lambda_endpoint_url: str = setting("AWS_ENDPOINT_URL_LAMBDA", "", parse_text)
    job_policies: str = setting("JOB_POLICIES", "", parse_text)


@dataclass(frozen=True, slots=True)
class AlertSettings(JobSettings):
    """DlqAlertFunction's: what it watches, where it pages, and when."""

    watched_queues: tuple[str, ...] = setting("WATCHED_QUEUES", (), _queue_names)
    alert_topic_arn: str = setting("ALERT_TOPIC_ARN", "", parse_text)
    stuck_claim_seconds: int = setting("STUCK_CLAIM_SECONDS", 900, parse_int(minimum=1))
    backlog_age_seconds: int = setting("BACKLOG_AGE_SECONDS", 900, parse_int(minimum=1))
    alert_reminder_seconds: int = setting("ALERT_REMINDER_SECONDS", 3600, parse_int(minimum=60))


@dataclass(frozen=True, slots=True)
class RedriveSettings(CommonSettings):
    """RedriveFunction's: the queue, its DLQ and the ledger (its event says what to move)."""


@dataclass(frozen=True, slots=True)
class PruneSettings(CommonSettings):
    """PruneFunction's: the ledger and how long settled claims are kept."""

    retention_days: int = _retention_days()


@dataclass(frozen=True, slots=True)
class OutboxRelaySettings(CommonSettings):
    """OutboxRelayFunction's (and ``infrai-jobs outbox``'s)."""

    outbox_database_url: str = setting("OUTBOX_DATABASE_URL", "", parse_text, secret=True)
    outbox_batch_size: int = setting("OUTBOX_BATCH_SIZE", 25, parse_int(minimum=1))


def _job_fields(
    env: Mapping[str, str], settings: Declared, secrets: Declared, allow_plain_http: bool
) -> dict[str, Any]:
    """The jobs' settings (URLs each) and secrets' ARNs from ``JOB_SETTINGS``, a JSON object of
    strings, or a variable of the name (set in both, they agree); a plain secret only locally."""
    try:
        mapped = json.loads(env.get(JOB_SETTINGS_ENV) or "{}")
        given = {name: value.strip() for name, value in mapped.items() if value.strip()}
    except (ValueError, AttributeError, RecursionError):  # not JSON, an object, or all strings
        raise ConfigurationError(f"{JOB_SETTINGS_ENV} must be a JSON object of strings") from None
    for name in [*settings, *secrets, *(name + SECRET_ARN_SUFFIX for name in secrets)]:
        if env.get(name) and given.setdefault(name, env[name]) != env[name]:
            raise ConfigurationError(f"{name} and {JOB_SETTINGS_ENV}'s {name} differ: keep one")
    owners = {name: tuple(jobs) for name, jobs in settings.items()}
    values = {name: given.get(name, "").strip() for name in owners}
    for name, value in values.items():
        if value:
            check_web_url(
                f"{name} (for {', '.join(owners[name])})",
                value,
                allow_plain_http=allow_plain_http,
                example="https://mail.example.com",
                credential_home=JOB_CREDENTIAL_HOME,
            )
    secret_owners = {name: tuple(jobs) for name, jobs in secrets.items()}
    arns = {name: given.get(name + SECRET_ARN_SUFFIX, "").strip() for name in secret_owners}
    plain = {name: given.get(name, "") for name in secret_owners}
    # Lambda names the function, and no local invocation said AWS_SAM_LOCAL=true.
    deployed = bool(secrets) and bool(env.get("AWS_LAMBDA_FUNCTION_NAME"))
    deployed = deployed and env.get("AWS_SAM_LOCAL", "").strip().lower() not in TRUE_WORDS
    for name, jobs in secret_owners.items():
        if plain[name] and (arns[name] or deployed):
            raise ConfigurationError(
                f"{name} and {name}{SECRET_ARN_SUFFIX} are both set: keep the value in the "
                f"secret only (unset {name})"
                if arns[name]
                else f"{name} (for {', '.join(jobs)}) is set in the function's plain environment, "
                "readable by whoever may read its configuration: store it in Secrets Manager, "
                f"name it with {name}{SECRET_ARN_SUFFIX} in JobSettings, and unset {name}"
            )
    return {
        "job_settings": MappingProxyType(values),
        "job_setting_owners": MappingProxyType(owners),
        "job_secret_arns": MappingProxyType(arns),
        "job_secrets": MappingProxyType(plain),
        "job_secret_owners": MappingProxyType(secret_owners),
    }


_HOW_TO_SET = {
    "INFRAI_BASE_URL": f"use {DEFAULT_BASE_URL} for the hosted service",
    "INFRAI_API_KEY": "export your Infrai API key "
    "(in AWS it is read from the SSM parameter named by INFRAI_API_KEY_PARAMETER)",
    "DATABASE_URL": "export a PostgreSQL URL such as postgresql://user@127.0.0.1:5432/jobs",
}


def _required(value: str, variable: str) -> str:
    if not value:
        raise ConfigurationError(f"{variable} is not set; {_HOW_TO_SET[variable]}")
    return value


# Where a URL's credential belongs instead, for Infrai's URL and for a job's setting.
INFRAI_CREDENTIAL_HOME = "Infrai's API key in the SSM parameter INFRAI_API_KEY_PARAMETER names"
JOB_CREDENTIAL_HOME = (
    'declare it on the job as a secret, e.g. secrets=("MAIL_API_TOKEN",), read by its handler '
    'as ctx.secrets["MAIL_API_TOKEN"]; in AWS it is fetched from the Secrets Manager secret '
    'MAIL_API_TOKEN_SECRET_ARN names (docs/jobs.md, "Secrets")'
)


def check_web_url(
    name: str,
    value: str,
    *,
    allow_plain_http: bool,
    example: str,
    credential_home: str = INFRAI_CREDENTIAL_HOME,
) -> None:
    """HTTPS, or plain HTTP to loopback (or elsewhere with ``allow_plain_http``): refused before
    any call, so a typo never sends a key in clear text. The error names ``name``, never the
    whole value (it may hold a secret)."""
    try:
        parts = urlsplit(value)
        host = parts.hostname or ""
    except ValueError:
        raise ConfigurationError(f"{name} is not a valid URL, e.g. {example}") from None
    if parts.scheme not in ("http", "https") or not host:
        raise ConfigurationError(f"{name} must be an http(s) URL with a host, e.g. {example}")
    if parts.username is not None or parts.password is not None:
        # In AWS the environment is plain text to anyone who may read the function's
        # configuration: a credential there is a leaked credential.
        raise ConfigurationError(
            f"{name} carries credentials (user or password before the host): give the URL "
            f"without them, and keep the credential in a secret fetched by name, never in the "
            f"environment: {credential_home}"
        )
    if parts.scheme == "http" and not is_loopback_host(host) and not allow_plain_http:
        raise ConfigurationError(
            f"{name} uses plain HTTP to {host}: use HTTPS (plain HTTP is allowed on loopback "
            f"only, or on a local network with {ALLOW_PLAIN_HTTP_ENV}=true)"
        )


def _is_plain_http_off_loopback(url: str) -> bool:
    parts = urlsplit(url)
    return parts.scheme == "http" and not is_loopback_host(parts.hostname or "")


def _check_second_layer(settings: JobSettings) -> None:
    backend = settings.idempotency_backend
    if backend == "dynamodb" and not settings.idempotency_table:
        raise ConfigurationError(
            "IDEMPOTENCY_BACKEND=dynamodb needs IDEMPOTENCY_TABLE, the name of the table the "
            "template creates (stack output IdempotencyTableName)"
        )
    if backend != "redis":
        return
    if not settings.redis_url and not settings.redis_secret_arn:
        raise ConfigurationError(
            "IDEMPOTENCY_BACKEND=redis needs REDIS_URL, e.g. rediss://my-cache.example:6379/0 "
            "(or REDIS_SECRET_ARN, a secret holding the whole URL)"
        )
    if settings.redis_url:
        check_redis_url("REDIS_URL", settings.redis_url)
    parts = urlsplit(settings.redis_url)  # checked above: it parses
    if settings.redis_secret_arn and (parts.username or parts.password):
        raise ConfigurationError(
            "REDIS_URL carries credentials while REDIS_SECRET_ARN is set: keep the password in "
            "the secret only"
        )


def tracing_on() -> bool:
    """Whether the template turned tracing on; read when the handler is decorated at import."""
    disabled = os.environ.get("POWERTOOLS_TRACE_DISABLED", "true").lower()
    return disabled not in ("1", "true", "yes")
