"""``enqueue``: a job written into the outbox inside the producer's own transaction.

An API handler that commits a business write and publishes after it loses the job when the
publish fails or the process dies between the two; one that publishes and retries on a stalled
answer publishes twice (Infrai has no producer-side deduplication). Writing the intent into the
same transaction as the business write closes both::

    import psycopg
    from infrai_jobs.outbox import enqueue

    with psycopg.connect(url) as conn, conn.transaction():
        conn.execute("UPDATE refunds SET state = 'approved' WHERE id = %s", (refund_id,))
        enqueue(conn, {"job": "refund.issue", "refund_id": refund_id}, registry=registry)

The row commits or rolls back with the business write; a relay (``infrai_jobs.outbox.relay``)
publishes what committed. The row's key is the job's idempotency key as the drain derives it
(``JobRegistry.derive`` for a job the registry knows, which also checks the payload against
the job's schema and raises before anything is written), else the payload's
``_idempotency_key`` or ``key=``. A key the outbox holds already (pending, or published and not
yet pruned) is not written again: ``enqueue`` returns the row it holds, so a retried request
costs one publish, not two.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, LiteralString

import psycopg
from psycopg.pq import TransactionStatus
from psycopg.rows import class_row

from infrai_jobs.errors import InvalidPayload, KeyDerivationError, OutboxError, OutboxKeyConflict
from infrai_jobs.jobs.correlation import with_correlation_id
from infrai_jobs.jobs.keys import NO_KEY_RULES, PRODUCER_KEY_FIELD, derive_key, payload_fingerprint
from infrai_jobs.jobs.registry import JobRegistry
from infrai_jobs.ledger.postgres import ledger_errors
from infrai_jobs.outbox.rows import OUTBOX_COLUMNS, OUTBOX_ROW_BY_KEY, OutboxRow

_INSERT: LiteralString = (
    """
INSERT INTO outbox (idem_key, queue, job, body, payload_sha256)
VALUES (%(key)s, %(queue)s, %(job)s, %(body)s::jsonb, %(fingerprint)s)
ON CONFLICT (idem_key) DO NOTHING
RETURNING """
    + OUTBOX_COLUMNS
)

# What a following relay listens on; the payload is empty (the relay reads the table).
NOTIFY_CHANNEL = "infrai_outbox"
_NOTIFY: LiteralString = "SELECT pg_notify('infrai_outbox', '')"


def enqueue(
    conn: psycopg.Connection[Any],
    payload: Mapping[str, Any],
    *,
    queue: str | None = None,
    key: str | None = None,
    registry: JobRegistry | None = None,
    correlation_id: str | None = None,
    notify: bool = False,
) -> OutboxRow:
    """Write ``payload`` into the outbox in ``conn``'s open transaction and return its row.

    ``queue`` None publishes to the relay's queue (its ``INFRAI_QUEUE``). ``key`` keys a job the
    registry does not know (it is sent as the body's ``_idempotency_key``, so the drain derives
    the same key). Raises ``KeyDerivationError`` (``InvalidPayload``) for a payload the drain
    would refuse, ``OutboxError`` outside a transaction, ``OutboxKeyConflict`` when the key is
    held with different work; nothing is written then.

    ``notify`` also sends ``NOTIFY infrai_outbox`` with the transaction (delivered at its
    commit), which wakes a following relay (``infrai-jobs outbox relay --follow``) at once
    instead of at its next poll; it costs a round trip here and a lock at commit."""
    _require_transaction(conn)
    body, idem_key, job = outbox_key(payload, key=key, registry=registry)
    try:
        body, _chosen = with_correlation_id(body, correlation_id)
        text = json.dumps(body, allow_nan=False, ensure_ascii=False)
    except ValueError as exc:
        raise InvalidPayload(f"the outbox cannot carry this payload: {exc}") from None
    if "\\u0000" in text:
        raise InvalidPayload(
            "the payload holds a NUL character (\\u0000), which the outbox's jsonb cannot store"
        )
    fingerprint = payload_fingerprint(body)
    params = {
        "key": idem_key,
        "queue": queue,
        "job": job,
        "body": text,
        "fingerprint": fingerprint,
    }
    with (
        ledger_errors("cannot enqueue into the outbox"),
        conn.cursor(row_factory=class_row(OutboxRow)) as cur,
    ):
        inserted = cur.execute(_INSERT, params).fetchone()
        if inserted is not None:
            if notify:
                cur.execute(_NOTIFY)
            return _created(inserted)
        held = cur.execute(OUTBOX_ROW_BY_KEY, {"key": idem_key}).fetchone()
    if held is None:
        # Pruned between the two statements: the key is free again, so write it after all.
        return enqueue(conn, body, queue=queue, key=key, registry=registry)
    if held.payload_sha256 != fingerprint:
        raise OutboxKeyConflict(
            f"the outbox holds key {idem_key!r} with different work (another payload "
            "fingerprint): a second intent needs its own key"
        )
    return held


def outbox_key(
    payload: Mapping[str, Any], *, key: str | None, registry: JobRegistry | None
) -> tuple[dict[str, Any], str, str | None]:
    """The body to store, its idempotency key as the drain will derive it, and its job name."""
    if not isinstance(payload, Mapping):
        raise KeyDerivationError(f"payload is not a JSON object (got {type(payload).__name__})")
    body = dict(payload)
    if key is not None:
        given = body.get(PRODUCER_KEY_FIELD)
        if given is not None and given != key:
            raise OutboxError(
                f"key={key!r} differs from the payload's {PRODUCER_KEY_FIELD} {given!r}: "
                "pass one of them"
            )
        body[PRODUCER_KEY_FIELD] = key
    name = body.get("job")
    job = name if isinstance(name, str) and name else None
    if registry is not None and (
        (job is not None and registry.get(job) is not None) or PRODUCER_KEY_FIELD not in body
    ):
        # The drain's own rule: the job's schema, then its key (or "unknown job").
        return body, registry.derive(body).idem_key, job
    if PRODUCER_KEY_FIELD not in body:
        raise KeyDerivationError(
            "the outbox needs the job's key: pass registry= (the jobs package's registry, "
            f"which keys and checks known jobs), key=, or a {PRODUCER_KEY_FIELD} in the payload"
        )
    return body, derive_key(body, NO_KEY_RULES), job


def _require_transaction(conn: psycopg.Connection[Any]) -> None:
    status = conn.info.transaction_status
    if status == TransactionStatus.INERROR:
        raise OutboxError(
            "the transaction has failed already (roll it back first): nothing was enqueued"
        )
    if conn.autocommit and status == TransactionStatus.IDLE:
        raise OutboxError(
            "enqueue needs the business write's transaction: call it inside "
            "`with conn.transaction():` (this autocommit connection has none open)"
        )


def _created(row: OutboxRow) -> OutboxRow:
    return replace(row, created=True)
