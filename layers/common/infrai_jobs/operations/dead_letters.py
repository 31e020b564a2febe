"""Dead letters live in the ledger: Infrai's DLQ is moved into ``dead_letters``, then worked on.
Reading the DLQ consumes it, so only ``collect`` reads it, and acks each letter only after its
row committed; a redrive holds the row's lock across its publish. The protocol and its crash
cases: docs/operations.md, "Dead letters live in the ledger"."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any, LiteralString

import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from infrai_jobs.errors import ConsumeAnswerLost, KeyDerivationError, QueueMessageNotFound
from infrai_jobs.jobs.keys import payload_fingerprint
from infrai_jobs.jobs.policy import RetryPolicy
from infrai_jobs.ledger.dead_letter_rows import (
    LEDGER_HELD_DLQ,
    RECORD_DEAD_LETTER,
    RESOLVE_DEAD_LETTER,
    UNRESOLVED_DEAD_LETTERS,
)
from infrai_jobs.ledger.job_schema import check_schema
from infrai_jobs.ledger.postgres import record_history, storable_json
from infrai_jobs.queue.models import QueueMessage
from infrai_jobs.queue.ports import QueuePort
from infrai_jobs.queue_contract import MAX_RECEIVE_COUNT
from infrai_jobs.work.admin import WorkStore
from infrai_jobs.work.states import ClaimRow
from infrai_jobs.work.store import (
    DRAIN_ACTOR,
    DeferOutcome,
    DeferredWork,
    claim_of,
    defer,
    release_for_take_back,
)

logger = logging.getLogger(__name__)

KeyOf = Callable[[Any], str]
# A job's effect class and retry policy in force, by job name; None when it has none.
RetryOf = Callable[[str], tuple[str, RetryPolicy] | None]

# A dead letter taken back as deferred work runs again after this long.
TAKE_BACK_DELAY_SECONDS = 1.0

# Dead letters one call moves into the ledger at most; the rest wait in the DLQ.
COLLECT_LIMIT = 1_000

# Unreadable answers in a row after which a DLQ read stops: a run of them says the answers,
# not the messages, are broken (and each hides a letter for the visibility timeout).
MAX_UNREADABLE_IN_A_ROW = 10

_ROWS: LiteralString = """
SELECT message_id, queue, dlq, unreadable, payload, raw_text, size_bytes, job, idem_key, state,
       claim_state, reason, main_deliveries, dlq_deliveries, published_at, first_seen,
       resolution, resolved_at, resolved_by, resolution_note
FROM dead_letters"""

# Every filter is optional; ``unresolved`` false lists the resolved ones too.
_SELECT: LiteralString = (
    _ROWS
    + """
WHERE queue = %(queue)s
  AND (NOT %(unresolved)s OR resolution IS NULL)
  AND (%(message_id)s::text IS NULL OR message_id = %(message_id)s)
  AND (%(key)s::text IS NULL OR idem_key = %(key)s)
  AND (%(job)s::text IS NULL OR job = %(job)s)
ORDER BY first_seen, message_id
LIMIT %(limit)s
"""
)

_LOCK_UNRESOLVED: LiteralString = (
    _ROWS + " WHERE message_id = %(message_id)s AND resolution IS NULL FOR UPDATE SKIP LOCKED"
)

_RESOLUTION_FIELDS = ("resolution", "resolved_at", "resolved_by", "resolution_note")
# What ``RECORD_DEAD_LETTER`` takes that a dead letter may lack.
_NULLABLE: tuple[str, ...] = ("payload", "raw_text", "size_bytes", "job", "idem_key", "state")
_NULLABLE += ("claim_state", "dlq_deliveries", "published_at")

# Unresolved letters whose key's claim is done (a conflict's is other work's); ``_resolve`` judges.
_KEY_DONE: LiteralString = """
SELECT message_id FROM dead_letters WHERE queue = %(queue)s AND resolution IS NULL
  AND state IS DISTINCT FROM 'conflict'
  AND idem_key IN (SELECT idem_key FROM job_claims WHERE state = 'done') LIMIT %(limit)s"""
_NO_CLAIM = "no claim: it failed and was released (why: the drain's log lines with action retry"
_NO_CLAIM += " and this idem_key), or never got that far; a redrive runs it again"
WORK_DONE_NOTE = "its work is done (its key's claim is done): nothing is left to redrive"
_HISTORY_ACTIONS = {"discarded": "discard", "redriven": "redrive", "done": "dead_letter_done"}


@dataclass(frozen=True, slots=True)
class Unreadable:
    """A dead letter whose consume answer was lost or unreadable; its id only when still read."""

    message_id: str | None
    size: int | None
    reason: str

    def describe(self) -> str:
        size = f"{self.size} bytes" if self.size is not None else "size unknown"
        return f"unreadable dead letter ({size}): {self.reason}"

    def as_dict(self) -> dict[str, Any]:
        seen = {"message_id": self.message_id, "unreadable": True, "size_bytes": self.size}
        return {**seen, "reason": self.describe()}


DeadLetter = QueueMessage | Unreadable


@dataclass(frozen=True, slots=True)
class DeadLetterRow:
    message_id: str
    queue: str
    dlq: str
    unreadable: bool
    payload: Any
    raw_text: str | None
    size_bytes: int | None
    job: str | None
    idem_key: str | None
    state: str | None
    claim_state: str | None
    reason: str
    main_deliveries: int | None
    dlq_deliveries: int | None
    published_at: datetime | None
    first_seen: datetime
    resolution: str | None = None
    resolved_at: datetime | None = None
    resolved_by: str | None = None
    resolution_note: str | None = None

    @property
    def body(self) -> Any:
        """The payload as read (None when unreadable; from ``raw_text`` if jsonb refused it)."""
        if self.unreadable:
            return None
        if self.payload is None and self.raw_text is not None:
            return json.loads(self.raw_text)
        return self.payload

    @property
    def held_by_ledger(self) -> bool:
        """Recorded by the ledger itself (deferred work out of attempts), never in Infrai's
        DLQ: a redrive must reopen its failed claim, or the new copy could not run."""
        return self.dlq == LEDGER_HELD_DLQ

    @property
    def redrivable(self) -> str:
        """Why this row cannot be published again, or "" when it can."""
        if self.unreadable:
            return "unreadable: its payload is unknown (discard it, or publish the work anew)"
        if not isinstance(self.body, dict):
            return "payload is not a JSON object (Infrai only takes objects)"
        return ""

    def as_dict(self, *, resolution: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in self.__dataclass_fields__:
            if resolution or name not in _RESOLUTION_FIELDS:
                value = getattr(self, name)
                out[name] = value.isoformat() if isinstance(value, datetime) else value
        out["payload"] = storable_json(self.body)
        return out


@dataclass
class Collected:
    """What one ``collect`` moved from Infrai's DLQ into the ledger."""

    read: int = 0
    recorded: int = 0
    already_recorded: int = 0  # read again after a crash between its commit and its ack
    acked: int = 0
    ack_lost: int = 0
    taken_back: int = 0  # of a job with retry attempts left: deferred work again, no letter
    # Unreadable answers that named no message: unrecorded, unacked, read again later.
    unrecorded: list[dict[str, Any]] = field(default_factory=list)


def fingerprint_or_none(payload: Any) -> str | None:
    """The payload's fingerprint, or None for work that has none (unrepresentable)."""
    try:
        return payload_fingerprint(payload)
    except KeyDerivationError:
        return None


def other_work(claim: ClaimRow, payload: Any) -> bool:
    return bool(claim.payload_sha256) and claim.payload_sha256 != fingerprint_or_none(payload)


class DeadLetterStore:
    """The ``dead_letters`` table; one short connection per call."""

    def __init__(self, work: WorkStore) -> None:
        self._connector = work.connector
        self._visibility = work.visibility

    def _take_back(
        self,
        conn: psycopg.Connection[Any],
        dead: QueueMessage,
        letter: dict[str, Any],
        *,
        effect: str,
        claim: ClaimRow | None,
    ) -> bool:
        """Defer ``dead``'s work (``letter`` is the row it would record otherwise) in the caller's
        transaction when nothing else holds its key; False (record the letter) otherwise."""
        key, state, deliveries = letter["idem_key"], letter["state"], MAX_RECEIVE_COUNT
        if claim is not None and claim.owned:
            # The ledger holds the work already (the letter is a stale copy), or its deferred life
            # ended (done, failed, cancelled): a stale letter never brings it back.
            return state in ("deferred", "running")
        # Only a key-passing job's own expired claim may be taken over; done, failed, a
        # conflict or an irreversible job's unknown outcome stay letters for a human.
        passing = claim is None or (state == "running" and claim.effect == "external_idempotent")
        vis = self._visibility
        if not passing or (claim and not release_for_take_back(conn, claim, visibility=vis)):
            return False
        error = f"taken back from the DLQ after {deliveries} deliveries that did not finish"
        same = {name: letter[name] for name in ("idem_key", "job", "message_id", "queue")}
        fingerprint = fingerprint_or_none(dead.payload)
        work = DeferredWork(**same, effect=effect, payload=dead.payload, fingerprint=fingerprint)
        outcome = defer(
            conn, work, attempts=deliveries, error=error, delay_seconds=TAKE_BACK_DELAY_SECONDS
        )
        if outcome is not DeferOutcome.DEFERRED:
            return outcome is DeferOutcome.ALREADY_HELD
        # The claim it released, if any, as it was: the history keeps both sides of the change.
        before = None if claim is None else claim.as_dict()
        after = {"message_id": dead.message_id, "attempts": deliveries}
        action = "dead_letter_taken_back"
        record_history(conn, key, action, actor=DRAIN_ACTOR, before=before, after=after, note=error)
        return True

    def ensure_reachable(self) -> None:
        """Raise ``LedgerUnavailable``, or ``SchemaNotMigrated`` for a schema this code may not
        run on (``check_schema``), before a dead letter is consumed."""
        with self._connector.session("cannot reach the ledger's dead letters") as conn:
            check_schema(conn)

    def record(
        self,
        dead: DeadLetter,
        *,
        queue: str,
        dlq: str,
        key_of: KeyOf | None,
        retry_of: RetryOf | None = None,
    ) -> str:
        """Record ``dead`` (it must have a message id): "recorded", or "already_recorded";
        "taken_back" when ``_take_back`` defers its work instead (an ``external`` job's claim
        stays a human's). Each is the ``Collected`` count it adds to."""
        assert dead.message_id is not None
        values: dict[str, Any] = dict.fromkeys(_NULLABLE)
        values.update(message_id=dead.message_id, queue=queue, dlq=dlq, reason="")
        values.update(unreadable=False, main_deliveries=MAX_RECEIVE_COUNT)
        key: str | None = None
        if isinstance(dead, Unreadable):
            values.update(unreadable=True, raw_text=dead.reason, size_bytes=dead.size)
            values.update(state="unreadable", reason=dead.describe())
        else:
            payload = dead.payload
            # A body jsonb cannot hold is kept as its exact JSON text, ASCII-escaped.
            if storable_json(payload) is payload:
                values["payload"] = Jsonb(payload)
            else:
                values["raw_text"] = json.dumps(payload, ensure_ascii=True)
            job = payload.get("job") if isinstance(payload, Mapping) else None
            values["job"] = job if isinstance(job, str) else None
            values.update(dlq_deliveries=dead.delivery_count, published_at=dead.published_at)
            if key_of is not None:
                try:
                    key = key_of(payload)
                except KeyDerivationError as exc:
                    values["reason"] = f"no key: {exc}"
        with self._connector.session("cannot record a dead letter") as conn, conn.transaction():
            if key is not None:
                assert isinstance(dead, QueueMessage)
                claim = claim_of(conn, key, visibility=self._visibility)
                values.update(idem_key=key, state=None, claim_state=None, reason=_NO_CLAIM)
                if claim is not None:
                    # A claim for other work is a conflict, never its own state (a "done" there
                    # would read as nothing wrong).
                    values.update(
                        state=claim.state, claim_state=claim.state, reason=claim.error or ""
                    )
                    if other_work(claim, dead.payload):
                        reason = f"conflict with {key} ({claim.state}, different work)"
                        values.update(state="conflict", reason=reason)
                # A job whose policy has attempts left after the DLQ's deliveries.
                found = retry_of(values["job"]) if retry_of and values["job"] is not None else None
                if (
                    found
                    and found[1].attempts > MAX_RECEIVE_COUNT
                    and self._take_back(conn, dead, values, effect=found[0], claim=claim)
                ):
                    return "taken_back"
            added = conn.execute(RECORD_DEAD_LETTER, values).rowcount == 1
            return "recorded" if added else "already_recorded"

    def rows(
        self,
        queue: str,
        *,
        unresolved: bool = True,
        message_id: str | None = None,
        key: str | None = None,
        job: str | None = None,
        limit: int = 100,
    ) -> list[DeadLetterRow]:
        params = {"queue": queue, "unresolved": unresolved, "message_id": message_id}
        params.update(key=key, job=job, limit=limit)
        with (
            self._connector.session("cannot read the dead letters") as conn,
            conn.cursor(row_factory=dict_row) as cur,
        ):
            return [DeadLetterRow(**row) for row in cur.execute(_SELECT, params).fetchall()]

    def unresolved_count(self, queue: str) -> int:
        with self._connector.session("cannot count the dead letters") as conn:
            row = conn.execute(UNRESOLVED_DEAD_LETTERS, {"queue": queue}).fetchone()
        return int(row[0]) if row else 0

    def discard(self, message_id: str, *, actor: str, note: str = "") -> bool:
        """Resolve a row as discarded; False when it is resolved (or being resolved) already."""
        return self._resolve(message_id, "discarded", actor=actor, note=note)

    def redrive(
        self, message_id: str, publish: Callable[[Any], object], *, actor: str, note: str = ""
    ) -> bool:
        """Publish an unresolved row's payload (``publish``), then mark it redriven, under the
        row's lock; False when it is resolved already or another redrive holds it. A crash in
        between leaves it unresolved: the next redrive publishes it again, the claims absorb it."""
        return self._resolve(message_id, "redriven", actor=actor, note=note, before=publish)

    def resolve_done(self, queue: str, *, actor: str, limit: int = COLLECT_LIMIT) -> list[str]:
        """Resolve ``queue``'s dead letters of work done (recorded as a discard is); their ids."""
        with self._connector.session("cannot read the dead letters of done work") as conn:
            found = conn.execute(_KEY_DONE, {"queue": queue, "limit": limit}).fetchall()
        return [m for (m,) in found if self._resolve(m, "done", actor=actor, note=WORK_DONE_NOTE)]

    def _resolve(
        self,
        message_id: str,
        resolution: str,
        *,
        actor: str,
        note: str,
        before: Callable[[Any], object] | None = None,
    ) -> bool:
        with self._connector.transaction(f"cannot mark a dead letter {resolution}") as conn:
            with conn.cursor(row_factory=dict_row) as cur:
                found = cur.execute(_LOCK_UNRESOLVED, {"message_id": message_id}).fetchone()
            if found is None:
                return False
            row = DeadLetterRow(**found)
            key = row.idem_key
            claim = claim_of(conn, key, visibility=self._visibility) if key is not None else None
            done = claim is not None and claim.state == "done" and not other_work(claim, row.body)
            if resolution == "done" and not done:
                return False
            if before is not None:
                before(row.body)
            params = {"message_id": message_id, "resolution": resolution, "actor": actor}
            conn.execute(RESOLVE_DEAD_LETTER, {**params, "note": note or None})
            # Beside its key's claim changes (its message id without a key), as it was then.
            was: dict[str, Any] = {"dead_letter": row.as_dict(resolution=False)}
            was["claim"] = claim.as_dict() if claim else None
            action, key = _HISTORY_ACTIONS[resolution], key or message_id
            record_history(conn, key, action, actor=actor, before=was, after=None, note=note)
        return True


def collect(
    queue: QueuePort,
    store: DeadLetterStore,
    *,
    dlq: str,
    main_queue: str,
    key_of: KeyOf | None,
    stop: Callable[[], bool] | None = None,
    retry_of: RetryOf | None = None,
) -> Collected:
    """Move up to ``COLLECT_LIMIT`` dead letters from Infrai's ``dlq`` into the ledger (see the
    module's doc), asking ``stop`` before each read; each is recorded (or taken back:
    ``DeadLetterStore.record``), then acked."""
    store.ensure_reachable()
    summary = Collected()
    unreadable_in_a_row = 0
    while summary.read < COLLECT_LIMIT and unreadable_in_a_row < MAX_UNREADABLE_IN_A_ROW:
        if stop is not None and stop():
            break
        try:
            # One per consume: an unreadable answer has spent every message it served, unseen,
            # so with one per consume an unreadable dead letter hides only itself.
            batch: list[DeadLetter] = [*queue.consume(dlq, 1)]
            unreadable_in_a_row = 0
        except ConsumeAnswerLost as exc:
            unreadable_in_a_row += 1
            ids = exc.message_ids
            unreadable = Unreadable(ids[0] if len(ids) == 1 else None, exc.size, str(exc))
            batch = [unreadable]
            extra: dict[str, Any] = {"action": "dead_letter_unreadable", "queue": dlq}
            extra.update(message_id=unreadable.message_id, size_bytes=unreadable.size)
            logger.error("a dead letter could not be read", extra={**extra, "detail": str(exc)})
        if not batch:
            break
        for dead in batch[: COLLECT_LIMIT - summary.read]:
            summary.read += 1
            if isinstance(dead, Unreadable) and dead.message_id is None:
                summary.unrecorded.append(dead.as_dict())
                continue
            # An unreadable one is acked by its message id (the contract's handle then).
            handle = dead.receipt_handle if isinstance(dead, QueueMessage) else dead.message_id
            assert handle is not None
            counted = store.record(
                dead, queue=main_queue, dlq=dlq, key_of=key_of, retry_of=retry_of
            )
            setattr(summary, counted, getattr(summary, counted) + 1)
            try:
                queue.ack(dlq, handle)
                summary.acked += 1
            except QueueMessageNotFound:
                summary.ack_lost += 1
    if summary.read:
        logger.info(
            "dead letters moved into the ledger",
            extra={"action": "dead_letters_collected", "queue": dlq, **asdict(summary)},
        )
    return summary
