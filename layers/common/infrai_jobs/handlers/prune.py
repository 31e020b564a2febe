"""PruneFunction (daily): delete settled claims older than the retention, in small batches."""

from __future__ import annotations

from functools import cache
from typing import Any

from aws_lambda_powertools.logging import correlation_paths
from aws_lambda_powertools.metrics import MetricUnit
from aws_lambda_powertools.utilities.typing import LambdaContext

from infrai_jobs.config.settings import PruneSettings
from infrai_jobs.runtime.factory import make_claims_admin, with_secrets
from infrai_jobs.runtime.observability import function_observability, tracing
from infrai_jobs.work.admin import WorkStore

logger, metrics = function_observability()


@cache
def dependencies() -> tuple[PruneSettings, WorkStore]:
    """It never calls Infrai, so it never fetches the API key."""
    settings, refresh = with_secrets(PruneSettings.from_env(), api_key=False)
    return settings, make_claims_admin(settings, refresh=refresh)


@logger.inject_lambda_context(correlation_id_path=correlation_paths.EVENT_BRIDGE, clear_state=True)
@metrics.log_metrics
@tracing
def lambda_handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    settings, admin = dependencies()
    result = admin.prune(older_than_days=settings.retention_days)
    logger.info(
        "pruned settled claims and outbox rows",
        extra={"action": "prune", "deleted": result.deleted, "outbox": result.outbox_deleted},
    )
    metrics.add_metric(name="ClaimsPruned", unit=MetricUnit.Count, value=result.deleted)
    return {
        "deleted": result.deleted,
        "batches": result.batches,
        "older_than_days": settings.retention_days,
    }
