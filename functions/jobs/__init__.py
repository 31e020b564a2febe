"""The jobs this drain runs. Copy an example module, register it in ``build_registry``, done.

Each module declares one job: its name, the payload fields that identify the work (its
idempotency key), its effect class, and a handler. See ``infrai_jobs.jobs`` for the contract.
"""

from __future__ import annotations

from infrai_jobs.jobs import JobRegistry
from jobs import digest, invoice, receipt


def build_registry(provider_url: str) -> JobRegistry:
    """Every job this function knows; ``provider_url`` is where the example effects go."""
    registry = JobRegistry()
    invoice.register(registry)
    receipt.register(registry, provider_url)
    digest.register(registry, provider_url)
    return registry
