"""Observability, declared once: the Powertools Logger, Metrics and Tracer every function uses. The
library logs through stdlib ``logging`` (a stable ``action`` word, and ``idem_key``, ``message_id``,
``job``, ... about a message); the function's Powertools Logger formats it as JSON. Metrics are EMF
with low-cardinality dimensions only: the queue, never a key or a message id."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any, TypeVar, cast

from aws_lambda_powertools import Logger, Metrics
from aws_lambda_powertools.logging.utils import copy_config_to_registered_loggers
from aws_lambda_powertools.metrics import EphemeralMetrics, MetricUnit

from infrai_jobs.config.settings import tracing_on
from infrai_jobs.drain.model import DrainFeature, DrainSummary, HandlerAttempt
from infrai_jobs.jobs.correlation import traceparent_trace_id
from infrai_jobs.jobs.probes import ANSWERS, DONE, NOT_DONE, UNKNOWN
from infrai_jobs.jobs.registry import JobContext
from infrai_jobs.work.outcomes import OUTCOME_METRICS
from infrai_jobs.work.states import JobRun

if TYPE_CHECKING:
    from aws_lambda_powertools import Tracer

    from infrai_jobs.operations.alerting import AlertReport
    from infrai_jobs.outbox.relay import RelayReport
    from infrai_jobs.outbox.status import OutboxStatus

PACKAGE_LOGGER = "infrai_jobs"

# The drain's summary totals; ``record_drain`` adds one metric per row of the outcome table.
DRAIN_METRICS = {
    "consumed": "MessagesConsumed",
    "done": "JobsDone",
    "duplicates": "DuplicatesSkipped",
    "retried": "JobsRetried",
    "failed": "JobsFailed",
    "parked": "MessagesParked",
    "deferred": "JobsDeferred",
    "acked": "MessagesAcked",
    "ack_lost": "AcksLost",
    "ack_failed": "AcksFailed",
    "batches": "Batches",
    "takeovers": "LeaseTakeovers",
    "answers_lost": "ConsumeAnswersLost",
    "unreadable": "UnreadableMessages",
    "idle_polls": "IdlePolls",
    "fanned_out": "DrainsFannedOut",
    "fan_out_throttled": "FanOutThrottled",
    "fan_out_failed": "FanOutFailed",
    "visibility_mismatches": "VisibilityMismatch",
    "deferred_ran": "DeferredJobsRun",
    "deferred_done": "DeferredJobsDone",
    "deferred_failed": "DeferredJobsFailed",
    "rate_limit_waits": "RateLimitWaits",
    "database_full": "DatabaseFull",
    "lanes_shed": "LanesShed",
}


F = TypeVar("F", bound=Callable[..., Any])


def tracing(handler: F) -> F:
    """X-Ray tracing around a handler, only when the template turns it on (otherwise the X-Ray
    SDK is never imported, which saves about 300 ms of cold start: docs/performance.md)."""
    tracer = _tracer()
    return handler if tracer is None else cast(F, tracer.capture_lambda_handler(handler))


def _tracer() -> Tracer | None:
    if not tracing_on():
        return None
    from aws_lambda_powertools import Tracer  # noqa: PLC0415 - imports the X-Ray SDK

    return Tracer()


MessageSpan = Callable[[JobContext], AbstractContextManager[object]]


def message_tracing() -> MessageSpan | None:
    """With tracing on, the span each handler run gets (``MessageTracing``): an X-Ray subsegment
    ``## job NAME`` annotated by ``message_annotations``, so the drain's trace can be found from
    the producer's. With tracing off: None."""
    if (tracer := _tracer()) is None:
        return None

    @contextmanager
    def span(ctx: JobContext) -> Iterator[object]:
        with tracer.provider.in_subsegment(f"## job {ctx.job}") as subsegment:
            for key, value in message_annotations(ctx).items():
                subsegment.put_annotation(key, value)
            yield subsegment

    return span


class MessageTracing(DrainFeature):
    """Tracing as a drain feature: each handler run inside ``span`` (``message_tracing``)."""

    def __init__(self, span: MessageSpan) -> None:
        self.span = span

    def around_handler(self, attempt: HandlerAttempt, run: Callable[[], JobRun]) -> JobRun:
        with self.span(attempt.ctx):
            return run()


def message_annotations(ctx: JobContext) -> dict[str, str]:
    """The X-Ray annotations of one handler run: its job and message id and, when its producer
    sent them, its correlation id and its traceparent's trace id (also as X-Ray writes it)."""
    annotations = {"job": ctx.job, "message_id": ctx.message_id}
    if ctx.correlation_id is not None:
        annotations["correlation_id"] = ctx.correlation_id
    if (trace_id := traceparent_trace_id(ctx.traceparent)) is not None:
        annotations["trace_id"] = trace_id
        # X-Ray's form of the same 128 bits: 1-{first 8 hex digits}-{the other 24}.
        annotations["xray_trace_id"] = f"1-{trace_id[:8]}-{trace_id[8:]}"
    return annotations


def function_observability() -> tuple[Logger, Metrics]:
    """The Logger and Metrics of a Lambda function (configured by the template's POWERTOOLS_*
    variables); call once, at the handler module's top."""
    logger = Logger()
    # Registering the package logger first lets the copy below reach every infrai_jobs.* child.
    logging.getLogger(PACKAGE_LOGGER)
    copy_config_to_registered_loggers(source_logger=logger, include={PACKAGE_LOGGER})
    return logger, Metrics()


def record_drain(
    metrics: Metrics, queue: str, summary: DrainSummary, *, second_layer_hits: int = 0
) -> None:
    """Every summary total and every outcome (zero included, so alarms see a steady series)."""
    metrics.add_dimension(name="queue", value=queue)
    counts = summary.as_dict()
    _add(metrics, MetricUnit.Count, {name: counts[field] for field, name in DRAIN_METRICS.items()})
    outcomes = {name: summary.outcomes[outcome] for outcome, name in OUTCOME_METRICS.items()}
    _add(metrics, MetricUnit.Count, {**outcomes, "SecondLayerHits": second_layer_hits})


def _add(
    metrics: Metrics | EphemeralMetrics, unit: MetricUnit, values: Mapping[str, float]
) -> None:
    for name, value in values.items():
        metrics.add_metric(name=name, unit=unit, value=value)


QUEUE_METRICS = {
    "dlq_count": "DlqCount",
    "ledger_dead_letters": "LedgerDeadLetters",
    # Both together: what the watcher alerts on, and what DlqCountAlarm pages on.
    "dead_letters": "DeadLetters",
    "available_count": "AvailableCount",
    "in_flight_count": "InFlightCount",
    "delayed_count": "DelayedCount",
}

# Stuck claims probed by the watcher before counting, by the probe's answer.
RECONCILE_METRICS = {
    DONE: "ReconciledDone",
    NOT_DONE: "ReconciledNotDone",
    UNKNOWN: "ReconciledUnknown",
}


def record_alert_check(metrics: Metrics, report: AlertReport) -> None:
    """One EMF document per queue (dimension ``queue``), the ledger's figures on ``metrics``;
    every figure zero included, so a dashboard (and OldestDeferredAlarm) sees a steady series."""
    for queue in report.as_dict()["queues"]:
        per_queue = EphemeralMetrics(namespace=metrics.namespace, service=metrics.service)
        per_queue.add_dimension(name="queue", value=queue["queue"])
        _add(per_queue, MetricUnit.Count, {name: queue[f] for f, name in QUEUE_METRICS.items()})
        age = queue["oldest_message_age_seconds"]
        _add(per_queue, MetricUnit.Seconds, {"OldestMessageAgeSeconds": age})
        per_queue.flush_metrics()
    reconciled = report.reconciled.by_answer() if report.reconciled else dict.fromkeys(ANSWERS, 0)
    counts = {
        "StuckClaims": report.stuck.count,
        "DeferredBacklog": report.deferred.backlog,
        "AlertsSent": len(report.sent),
        **{name: reconciled[answer] for answer, name in RECONCILE_METRICS.items()},
    }
    _add(metrics, MetricUnit.Count, counts)
    ages = {
        "OldestRunningClaimAgeSeconds": report.stuck.oldest_running_age_seconds,
        "OldestDeferredAgeSeconds": report.deferred.oldest_age_seconds,
    }
    _add(metrics, MetricUnit.Seconds, ages)


def record_outbox_relay(metrics: Metrics, report: RelayReport, status: OutboxStatus) -> None:
    """One relay pass, and the outbox after it: OldestOutboxAlarm pages on the oldest pending
    row's age (zero included, so the alarm sees a steady series)."""
    counts = {
        "OutboxPublished": report.published,
        "OutboxRetried": report.retried,
        "OutboxDeadLettered": report.dead,
        "OutboxPending": status.pending,
    }
    _add(metrics, MetricUnit.Count, counts)
    _add(metrics, MetricUnit.Seconds, {"OldestOutboxAgeSeconds": status.oldest_pending_age_seconds})
