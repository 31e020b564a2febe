"""Builds the real adapters from settings. Only handlers and the CLI call this."""

from __future__ import annotations

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
