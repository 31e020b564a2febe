"""The fixture code root's ``jobs`` package, for ``infrai-jobs`` children (``INFRAI_JOBS_PATH``),
child Pythons (this folder first on ``PYTHONPATH``) and the fixture project's functions: the
framework tests' jobs (``fixture_jobs``), whichever jobs a team has, and the harness's counted
test jobs (``counted``). It is laid out as a team's package is (one ``from jobs import`` line,
one ``return registry``), so ``infrai-jobs new-job`` can add a job to a copy of it.

A child that runs the counted jobs itself registers them on ``fixture_jobs.build_registry()``.
"""

from __future__ import annotations

from fixture_jobs import build_registry as build_fixture_registry

from infrai_jobs.jobs.registry import JobRegistry
from jobs import counted


def build_registry() -> JobRegistry:
    registry: JobRegistry = build_fixture_registry()
    counted.register(registry)
    return registry
