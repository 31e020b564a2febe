"""The small ports the core depends on. Adapters are passed in; only handlers build real ones.

Each Protocol is what the drain, alerting and operations code may ask of the outside world, and
nothing more, so an in-memory fake (``infrai_local.fakes``) can stand in for it in unit tests.
``ForwardingQueue`` is the base of the wrappers that watch some of a queue's calls.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from infrai_jobs.queue_models import Pending, PublishPrice, QueueMessage, QueueStats

if TYPE_CHECKING:
    from infrai_jobs.claims import ClaimDecision, ClaimRequest, JobRun, Settlement
    from infrai_jobs.ledger import DatabaseRunner


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

    def send_consume(self, queue: str, max_messages: int = 10) -> Pending[list[QueueMessage]]:
        """``consume`` whose answer is read later (``Pending.settled`` when nothing travels)."""
        ...

    def ack(self, queue: str, receipt_handle: str) -> None: ...

    def send_ack(self, queue: str, receipt_handle: str) -> Pending[None]:
        """``ack`` whose answer is read later (``Pending.settled`` when nothing travels)."""
        ...

    def stats(self, queue: str) -> QueueStats: ...

    def publish_price(self) -> PublishPrice: ...


class ForwardingQueue:
    """A ``QueuePort`` that hands every call to ``inner`` unchanged: a wrapper that watches
    some calls subclasses it and overrides only those."""

    def __init__(self, inner: QueuePort) -> None:
        self._inner = inner

    @property
    def inner(self) -> QueuePort:
        """The queue this one forwards to."""
        return self._inner

    def publish(
        self,
        queue: str,
        body: Mapping[str, Any],
        *,
        delay_seconds: int | None = None,
        retry: bool | None = None,
    ) -> str:
        return self._inner.publish(queue, body, delay_seconds=delay_seconds, retry=retry)

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


class LedgerPort(Protocol):
    """What the drain needs from the claim ledger (``PostgresLedger`` in production)."""

    def claim(self, requests: Sequence[ClaimRequest]) -> list[ClaimDecision]:
        """Claim external-effect jobs; the claims are committed before this returns."""
        ...

    def run_database_batch(
        self, requests: Sequence[ClaimRequest], runner: DatabaseRunner
    ) -> tuple[list[ClaimDecision], list[Settlement]]:
        """Claim, run and settle database jobs atomically."""
        ...

    def settle(self, request: ClaimRequest, run: JobRun) -> Settlement:
        """Record one external job's outcome, fenced by its claim token."""
        ...

    def flag_stuck(self, reasons: dict[str, str]) -> None:
        """Annotate running claims a human must look at."""
        ...

    def ping(self) -> None:
        """Raise ``LedgerUnavailable`` unless the ledger answers (reconnecting once)."""
        ...

    def consume_isolation(self, queue: str) -> float:
        """Seconds left in ``queue``'s one-message-at-a-time window (0: consume in batches)."""
        ...

    def isolate_consumes(self, queue: str, seconds: float, reason: str) -> float:
        """Open or extend ``queue``'s window to at least ``seconds``; the seconds left."""
        ...


class EffectGuard(Protocol):
    """An optional second layer around an external effect (Powertools idempotency).

    ``call`` performs the effect. The guard may return a result recorded earlier for the same
    key instead of calling it, and must let ``EffectUncertain`` and other job errors through to
    the drain unchanged (see ``infrai_jobs.second_layer``).
    """

    def run(self, idem_key: str, fingerprint: str, call: Callable[[], Any]) -> Any: ...


class DrainFleetPort(Protocol):
    """The drains of a queue alive now, as the ledger counts them (``drain_leases``).

    Leases are in seconds from the ledger's own clock. ``join`` and ``reserve`` decide under one
    lock per queue, so two drains deciding at once never both start the missing ones.
    """

    def join(
        self, queue: str, drain_id: str, *, origin: str, lease_seconds: float, cap: int
    ) -> bool:
        """Count this drain in: adopt its reserved slot, or take a free one; False when
        ``cap`` drains are alive already."""
        ...

    def renew(self, queue: str, drain_id: str, *, lease_seconds: float) -> int:
        """Extend this drain's lease; return how many drains of the queue are alive."""
        ...

    def reserve(self, queue: str, *, wanted: int, cap: int, lease_seconds: float) -> list[str]:
        """Reserve slots for the drains missing to make ``min(wanted, cap)`` alive; their ids."""
        ...

    def leave(self, queue: str, drain_ids: Sequence[str]) -> None:
        """Give back these drains' leases or reserved slots."""
        ...


class DrainStarterPort(Protocol):
    """Starts one more drain invocation asynchronously (Lambda ``Invoke``, ``Event``)."""

    def start(self, event: Mapping[str, Any]) -> None:
        """Hand ``event`` to a new drain and return at once; ``FanOutThrottled`` when refused
        for capacity, ``FanOutError`` for any other failure."""
        ...


class Clock(Protocol):
    """Wall-clock seconds since the epoch; a fake moves by hand in tests."""

    def now(self) -> float: ...
