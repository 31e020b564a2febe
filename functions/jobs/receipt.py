"""``receipt.send``: an ``external`` job. A sent e-mail cannot be unsent.

Its claim is committed before the call. If the call may have reached the provider but we cannot
tell (a timeout, a 5xx), the pool's ``call`` raises ``EffectUncertain``: the claim stays
``running`` and is flagged for a human, instead of a retry that might send a second receipt.

When a claim is stuck anyway, its reconcile probe asks the provider for the mails sent for the
invoice (``GET /v1/mail?invoice_id=...``) and looks for this invoice's receipt among them (its
invoice id and the ``receipt`` template: a reminder for the same invoice is not a receipt):
one found settles the claim ``done`` with that mail's id, none releases it for one more try,
and any other answer (a listed mail that does not say what it is) leaves it to a human. That is
safe only because the provider's search sees a mail as soon as its send was answered; with a
provider whose search lags, answer ``Unknown`` for recent claims instead of ``NotDone``.

Its result is kept in the ledger (and in the second layer's store), so it holds no e-mail
address: only the SHA-256 of the address as sent (trimmed, lower-cased), enough to confirm
which address a receipt went to when you already know it, not to read one back.
"""

from __future__ import annotations

import hashlib
import json
from urllib.parse import urlencode

from infrai_jobs.jobs.http_pool import LazyPool
from infrai_jobs.jobs.probes import Done, NotDone, ProbeAnswer, Unknown
from infrai_jobs.jobs.registry import Effect, JobContext, JobRegistry, JsonValue, Payload

_http = LazyPool(connect_s=2.0, read_s=5.0)

RECEIPT_TEMPLATE = "receipt"

# Where receipts are mailed: the mail provider's base URL (HTTPS; HTTP on loopback only).
MAIL_PROVIDER_URL = "MAIL_PROVIDER_URL"


def send_receipt(payload: Payload, ctx: JobContext) -> JsonValue:
    body = json.dumps(
        {
            "to": payload["email"],
            "template": RECEIPT_TEMPLATE,
            "invoice_id": payload["invoice_id"],
        }
    )
    response = _http.call(
        "POST",
        f"{ctx.settings[MAIL_PROVIDER_URL]}/v1/mail/send",
        provider="mail provider",
        body=body,
        headers={"Content-Type": "application/json"},
    )
    # The mail is sent: whatever the body looks like, this must not become a retry.
    try:
        answer = json.loads(response.data)
    except ValueError:
        answer = {}
    provider_id = answer.get("id") if isinstance(answer, dict) else None
    return {"provider_message_id": provider_id, "to_sha256": address_digest(payload["email"])}


def find_receipt(payload: Payload, ctx: JobContext) -> ProbeAnswer:
    """The reconcile probe: was a receipt mailed for this invoice? (A failed call raises, which
    the reconcile pass counts as unknown.)"""
    invoice = payload.get("invoice_id")
    if invoice is None:
        return Unknown("the claim's key names no invoice (a producer key): look it up by hand")
    query = urlencode({"invoice_id": str(invoice)})
    response = _http.request("GET", f"{ctx.settings[MAIL_PROVIDER_URL]}/v1/mail?{query}")
    if response.status != 200:
        return Unknown(f"mail provider's search answered HTTP {response.status}")
    answer = json.loads(response.data)
    messages = answer.get("messages") if isinstance(answer, dict) else None
    if not isinstance(messages, list):
        return Unknown("mail provider's search answered without a list of messages")
    mails = [m for m in messages if isinstance(m, dict)]
    receipts = [
        m
        for m in mails
        if str(m.get("invoice_id")) == str(invoice) and m.get("template") == RECEIPT_TEMPLATE
    ]
    if receipts:
        found = receipts[-1]
        # Only the reference: the provider's answer itself is not the claim's to keep.
        return Done(
            {
                "provider_message_id": found.get("id"),
                "to_sha256": address_digest(str(found.get("to", ""))),
                "reconciled": True,
            }
        )
    if len(mails) < len(messages) or any("template" not in m for m in mails):
        return Unknown("mail provider listed mails that do not say what they are")
    return NotDone()


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
        probe=find_receipt,
        prepare=_http.warm,  # ready before a rate-limited start: see infrai_jobs.jobs.http_pool
    )(send_receipt)
