"""Ports of this package: what its callers may ask of an adapter, and nothing more."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import psycopg

    from infrai_jobs.work.ledger import DatabaseRunner
    from infrai_jobs.work.states import ClaimDecision, ClaimRequest, JobRun, Settlement


class LedgerPort(Protocol):
    """What the drain needs from the claim ledger (``PostgresLedger`` in production)."""

    def claim(self, requests: Sequence[ClaimRequest]) -> list[ClaimDecision]:
        """Claim external-effect jobs; the claims are committed before this returns."""

    def run_database_batch(
        self, requests: Sequence[ClaimRequest], runner: DatabaseRunner
    ) -> tuple[list[ClaimDecision], list[Settlement]]:
        """Claim, run and settle database jobs atomically."""

    def settle(self, request: ClaimRequest, run: JobRun) -> Settlement:
        """Record one external job's outcome, fenced by its claim token."""

    def flag_stuck(self, reasons: dict[str, str]) -> None: ...

    def connection(self) -> psycopg.Connection[Any]:
        """Its one connection, reopened when the server closed it: flow control runs its
        statements (``work.store``, ``flow.limits``) on it, so a lane holds one connection."""

    def ping(self) -> None:
        """Raise ``LedgerUnavailable`` unless the ledger answers (reconnecting once)."""

    def consume_isolation(self, queue: str) -> float:
        """Seconds left in ``queue``'s one-message-at-a-time window (0: consume in batches)."""

    def isolate_consumes(self, queue: str, seconds: float, reason: str) -> float:
        """Open or extend ``queue``'s window to at least ``seconds``; the seconds left."""


class EffectGuard(Protocol):
    """An optional second layer around an external effect (``aws.second_layer``): it may return
    a result recorded earlier for the key instead of ``call``, and must let ``EffectUncertain``
    and other job errors through unchanged."""

    def run(self, idem_key: str, fingerprint: str, call: Callable[[], Any]) -> Any: ...
