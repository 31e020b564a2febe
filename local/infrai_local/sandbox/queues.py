"""Creating Infrai queues: the CLI's, the local stack's and the tests' business, never a
deployed drain's (its queues exist before it runs)."""

from __future__ import annotations

from typing import Any

from infrai_jobs.errors import InfraiError
from infrai_jobs.queue.client import InfraiClient, QueueCall


def ensure_queue(
    client: InfraiClient, name: str, *, dlq: str | None = None, type_: str = "standard"
) -> bool:
    """Create ``name`` (and its DLQ) through ``client``; return False when it already existed."""
    body: dict[str, Any] = {"name": name, "type": type_}
    if dlq:
        body["dlq"] = dlq
    try:
        # Retried like any idempotent call: a repeat that finds the queue answers 409.
        client._call(QueueCall("create", "POST", "/v1/queue/create", body), retryable=True)
    except InfraiError as exc:
        if exc.code == "QUEUE_ALREADY_EXISTS":
            return False
        raise
    return True
