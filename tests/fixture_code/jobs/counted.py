"""The harness's counted test jobs (``drainkit.add_test_jobs``), declared by name, effect and
identity only: a child process derives their keys and judges their dead letters as the harness's
drain does. Their handlers run only in the harness; here they refuse, so a child that tried to
run one would say so."""

from __future__ import annotations

from infrai_jobs.errors import PermanentJobError
from infrai_jobs.jobs.registry import Effect, JobContext, JobRegistry, JsonValue, Payload


def _not_here(payload: Payload, ctx: JobContext) -> JsonValue:
    raise PermanentJobError("the fixture package only derives keys; the harness runs its jobs")


def register(registry: JobRegistry) -> None:
    registry.job("test.db", effect=Effect.DATABASE, identity=("id",))(_not_here)
    registry.job("test.ext", effect=Effect.EXTERNAL, identity=("id",))(_not_here)
