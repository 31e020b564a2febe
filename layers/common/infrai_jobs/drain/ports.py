"""Ports of this package: what its callers may ask of an adapter, and nothing more."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol


class DrainFleetPort(Protocol):
    """The drains of a queue alive now, as the ledger counts them (``drain_leases``), leases in
    seconds on its clock. ``join`` and ``reserve`` decide under one lock per queue."""

    def join(
        self, queue: str, drain_id: str, *, origin: str, lease_seconds: float, cap: int
    ) -> bool:
        """Count this drain in: adopt its reserved slot, or take a free one; False when
        ``cap`` drains are alive already."""

    def renew(self, queue: str, drain_id: str, *, lease_seconds: float) -> int:
        """Extend this drain's lease; return how many drains of the queue are alive."""

    def reserve(self, queue: str, *, wanted: int, cap: int, lease_seconds: float) -> list[str]:
        """Reserve slots for the drains missing to make ``min(wanted, cap)`` alive; their ids."""

    def leave(self, queue: str, drain_ids: Sequence[str]) -> None:
        """Give back these drains' leases or reserved slots."""


class DrainStarterPort(Protocol):
    """Starts one more drain invocation asynchronously (Lambda ``Invoke``, ``Event``)."""

    def start(self, event: Mapping[str, Any]) -> None:
        """Hand ``event`` to a new drain and return at once; ``FanOutThrottled`` when refused
        for capacity, ``FanOutError`` for any other failure."""
