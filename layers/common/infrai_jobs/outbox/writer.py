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

What the queue would refuse is refused here, before anything is written: a queue name outside
Infrai's rule (``QUEUE_NAME``), a body above ``MAX_BODY_BYTES``, a payload nested too deeply to
encode, and a producer's key in another job's key space (``check_producer_key``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Final, LiteralString

import psycopg
from psycopg.pq import TransactionStatus
from psycopg.rows import class_row

from infrai_jobs.errors import InvalidPayload, KeyDerivationError, OutboxError, OutboxKeyConflict
from infrai_jobs.jobs.correlation import with_correlation_id
from infrai_jobs.jobs.keys import (
    CONTENT_KEY_PREFIX,
    NO_KEY_RULES,
    PRODUCER_KEY_FIELD,
    derive_key,
    payload_fingerprint,
)
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

# Infrai's queue names (docs/infrai-api.md, as the emulator checks them): 1-80 letters, digits,
# '.', '_' or '-', starting with a letter or digit; within the template's QueueName pattern.
QUEUE_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,79}")
# The largest body the outbox takes and the relay publishes, as the client sends it (compact
# UTF-8 JSON). One consume serves up to 10 messages (CONSUME_CAP), and the drain's client reads
# an answer of at most INFRAI_MAX_ANSWER_BYTES (16 MiB by default): ten bodies of 1 MiB and their
# items' fields stay well under it, so no two large messages can make a consume answer that
# the drain refuses (and that spends a delivery of every message beside them).
MAX_BODY_BYTES: Final = 1024 * 1024
# A name shaped like a job's (``refund.issue``): the first part of a natural key,
# ``refund.issue:r_1``. A producer's key may not start with another job's.
_JOB_SHAPED: Final = re.compile(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)+")


def enqueue(
    conn: psycopg.Connection[Any],
    payload: Mapping[str, Any],
    *,
    queue: str | None = None,
    key: str | None = None,
    registry: JobRegistry | None = None,
    correlation_id: str | None = None,
    notify: bool = False,
    max_body_bytes: int = MAX_BODY_BYTES,
) -> OutboxRow:
    """Write ``payload`` into the outbox in ``conn``'s open transaction and return its row.

    ``queue`` None publishes to the relay's queue (its ``INFRAI_QUEUE``); another must be a
    name Infrai takes (``QUEUE_NAME``). ``key`` keys a job the registry does not know (it is
    sent as the body's ``_idempotency_key``, so the drain derives the same key). Raises
    ``KeyDerivationError`` (``InvalidPayload``) for a payload the drain or the queue would
    refuse (a body above ``max_body_bytes``, at most ``MAX_BODY_BYTES``, included),
    ``OutboxError`` outside a transaction or for a bad queue name, ``OutboxKeyConflict`` when
    the key is held with different work; nothing is written then.

    ``notify`` also sends ``NOTIFY infrai_outbox`` with the transaction (delivered at its
    commit), which wakes a following relay (``infrai-jobs outbox relay --follow``) at once
    instead of at its next poll; it costs a round trip here and a lock at commit."""
    _require_transaction(conn)
    check_queue_name(queue)
    if not 0 < max_body_bytes <= MAX_BODY_BYTES:
        raise OutboxError(f"max_body_bytes must be from 1 to {MAX_BODY_BYTES}")
    body, idem_key, job = outbox_key(payload, key=key, registry=registry)
    try:
        body, _chosen = with_correlation_id(body, correlation_id)
        text = json.dumps(body, allow_nan=False, ensure_ascii=False, separators=(",", ":"))
    except ValueError as exc:
        raise InvalidPayload(f"the outbox cannot carry this payload: {exc}") from None
    except RecursionError:
        raise InvalidPayload(
            "the outbox cannot carry this payload: it is nested too deeply to encode"
        ) from None
    if "\\u0000" in text:
        raise InvalidPayload(
            "the payload holds a NUL character (\\u0000), which the outbox's jsonb cannot store"
        )
    oversized = body_size_refusal(text, max_body_bytes)
    if oversized is not None:
        raise InvalidPayload(oversized)
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
        return enqueue(
            conn,
            body,
            queue=queue,
            key=key,
            registry=registry,
            notify=notify,
            max_body_bytes=max_body_bytes,
        )
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
    check_producer_key(body, job, registry)
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


def check_queue_name(queue: str | None) -> None:
    """``OutboxError`` unless ``queue`` is None (the relay's own) or a name Infrai takes."""
    if queue is not None and not (isinstance(queue, str) and QUEUE_NAME.fullmatch(queue)):
        raise OutboxError(
            f"queue {queue!r} is not a queue name Infrai takes: 1-80 letters, digits, '.', '_' "
            "or '-', starting with a letter or digit (None publishes to the relay's queue)"
        )


def body_size_refusal(text: str, max_body_bytes: int = MAX_BODY_BYTES) -> str | None:
    """Why a body spelt ``text`` (compact JSON) is too large to publish, or None."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size <= max_body_bytes:
        return None
    return (
        f"the payload is {size} bytes as JSON, above the outbox's limit of {max_body_bytes}: "
        "store the data elsewhere and send a reference"
    )


def producer_key_refusal(
    body: Mapping[str, Any], job: str | None, known: frozenset[str]
) -> str | None:
    """Why the body's ``_idempotency_key`` may not be used for ``job``, or None. A key of the
    form ``<name>:...`` whose ``<name>`` is another job's (one of ``known``, or any dotted
    job-shaped name), or the content keys' ``sha256:``, could take the key of another job's
    work: that job's own message would then be refused as a conflict, or skipped."""
    given = body.get(PRODUCER_KEY_FIELD)
    if not isinstance(given, str):
        return None
    prefix, colon, _ = given.partition(":")
    if not colon or (job is not None and prefix == job):
        return None
    if given.startswith(CONTENT_KEY_PREFIX):
        space = "the content keys' space (sha256:...), which the drain derives itself"
    elif prefix in known or _JOB_SHAPED.fullmatch(prefix):
        space = f"the key space of job {prefix!r}"
    else:
        return None
    owner = f"job {job!r}'s" if job is not None else "this payload's (it names no job)"
    return (
        f"{PRODUCER_KEY_FIELD} {given!r} is in {space}, not {owner}: a producer's key may "
        "start with '<job>:' only for its own job"
    )


def check_producer_key(
    body: Mapping[str, Any], job: str | None, registry: JobRegistry | None
) -> None:
    """``KeyDerivationError`` when the body's producer key is in another job's key space
    (``producer_key_refusal``; with ``registry``, every job it knows counts)."""
    known = frozenset(d.name for d in registry) if registry is not None else frozenset()
    refusal = producer_key_refusal(body, job, known)
    if refusal is not None:
        raise KeyDerivationError(refusal)


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
