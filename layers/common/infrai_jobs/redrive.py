"""Dead-letter inspection and redrive: the third source of duplicates, made safe.

A redrive moves messages from the DLQ back to the main queue: **publish first, then ack** the
dead letter. A crash between the two leaves the dead letter in place, so a second redrive
publishes it again; the claim ledger absorbs that duplicate. Nothing is lost, no effect doubles.

``reopen_failed`` deletes the ``failed`` claims of the redriven work (matched by message id or
payload fingerprint), recording each in ``claim_history``, so the fixed job runs again. A stuck
``running`` claim of an irreversible job is never reopened: that needs a human's verdict first
(``infrai-jobs claims resolve``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, LiteralString

import psycopg

from infrai_jobs.claims_admin import default_actor
from infrai_jobs.errors import (
    ConfigurationError,
    InfraiInvalidResponse,
    InfraiUnavailable,
    KeyDerivationError,
    LedgerError,
    LedgerUnavailable,
    QueueMessageNotFound,
)
from infrai_jobs.keys import payload_fingerprint
from infrai_jobs.ledger import connect_to_ledger
from infrai_jobs.ports import QueuePort
from infrai_jobs.queue_models import QueueMessage

logger = logging.getLogger(__name__)

# The field notes' price, verified 2026-07-26; used only when discovery cannot be reached.
FALLBACK_PUBLISH_PRICE_USD = Decimal("0.00002")

_REOPEN: LiteralString = """
WITH reopened AS (
    DELETE FROM job_claims
    WHERE state = 'failed' AND (message_id = %(message_id)s OR payload_sha256 = %(fingerprint)s)
    RETURNING *
)
INSERT INTO claim_history (idem_key, action, actor, before, note)
SELECT idem_key, 'reopen', %(actor)s, to_jsonb(reopened), 'redrive --reopen-failed'
FROM reopened
RETURNING idem_key
"""

Progress = Callable[[int], None]

MAX_REDRIVE_PER_CALL = 10_000
# A message is moved only while this much of the invocation is left. A move is a publish and an
# ack, normally well under a second; this covers a few retries. Like the drain's batch budget.
MESSAGE_BUDGET_MS = 20_000


@dataclass(frozen=True, slots=True)
class RedriveRequest:
    """What RedriveFunction's event asks for (see events/redrive.json)."""

    max_messages: int = 100
    reopen_failed: bool = False
    dry_run: bool = False

    @classmethod
    def from_event(cls, event: object) -> RedriveRequest:
        if not isinstance(event, Mapping):
            raise ConfigurationError("the redrive event must be a JSON object")
        unknown = set(event) - {"max_messages", "reopen_failed", "dry_run"}
        if unknown:
            raise ConfigurationError(
                f"unknown redrive event field(s): {', '.join(sorted(unknown))}"
            )
        max_messages = event.get("max_messages", 100)
        if isinstance(max_messages, bool) or not isinstance(max_messages, int):
            raise ConfigurationError("max_messages must be an integer")
        if not 1 <= max_messages <= MAX_REDRIVE_PER_CALL:
            raise ConfigurationError(f"max_messages must be between 1 and {MAX_REDRIVE_PER_CALL}")
        flags = {}
        for name in ("reopen_failed", "dry_run"):
            value = event.get(name, False)
            if not isinstance(value, bool):
                raise ConfigurationError(f"{name} must be true or false")
            flags[name] = value
        return cls(max_messages=max_messages, **flags)


@dataclass
class RedriveSummary:
    source: str
    target: str
    dry_run: bool
    consumed: int = 0
    published: int = 0
    acked: int = 0
    ack_lost: int = 0
    reopened: list[str] = field(default_factory=list)
    skipped: list[dict[str, str]] = field(default_factory=list)
    seen: list[dict[str, Any]] = field(default_factory=list)
    # "time_budget" when the invocation ran short and the redrive stopped early; "" otherwise.
    stopped: str = ""
    # Received but neither looked at nor moved when it stopped: hidden in the DLQ until its
    # visibility timeout ends, then there for the next redrive.
    left_hidden: int = 0
    price_usd_per_message: Decimal = FALLBACK_PUBLISH_PRICE_USD
    price_source: str = "fallback"

    @property
    def cost_usd(self) -> Decimal:
        return self.price_usd_per_message * self.published

    def as_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "target": self.target,
            "dry_run": self.dry_run,
            "consumed": self.consumed,
            "published": self.published,
            "acked": self.acked,
            "ack_lost": self.ack_lost,
            "reopened": self.reopened,
            "skipped": self.skipped,
            "seen": self.seen,
            "stopped": self.stopped,
            "left_hidden": self.left_hidden,
            "price_usd_per_message": str(self.price_usd_per_message),
            "price_source": self.price_source,
            "cost_usd": str(self.cost_usd),
        }


def publish_price(queue: QueuePort) -> tuple[Decimal, str]:
    """Discovery's live price, or the documented fallback when discovery cannot be reached or
    its answer read. Any other error (a 401: the key is wrong) is raised: every other call
    would fail the same way, and a price is no reason to hide it."""
    try:
        return queue.publish_price().usd_per_message, "discovery"
    except (InfraiUnavailable, InfraiInvalidResponse) as exc:
        logger.warning(
            "discovery unavailable; using the fallback publish price",
            extra={"action": "price_fallback", "detail": str(exc)},
        )
        return FALLBACK_PUBLISH_PRICE_USD, "fallback"


def redrive(
    queue: QueuePort,
    *,
    source: str,
    target: str,
    max_messages: int,
    dry_run: bool = False,
    reopen_failed: bool = False,
    database_url: str | None = None,
    describe: Callable[[QueueMessage], Mapping[str, Any]] | None = None,
    progress: Progress | None = None,
    time_left_ms: Callable[[], int] | None = None,
) -> RedriveSummary:
    """Move up to ``max_messages`` dead letters from ``source`` back to ``target``.

    ``dry_run`` consumes to look (the DLQ can only be read by consuming) and acks nothing, so
    the messages it saw stay hidden in the DLQ for the visibility timeout, then return.

    ``time_left_ms`` (RedriveFunction passes its Lambda context's) makes the redrive stop while
    it can still report: no batch is received, and no message moved, with less than
    ``MESSAGE_BUDGET_MS`` left. What was received but not moved stays hidden in the DLQ for
    its visibility timeout, like a dry run's; ``summary.stopped`` says so.
    """
    if reopen_failed and not database_url:
        raise ValueError("reopen_failed needs the ledger's database_url")
    summary = RedriveSummary(source=source, target=target, dry_run=dry_run)
    summary.price_usd_per_message, summary.price_source = publish_price(queue)

    def short_of_time() -> bool:
        return time_left_ms is not None and time_left_ms() < MESSAGE_BUDGET_MS

    while summary.consumed < max_messages and not summary.stopped:
        if short_of_time():
            summary.stopped = "time_budget"
            break
        batch = queue.consume(source, min(10, max_messages - summary.consumed))
        if not batch:
            break
        for index, message in enumerate(batch):
            if index and short_of_time():
                summary.stopped = "time_budget"
                summary.left_hidden = len(batch) - index
                break
            summary.consumed += 1
            if describe is not None:
                summary.seen.append({"message_id": message.message_id, **describe(message)})
            if not dry_run:
                _move(queue, message, summary, reopen_failed, database_url)
            if progress is not None:
                progress(summary.consumed)
    if summary.stopped:
        logger.warning(
            "redrive stopped before the invocation's time ran out; invoke it again for the rest "
            "(messages received but not moved return to the DLQ after its visibility timeout)",
            extra={"action": "redrive_stopped", "left_hidden": summary.left_hidden},
        )
    logger.info("redrive finished", extra={"action": "redrive_summary", **summary.as_dict()})
    return summary


def _move(
    queue: QueuePort,
    message: QueueMessage,
    summary: RedriveSummary,
    reopen_failed: bool,
    database_url: str | None,
) -> None:
    payload = message.payload
    if not isinstance(payload, dict):
        # Infrai only takes objects as bodies; this one stays in the DLQ for a human.
        summary.skipped.append(
            {"message_id": message.message_id, "reason": "payload is not a JSON object"}
        )
        return
    if reopen_failed and database_url:
        summary.reopened.extend(_reopen(database_url, message))
    # Retrying the publish is safe here: the drain's claims absorb a duplicate.
    queue.publish(summary.target, payload, retry=True)
    summary.published += 1
    try:
        queue.ack(summary.source, message.receipt_handle)
        summary.acked += 1
    except QueueMessageNotFound:
        summary.ack_lost += 1


def _reopen(database_url: str, message: QueueMessage) -> list[str]:
    try:
        fingerprint: str | None = payload_fingerprint(message.payload)
    except KeyDerivationError:
        fingerprint = None  # unrepresentable work: match the claim by message id alone
    params = {
        "message_id": message.message_id,
        "fingerprint": fingerprint,
        "actor": default_actor(),
    }
    try:
        with connect_to_ledger(database_url, application_name="infrai-jobs-redrive") as conn:
            return [row[0] for row in conn.execute(_REOPEN, params).fetchall()]
    except psycopg.OperationalError as exc:
        raise LedgerUnavailable(f"cannot reopen failed claims: {exc}") from exc
    except psycopg.Error as exc:
        raise LedgerError(f"cannot reopen failed claims: {exc}") from exc
