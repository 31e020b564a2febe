"""Ports of this package: what its callers may ask of an adapter, and nothing more."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, TypedDict, Unpack

from infrai_jobs.queue.models import Pending, PublishPrice, QueueMessage, QueueStats


class PublishOptions(TypedDict, total=False):
    """``publish``'s options, each None by default: seconds before the message is delivered, and
    whether a failed publish is retried (None: as the adapter is set up to)."""

    delay_seconds: int | None
    retry: bool | None


class QueuePort(Protocol):
    """What the package needs from Infrai's queue."""

    def publish(
        self, queue: str, body: Mapping[str, Any], **options: Unpack[PublishOptions]
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
    """A ``QueuePort`` handing every call to ``inner``: a wrapper overrides the calls it watches
    (``publish`` is spelt out, for an override calling ``super().publish``)."""

    def __init__(self, inner: QueuePort) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        # Reached only for what the wrapper lacks; never for private names (a half-built copy).
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._inner, name)

    def publish(
        self, queue: str, body: Mapping[str, Any], **options: Unpack[PublishOptions]
    ) -> str:
        return self._inner.publish(queue, body, **options)
