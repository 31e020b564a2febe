"""The relay: what committed in the outbox, published to Infrai at least once, oldest first.

One batch is one transaction on the outbox's database. It takes up to ``batch_size`` due
pending rows, oldest first, ``FOR UPDATE SKIP LOCKED`` (so two relays never hold, nor publish,
the same row at once), publishes each, records each answer on its row, and commits. A relay that
dies mid-batch rolls its marks back with the transaction and its locks go with its connection:
the next relay publishes those rows again (each one at least once; the consumer's key makes its
effect once). What each answer does to its row:

* accepted: ``published`` with Infrai's ``message_id``;
* 5xx, 429, a lost or unreadable answer (``InfraiUnavailable``, ``InfraiInvalidResponse``), after
  the client's own retries: stays ``pending``, ``attempts`` + 1, due again after a back-off
  (doubling, capped); never given up, so nothing is lost while Infrai is down;
* refused for good (400, 413, 422: the payload itself), or a row the relay will not publish (a
  body above ``max_body_bytes``, a producer's key in another job's key space: what ``enqueue``
  refuses, written by older code or by hand): ``dead``, with a dead letter in ``dead_letters``
  (dlq ``(outbox)``) that ``infrai-jobs dlq`` lists and the watcher counts;
* the row's own queue refused (``QUEUE_NOT_FOUND`` for a ``queue`` other than the relay's): the
  row, not the setting, is wrong. It backs off as a failure does and the pass goes on with the
  rows behind it; refused at its ``max_queue_refusals``-th attempt, it is ``dead`` with its
  dead letter. Nothing is deleted: ``infrai-jobs outbox list|retry|discard`` take it from there;
* any other refusal (401, 403, 404 for the relay's own queue or route, an untrusted server): the
  setting is wrong, not the row. The row stays ``pending`` with the error, the batch commits
  what it did, and the pass raises.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Final, LiteralString

import psycopg
from psycopg.rows import class_row
from psycopg.types.json import Jsonb

from infrai_jobs.errors import InfraiError, InfraiInvalidResponse, InfraiUnavailable
from infrai_jobs.ledger.dead_letter_rows import RECORD_DEAD_LETTER
from infrai_jobs.ledger.postgres import LedgerConnector, one_line
from infrai_jobs.outbox.rows import OUTBOX_COLUMNS, OUTBOX_DLQ, OutboxRow
from infrai_jobs.outbox.status import OutboxStatus, read_status
from infrai_jobs.outbox.writer import MAX_BODY_BYTES, body_size_refusal, producer_key_refusal
from infrai_jobs.queue.ports import QueuePort

logger = logging.getLogger(__name__)

DEFAULT_BATCH_SIZE: Final = 25
# What one more publish may take at most before the pass stops taking rows: the client's
# read timeout and a retry or two. A row left untaken is due at once for the next pass.
DEFAULT_RESERVE_MS: Final = 20_000
# Payload refusals: the row is the problem, and sending it again cannot help.
PERMANENT_STATUSES: Final = frozenset({400, 413, 422})
# A row whose own queue Infrai refuses is tried this many times in all (backing off as a failure
# does: about a quarter of an hour at the default delays), then dead: time to create the queue
# it names in a deploy, and a bound on what it costs every pass after that.
MAX_QUEUE_REFUSALS: Final = 10
_QUEUE_NOT_FOUND: Final = "QUEUE_NOT_FOUND"
_REFUSED: Final = "outbox_queue_refused"

_TAKE_BATCH: LiteralString = (
    "SELECT "
    + OUTBOX_COLUMNS
    + """
FROM outbox
WHERE state = 'pending' AND next_attempt_at <= now()
ORDER BY seq
LIMIT %(limit)s
FOR UPDATE SKIP LOCKED
"""
)

_MARK_PUBLISHED: LiteralString = """
UPDATE outbox
SET state = 'published', message_id = %(message_id)s, published_at = clock_timestamp(),
    settled_at = clock_timestamp(), attempts = attempts + 1, last_error = NULL
WHERE idem_key = %(key)s AND state = 'pending'
"""

_MARK_RETRY: LiteralString = """
UPDATE outbox
SET attempts = attempts + 1, last_error = %(error)s,
    next_attempt_at = clock_timestamp() + make_interval(secs => least(
        %(max_delay)s::float8, %(base_delay)s::float8 * power(2, least(attempts, 30))))
WHERE idem_key = %(key)s AND state = 'pending'
"""

_MARK_DEAD: LiteralString = """
UPDATE outbox
SET state = 'dead', settled_at = clock_timestamp(), attempts = attempts + 1,
    last_error = %(error)s
WHERE idem_key = %(key)s AND state = 'pending'
"""


@dataclass(frozen=True, slots=True)
class RelayConfig:
    default_queue: str
    batch_size: int = DEFAULT_BATCH_SIZE
    # The first retry waits this long, each later one twice the last, up to max_delay_seconds.
    base_delay_seconds: float = 2.0
    max_delay_seconds: float = 300.0
    reserve_ms: int = DEFAULT_RESERVE_MS
    max_queue_refusals: int = MAX_QUEUE_REFUSALS
    # A larger row is never published (dead instead): see writer.MAX_BODY_BYTES.
    max_body_bytes: int = MAX_BODY_BYTES


@dataclass
class RelayReport:
    """What one pass did: rows published, retried later, dead-lettered; batches run.
    ``refused`` counts the rows whose own queue Infrai refused (each is also in ``retried``
    when it backs off, or in ``dead`` at its last attempt)."""

    published: int = 0
    retried: int = 0
    dead: int = 0
    batches: int = 0
    refused: int = 0
    # Infrai's message ids, in publish order (for the log and the demo; never a metric).
    message_ids: list[str] = field(default_factory=list)

    def add(self, other: RelayReport) -> None:
        self.published += other.published
        self.retried += other.retried
        self.dead += other.dead
        self.batches += other.batches
        self.refused += other.refused
        self.message_ids.extend(other.message_ids)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        del out["message_ids"]
        return out


class OutboxRelay:
    """Publishes the outbox at ``outbox`` to ``queue``; outbox dead letters go to the
    ``dead_letters`` table at ``dead_letters`` (the ledger's database; the outbox's by
    default)."""

    def __init__(
        self,
        outbox: LedgerConnector,
        queue: QueuePort,
        config: RelayConfig,
        *,
        dead_letters: LedgerConnector | None = None,
    ) -> None:
        self._outbox = outbox
        self._queue = queue
        self._config = config
        self._dead_letters = dead_letters or outbox

    def __repr__(self) -> str:
        return f"OutboxRelay(batch_size={self._config.batch_size})"

    def run(
        self, time_left_ms: Callable[[], int], *, max_batches: int | None = None
    ) -> RelayReport:
        """Batches until the outbox has nothing due, the time left is short, or
        ``max_batches`` ran. Raises the first refusal that no row can fix (after committing
        the batch it met it in)."""
        report = RelayReport()
        while max_batches is None or report.batches < max_batches:
            if time_left_ms() < self._config.reserve_ms:
                break
            batch, taken = self.run_batch(time_left_ms)
            report.add(batch)
            if taken < self._config.batch_size:
                break
        return report

    def status(self) -> OutboxStatus:
        """The outbox now: pending, oldest pending age, published in the last hour, dead."""
        with self._outbox.session("cannot read the outbox") as conn:
            return read_status(conn)

    def run_batch(self, time_left_ms: Callable[[], int] | None = None) -> tuple[RelayReport, int]:
        """One batch (see the module's doc); the report and how many rows it took."""
        report = RelayReport(batches=1)
        stop: InfraiError | None = None
        with self._outbox.session("outbox relay") as conn, conn.transaction():
            with conn.cursor(row_factory=class_row(OutboxRow)) as cur:
                rows = cur.execute(_TAKE_BATCH, {"limit": self._config.batch_size}).fetchall()
            for row in rows:
                if time_left_ms is not None and time_left_ms() < self._config.reserve_ms:
                    break
                queue = row.queue or self._config.default_queue
                unpublishable = self._unpublishable(row)
                if unpublishable is not None:
                    self._mark_dead(conn, row, queue, f"not published: {unpublishable}")
                    report.dead += 1
                    _log_dead("the relay will not publish an outbox row", row, unpublishable)
                    continue
                try:
                    message_id = self._queue.publish(queue, row.body, retry=True)
                except (InfraiUnavailable, InfraiInvalidResponse) as exc:
                    conn.execute(_MARK_RETRY, self._retry_params(row, exc))
                    report.retried += 1
                    _log("outbox publish failed; retried later", row, exc, "outbox_retry")
                    continue
                except InfraiError as exc:
                    if exc.status in PERMANENT_STATUSES:
                        reason = f"Infrai refused the outbox's publish: {_text(exc)}"
                        self._mark_dead(conn, row, queue, reason, error=_text(exc))
                        report.dead += 1
                        _log("Infrai refused an outbox row for good", row, exc, "outbox_dead")
                        continue
                    if self._refuses_the_rows_queue(row, exc):
                        report.refused += 1
                        if self._queue_refusal_is_final(conn, row, queue, exc):
                            report.dead += 1
                        else:
                            report.retried += 1
                        continue
                    conn.execute(_MARK_RETRY, self._retry_params(row, exc))
                    stop = exc
                    break
                conn.execute(_MARK_PUBLISHED, {"key": row.idem_key, "message_id": message_id})
                report.published += 1
                report.message_ids.append(message_id)
                logger.info(
                    "outbox row published",
                    extra={
                        "action": "outbox_published",
                        "idem_key": row.idem_key,
                        "message_id": message_id,
                        "job": row.job,
                        "attempts": row.attempts + 1,
                    },
                )
        if stop is not None:
            raise stop
        return report, len(rows)

    def _unpublishable(self, row: OutboxRow) -> str | None:
        """Why the relay will not publish ``row`` (what ``enqueue`` refuses now), or None."""
        try:
            text = json.dumps(row.body, ensure_ascii=False, separators=(",", ":"))
        except RecursionError:
            return "the payload is nested too deeply to encode"
        too_large = body_size_refusal(text, self._config.max_body_bytes)
        return too_large or producer_key_refusal(row.body, row.job, frozenset())

    def _refuses_the_rows_queue(self, row: OutboxRow, exc: InfraiError) -> bool:
        """Infrai has no queue by the row's own name: that row's fault, not the setting's (the
        relay's own queue missing, or any other refusal, stops the pass)."""
        own = row.queue is not None and row.queue != self._config.default_queue
        return own and exc.code == _QUEUE_NOT_FOUND

    def _queue_refusal_is_final(
        self, conn: psycopg.Connection[Any], row: OutboxRow, queue: str, exc: InfraiError
    ) -> bool:
        """Back ``row`` off after Infrai refused its own queue, or mark it dead (True) at its
        ``max_queue_refusals``-th attempt."""
        attempt = row.attempts + 1
        if attempt < self._config.max_queue_refusals:
            conn.execute(_MARK_RETRY, self._retry_params(row, exc))
            _log("Infrai refused an outbox row's queue; the row backs off", row, exc, _REFUSED)
            return False
        reason = (
            f"Infrai refused the row's queue {queue!r} at its attempt {attempt}, the last the "
            f"relay makes for a queue Infrai refuses: {_text(exc)}"
        )
        self._mark_dead(conn, row, queue, reason, error=_text(exc))
        _log("Infrai refused an outbox row's queue for the last time", row, exc, "outbox_dead")
        return True

    def _mark_dead(
        self,
        conn: psycopg.Connection[Any],
        row: OutboxRow,
        queue: str,
        reason: str,
        *,
        error: str | None = None,
    ) -> None:
        self._record_dead_letter(row, queue, reason)
        conn.execute(_MARK_DEAD, {"key": row.idem_key, "error": error or reason})

    def _retry_params(self, row: OutboxRow, exc: InfraiError) -> dict[str, Any]:
        return {
            "key": row.idem_key,
            "error": _text(exc),
            "base_delay": self._config.base_delay_seconds,
            "max_delay": self._config.max_delay_seconds,
        }

    def _record_dead_letter(self, row: OutboxRow, queue: str, reason: str) -> None:
        """The dead letter first, committed on its own: a crash before the row is marked
        leaves it pending, the next pass is refused again, and the letter is not doubled
        (one per outbox row: ``outbox:<seq>``)."""
        values = {
            "message_id": f"outbox:{row.seq}",
            "queue": queue,
            "dlq": OUTBOX_DLQ,
            "unreadable": False,
            "payload": Jsonb(row.body),
            "raw_text": None,
            "size_bytes": None,
            "job": row.job,
            "idem_key": row.idem_key,
            "state": "outbox",
            "claim_state": None,
            "reason": reason,
            "main_deliveries": None,
            "dlq_deliveries": None,
            "published_at": None,
        }
        with self._dead_letters.session("cannot record an outbox dead letter") as conn:
            conn.execute(RECORD_DEAD_LETTER, values)


def _text(exc: InfraiError) -> str:
    return one_line(str(exc))[:1000]


def _log_dead(message: str, row: OutboxRow, reason: str) -> None:
    logger.warning(
        message,
        extra={"action": "outbox_dead", "idem_key": row.idem_key, "job": row.job, "reason": reason},
    )


def _log(message: str, row: OutboxRow, exc: InfraiError, action: str) -> None:
    logger.warning(
        message,
        extra={
            "action": action,
            "idem_key": row.idem_key,
            "job": row.job,
            "attempts": row.attempts + 1,
            "code": exc.code,
            "status": exc.status,
        },
    )
