"""``receipt.send`` of the fixture jobs: an ``external`` job, a mail that cannot be unsent.

A call that may have reached the provider without an answer is ``EffectUncertain`` (the claim
stays for a human or the probe); a refused connection sent nothing and is retried. The probe
looks for this invoice's receipt among the mails the provider lists for the invoice.
"""

from __future__ import annotations

import json
from urllib.parse import quote

from fixture_jobs.provider import Provider
from infrai_jobs.jobs.probes import Done, NotDone, ProbeAnswer, Unknown
from infrai_jobs.jobs.registry import Effect, JobContext, JobRegistry, JsonValue, Payload

NAME = "receipt.send"

mailer = Provider("MAIL_PROVIDER_URL", read_timeout=5.0)
KIND = "receipt"


def send(payload: Payload, ctx: JobContext) -> JsonValue:
    mail = {"to": payload["email"], "template": KIND, "invoice_id": payload["invoice_id"]}
    headers = {"Content-Type": "application/json"}
    url = mailer.url(ctx, "/v1/mail/send")
    answer = mailer.call(
        "POST", url, provider="the mail provider", body=json.dumps(mail), headers=headers
    )
    sent = json.loads(answer.data or b"{}")
    return {"provider_message_id": sent.get("id") if isinstance(sent, dict) else None}


def find_sent(payload: Payload, ctx: JobContext) -> ProbeAnswer:
    if "invoice_id" not in payload:
        return Unknown("a producer's key names no invoice to look for")
    invoice = quote(str(payload["invoice_id"]), safe="")
    answer = mailer.request("GET", mailer.url(ctx, f"/v1/mail?invoice_id={invoice}"))
    if answer.status != 200:
        return Unknown(f"the mail search answered HTTP {answer.status}")
    listed = json.loads(answer.data).get("messages")
    if not isinstance(listed, list):
        return Unknown("the mail search answered no list")
    receipts = [m for m in listed if isinstance(m, dict) and m.get("template") == KIND]
    if not receipts:
        return NotDone()
    return Done({"provider_message_id": receipts[-1].get("id"), "reconciled": True})


def register(registry: JobRegistry) -> None:
    schema = {"invoice_id": (str, int), "email": str}
    registry.job(
        NAME,
        identity=("invoice_id",),
        fields=schema,
        effect=Effect.EXTERNAL,
        settings=(mailer.setting,),
        prepare=mailer.warm,
        probe=find_sent,
    )(send)
