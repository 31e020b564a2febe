"""The small ports the core depends on. Adapters are passed in; only handlers build real ones.

Each Protocol is what the drain, alerting and operations code may ask of the outside world, and
nothing more, so an in-memory fake (``infrai_jobs.testing``) can stand in for it in unit tests.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from infrai_jobs.queue_models import PublishPrice, QueueMessage, QueueStats


class QueuePort(Protocol):
    """What the package needs from Infrai's queue."""

    def publish(
        self,
        queue: str,
        body: Mapping[str, Any],
        *,
        delay_seconds: int | None = None,
        retry: bool | None = None,
    ) -> str: ...

    def consume(self, queue: str, max_messages: int = 10) -> list[QueueMessage]: ...

    def ack(self, queue: str, receipt_handle: str) -> None: ...

    def stats(self, queue: str) -> QueueStats: ...

    def publish_price(self) -> PublishPrice: ...


class Clock(Protocol):
    """Wall-clock seconds since the epoch; a fake moves by hand in tests."""

    def now(self) -> float: ...
