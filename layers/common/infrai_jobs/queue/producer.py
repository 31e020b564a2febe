"""Publishing a job only when the drain could run it (usage: docs/payload-schemas.md): a payload
the drain cannot key waits in the DLQ, its publish paid for, so ``publish_checked`` applies the
drain's own rule first, as ``infrai-jobs publish`` does. The ``_correlation_id`` it adds is
envelope: the key and fingerprint do not change with it, so a retry may pass it or not."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from infrai_jobs.errors import InvalidPayload
from infrai_jobs.jobs.correlation import with_correlation_id
from infrai_jobs.jobs.registry import DerivedJob, JobRegistry
from infrai_jobs.queue.ports import QueuePort


@dataclass(frozen=True, slots=True)
class PublishedJob:
    """A checked payload the queue accepted."""

    message_id: str
    # The key the drain will claim this work under: what to log to find its claim later.
    idem_key: str
    job: str
    # The body's ``_correlation_id``: what the drain's log lines about it carry.
    correlation_id: str


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
    correlation_id: str | None = None,
) -> PublishedJob:
    """Check ``payload`` as the drain will, then publish it to ``queue_name`` with a
    ``_correlation_id``. Raises, before anything is sent, ``KeyDerivationError`` when the drain
    would reject it and ``InvalidPayload`` for a correlation id or traceparent the drain would
    ignore; the queue's own errors as ``queue.publish`` raises them."""
    derived = check_publishable(registry, payload)
    try:
        body, chosen = with_correlation_id(payload, correlation_id)
    except ValueError as exc:
        raise InvalidPayload(str(exc)) from None
    message_id = queue.publish(queue_name, body, delay_seconds=delay_seconds)
    return PublishedJob(message_id, derived.idem_key, derived.definition.name, chosen)
