"""Publishing a job only when the drain could run it: the producer's side of the job registry.

A payload the drain cannot key (an unknown job, a missing or mistyped field, a value JSON cannot
carry exactly) is rejected there and waits in the DLQ for a human, and its publish has been
paid for. ``publish_checked`` applies the drain's own rule first (``check_publishable``, which is
``JobRegistry.derive``) and publishes only what passes::

    from infrai_jobs.producer import publish_checked

    registry = build_registry()  # the jobs package every function loads (functions/jobs)
    published = publish_checked(queue, registry, "billing-jobs", {"job": "refund.issue", ...})
    logger.info("job published", extra={"idem_key": published.idem_key})

A payload that fails raises ``KeyDerivationError`` (``InvalidPayload`` for a field that is
missing or of the wrong type) with the drain's reason, and nothing is sent. ``infrai-jobs
publish`` checks with ``check_publishable`` too, so a producer and the command line follow one
rule.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from infrai_jobs.jobs import DerivedJob, JobRegistry
from infrai_jobs.ports import QueuePort


@dataclass(frozen=True, slots=True)
class PublishedJob:
    """A checked payload the queue accepted."""

    message_id: str
    # The key the drain will claim this work under: what to log to find its claim later.
    idem_key: str
    job: str


def check_publishable(registry: JobRegistry, payload: Mapping[str, Any]) -> DerivedJob:
    """The payload matched to its job, with the key the drain will claim it under; raises
    ``KeyDerivationError`` with the reason the drain would reject it."""
    return registry.derive(payload)


def publish_checked(
    queue: QueuePort,
    registry: JobRegistry,
    queue_name: str,
    payload: Mapping[str, Any],
    *,
    delay_seconds: int | None = None,
) -> PublishedJob:
    """Check ``payload`` as the drain will (``registry.derive``), then publish it to
    ``queue_name``. Raises ``KeyDerivationError`` before anything is sent when the drain would
    reject it; the queue's own errors (``InfraiError``) as ``queue.publish`` raises them."""
    derived = check_publishable(registry, payload)
    message_id = queue.publish(queue_name, payload, delay_seconds=delay_seconds)
    return PublishedJob(message_id, derived.idem_key, derived.definition.name)
