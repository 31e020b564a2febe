"""PruneFunction (daily): delete settled claims older than the retention, in small batches."""

from __future__ import annotations

from functools import cache
from typing import Any

from aws_lambda_powertools.logging import correlation_paths
from aws_lambda_powertools.metrics import MetricUnit
from aws_lambda_powertools.utilities.typing import LambdaContext

from infrai_jobs.claims_admin import ClaimsAdmin
from infrai_jobs.errors import LedgerError
from infrai_jobs.observability import function_observability, tracing
from infrai_jobs.secrets import resolve_secrets
from infrai_jobs.settings import Settings

logger, metrics = function_observability()


@cache
def dependencies() -> tuple[Settings, ClaimsAdmin]:
    """Built on the first invocation; built again, with the secret fetched past its cache,
    after a run could not use the ledger (a rotated password)."""
    settings = resolve_secrets(Settings.from_env(), api_key=False, force_fetch=True)
    return settings, ClaimsAdmin(settings.require_database_url())


# The scheduled event's id (Scheduler's execution id) is the correlation id of every log line.
@logger.inject_lambda_context(correlation_id_path=correlation_paths.EVENT_BRIDGE, clear_state=True)
@metrics.log_metrics
@tracing
def lambda_handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    settings, admin = dependencies()
    try:
        result = admin.prune(older_than_days=settings.retention_days)
    except LedgerError:
        dependencies.cache_clear()
        raise
    logger.info("pruned settled claims", extra={"action": "prune", "deleted": result.deleted})
    metrics.add_metric(name="ClaimsPruned", unit=MetricUnit.Count, value=result.deleted)
    return {
        "deleted": result.deleted,
        "batches": result.batches,
        "older_than_days": settings.retention_days,
    }
