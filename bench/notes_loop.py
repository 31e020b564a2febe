"""Variant (a): the field notes' Node worker loop, ported line for line to Python.

Sequential. ``drain`` consumes up to 10 messages; per message ``run_once`` runs one claim
``INSERT ... ON CONFLICT DO NOTHING RETURNING``, the effect (``UPDATE invoices ... RETURNING``), one
``UPDATE job_claims SET state = 'done'``, and then one ack over HTTP; every statement autocommits
(node-postgres' pool, one query at a time). The notes run ``await drain()`` once; a worker runs it
until the queue is empty, which ``drain_until_empty`` does.

What differs from the Node original is only the language: psycopg instead of ``pg`` and the
project's ``InfraiClient`` (the same keep-alive HTTP stack the drain uses) instead of ``fetch``.
The ack sends ``message.message_id`` as the receipt handle, exactly as the notes do.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any, LiteralString

import psycopg
from psycopg.types.json import Jsonb

from infrai_jobs.queue.models import QueueMessage
from infrai_jobs.queue.ports import QueuePort

logger = logging.getLogger("bench.notes_loop")

_CLAIM: LiteralString = """INSERT INTO job_claims (idem_key, state, message_id)
VALUES (%s, 'running', %s) ON CONFLICT (idem_key) DO NOTHING RETURNING idem_key"""
_DONE: LiteralString = "UPDATE job_claims SET state = 'done', result = %s WHERE idem_key = %s"
_RELEASE: LiteralString = "DELETE FROM job_claims WHERE idem_key = %s AND state = 'running'"
_FINALIZE: LiteralString = """UPDATE invoices SET status = 'final', total_cents = %s WHERE id = %s
RETURNING id, status"""


def idem_key(payload: dict[str, Any]) -> str:
    if payload.get("job") and payload.get("invoice_id"):
        return f"{payload['job']}:{payload['invoice_id']}"
    # JSON.stringify(payload, Object.keys(payload).sort())
    canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def run_once(db: psycopg.Connection[Any], message: QueueMessage) -> bool:
    key = idem_key(message.payload)
    claim = db.execute(_CLAIM, (key, message.message_id))
    if claim.rowcount == 0:
        logger.info("skip %s: already claimed (delivery %s)", key, message.delivery_count)
        return True
    try:
        result = finalize_invoice(db, message.payload)
        db.execute(_DONE, (Jsonb(result), key))
        return True
    except Exception as err:  # noqa: BLE001 - the notes' catch (err): release and retry later
        db.execute(_RELEASE, (key,))
        logger.error("job %s failed on delivery %s: %s", key, message.delivery_count, err)
        return False


def finalize_invoice(db: psycopg.Connection[Any], payload: dict[str, Any]) -> dict[str, Any]:
    rows = db.execute(_FINALIZE, (payload["amount_cents"], payload["invoice_id"])).fetchall()
    if rows:
        return {"id": rows[0][0], "status": rows[0][1]}
    return {"id": payload["invoice_id"], "status": "missing"}


def drain(api: QueuePort, db: psycopg.Connection[Any], queue: str) -> int:
    items = api.consume(queue, 10)
    for message in items:
        settled = run_once(db, message)
        if settled:
            api.ack(queue, message.message_id)
    return len(items)


def drain_until_empty(api: QueuePort, db: psycopg.Connection[Any], queue: str) -> int:
    """The worker: ``drain()`` again and again until a consume comes back empty.

    ``db`` is an autocommit connection, like node-postgres' pool hands out.
    """
    consumed = 0
    while (count := drain(api, db, queue)) > 0:
        consumed += count
    return consumed
