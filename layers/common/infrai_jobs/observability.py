"""Observability, declared once: the Powertools Logger and Metrics every function uses.

Log lines about a message carry ``idem_key``, ``message_id``, ``delivery_count``, ``job`` and a
stable ``action`` word (the library logs them through stdlib ``logging``; the function's
Powertools Logger formats them as JSON). Metrics are EMF with low-cardinality dimensions only:
the queue name, never a key or a message id.
"""

from __future__ import annotations

import logging

from aws_lambda_powertools import Logger, Metrics
from aws_lambda_powertools.logging.utils import copy_config_to_registered_loggers
from aws_lambda_powertools.metrics import MetricUnit

from infrai_jobs.drain import DrainSummary

PACKAGE_LOGGER = "infrai_jobs"

# Metric name for each drain summary field: one vocabulary for dashboards and alarms.
DRAIN_METRICS = {
    "consumed": "MessagesConsumed",
    "done": "JobsDone",
    "duplicates": "DuplicatesSkipped",
    "failed": "JobsFailed",
    "parked": "MessagesParked",
    "acked": "MessagesAcked",
    "ack_lost": "AcksLost",
    "ack_failed": "AcksFailed",
    "batches": "Batches",
}


def function_observability() -> tuple[Logger, Metrics]:
    """The Logger and Metrics of a Lambda function; call once, at the handler module's top.

    Service name, namespace and level come from the POWERTOOLS_* variables the template sets.
    """
    logger = Logger()
    # Registering the package logger first lets the copy below reach every infrai_jobs.* child.
    logging.getLogger(PACKAGE_LOGGER)
    copy_config_to_registered_loggers(source_logger=logger, include={PACKAGE_LOGGER})
    return logger, Metrics()


def record_drain(metrics: Metrics, queue: str, summary: DrainSummary) -> None:
    metrics.add_dimension(name="queue", value=queue)
    counts = summary.as_dict()
    for field, name in DRAIN_METRICS.items():
        metrics.add_metric(name=name, unit=MetricUnit.Count, value=counts[field])
