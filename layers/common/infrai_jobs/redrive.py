"""Dead-letter inspection and redrive: the third source of duplicates, made safe.

A redrive moves messages from the DLQ back to the main queue: **publish first, then ack** the
dead letter. A crash between the two leaves the dead letter in place, so a second redrive
publishes it again; the claim ledger absorbs that duplicate. Nothing is lost, no effect doubles.

``reopen_failed`` deletes the ``failed`` claims of the redriven work (matched by message id or
payload fingerprint), recording each in ``claim_history``, so the fixed job runs again. A stuck
``running`` claim of an irreversible job is never reopened: that needs a human's verdict first
(``infrai-jobs claims resolve``).

The DLQ is read one message per consume (``read_dead_letters``): a consume whose answer cannot
be read has spent it on every message it served, unseen, so with one message per consume an
unreadable dead letter hides only itself, and is reported as such (``Unreadable``) while every
other is still read. A redrive may move only some dead letters (``Selection``: by key, job or
message id); the others it read stay hidden in the DLQ for its visibility timeout.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from infrai_jobs.claims_admin import ClaimsAdmin, default_actor
from infrai_jobs.dead_letters import DeadLetter, Unreadable, read_dead_letters
from infrai_jobs.errors import (
    ConfigurationError,
    InfraiInvalidResponse,
    InfraiUnavailable,
    KeyDerivationError,
    QueueMessageNotFound,
)
from infrai_jobs.keys import payload_fingerprint
from infrai_jobs.ports import QueuePort
from infrai_jobs.queue_models import QueueMessage

logger = logging.getLogger(__name__)

# The field notes' price, verified 2026-07-26; used only when discovery cannot be reached.
FALLBACK_PUBLISH_PRICE_USD = Decimal("0.00002")


Progress = Callable[[int], None]
KeyOf = Callable[[Any], str]

MAX_REDRIVE_PER_CALL = 10_000
# A message is moved only while this much of the invocation is left. A move is a publish and an
# ack, normally well under a second; this covers a few retries. Like the drain's batch budget.
MESSAGE_BUDGET_MS = 20_000


@dataclass(frozen=True, slots=True)
class Selection:
    """Which dead letters a redrive moves: those matching every filter given (all when none)."""

    key: str | None = None
    job: str | None = None
    message_id: str | None = None

    @property
    def everything(self) -> bool:
        return self.key is None and self.job is None and self.message_id is None

    def matches(self, dead: DeadLetter, key_of: KeyOf | None) -> bool:
        """Whether ``dead`` is selected; ``key_of`` derives keys, and is needed for a key."""
        if self.message_id is not None and dead.message_id != self.message_id:
            return False
        if self.key is None and self.job is None:
            return True
        if isinstance(dead, Unreadable) or not isinstance(dead.payload, Mapping):
            return False
        if self.job is not None and dead.payload.get("job") != self.job:
            return False
        if self.key is not None:
            if key_of is None:
                raise ValueError("selecting dead letters by key needs key_of")
            try:
                return key_of(dead.payload) == self.key
            except KeyDerivationError:
                return False
        return True

    def as_dict(self) -> dict[str, str]:
        chosen = {"key": self.key, "job": self.job, "message_id": self.message_id}
        return {name: value for name, value in chosen.items() if value is not None}

    def describe(self) -> str:
        return " ".join(f"--{n.replace('_', '-')} {v}" for n, v in self.as_dict().items())


@dataclass(frozen=True, slots=True)
class RedriveRequest:
    """What RedriveFunction's event asks for (see events/redrive.json)."""

    max_messages: int = 100
    reopen_failed: bool = False
    dry_run: bool = False
    selection: Selection = field(default_factory=Selection)

    @classmethod
    def from_event(cls, event: object) -> RedriveRequest:
        if not isinstance(event, Mapping):
            raise ConfigurationError("the redrive event must be a JSON object")
        unknown = set(event) - {
            "max_messages",
            "reopen_failed",
            "dry_run",
            "key",
            "job",
            "message_id",
        }
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
        filters: dict[str, str] = {}
        for name in ("key", "job", "message_id"):
            value = event.get(name)
            if value is None:
                continue
            if not isinstance(value, str) or not value.strip():
                raise ConfigurationError(f"{name} must be a non-empty string")
            filters[name] = value
        return cls(max_messages=max_messages, selection=Selection(**filters), **flags)


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
    # Dead letters whose answer could not be read: neither moved nor acked (Unreadable.as_dict).
    unreadable: list[dict[str, Any]] = field(default_factory=list)
    # Read but not selected (a selective redrive): hidden in the DLQ for its visibility timeout.
    not_selected: int = 0
    selection: dict[str, str] = field(default_factory=dict)
    seen: list[dict[str, Any]] = field(default_factory=list)
    # "time_budget" when the invocation ran short and the redrive stopped early; "" otherwise.
    # Nothing was read that was not moved: the rest is in the DLQ for the next redrive.
    stopped: str = ""
    price_usd_per_message: Decimal = FALLBACK_PUBLISH_PRICE_USD
    price_source: str = "fallback"

    @property
    def cost_usd(self) -> Decimal:
        return self.price_usd_per_message * self.published

    @property
    def complete(self) -> bool:
        """Every dead letter it meant to move was read and moved (or, dry, looked at)."""
        return not self.skipped and not self.unreadable

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
            "unreadable": self.unreadable,
            "not_selected": self.not_selected,
            "selection": self.selection,
            "complete": self.complete,
            "seen": self.seen,
            "stopped": self.stopped,
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
    admin: ClaimsAdmin | None = None,
    describe: Callable[[QueueMessage], Mapping[str, Any]] | None = None,
    progress: Progress | None = None,
    time_left_ms: Callable[[], int] | None = None,
    selection: Selection | None = None,
    key_of: KeyOf | None = None,
) -> RedriveSummary:
    """Move up to ``max_messages`` dead letters from ``source`` back to ``target``.

    ``dry_run`` consumes to look (the DLQ can only be read by consuming) and acks nothing, so
    the messages it saw stay hidden in the DLQ for the visibility timeout, then return.

    ``selection`` moves only the dead letters it matches (``key_of``, needed to select by key,
    derives their keys); the others read stay hidden in the DLQ for its visibility timeout.
    ``max_messages`` bounds the dead letters read, moved or not.

    ``time_left_ms`` (RedriveFunction passes its Lambda context's) makes the redrive stop while
    it can still report: no message is read, and none moved, with less than
    ``MESSAGE_BUDGET_MS`` left; ``summary.stopped`` says so.

    A dead letter that cannot be read is never reported as moved: it is listed in
    ``summary.unreadable`` and stays in the DLQ (``summary.complete`` is then false).
    """
    if reopen_failed and admin is None:
        raise ValueError("reopen_failed needs the ledger (admin)")
    selection = selection or Selection()
    if selection.key is not None and key_of is None:
        raise ValueError("selecting dead letters by key needs key_of")
    summary = RedriveSummary(
        source=source, target=target, dry_run=dry_run, selection=selection.as_dict()
    )
    summary.price_usd_per_message, summary.price_source = publish_price(queue)

    def short_of_time() -> bool:
        if time_left_ms is not None and time_left_ms() < MESSAGE_BUDGET_MS:
            summary.stopped = "time_budget"
            return True
        return False

    read = 0
    for dead in read_dead_letters(queue, source, max_messages, stop=short_of_time):
        read += 1
        if progress is not None:
            progress(read)
        if not selection.matches(dead, key_of):
            summary.not_selected += 1
            continue
        if isinstance(dead, Unreadable):
            summary.unreadable.append(dead.as_dict())
        else:
            summary.consumed += 1
            if describe is not None:
                summary.seen.append({"message_id": dead.message_id, **describe(dead)})
            if not dry_run:
                _move(queue, dead, summary, admin if reopen_failed else None)
        if selection.message_id is not None:
            break  # message ids are unique: nothing else can match
    if summary.stopped:
        logger.warning(
            "redrive stopped before the invocation's time ran out; invoke it again for the rest",
            extra={"action": "redrive_stopped", "moved": summary.published},
        )
    if summary.unreadable:
        logger.error(
            "redrive could not read every dead letter; the unreadable ones stay in the DLQ",
            extra={"action": "redrive_incomplete", "unreadable": len(summary.unreadable)},
        )
    logger.info("redrive finished", extra={"action": "redrive_summary", **summary.as_dict()})
    return summary


def _move(
    queue: QueuePort,
    message: QueueMessage,
    summary: RedriveSummary,
    reopen: ClaimsAdmin | None,
) -> None:
    payload = message.payload
    if not isinstance(payload, dict):
        # Infrai only takes objects as bodies; this one stays in the DLQ for a human.
        summary.skipped.append(
            {"message_id": message.message_id, "reason": "payload is not a JSON object"}
        )
        return
    if reopen is not None:
        summary.reopened.extend(_reopen(reopen, message))
    # Retrying the publish is safe here: the drain's claims absorb a duplicate.
    queue.publish(summary.target, payload, retry=True)
    summary.published += 1
    try:
        queue.ack(summary.source, message.receipt_handle)
        summary.acked += 1
    except QueueMessageNotFound:
        summary.ack_lost += 1


def _reopen(admin: ClaimsAdmin, message: QueueMessage) -> list[str]:
    try:
        fingerprint: str | None = payload_fingerprint(message.payload)
    except KeyDerivationError:
        fingerprint = None  # unrepresentable work: match the claim by message id alone
    return admin.reopen_failed(
        message_id=message.message_id, fingerprint=fingerprint, actor=default_actor()
    )
