"""Builds the real adapters from settings. Only handlers and the CLI call this."""

from __future__ import annotations

import logging

from infrai_jobs.alerting import (
    AlertCheck,
    Alerter,
    AlertThresholds,
    PrintingAlerter,
    SnsAlerter,
)
from infrai_jobs.ledger import PostgresLedger
from infrai_jobs.queue_client import InfraiClient
from infrai_jobs.settings import Settings


def make_queue_client(settings: Settings) -> InfraiClient:
    return InfraiClient(
        settings.require_base_url(),
        settings.require_api_key(),
        retry_publish=settings.publish_retries,
    )


def make_ledger(settings: Settings) -> PostgresLedger:
    return PostgresLedger(settings.require_database_url())


def make_alerter(settings: Settings) -> Alerter:
    if settings.alert_topic_arn:
        return SnsAlerter(settings.alert_topic_arn)
    logging.getLogger(__name__).warning(
        "ALERT_TOPIC_ARN is not set: alerts are printed, not sent",
        extra={"action": "alerts_printed"},
    )
    return PrintingAlerter()


def make_alert_check(settings: Settings, alerter: Alerter | None = None) -> AlertCheck:
    return AlertCheck(
        make_queue_client(settings),
        settings.require_database_url(),
        alerter or make_alerter(settings),
        AlertThresholds(
            stuck_claim_seconds=settings.stuck_claim_seconds,
            backlog_age_seconds=settings.backlog_age_seconds,
            reminder_seconds=settings.alert_reminder_seconds,
        ),
    )
