"""DlqAlertFunction: every few minutes, page a human about dead letters, stuck claims and lag."""

from __future__ import annotations

from functools import cache
from typing import Any

from aws_lambda_powertools.logging import correlation_paths
from aws_lambda_powertools.utilities.typing import LambdaContext

from infrai_jobs.config.settings import AlertSettings
from infrai_jobs.operations.alerting import AlertCheck
from infrai_jobs.runtime.factory import make_alert_check, with_secrets
from infrai_jobs.runtime.observability import function_observability, record_alert_check, tracing
from jobs import build_registry

logger, metrics = function_observability()


@cache
def check() -> tuple[AlertCheck, tuple[str, ...]]:
    """The jobs' probes reconcile stuck claims before they are counted, so the settings and
    secrets they declared are read and bound; a probe whose setting or secret is missing is left
    out (said once here), never the page."""
    registry = build_registry()
    settings, refresh = with_secrets(
        AlertSettings.from_env(
            job_settings=registry.declared_settings(probes_only=True),
            job_secrets=registry.declared_secrets(probes_only=True),
        )
    )
    unprobed = registry.bind_probe_settings(settings.job_settings, secrets=settings.job_secrets)
    for job, missing in unprobed.items():
        logger.warning(
            "a setting or secret of this job is not set: its stuck claims are not probed",
            extra={"action": "probe_off", "job": job, "missing": list(missing)},
        )
    return make_alert_check(settings, refresh=refresh, registry=registry), settings.watched_queues


@logger.inject_lambda_context(correlation_id_path=correlation_paths.EVENT_BRIDGE, clear_state=True)
@metrics.log_metrics
@tracing
def lambda_handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    # A failing stats call or ledger raises: the function's Errors alarm fires, and no
    # "all clear" is ever sent on missing data.
    alert_check, watched = check()
    report = alert_check.run(watched)
    record_alert_check(metrics, report)
    return report.as_dict()
