"""The framework tests' own jobs: one of each effect class, whichever jobs a team has.

They answer to the example jobs' names (``invoice.finalize``, ``receipt.send``,
``digest.build``) because the framework's tests speak of what those names stand for: a
``database`` job updating a table of its own, a mail-like ``external`` job with a reconcile
probe, and a provider call that honours an ``Idempotency-Key``. They are written apart from
``functions/jobs`` and never import it, so a team may change, extend or delete the examples and
the framework's tests do not notice.

In the test process this package is ``fixture_jobs``: ``tests/fixture_code`` comes after
``functions/`` on the path, so ``jobs`` stays the team's package (the example tests' and the
team's own test-kit tests'). A CLI child or a child Python meets them as ``jobs``, the code
root's package beside this one (``INFRAI_JOBS_PATH=tests/fixture_code``).
"""

from __future__ import annotations

from pathlib import Path

from fixture_jobs import billing, digest, mail
from infrai_jobs.jobs.registry import JobRegistry

CODE_ROOT = Path(__file__).resolve().parent.parent
"""A code root laid out as ``functions/``: its ``jobs`` package serves these jobs to children,
and its ``jobs/migrations`` holds their tables."""


def build_registry() -> JobRegistry:
    """A fresh registry of the fixture jobs (settings not bound)."""
    registry = JobRegistry()
    for module in (billing, mail, digest):
        module.register(registry)
    return registry


def provider_settings(url: str) -> dict[str, str]:
    """Every setting the fixture jobs declare, each pointed at one provider (the sink)."""
    return dict.fromkeys(build_registry().declared_settings(), url)
