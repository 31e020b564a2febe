"""Ports of this package: what its callers may ask of an adapter, and nothing more."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from infrai_jobs.queue.models import Pending, PublishPrice, QueueMessage, QueueStats


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

    # ``consume`` and ``ack`` sent now, answered by ``Pending.wait()`` (an in-memory queue may
    # answer at once).
    def send_consume(self, queue: str, max_messages: int = 10) -> Pending[list[QueueMessage]]: ...

    def ack(self, queue: str, receipt_handle: str) -> None: ...

    def send_ack(self, queue: str, receipt_handle: str) -> Pending[None]: ...

    def stats(self, queue: str) -> QueueStats: ...

    def publish_price(self) -> PublishPrice: ...


class ForwardingQueue:
    """A ``QueuePort`` handing every call to ``inner``: a wrapper overrides the calls it watches."""

    def __init__(self, inner: QueuePort) -> None:
        self._inner = inner

    @property
    def inner(self) -> QueuePort:
        return self._inner

    def publish(self, queue: str, body: Mapping[str, Any], **options: Any) -> str:
        return self._inner.publish(queue, body, **options)

    def consume(self, queue: str, max_messages: int = 10) -> list[QueueMessage]:
        return self._inner.consume(queue, max_messages)

    def send_consume(self, queue: str, max_messages: int = 10) -> Pending[list[QueueMessage]]:
        return self._inner.send_consume(queue, max_messages)

    def ack(self, queue: str, receipt_handle: str) -> None:
        self._inner.ack(queue, receipt_handle)

    def send_ack(self, queue: str, receipt_handle: str) -> Pending[None]:
        return self._inner.send_ack(queue, receipt_handle)

    def stats(self, queue: str) -> QueueStats:
        return self._inner.stats(queue)

    def publish_price(self) -> PublishPrice:
        return self._inner.publish_price()
