"""``receipt.send``: an ``external`` job. A sent e-mail cannot be unsent.

Its claim is committed before the call. If the call may have reached the provider but we cannot
tell (a timeout, a 5xx), the handler raises ``EffectUncertain``: the claim stays ``running`` and is
flagged for a human, instead of a retry that might send a second receipt.

Its result is kept in the ledger (and in the second layer's store), so it holds no e-mail
address: only the SHA-256 of the address as sent (trimmed, lower-cased), enough to confirm
which address a receipt went to when you already know it, not to read one back.
"""

from __future__ import annotations

import hashlib
import json

from infrai_jobs.errors import EffectUncertain, PermanentJobError
from infrai_jobs.jobs import Effect, JobContext, JobRegistry, JsonValue, Payload
from jobs._http import LazyPool

_http = LazyPool(connect_s=2.0, read_s=5.0)

# Where receipts are mailed: the mail provider's base URL (HTTPS; HTTP on loopback only).
MAIL_PROVIDER_URL = "MAIL_PROVIDER_URL"


def send_receipt(payload: Payload, ctx: JobContext) -> JsonValue:
    import urllib3  # noqa: PLC0415 (on first use, like the pool: see jobs._http)

    body = json.dumps(
        {"to": payload["email"], "template": "receipt", "invoice_id": payload["invoice_id"]}
    )
    try:
        response = _http.request(
            "POST",
            f"{ctx.settings[MAIL_PROVIDER_URL]}/v1/mail/send",
            body=body,
            headers={"Content-Type": "application/json"},
        )
    except urllib3.exceptions.NewConnectionError:
        raise  # nothing was sent: the transient failure releases the claim for a retry
    except urllib3.exceptions.HTTPError as exc:
        raise EffectUncertain(f"mail provider call ended without an answer: {exc}") from exc
    if response.status >= 500:
        raise EffectUncertain(f"mail provider answered {response.status}; it may have sent")
    if response.status >= 400:
        raise PermanentJobError(f"mail provider refused the receipt: HTTP {response.status}")
    # The mail is sent: whatever the body looks like, this must not become a retry.
    try:
        answer = json.loads(response.data)
    except ValueError:
        answer = {}
    provider_id = answer.get("id") if isinstance(answer, dict) else None
    return {"provider_message_id": provider_id, "to_sha256": address_digest(payload["email"])}


def address_digest(email: str) -> str:
    """The hex SHA-256 of an e-mail address, trimmed and lower-cased: how a result names its
    recipient without holding personal data in clear."""
    return hashlib.sha256(email.strip().lower().encode("utf-8")).hexdigest()


def register(registry: JobRegistry) -> None:
    registry.job(
        "receipt.send",
        effect=Effect.EXTERNAL,
        identity=("invoice_id",),
        fields={"invoice_id": (str, int), "email": str},
        settings=(MAIL_PROVIDER_URL,),
    )(send_receipt)
