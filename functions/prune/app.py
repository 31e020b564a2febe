"""PruneFunction (daily): delete settled claims older than the retention, in small batches."""

from __future__ import annotations

from functools import cache
from typing import Any

from aws_lambda_powertools.logging import correlation_paths
from aws_lambda_powertools.metrics import MetricUnit
from aws_lambda_powertools.utilities.typing import LambdaContext

from infrai_jobs.aws.secrets import resolve_secrets
from infrai_jobs.config.settings import Settings
from infrai_jobs.operations.claims_admin import ClaimsAdmin
from infrai_jobs.runtime.factory import make_claims_admin, secret_refresh
from infrai_jobs.runtime.observability import function_observability, tracing

logger, metrics = function_observability()


@cache
def dependencies() -> tuple[Settings, ClaimsAdmin]:
    """Built once per warm environment; a rotated database secret is fetched again when a
    connection fails with the cached one (factory.secret_refresh, as every function does)."""
    settings = Settings.from_env()
    resolved = resolve_secrets(settings, api_key=False)
    return resolved, make_claims_admin(resolved, refresh=secret_refresh(settings))


# The scheduled event's id (Scheduler's execution id) is the correlation id of every log line.
@logger.inject_lambda_context(correlation_id_path=correlation_paths.EVENT_BRIDGE, clear_state=True)
@metrics.log_metrics
@tracing
def lambda_handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    settings, admin = dependencies()
    result = admin.prune(older_than_days=settings.retention_days)
    logger.info("pruned settled claims", extra={"action": "prune", "deleted": result.deleted})
    metrics.add_metric(name="ClaimsPruned", unit=MetricUnit.Count, value=result.deleted)
    return {
        "deleted": result.deleted,
        "batches": result.batches,
        "older_than_days": settings.retention_days,
    }
