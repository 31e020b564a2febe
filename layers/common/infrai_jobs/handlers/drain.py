"""DrainFunction: on each EventBridge tick, drain Infrai's queue through the claim ledger.

A fan-out event (another drain started this one for a backlog) carries the slot it reserved."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

from aws_lambda_powertools.logging import correlation_paths
from aws_lambda_powertools.utilities.typing import LambdaContext

import jobs
from infrai_jobs.config.settings import DrainSettings
from infrai_jobs.drain.fan_out import FAN_OUT_EVENT_KEY, fan_out_slot
from infrai_jobs.ledger.job_schema import job_migrations_in
from infrai_jobs.runtime.drain_service import DrainService
from infrai_jobs.runtime.observability import (
    function_observability,
    message_tracing,
    record_drain,
    tracing,
)
from jobs import build_registry

logger, metrics = function_observability()


@cache
def service() -> DrainService:
    """Only the settings (and secrets) the registered jobs declared are read, and each must be
    set (``factory.with_secrets``, in ``from_settings``). The jobs' migrations shipped with the
    code are part of the schema check."""
    registry = build_registry()
    settings = DrainSettings.from_env(
        job_settings=registry.declared_settings(), job_secrets=registry.declared_secrets()
    )
    return DrainService.from_settings(
        settings,
        registry,
        message_span=message_tracing(),
        job_migrations=job_migrations_in(Path(str(jobs.__file__)).parent),
    )


# The correlation id of every log line: a tick's event id (Scheduler's execution id), or for a
# drain another one started, the slot its fan-out event carries. A line about a message whose
# producer sent one carries the producer's too, as ``message_correlation_id``.
CORRELATION_ID_PATH = f"{correlation_paths.EVENT_BRIDGE} || {FAN_OUT_EVENT_KEY}.drain_id"


@logger.inject_lambda_context(correlation_id_path=CORRELATION_ID_PATH, clear_state=True)
@metrics.log_metrics(capture_cold_start_metric=True)
@tracing
def lambda_handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    drain = service()
    summary = drain.run(context.get_remaining_time_in_millis, fan_out_slot=fan_out_slot(event))
    record_drain(
        metrics, drain.settings.queue, summary, second_layer_hits=drain.take_second_layer_hits()
    )
    return summary.as_dict()
