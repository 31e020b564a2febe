"""``digest.build`` of the fixture jobs: an ``external_idempotent`` job.

The provider takes the claim's key as ``Idempotency-Key``, so a repeated call replays the first
answer; the probe looks the digest up by that key. ``_http`` is the provider's client, which a
test may wrap (a drain that dies right after the call).
"""

from __future__ import annotations

import json
from urllib.parse import quote

from fixture_jobs.provider import Provider
from infrai_jobs.jobs.probes import Done, NotDone, ProbeAnswer, Unknown
from infrai_jobs.jobs.registry import Effect, JobContext, JobRegistry, JsonValue, Payload

NAME = "digest.build"

_http = Provider("DIGEST_PROVIDER_URL", read_timeout=10.0)


def build(payload: Payload, ctx: JobContext) -> JsonValue:
    period = {"tenant_id": payload["tenant_id"], "period": payload["period"]}
    answer = _http.call(
        "POST",
        _http.url(ctx, "/v1/digests"),
        provider="digest provider",
        idempotent=True,
        body=json.dumps(period),
        headers={"Content-Type": "application/json", "Idempotency-Key": ctx.idem_key},
    )
    built = json.loads(answer.data)
    return {"digest_id": built.get("id"), "replayed": bool(built.get("replayed"))}


def find_built(payload: Payload, ctx: JobContext) -> ProbeAnswer:
    answer = _http.request("GET", _http.url(ctx, f"/v1/digests/{quote(ctx.idem_key, safe='')}"))
    if answer.status == 404:
        return NotDone()
    found = json.loads(answer.data) if answer.status == 200 else None
    if not isinstance(found, dict) or found.get("idempotency_key") != ctx.idem_key:
        return Unknown(f"the digest lookup answered HTTP {answer.status} without this key")
    return Done({"digest_id": str(found.get("id")), "replayed": False, "reconciled": True})


def register(registry: JobRegistry) -> None:
    registry.job(
        NAME,
        identity=("tenant_id", "period"),
        fields=dict.fromkeys(("tenant_id", "period"), str),
        effect=Effect.EXTERNAL_IDEMPOTENT,
        settings=(_http.setting,),
        prepare=_http.warm,
        probe=find_built,
    )(build)
