"""``digest.build``: an ``external_idempotent`` job, keyed by tenant and period.

The provider accepts our idempotency key as an ``Idempotency-Key`` header, so a repeated call is
harmless downstream: a crashed attempt's claim may be taken over once its lease expires, and
every failure can simply be retried.

A claim flagged stuck is reconciled by asking the provider for the digest built under our key
(``GET /v1/digests/<key>``): found settles it ``done``, 404 releases it, anything else leaves it
to a human.
"""

from __future__ import annotations

import json
from urllib.parse import quote

from infrai_jobs.jobs.http_pool import LazyPool
from infrai_jobs.jobs.probes import Done, NotDone, ProbeAnswer, Unknown
from infrai_jobs.jobs.registry import Effect, JobContext, JobRegistry, JsonValue, Payload

_http = LazyPool(connect_s=2.0, read_s=10.0)

# Where digests are built: the digest provider's base URL (HTTPS; HTTP on loopback only).
DIGEST_PROVIDER_URL = "DIGEST_PROVIDER_URL"


def build_digest(payload: Payload, ctx: JobContext) -> JsonValue:
    body = json.dumps({"tenant_id": payload["tenant_id"], "period": payload["period"]})
    response = _http.call(
        "POST",
        f"{ctx.settings[DIGEST_PROVIDER_URL]}/v1/digests",
        provider="digest provider",
        idempotent=True,
        body=body,
        headers={"Content-Type": "application/json", "Idempotency-Key": ctx.idem_key},
    )
    answer = json.loads(response.data)
    return {"digest_id": answer.get("id"), "replayed": bool(answer.get("replayed"))}


def find_digest(payload: Payload, ctx: JobContext) -> ProbeAnswer:
    """The reconcile probe: did the provider build a digest under this claim's key?"""
    url = f"{ctx.settings[DIGEST_PROVIDER_URL]}/v1/digests/{quote(ctx.idem_key, safe='')}"
    response = _http.request("GET", url)
    if response.status == 404:
        return NotDone()
    if response.status != 200:
        return Unknown(f"digest provider's lookup answered HTTP {response.status}")
    answer = json.loads(response.data)
    if not isinstance(answer, dict) or not answer.get("id"):
        return Unknown("digest provider's lookup answered without a digest id")
    if answer.get("idempotency_key") != ctx.idem_key:
        # Not the digest this claim stands for: settling on it could hide one never built.
        return Unknown("digest provider's lookup answered a digest of another key")
    return Done({"digest_id": str(answer["id"]), "replayed": False, "reconciled": True})


def register(registry: JobRegistry) -> None:
    registry.job(
        "digest.build",
        effect=Effect.EXTERNAL_IDEMPOTENT,
        identity=("tenant_id", "period"),
        fields={"tenant_id": str, "period": str},
        settings=(DIGEST_PROVIDER_URL,),
        probe=find_digest,
        prepare=_http.warm,  # ready before a rate-limited start: see infrai_jobs.jobs.http_pool
    )(build_digest)
