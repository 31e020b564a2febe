"""OutboxRelayFunction (every minute): publish what producers committed to the outbox, due rows
oldest first, until none is due or the time is short (infrai_jobs.outbox.relay), then report the
backlog as metrics. What each refusal does, and the alarms on these metrics: docs/producers.md."""

from __future__ import annotations

from functools import cache
from typing import Any

from aws_lambda_powertools.logging import correlation_paths
from aws_lambda_powertools.utilities.typing import LambdaContext

from infrai_jobs.config.settings import OutboxRelaySettings
from infrai_jobs.outbox.relay import OutboxRelay
from infrai_jobs.runtime.factory import make_outbox_relay, make_queue_client, with_secrets
from infrai_jobs.runtime.observability import function_observability, record_outbox_relay, tracing

logger, metrics = function_observability()


@cache
def relay() -> OutboxRelay:
    settings, refresh = with_secrets(OutboxRelaySettings.from_env())
    queue = make_queue_client(settings, refresh_api_key=refresh.api_key)
    return make_outbox_relay(settings, queue, refresh=refresh)


@logger.inject_lambda_context(correlation_id_path=correlation_paths.EVENT_BRIDGE, clear_state=True)
@metrics.log_metrics
@tracing
def lambda_handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    outbox = relay()
    report = outbox.run(context.get_remaining_time_in_millis)
    status = outbox.status()
    record_outbox_relay(metrics, report, status)
    logger.info("outbox relayed", extra={"action": "outbox_relay", **report.as_dict()})
    return {**report.as_dict(), "outbox": status.as_dict()}
