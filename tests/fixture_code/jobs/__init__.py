"""The fixture code root's ``jobs`` package, for ``infrai-jobs`` children (``INFRAI_JOBS_PATH``)
and child Pythons (this folder first on ``PYTHONPATH``): the framework tests' jobs
(``fixture_jobs``), whichever jobs a team has.

It also declares the harness's counted test jobs (``drainkit.add_test_jobs``) by name, effect
and identity, so a command run in a child process derives the same keys and judges the same dead
letters as the harness's drain does. Their handlers run only in the harness: here they refuse, so
a child that tried to run one would say so. A child that runs them registers them itself, on
``fixture_jobs.build_registry()``.
"""

from __future__ import annotations

from fixture_jobs import build_registry as build_fixture_registry

from infrai_jobs.errors import PermanentJobError
from infrai_jobs.jobs.registry import Effect, JobContext, JobRegistry, JsonValue, Payload


def _not_here(payload: Payload, ctx: JobContext) -> JsonValue:
    raise PermanentJobError("the fixture package only derives keys; the harness runs its jobs")


def build_registry() -> JobRegistry:
    registry = build_fixture_registry()
    registry.job("test.db", effect=Effect.DATABASE, identity=("id",))(_not_here)
    registry.job("test.ext", effect=Effect.EXTERNAL, identity=("id",))(_not_here)
    return registry
