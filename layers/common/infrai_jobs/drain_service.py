"""What DrainFunction and ``infrai-jobs drain`` share: the adapters, built once and reused.

A warm Lambda keeps one ``DrainService``: its HTTP pool and its database connection live across
invocations, and the connection is re-established when the server has closed it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from infrai_jobs.drain import DrainConfig, DrainSummary, drain
from infrai_jobs.errors import LedgerUnavailable
from infrai_jobs.factory import make_ledger, make_queue_client
from infrai_jobs.jobs import JobRegistry
from infrai_jobs.ledger import PostgresLedger
from infrai_jobs.ports import QueuePort
from infrai_jobs.secrets import resolve_secrets
from infrai_jobs.settings import Settings

RegistryFactory = Callable[[str], JobRegistry]


@dataclass
class DrainService:
    settings: Settings
    queue: QueuePort
    ledger: PostgresLedger
    registry: JobRegistry

    @classmethod
    def from_settings(cls, settings: Settings, build_registry: RegistryFactory) -> DrainService:
        resolved = resolve_secrets(settings)
        return cls(
            settings=resolved,
            queue=make_queue_client(resolved),
            ledger=make_ledger(resolved),
            registry=build_registry(resolved.provider_url),
        )

    def config(self, max_batches: int | None = None) -> DrainConfig:
        return DrainConfig(
            queue=self.settings.queue,
            batch_budget_ms=self.settings.batch_budget_ms,
            lease_grace_seconds=self.settings.lease_grace_seconds,
            max_batches=max_batches,
        )

    def run(self, time_left_ms: Callable[[], int], max_batches: int | None = None) -> DrainSummary:
        """Drain once. A ledger outage is raised after what settled was acked, so the
        function's Errors alarm fires instead of the invocation looking healthy."""
        summary = drain(
            self.queue, self.ledger, self.registry, self.config(max_batches), time_left_ms
        )
        if summary.stopped == "ledger_unavailable":
            raise LedgerUnavailable(
                f"the ledger database failed mid-drain; summary so far: {summary.as_dict()}"
            )
        return summary
