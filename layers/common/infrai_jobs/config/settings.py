"""Settings, read once at the edge into frozen, validated objects, one type per function.

This is the only module that reads the package's settings from the environment (Powertools'
own variables aside). ``CommonSettings`` holds what every function reads (Infrai's URL and key,
the queue and its DLQ, the ledger's URL or secret and its TLS); ``DrainSettings``,
``AlertSettings``, ``RedriveSettings``, ``PruneSettings`` and ``OutboxRelaySettings`` add what
only their function reads.
A handler, or a CLI command, calls ``from_env()`` of its type once (one loader,
``load_settings``); everything below receives values, not ``os.environ``.

The framework's own settings are named here. The jobs' settings are not: each job declares the
ones it needs (``JobRegistry.declared_settings()``), and
``DrainSettings.from_env(job_settings=...)`` reads exactly those, as URLs (HTTPS unless
loopback); so does ``AlertSettings`` for the jobs' probes.

One rule for every URL the package calls over HTTP (Infrai's and the jobs' downstreams,
``check_web_url``): HTTPS, or plain HTTP to a loopback host. ``INFRAI_ALLOW_PLAIN_HTTP=true`` lets
plain HTTP reach other hosts too (a local network); it is logged as a warning every time the
settings are read, that is at every cold start.

Whether ``DATABASE_URL`` is well formed is checked where the ledger's connector is built
(``runtime.factory``), so reading settings never loads the database driver.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal, Self, TypeVar
from urllib.parse import urlsplit

from infrai_jobs.config.redis_url import check_redis_url, is_loopback_host, redis_lacks_auth
from infrai_jobs.errors import ConfigurationError
from infrai_jobs.queue_contract import DEFAULT_VISIBILITY_TIMEOUT_SECONDS

DEFAULT_BASE_URL = "https://api.infrai.cc"
DEFAULT_QUEUE = "billing-jobs"
MAX_DRAIN_LANES = 16
DEFAULT_MAX_ANSWER_BYTES = 16 * 1024 * 1024
# Lambda's own ceiling on one function's concurrency in a default account.
MAX_DRAIN_CONCURRENCY = 1000
# Idle polling faster than this would spend Infrai's consume rate limit on an empty queue.
MIN_IDLE_POLL_MS = 50

# The ledger's TLS in AWS, strongest first: verify-full checks the certificate and the host name,
# verify-ca the certificate only, require neither (an explicit, logged opt-out each).
DATABASE_SSLMODES = ("verify-full", "verify-ca", "require")
DEFAULT_DATABASE_SSLMODE = "verify-full"

AnySettings = TypeVar("AnySettings", bound="CommonSettings")

IdempotencyBackend = Literal["off", "dynamodb", "redis"]
_IDEMPOTENCY_BACKENDS: dict[str, IdempotencyBackend] = {
    "off": "off",
    "dynamodb": "dynamodb",
    "redis": "redis",
}


@dataclass(frozen=True, slots=True)
class CommonSettings:
    """What every function reads: how to reach Infrai and the ledger, and the queue's names.

    Each function's own settings add what only it reads (``DrainSettings``, ``AlertSettings``,
    ``RedriveSettings``, ``PruneSettings``); each is read by ``from_env`` at the function's (or
    the command's) edge, once."""

    # Empty means "not configured": local commands then start an emulator; handlers refuse.
    infrai_base_url: str = ""
    infrai_api_key: str = field(default="", repr=False)
    queue: str = DEFAULT_QUEUE
    dlq: str = f"{DEFAULT_QUEUE}-dlq"
    database_url: str = field(default="", repr=False)
    # In AWS the secrets are named here and fetched by infrai_jobs.aws.secrets.
    api_key_parameter: str = ""
    database_secret_arn: str = ""
    # The largest Infrai answer read (a consume of ten messages is one answer); a consume
    # whose answer is larger is lost, and its messages are then received one at a time.
    max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES
    publish_retries: bool = False
    # Opt-out: plain HTTP to hosts that are not loopback (INFRAI_ALLOW_PLAIN_HTTP).
    allow_plain_http: bool = False
    # How a URL read from the database secret reaches its server (AWS only; DATABASE_URL is
    # used as written): verify-full unless DATABASE_SSLMODE opts out, with the CA bundle file
    # DATABASE_CA_BUNDLE names (relative to the function's code, LAMBDA_TASK_ROOT).
    database_sslmode: str = DEFAULT_DATABASE_SSLMODE
    database_ca_bundle: str = ""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Self:
        """These settings, read from ``environ`` (the process's environment by default) and
        checked; a bad value is a ``ConfigurationError`` naming its variable."""
        return load_settings(cls, environ)

    def declared_urls(self) -> Mapping[str, str]:
        """The jobs' declared settings these settings hold (none here)."""
        return MappingProxyType({})

    def security_opt_outs(self) -> list[str]:
        """One sentence per secure default these settings turn off, for a warning each time
        they are read (every cold start)."""
        opt_outs = []
        if self.allow_plain_http:
            plain = [
                name
                for name, url in (
                    ("INFRAI_BASE_URL", self.infrai_base_url),
                    *self.declared_urls().items(),
                )
                if url and is_plain_http_off_loopback(url)
            ]
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
        return _required(
            self.infrai_base_url,
            "INFRAI_BASE_URL",
            f"use {DEFAULT_BASE_URL} for the hosted service",
        )

    def require_api_key(self) -> str:
        return _required(
            self.infrai_api_key,
            "INFRAI_API_KEY",
            "export your Infrai API key "
            "(in AWS it is read from the SSM parameter named by INFRAI_API_KEY_PARAMETER)",
        )

    def require_database_url(self) -> str:
        return _required(
            self.database_url,
            "DATABASE_URL",
            "export a PostgreSQL URL such as postgresql://user@127.0.0.1:5432/jobs",
        )


@dataclass(frozen=True, slots=True)
class JobSettings(CommonSettings):
    """Common settings plus the settings the registered jobs declared (the drain's jobs run
    with them; the watcher's probes ask their providers)."""

    # Each declared setting's value ("" when unset), and the jobs that declared each.
    job_settings: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    job_setting_owners: Mapping[str, tuple[str, ...]] = field(
        default_factory=lambda: MappingProxyType({})
    )
    # The optional second layer (infrai_jobs.aws.second_layer): off, dynamodb or redis. The
    # drain guards its jobs' effects with it; the watcher's reconcile pass drops a key's record
    # when it releases the claim, so both agree the job may run again.
    idempotency_backend: IdempotencyBackend = "off"
    idempotency_table: str = ""
    # May carry a password locally; the template only passes URLs without credentials, and the
    # password (or the whole URL) in the Secrets Manager secret REDIS_SECRET_ARN names.
    redis_url: str = field(default="", repr=False)
    redis_secret_arn: str = ""
    # The second layer's records outlive the ledger's settled claims by a day.
    retention_days: int = 30

    @classmethod
    def from_env(
        cls,
        environ: Mapping[str, str] | None = None,
        *,
        job_settings: Mapping[str, Sequence[str]] | None = None,
    ) -> Self:
        """As ``CommonSettings.from_env``, with ``job_settings``: the settings the registered
        jobs declared, with their jobs (``JobRegistry.declared_settings()``); only those are
        read, and a set one must be an HTTPS URL (HTTP on loopback). An unset one is allowed
        here: whether that is an error, or a sandbox's stand-in, is decided by the command or
        the function."""
        return load_settings(cls, environ, job_settings=job_settings)

    def declared_urls(self) -> Mapping[str, str]:
        return self.job_settings

    def security_opt_outs(self) -> list[str]:
        opt_outs = CommonSettings.security_opt_outs(self)
        if (
            self.idempotency_backend == "redis"
            and not self.redis_secret_arn
            and redis_lacks_auth(self.redis_url)
        ):
            opt_outs.append(
                "REDIS_URL carries no password and REDIS_SECRET_ARN is not set: the second "
                "layer's Redis takes commands without AUTH, so anyone who reaches it can read or "
                "drop its records (name the AUTH token's secret with REDIS_SECRET_ARN)"
            )
        return opt_outs

    def require_job_settings(self) -> dict[str, str]:
        """The jobs' declared settings, every one set; else a ``ConfigurationError`` naming each
        missing setting and the jobs that need it."""
        missing = [name for name, value in self.job_settings.items() if not value]
        if missing:
            raise ConfigurationError(
                "; ".join(
                    f"{name} is not set, and job(s) {', '.join(self.job_setting_owners[name])} "
                    "need it"
                    for name in missing
                )
                + ": set each to its downstream's URL (or a running `infrai-jobs provider-sink`)"
            )
        return dict(self.job_settings)


@dataclass(frozen=True, slots=True)
class DrainSettings(JobSettings):
    """DrainFunction's (and ``infrai-jobs drain``'s, and the operator tools' second layer)."""

    # Milliseconds a batch is assumed to need at most; the drain consumes another batch only
    # when the time left covers it (a receive burns one of three deliveries).
    batch_budget_ms: int = 20_000
    # How long an external claim's lease outlives the invocation that took it, in seconds;
    # never past its message's visibility window, whatever this says.
    lease_grace_seconds: int = 60
    # The drained queue's visibility timeout: how long a consumed message stays hidden.
    visibility_timeout_seconds: int = DEFAULT_VISIBILITY_TIMEOUT_SECONDS
    # Concurrent drain loops in one invocation, each with its own database connection.
    drain_lanes: int = 1
    # Idle polling (opt-in): after an empty consume, wait this long and consume again while
    # the idle window and the time budget allow. 0 stops at the first empty consume.
    drain_idle_poll_ms: int = 0
    # Seconds after a drain starts during which it keeps polling an empty queue; below the
    # schedule's period, so about one poller is alive at a time. 0: the whole time budget.
    drain_idle_window_seconds: int = 0
    # Backlog fan-out: drains alive at once at most (the function's reserved concurrency in
    # AWS), counted in the ledger's drain_leases. 0 counts nothing and never fans out.
    drain_max_concurrency: int = 0
    # More drains are started when the backlog would take longer than this to clear.
    drain_fan_out_after_seconds: int = 30
    # The function a fan-out invokes (Lambda sets AWS_LAMBDA_FUNCTION_NAME to its own name).
    drain_function_name: str = ""
    # A local invocation (`sam local invoke` and `infrai-jobs invoke` set AWS_SAM_LOCAL), and
    # the Lambda endpoint it was given (AWS_ENDPOINT_URL_LAMBDA): a local run's fan-out goes
    # there only, never to the real Lambda service.
    local_invocation: bool = False
    lambda_endpoint_url: str = ""
    # JOB_POLICIES: the JSON document overriding the jobs' flow policies, as written; parsed
    # against the registry where the drain is built (infrai_jobs.flow.policies).
    job_policies: str = ""


@dataclass(frozen=True, slots=True)
class AlertSettings(JobSettings):
    """DlqAlertFunction's: what it watches, where it pages, and when."""

    watched_queues: tuple[str, ...] = ()
    alert_topic_arn: str = ""
    stuck_claim_seconds: int = 900
    backlog_age_seconds: int = 900
    alert_reminder_seconds: int = 3600


@dataclass(frozen=True, slots=True)
class RedriveSettings(CommonSettings):
    """RedriveFunction's: the queue, its DLQ and the ledger, nothing more (its event says what
    to move)."""


@dataclass(frozen=True, slots=True)
class PruneSettings(CommonSettings):
    """PruneFunction's: the ledger and how long settled claims are kept."""

    retention_days: int = 30


@dataclass(frozen=True, slots=True)
class OutboxRelaySettings(CommonSettings):
    """OutboxRelayFunction's (and ``infrai-jobs outbox``'s): where the outbox lives (the
    ledger's database unless OUTBOX_DATABASE_URL names the producers' own) and the batch size."""

    outbox_database_url: str = field(default="", repr=False)
    outbox_batch_size: int = 25


# --- The one loader ------------------------------------------------------------------------------


def load_settings(
    kind: type[AnySettings],
    environ: Mapping[str, str] | None = None,
    *,
    job_settings: Mapping[str, Sequence[str]] | None = None,
) -> AnySettings:
    """``kind`` read from ``environ`` (``os.environ`` by default): only the variables ``kind``
    holds are read, each checked, and every secure default it turns off is logged."""
    env = os.environ if environ is None else environ
    allow_plain_http = _bool(env, ALLOW_PLAIN_HTTP_ENV, default=False)
    values: dict[str, Any] = {}
    if issubclass(kind, JobSettings):
        values.update(_job_fields(env, job_settings or {}, allow_plain_http=allow_plain_http))
        values.update(_second_layer_fields(env))
    values.update(_common_fields(env, allow_plain_http=allow_plain_http))
    if issubclass(kind, DrainSettings):
        values.update(_drain_fields(env))
    if issubclass(kind, AlertSettings):
        values.update(_alert_fields(env, queue=str(values["queue"])))
    if issubclass(kind, PruneSettings):
        values.update(retention_days=_retention_days(env))
    if issubclass(kind, OutboxRelaySettings):
        values.update(
            outbox_database_url=env.get("OUTBOX_DATABASE_URL", "").strip(),
            outbox_batch_size=_int(env, "OUTBOX_BATCH_SIZE", 25, minimum=1),
        )
    settings = kind(**values)
    if isinstance(settings, JobSettings):
        _check_second_layer(settings)
    if not settings.queue:
        raise ConfigurationError("INFRAI_QUEUE is empty; set it to the queue to drain")
    if isinstance(settings, DrainSettings):
        _check_drain(settings)
    if settings.dlq == settings.queue:
        raise ConfigurationError("INFRAI_DLQ must differ from INFRAI_QUEUE")
    for warning in settings.security_opt_outs():
        _logger.warning(warning, extra={"action": "security_opt_out"})
    return settings


def _job_fields(
    env: Mapping[str, str], declared: Mapping[str, Sequence[str]], *, allow_plain_http: bool
) -> dict[str, Any]:
    owners = {name: tuple(jobs) for name, jobs in declared.items()}
    values = {name: env.get(name, "").strip() for name in owners}
    for name, value in values.items():
        if value:
            check_web_url(
                f"{name} (for {', '.join(owners[name])})",
                value,
                allow_plain_http=allow_plain_http,
                example="https://mail.example.com",
            )
    return {
        "job_settings": MappingProxyType(values),
        "job_setting_owners": MappingProxyType(owners),
    }


def _common_fields(env: Mapping[str, str], *, allow_plain_http: bool) -> dict[str, Any]:
    base_url = env.get("INFRAI_BASE_URL", "").strip()
    if base_url:
        check_web_url(
            "INFRAI_BASE_URL",
            base_url,
            allow_plain_http=allow_plain_http,
            example=DEFAULT_BASE_URL,
        )
    queue = env.get("INFRAI_QUEUE", DEFAULT_QUEUE).strip()
    return {
        "infrai_base_url": base_url,
        "infrai_api_key": env.get("INFRAI_API_KEY", ""),
        "queue": queue,
        "dlq": env.get("INFRAI_DLQ", f"{queue}-dlq").strip(),
        "database_url": env.get("DATABASE_URL", ""),
        "api_key_parameter": env.get("INFRAI_API_KEY_PARAMETER", "").strip(),
        "database_secret_arn": env.get("DATABASE_SECRET_ARN", "").strip(),
        "max_answer_bytes": _int(
            env, "INFRAI_MAX_ANSWER_BYTES", DEFAULT_MAX_ANSWER_BYTES, minimum=65_536
        ),
        "publish_retries": _bool(env, "INFRAI_PUBLISH_RETRIES", default=False),
        "allow_plain_http": allow_plain_http,
        "database_sslmode": _database_sslmode(env),
        "database_ca_bundle": _in_task_root(env, env.get("DATABASE_CA_BUNDLE", "").strip()),
    }


def _drain_fields(env: Mapping[str, str]) -> dict[str, Any]:
    return {
        "batch_budget_ms": _int(env, "DRAIN_BATCH_BUDGET_MS", 20_000, minimum=100),
        "lease_grace_seconds": _int(env, "LEASE_GRACE_SECONDS", 60, minimum=0),
        "visibility_timeout_seconds": _int(
            env,
            "INFRAI_VISIBILITY_TIMEOUT_SECONDS",
            DEFAULT_VISIBILITY_TIMEOUT_SECONDS,
            minimum=1,
        ),
        "drain_lanes": _int(env, "DRAIN_LANES", 1, minimum=1),
        "drain_idle_poll_ms": _int(env, "DRAIN_IDLE_POLL_MS", 0, minimum=0),
        "drain_idle_window_seconds": _int(env, "DRAIN_IDLE_WINDOW_SECONDS", 0, minimum=0),
        "drain_max_concurrency": _int(env, "DRAIN_MAX_CONCURRENCY", 0, minimum=0),
        "drain_fan_out_after_seconds": _int(env, "DRAIN_FANOUT_AFTER_SECONDS", 30, minimum=1),
        "drain_function_name": env.get("AWS_LAMBDA_FUNCTION_NAME", "").strip(),
        "local_invocation": _bool(env, "AWS_SAM_LOCAL", default=False),
        "lambda_endpoint_url": env.get("AWS_ENDPOINT_URL_LAMBDA", "").strip(),
        "job_policies": env.get("JOB_POLICIES", "").strip(),
    }


def _second_layer_fields(env: Mapping[str, str]) -> dict[str, Any]:
    return {
        "retention_days": _retention_days(env),
        "idempotency_backend": _backend(env),
        "idempotency_table": env.get("IDEMPOTENCY_TABLE", "").strip(),
        "redis_url": env.get("REDIS_URL", "").strip(),
        "redis_secret_arn": env.get("REDIS_SECRET_ARN", "").strip(),
    }


def _alert_fields(env: Mapping[str, str], *, queue: str) -> dict[str, Any]:
    return {
        "watched_queues": _names(env.get("WATCHED_QUEUES", "")) or (queue,),
        "alert_topic_arn": env.get("ALERT_TOPIC_ARN", "").strip(),
        "stuck_claim_seconds": _int(env, "STUCK_CLAIM_SECONDS", 900, minimum=1),
        "backlog_age_seconds": _int(env, "BACKLOG_AGE_SECONDS", 900, minimum=1),
        "alert_reminder_seconds": _int(env, "ALERT_REMINDER_SECONDS", 3600, minimum=60),
    }


def _retention_days(env: Mapping[str, str]) -> int:
    return _int(env, "LEDGER_RETENTION_DAYS", 30, minimum=1)


def _check_drain(settings: DrainSettings) -> None:
    if settings.drain_lanes > MAX_DRAIN_LANES:
        raise ConfigurationError(
            f"DRAIN_LANES={settings.drain_lanes} is above {MAX_DRAIN_LANES}; add concurrent "
            "invocations instead (overlapping schedules are safe)"
        )
    if settings.drain_max_concurrency > MAX_DRAIN_CONCURRENCY:
        raise ConfigurationError(
            f"DRAIN_MAX_CONCURRENCY={settings.drain_max_concurrency} is above "
            f"{MAX_DRAIN_CONCURRENCY}, Lambda's default concurrency limit"
        )
    if 0 < settings.drain_idle_poll_ms < MIN_IDLE_POLL_MS:
        raise ConfigurationError(
            f"DRAIN_IDLE_POLL_MS={settings.drain_idle_poll_ms} is below {MIN_IDLE_POLL_MS}: "
            "every poll is a consume call, and Infrai rate-limits them (0 turns polling off)"
        )


def _required(value: str, variable: str, how: str) -> str:
    if not value:
        raise ConfigurationError(f"{variable} is not set; {how}")
    return value


ALLOW_PLAIN_HTTP_ENV = "INFRAI_ALLOW_PLAIN_HTTP"
_logger = logging.getLogger(__name__)


def check_web_url(name: str, value: str, *, allow_plain_http: bool, example: str) -> None:
    """The one rule for a URL called over HTTP (Infrai, a job's downstream): HTTPS, or plain
    HTTP to loopback (a local emulator, sink or test server); plain HTTP elsewhere only with
    ``allow_plain_http``. Refused before any call, so a typo never sends a key in clear text.
    ``name`` says which setting it is; the value is never echoed whole (it may hold a secret)."""
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
            "without them, and keep the credential in a secret (Secrets Manager or an SSM "
            "SecureString) that is fetched by name, never in the environment"
        )
    if parts.scheme == "http" and not is_loopback_host(host) and not allow_plain_http:
        raise ConfigurationError(
            f"{name} uses plain HTTP to {host}: use HTTPS (plain HTTP is allowed on loopback "
            f"only, or on a local network with {ALLOW_PLAIN_HTTP_ENV}=true)"
        )


def is_plain_http_off_loopback(url: str) -> bool:
    parts = urlsplit(url)
    return parts.scheme == "http" and not is_loopback_host(parts.hostname or "")


def raw_database_url(environ: Mapping[str, str] | None = None) -> str:
    """DATABASE_URL as the environment holds it, unchecked: for redacting it out of an error
    raised before (or while) the settings were read."""
    return (os.environ if environ is None else environ).get("DATABASE_URL", "")


def _backend(env: Mapping[str, str]) -> IdempotencyBackend:
    raw = env.get("IDEMPOTENCY_BACKEND", "").strip().lower() or "off"
    if raw not in _IDEMPOTENCY_BACKENDS:
        raise ConfigurationError(
            f"IDEMPOTENCY_BACKEND={raw!r} is not one of {', '.join(_IDEMPOTENCY_BACKENDS)}"
        )
    return _IDEMPOTENCY_BACKENDS[raw]


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
    if settings.redis_secret_arn and has_credentials(settings.redis_url):
        raise ConfigurationError(
            "REDIS_URL carries credentials while REDIS_SECRET_ARN is set: keep the password in "
            "the secret only"
        )


def has_credentials(url: str) -> bool:
    try:
        parts = urlsplit(url)
        return bool(parts.username or parts.password)
    except ValueError:
        return False


def _database_sslmode(env: Mapping[str, str]) -> str:
    raw = env.get("DATABASE_SSLMODE", "").strip() or DEFAULT_DATABASE_SSLMODE
    if raw not in DATABASE_SSLMODES:
        raise ConfigurationError(
            f"DATABASE_SSLMODE={raw!r} is not one of {', '.join(DATABASE_SSLMODES)}: modes that "
            "allow plain text are never used for the ledger in AWS"
        )
    return raw


def _in_task_root(env: Mapping[str, str], path: str) -> str:
    """A relative path as Lambda sees it: under the function's code (LAMBDA_TASK_ROOT)."""
    root = env.get("LAMBDA_TASK_ROOT", "")
    if not path or os.path.isabs(path) or not root:
        return path
    return os.path.join(root, path)


def _names(raw: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(name.strip() for name in raw.split(",") if name.strip()))


def _int(env: Mapping[str, str], name: str, default: int, *, minimum: int) -> int:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigurationError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise ConfigurationError(f"{name}={value} is below the minimum of {minimum}")
    return value


def _bool(env: Mapping[str, str], name: str, *, default: bool) -> bool:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    lowered = raw.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ConfigurationError(f"{name}={raw!r} is not a boolean (use true or false)")


def tracing_on() -> bool:
    """Whether the template turned tracing on (POWERTOOLS_TRACE_DISABLED=false). Read before
    any function's settings, when the handler is decorated at import time."""
    disabled = os.environ.get("POWERTOOLS_TRACE_DISABLED", "true").lower()
    return disabled not in ("1", "true", "yes")
