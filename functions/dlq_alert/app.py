"""DlqAlertFunction: every few minutes, page a human about dead letters, stuck claims and lag."""

from __future__ import annotations

from functools import cache
from typing import Any

from aws_lambda_powertools.logging import correlation_paths
from aws_lambda_powertools.utilities.typing import LambdaContext

from infrai_jobs.alerting import AlertCheck
from infrai_jobs.errors import InfraiError, LedgerError
from infrai_jobs.factory import make_alert_check
from infrai_jobs.observability import function_observability, record_alert_check, tracing
from infrai_jobs.secrets import resolve_secrets
from infrai_jobs.settings import Settings

logger, metrics = function_observability()


@cache
def check() -> tuple[AlertCheck, tuple[str, ...]]:
    """Built on the first invocation and reused while the environment stays warm; built
    again, with the secrets fetched past their cache, after a run failed (see below)."""
    settings = resolve_secrets(Settings.from_env(), force_fetch=True)
    return make_alert_check(settings), settings.watched_queues


# The scheduled event's id (Scheduler's execution id) is the correlation id of every log line.
@logger.inject_lambda_context(correlation_id_path=correlation_paths.EVENT_BRIDGE, clear_state=True)
@metrics.log_metrics
@tracing
def lambda_handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    # A failing stats call or ledger raises: the function's Errors alarm fires, and no
    # "all clear" is ever sent on missing data.
    alert_check, watched = check()
    try:
        report = alert_check.run(watched)
    except (InfraiError, LedgerError):
        # A rotated database password or API key fails every run of a warm environment until
        # it is rebuilt: the next invocation builds it afresh.
        check.cache_clear()
        alert_check.close()
        raise
    record_alert_check(metrics, report)
    return report.as_dict()
