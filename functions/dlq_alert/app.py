"""DlqAlertFunction: every few minutes, page a human about dead letters, stuck claims and lag."""

from __future__ import annotations

from functools import cache
from typing import Any

from aws_lambda_powertools.utilities.typing import LambdaContext

from infrai_jobs.alerting import AlertCheck
from infrai_jobs.factory import make_alert_check
from infrai_jobs.observability import function_observability, record_alert_check, tracing
from infrai_jobs.secrets import resolve_secrets
from infrai_jobs.settings import Settings

logger, metrics = function_observability()


@cache
def check() -> tuple[AlertCheck, tuple[str, ...]]:
    """Built on the first invocation and reused while the environment stays warm."""
    settings = resolve_secrets(Settings.from_env())
    return make_alert_check(settings), settings.watched_queues


@logger.inject_lambda_context(clear_state=True)
@metrics.log_metrics
@tracing
def lambda_handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    # A failing stats call or ledger raises: the function's Errors alarm fires, and no
    # "all clear" is ever sent on missing data.
    alert_check, watched = check()
    report = alert_check.run(watched)
    record_alert_check(metrics, report)
    return report.as_dict()
