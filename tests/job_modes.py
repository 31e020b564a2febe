"""Test jobs that fail on request: a payload field names the failure a handler raises, so one
job can walk every outcome row; and one that does nothing, for tests of a declaration alone.
Importable from every test folder, as ``child_process`` is."""

from __future__ import annotations

from infrai_jobs.errors import EffectUncertain, PermanentJobError
from infrai_jobs.jobs.registry import JobContext, JsonValue, Payload


def noop(payload: Payload, ctx: JobContext) -> JsonValue:
    """A handler with no effect: where only the job's declaration is under test."""
    return None


def fail_as_asked(payload: Payload, field: str = "mode") -> None:
    """Raise what ``payload[field]`` names: ``transient`` (a plain error, retried),
    ``permanent`` (``PermanentJobError``) or ``uncertain`` (``EffectUncertain``); any other
    value, or none, returns and the job goes on."""
    mode = payload.get(field, "ok")
    if mode == "transient":
        raise RuntimeError("simulated transient failure")
    if mode == "permanent":
        raise PermanentJobError("simulated permanent failure")
    if mode == "uncertain":
        raise EffectUncertain("simulated timeout after the call")
