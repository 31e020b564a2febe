"""Every place that connects to the ledger, each as a call of no arguments on one database URL:
what the security tests hand a hostile or malformed URL to, so that none is left out."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from infrai_jobs.operations.alerting import AlertCheck, AlertThresholds, PrintingAlerter
from infrai_jobs.operations.dead_letters import DeadLetterStore, fingerprint_or_none
from infrai_jobs.queue.models import QueueMessage
from infrai_jobs.work.admin import WorkStore
from infrai_jobs.work.ledger import PostgresLedger
from infrai_local import cli as cli_module
from infrai_local.operator.verbs import OperatorLedger


class NoQueue:
    """The watcher's queue, for a run that watches no queue (it fails on the ledger first)."""

    def stats(self, name: str) -> Any:  # pragma: no cover - no queue is watched
        raise AssertionError(name)


def entry_points(url: str) -> dict[str, Callable[[], object]]:
    """Each place that connects, by name. ``migrate`` imports the jobs package: run it with the
    fixture jobs as ``jobs`` (``fixture_project.fixture_jobs_as_jobs``)."""
    message = QueueMessage("qmsg_1", "billing-jobs-dlq", {"job": "x", "id": "1"}, 1, None, "r")
    return {
        "the drain's ledger": lambda: PostgresLedger(url, connect_timeout=1).ping(),
        "the watcher": lambda: AlertCheck(
            NoQueue(), url, PrintingAlerter(), AlertThresholds(), connect_timeout=1
        ).run([]),
        "claims admin": lambda: WorkStore(url, connect_timeout=1).stuck(),
        "operator ledger": lambda: OperatorLedger(url, connect_timeout=1).list_claims(),
        "migrate": lambda: cli_module._migrate(url),
        "redrive's reopen": lambda: WorkStore(url).reopen_failed(
            message_id=message.message_id,
            fingerprint=fingerprint_or_none(message.payload),
            actor="on-call",
        ),
        "the ledger's dead letters": lambda: DeadLetterStore(
            WorkStore(url, connect_timeout=1)
        ).ensure_reachable(),
    }
