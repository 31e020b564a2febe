"""The team's jobs. Copy an example module, register it in ``build_registry``, done.

Each module declares one job: its name, the payload fields that identify the work (its
idempotency key), its effect class, the settings it needs (the URLs it calls) and a handler; its
tables are migrations in ``migrations/``. See ``infrai_jobs.jobs.registry`` for the contract.
"""

from __future__ import annotations

from infrai_jobs.jobs.registry import JobRegistry
from jobs import digest, invoice, receipt


def build_registry() -> JobRegistry:
    """Every job the functions know. Their settings are bound by the drain at start-up."""
    registry = JobRegistry()
    invoice.register(registry)
    receipt.register(registry)
    digest.register(registry)
    return registry
