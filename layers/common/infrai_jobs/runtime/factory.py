"""Builds the real adapters from settings, at every handler's edge (and the CLI's): its settings
type's ``from_env()``, then ``with_secrets``, then the ``make_*`` builders here."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Generic, NamedTuple
from urllib.parse import urlsplit

from infrai_jobs.aws.secrets import SecretRefresh, SecretSource
from infrai_jobs.config.redis_url import is_loopback_host
from infrai_jobs.config.settings import (
    AlertSettings,
    AnySettings,
    CommonSettings,
    DrainSettings,
    JobSettings,
    OutboxRelaySettings,
)
from infrai_jobs.drain.ack_pipeline import HTTP_CONNECTIONS_PER_LANE
from infrai_jobs.errors import ConfigurationError
from infrai_jobs.ledger.job_schema import JobMigrationName
from infrai_jobs.ledger.postgres import LedgerConnector, malformed_reason
from infrai_jobs.queue.client import HttpRetryPolicy, InfraiClient
from infrai_jobs.queue.transport import PoolOptions
from infrai_jobs.work.ledger import PostgresLedger

if TYPE_CHECKING:
    from infrai_jobs.aws.lambda_starter import LambdaDrainStarter
    from infrai_jobs.aws.second_layer import SecondLayer
    from infrai_jobs.drain.fleet import PostgresDrainFleet
    from infrai_jobs.jobs.registry import JobRegistry
    from infrai_jobs.operations.alerting import AlertCheck, Alerter
    from infrai_jobs.outbox.relay import OutboxRelay
    from infrai_jobs.work.admin import WorkStore


class EdgeSettings(NamedTuple, Generic[AnySettings]):
    """A function's settings, its secrets resolved, and how to pick up a rotated one."""

    settings: AnySettings
    refresh: SecretRefresh


def with_secrets(settings: AnySettings, *, api_key: bool = True) -> EdgeSettings[AnySettings]:
    """``settings`` with the secrets they name fetched, and the hooks that fetch a rotated one
    again (``aws.secrets.SecretSource``); a malformed ``DATABASE_URL`` is refused here already,
    before anything is built. ``api_key=False`` for a function that never calls Infrai."""
    source = SecretSource(settings, api_key=api_key)
    resolved = source.resolve()
    if resolved.database_url:
        ledger_url(resolved)
    return EdgeSettings(resolved, source.refresh)


def ledger_url(settings: CommonSettings) -> str:
    """The ledger's URL for a connector: set, and well formed (a URL from the database secret
    was checked when it was read)."""
    return _well_formed(settings.require_database_url(), "DATABASE_URL")


def _well_formed(url: str, variable: str) -> str:
    # Names the variable, never the value: it may hold a password.
    if reason := malformed_reason(url):
        raise ConfigurationError(f"{variable} is malformed: {reason}")
    return url


def ledger_connector(
    settings: CommonSettings, application_name: str, refresh: SecretRefresh | None
) -> LedgerConnector:
    url, refresh_url = ledger_url(settings), refresh.database_url if refresh else None
    return LedgerConnector(url, application_name=application_name, refresh=refresh_url)


def make_queue_client(
    settings: CommonSettings, *, refresh_api_key: Callable[[], str] | None = None
) -> InfraiClient:
    lanes = settings.drain_lanes if isinstance(settings, DrainSettings) else 1
    return InfraiClient(
        settings.require_base_url(),
        settings.require_api_key(),
        retry=HttpRetryPolicy(publish=settings.publish_retries),
        refresh_api_key=refresh_api_key,
        pool=PoolOptions(
            maxsize=client_pool_size(lanes), max_answer_bytes=settings.max_answer_bytes
        ),
        allow_plain_http=settings.allow_plain_http,
    )


def client_pool_size(lanes: int) -> int:
    """Idle connections the Infrai client keeps: enough for every lane's concurrent calls."""
    return max(1, lanes) * HTTP_CONNECTIONS_PER_LANE


def make_ledger(
    settings: DrainSettings,
    *,
    refresh_url: Callable[[], str] | None = None,
    job_migrations: Sequence[JobMigrationName] = (),
) -> PostgresLedger:
    """``job_migrations``: the jobs package's, part of the schema check (``ledger.job_schema``).
    The drain's (and its lanes') connections are the only ones that may prepare statements."""
    return PostgresLedger(
        ledger_url(settings),
        visibility_timeout=settings.visibility_timeout_seconds,
        refresh_url=refresh_url,
        job_migrations=job_migrations,
        prepared_statements=settings.database_prepared_statements,
    )


def make_claims_admin(
    settings: CommonSettings, *, refresh: SecretRefresh | None = None
) -> WorkStore:
    """Claim changes outside the drain (PruneFunction, RedriveFunction, the watcher's reconcile
    pass)."""
    from infrai_jobs.work.admin import WorkStore  # noqa: PLC0415 - not on the drain's path

    return WorkStore(
        ledger_url(settings),
        visibility_timeout=settings.visibility_timeout_seconds,
        refresh_url=refresh.database_url if refresh else None,
    )


def make_drain_fleet(
    settings: DrainSettings, *, refresh_url: Callable[[], str] | None = None
) -> PostgresDrainFleet | None:
    """The drains alive, counted in the ledger; None unless DRAIN_MAX_CONCURRENCY is set."""
    if settings.drain_max_concurrency <= 0:
        return None
    from infrai_jobs.drain.fleet import PostgresDrainFleet  # noqa: PLC0415

    return PostgresDrainFleet(ledger_url(settings), refresh_url=refresh_url)


def make_drain_starter(settings: DrainSettings) -> LambdaDrainStarter | None:
    """Lambda's Invoke of this very function, when it may fan out. A local invocation fans out
    only through a Lambda endpoint on loopback (``infrai-jobs invoke`` serves one): the
    credentials it was given would reach the real Lambda service."""
    if settings.drain_max_concurrency <= 1 or not settings.drain_function_name:
        return None
    endpoint_host = urlsplit(settings.lambda_endpoint_url).hostname or ""
    if settings.local_invocation and not is_loopback_host(endpoint_host):
        logging.getLogger(__name__).warning(
            "backlog fan-out is off in a local invocation without a local Lambda endpoint "
            "(AWS_ENDPOINT_URL_LAMBDA on loopback): it would start drains in the real Lambda "
            "service",
            extra={"action": "fan_out_off_locally"},
        )
        return None
    from infrai_jobs.aws.lambda_starter import LambdaDrainStarter  # noqa: PLC0415

    return LambdaDrainStarter(settings.drain_function_name)


def make_alert_check(
    settings: AlertSettings,
    alerter: Alerter | None = None,
    *,
    refresh: SecretRefresh | None = None,
    registry: JobRegistry | None = None,
) -> AlertCheck:
    """DlqAlertFunction's check; ``refresh`` (``with_secrets(settings).refresh``) lets a warm
    environment pick up rotated secrets. With ``registry`` (its settings bound), each check
    first reconciles the stuck claims of the jobs that declare a probe."""
    # Imported here: the drain's cold start never needs the alerting module.
    from infrai_jobs.operations import alerting  # noqa: PLC0415
    from infrai_jobs.operations.reconcile import Reconciler  # noqa: PLC0415

    if alerter is None and settings.alert_topic_arn:
        alerter = alerting.SnsAlerter(settings.alert_topic_arn)
    elif alerter is None:
        logging.getLogger(__name__).warning(
            "ALERT_TOPIC_ARN is not set: alerts are printed, not sent",
            extra={"action": "alerts_printed"},
        )
        alerter = alerting.PrintingAlerter()

    reconciler = None
    if registry is not None:
        # With the second layer on, a claim the pass releases loses its record there too, or
        # the next delivery would replay its stored "uncertain" and be parked stuck again.
        guard = make_effect_guard(settings)
        reconciler = Reconciler(
            make_claims_admin(settings, refresh=refresh),
            registry,
            actor=alerting.WATCHER_ACTOR,
            forget=guard.forget if guard is not None else None,
        )

    return alerting.AlertCheck(
        make_queue_client(settings, refresh_api_key=refresh.api_key if refresh else None),
        ledger_url(settings),
        alerter,
        alerting.AlertThresholds(
            stuck_claim_seconds=settings.stuck_claim_seconds,
            backlog_age_seconds=settings.backlog_age_seconds,
            reminder_seconds=settings.alert_reminder_seconds,
            visibility=settings.visibility_timeout_seconds,
        ),
        refresh_url=refresh.database_url if refresh else None,
        reconciler=reconciler,
    )


def make_effect_guard(settings: JobSettings) -> SecondLayer | None:
    """The second layer around the drain's external effects, or the record store the watcher's
    reconcile pass forgets keys in; None when IDEMPOTENCY_BACKEND=off."""
    if settings.idempotency_backend == "off":
        return None
    # Imported here: the second layer pulls in boto3 (and redis).
    from infrai_jobs.aws import second_layer  # noqa: PLC0415

    if settings.idempotency_backend == "dynamodb":
        store = second_layer.dynamodb_store(settings.idempotency_table)
    else:
        store = second_layer.redis_store(settings.redis_url)
    return second_layer.SecondLayer(
        store, expires_after_seconds=second_layer.record_expiry_seconds(settings.retention_days)
    )


def outbox_connector(
    settings: OutboxRelaySettings, *, refresh: SecretRefresh | None = None
) -> LedgerConnector:
    """The outbox's database: OUTBOX_DATABASE_URL when set (the producers' own), else the
    ledger's."""
    if settings.outbox_database_url:
        url = _well_formed(settings.outbox_database_url, "OUTBOX_DATABASE_URL")
        return LedgerConnector(url, application_name=_OUTBOX_APPLICATION)
    return ledger_connector(settings, _OUTBOX_APPLICATION, refresh)


_OUTBOX_APPLICATION = "infrai-jobs-outbox"


def make_outbox_relay(
    settings: OutboxRelaySettings, queue: InfraiClient, *, refresh: SecretRefresh | None = None
) -> OutboxRelay:
    """OutboxRelayFunction's relay (and ``infrai-jobs outbox relay``'s): the outbox's database,
    the queue client, and the ledger's database for the dead letters it records."""
    from infrai_jobs.outbox.relay import OutboxRelay, RelayConfig  # noqa: PLC0415

    return OutboxRelay(
        outbox_connector(settings, refresh=refresh),
        queue,
        RelayConfig(default_queue=settings.queue, batch_size=settings.outbox_batch_size),
        dead_letters=ledger_connector(settings, _OUTBOX_APPLICATION, refresh),
    )
