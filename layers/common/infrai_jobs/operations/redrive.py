"""Redrive: dead letters back to the main queue after a fix, the third source of duplicates.

Dead letters live in the ledger (``operations.dead_letters``): a redrive first moves what is
new in Infrai's DLQ into ``dead_letters`` (recorded, then acked there), then works on the
unresolved rows it selects (all, by key, job or message id). For each it **publishes the row's
payload, then marks the row redriven**, under the row's lock: a crash in between publishes it
again at worst, and the claim ledger absorbs that duplicate. Nothing is lost, no effect doubles.
A dry run moves new dead letters into the ledger too (that is how they are read), and then
publishes and marks nothing.

``reopen_failed`` deletes the ``failed`` claims of the redriven work (matched by message id or
payload fingerprint), recording each in ``claim_history``, so the fixed job runs again. A dead
letter the ledger held itself (deferred work that ran out of attempts) always has its failed
claim reopened: that claim is why it is a dead letter. A stuck
``running`` claim of an irreversible job is never reopened: that needs a human's verdict first
(``infrai-jobs claims resolve``). An unreadable dead letter is never redriven blindly: it is
reported, and can be discarded (``infrai-jobs dlq discard``).

Before publishing, each selected letter is judged (``forecast``) against the registry and the
claim ledger as they are now: it would **run**, be **skipped** (its work is done, or deferred
work the ledger owns: the copy would be a duplicate), or **bounce** straight back to the DLQ
(a failed claim not reopened, a stuck claim, a payload the registry rejects or whose job it
lacks, a key holding other work). A redrive publishes only what would run, and reports the rest
in ``held_back``; ``include_bouncing`` publishes everything readable, as an operator may ask.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from enum import StrEnum
from typing import Any

from infrai_jobs.errors import (
    ConfigurationError,
    InfraiInvalidResponse,
    InfraiUnavailable,
    KeyDerivationError,
    UnknownJob,
)
from infrai_jobs.jobs.keys import payload_fingerprint
from infrai_jobs.ledger.claims import ClaimRow
from infrai_jobs.operations.claims_admin import ClaimsAdmin
from infrai_jobs.operations.dead_letters import DeadLetterRow, DeadLetterStore, RetryOf, collect
from infrai_jobs.queue.ports import QueuePort

logger = logging.getLogger(__name__)

# The field notes' price, verified 2026-07-26; used only when discovery cannot be reached.
FALLBACK_PUBLISH_PRICE_USD = Decimal("0.00002")


Progress = Callable[[int], None]
KeyOf = Callable[[Any], str]

MAX_REDRIVE_PER_CALL = 10_000
# A dead letter is read or published only while this much of the invocation is left. Each is a
# call or two, normally well under a second; this covers a few retries. Like the drain's batch
# budget.
MESSAGE_BUDGET_MS = 20_000

_NEEDS_LEDGER = "held by the ledger: its failed claim must be reopened, and no ledger was given"

# A running claim this long untouched counts as stuck, as `claims stuck` and the watcher count
# it (STUCK_CLAIM_SECONDS' default).
STUCK_AFTER_SECONDS = 900


class Verdict(StrEnum):
    """What a published copy of a dead letter would meet in the drain."""

    RUN = "run"  # the job runs (again)
    SKIP = "skip"  # the copy would be acked as a duplicate: nothing to publish for
    BOUNCE = "bounce"  # the copy would come straight back to the DLQ


@dataclass(frozen=True, slots=True)
class Forecast:
    verdict: Verdict
    # One word for the reason, for counting: no_claim, reopened, in_flight, done, deferred,
    # failed, stuck, conflict, rejected, unknown_job, unknown (no key, no ledger to ask).
    cause: str
    why: str

    def entry(self, row: DeadLetterRow, key: str | None) -> dict[str, Any]:
        return {
            "message_id": row.message_id,
            "idem_key": key,
            "state": row.state,
            "reason": row.reason,
            "verdict": str(self.verdict),
            "cause": self.cause,
            "why": self.why,
        }


def forecast(
    row: DeadLetterRow,
    *,
    key_of: KeyOf | None,
    admin: ClaimsAdmin | None,
    reopen_failed: bool,
    stuck_after_seconds: int = STUCK_AFTER_SECONDS,
    now: datetime | None = None,
) -> tuple[Forecast, str | None]:
    """What a copy of ``row`` published now would meet, and the key it would be claimed by.

    The key is derived again with ``key_of`` (the registry may have changed since the letter
    was recorded); without it, the key recorded with the row is used. Without a key or a ledger
    to ask, the letter is judged to run, as a redrive always assumed."""
    key = row.idem_key
    if key_of is not None:
        try:
            key = key_of(row.body)
        except UnknownJob as exc:
            return Forecast(Verdict.BOUNCE, "unknown_job", str(exc)), None
        except KeyDerivationError as exc:
            return Forecast(Verdict.BOUNCE, "rejected", f"the drain rejects it: {exc}"), None
    if key is None or admin is None:
        return Forecast(Verdict.RUN, "unknown", "no key or ledger to judge it by"), key
    claim = admin.find(key)
    if claim is None:
        return Forecast(Verdict.RUN, "no_claim", "no claim: the job runs"), key
    return _against_claim(row, claim, reopen_failed, stuck_after_seconds, now), key


def _against_claim(
    row: DeadLetterRow,
    claim: ClaimRow,
    reopen_failed: bool,
    stuck_after_seconds: int,
    now: datetime | None,
) -> Forecast:
    if claim.payload_sha256 and claim.payload_sha256 != _fingerprint(row.body):
        why = (
            f"conflict: {claim.idem_key} is claimed by different work ({claim.state}); the "
            "copy would be rejected as a payload mismatch"
        )
        return Forecast(Verdict.BOUNCE, "conflict", why)
    if claim.state == "done":
        return Forecast(
            Verdict.SKIP, "done", "done already: the copy would be acked as a duplicate"
        )
    if claim.owned and claim.state in ("deferred", "running"):
        why = (
            f"the ledger holds it as deferred work ({claim.state}, attempt {claim.attempts}): "
            "a copy is a duplicate (`claims list --state deferred`)"
        )
        return Forecast(Verdict.SKIP, "deferred", why)
    if claim.state == "cancelled":
        why = "an operator cancelled its deferred work: a copy is new work, and runs"
        return Forecast(Verdict.RUN, "cancelled", why)
    if claim.state == "failed":
        if reopen_failed or row.held_by_ledger:
            return Forecast(Verdict.RUN, "reopened", "its failed claim is reopened: it runs")
        why = (
            f"its claim failed ({claim.error or 'no error recorded'}): without "
            "--reopen-failed the copy is a duplicate of the failure and returns to the DLQ"
        )
        return Forecast(Verdict.BOUNCE, "failed", why)
    touched = claim.updated_at or claim.claimed_at
    moment = now or datetime.now(UTC)
    if claim.error is not None or moment - touched > timedelta(seconds=stuck_after_seconds):
        why = (
            f"its claim is stuck ({claim.error or 'running, untouched'}): a human decides "
            "first (`infrai-jobs claims resolve`)"
        )
        return Forecast(Verdict.BOUNCE, "stuck", why)
    return Forecast(
        Verdict.RUN, "in_flight", "a delivery holds its claim now: the copy meets its outcome"
    )


def _fingerprint(payload: Any) -> str | None:
    try:
        return payload_fingerprint(payload)
    except KeyDerivationError:
        return None


@dataclass(frozen=True, slots=True)
class Selection:
    """Which dead letters a redrive moves: those matching every filter given (all when none)."""

    key: str | None = None
    job: str | None = None
    message_id: str | None = None

    @property
    def everything(self) -> bool:
        return self.key is None and self.job is None and self.message_id is None

    def as_dict(self) -> dict[str, str]:
        chosen = {"key": self.key, "job": self.job, "message_id": self.message_id}
        return {name: value for name, value in chosen.items() if value is not None}

    def describe(self) -> str:
        return " ".join(f"--{n.replace('_', '-')} {v}" for n, v in self.as_dict().items())


@dataclass(frozen=True, slots=True)
class RedriveRequest:
    """One redrive: what RedriveFunction's event (see events/redrive.json) or the command line
    asks for, and where and for whom (``source``, ``target`` and ``actor``, which the caller
    names: its settings, ``--queue``, the operator or the function)."""

    max_messages: int = 100
    reopen_failed: bool = False
    dry_run: bool = False
    include_bouncing: bool = False
    selection: Selection = field(default_factory=Selection)
    source: str = ""
    target: str = ""
    actor: str = ""

    def to(self, *, source: str, target: str, actor: str) -> RedriveRequest:
        """This request, from ``source`` to ``target`` on behalf of ``actor``."""
        return replace(self, source=source, target=target, actor=actor)

    @classmethod
    def from_event(cls, event: object) -> RedriveRequest:
        if not isinstance(event, Mapping):
            raise ConfigurationError("the redrive event must be a JSON object")
        unknown = set(event) - {
            "max_messages",
            "reopen_failed",
            "dry_run",
            "include_bouncing",
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
        flags: dict[str, bool] = {}
        for name in ("reopen_failed", "dry_run", "include_bouncing"):
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
        return cls(
            max_messages=max_messages,
            selection=Selection(**filters),
            reopen_failed=flags["reopen_failed"],
            dry_run=flags["dry_run"],
            include_bouncing=flags["include_bouncing"],
        )


@dataclass(frozen=True, slots=True)
class JobsKnowledge:
    """What the jobs package tells a redrive: each letter's key (``key_of``; None: recorded
    without one), whether a selection's job exists (``known_jobs``: "" when it does, else what
    to say), and each job's retry policy in force (``retry_of``: a letter with attempts left is
    taken back as deferred work when it is collected)."""

    key_of: KeyOf | None = None
    known_jobs: Callable[[str], str] | None = None
    retry_of: RetryOf | None = None


@dataclass
class RedriveSummary:
    source: str
    target: str
    dry_run: bool
    # Moved from Infrai's DLQ into the ledger first (dead_letters.Collected): read, newly
    # recorded, and acked from the DLQ after their rows committed.
    consumed: int = 0
    recorded: int = 0
    acked: int = 0
    ack_lost: int = 0
    # The ledger's unresolved rows this redrive selected, and what it did with them.
    selected: int = 0
    published: int = 0
    reopened: list[str] = field(default_factory=list)
    # Selected rows it cannot publish (unreadable, or not a JSON object): left unresolved.
    skipped: list[dict[str, str]] = field(default_factory=list)
    # Selected rows it chose not to publish, each with its forecast: their copies would be
    # duplicates of done work, or bounce straight back. Left unresolved, for a human.
    held_back: list[dict[str, Any]] = field(default_factory=list)
    # Unreadable answers from the DLQ that named no message: neither recorded nor acked.
    unreadable: list[dict[str, Any]] = field(default_factory=list)
    # Unresolved rows of the queue this redrive did not select (a selective redrive, or more
    # than max_messages): they stay unresolved in the ledger for another redrive or a discard.
    not_selected: int = 0
    selection: dict[str, str] = field(default_factory=dict)
    seen: list[dict[str, Any]] = field(default_factory=list)
    # "time_budget" when the invocation ran short and the redrive stopped early; "" otherwise.
    # What it did not reach stays unresolved in the ledger (or in the DLQ) for the next one.
    stopped: str = ""
    price_usd_per_message: Decimal = FALLBACK_PUBLISH_PRICE_USD
    price_source: str = "fallback"

    @property
    def cost_usd(self) -> Decimal:
        return self.price_usd_per_message * self.published

    @property
    def complete(self) -> bool:
        """Every dead letter it meant to move was read and moved (or, dry, looked at)."""
        return not self.skipped and not self.unreadable and not self.stopped

    def held_back_by_cause(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for entry in self.held_back:
            counts[entry["cause"]] = counts.get(entry["cause"], 0) + 1
        return dict(sorted(counts.items()))

    def as_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "target": self.target,
            "dry_run": self.dry_run,
            "consumed": self.consumed,
            "recorded": self.recorded,
            "acked": self.acked,
            "ack_lost": self.ack_lost,
            "selected": self.selected,
            "published": self.published,
            "reopened": self.reopened,
            "skipped": self.skipped,
            "held_back": self.held_back,
            "held_back_by_cause": self.held_back_by_cause(),
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
    store: DeadLetterStore,
    request: RedriveRequest,
    *,
    admin: ClaimsAdmin | None = None,
    jobs: JobsKnowledge | None = None,
    progress: Progress | None = None,
    time_left_ms: Callable[[], int] | None = None,
) -> RedriveSummary:
    """Move new dead letters of ``request.source`` into the ledger, then publish up to
    ``request.max_messages`` of its unresolved rows (those its ``selection`` matches) to
    ``request.target``.

    ``request.actor`` is who is redriving, recorded with each row redriven and each claim
    reopened (the operator on the command line, ``RedriveFunction`` in Lambda).

    ``jobs.key_of`` derives the keys of the dead letters recorded now (a row keeps its key,
    which a selection by key matches), and judges each selected row (``forecast``); with
    ``jobs.retry_of`` a letter of a job with retry attempts left is taken back as deferred work
    as it is collected. A ``dry_run`` records, then publishes and marks nothing; its ``seen``
    lists the rows a redrive would publish, and ``held_back`` those it would not, each with its
    verdict and why. ``include_bouncing`` publishes the letters that would be skipped or bounce
    too. ``jobs.known_jobs`` refuses an unknown selected job (``ConfigurationError``) before
    anything is read.

    ``time_left_ms`` (RedriveFunction passes its Lambda context's), the one clock, makes the
    redrive stop while it can still report: nothing is read or published with less than
    ``MESSAGE_BUDGET_MS`` left; ``summary.stopped`` says so.
    """
    jobs = jobs or JobsKnowledge()
    source, target, actor = request.source, request.target, request.actor
    if not (source and target and actor):
        raise ValueError("a redrive names its source, target and actor (RedriveRequest.to)")
    max_messages, dry_run, selection = request.max_messages, request.dry_run, request.selection
    reopen_failed, include_bouncing = request.reopen_failed, request.include_bouncing
    key_of = jobs.key_of
    if reopen_failed and admin is None:
        raise ValueError("reopen_failed needs the ledger (admin)")
    _refuse_an_unknown_job(selection, jobs.known_jobs)
    summary = RedriveSummary(
        source=source, target=target, dry_run=dry_run, selection=selection.as_dict()
    )

    def short_of_time() -> bool:
        if time_left_ms is not None and time_left_ms() < MESSAGE_BUDGET_MS:
            summary.stopped = "time_budget"
            return True
        return False

    collected = collect(
        queue,
        store,
        dlq=source,
        main_queue=target,
        key_of=key_of,
        stop=short_of_time,
        retry_of=jobs.retry_of,
    )
    summary.consumed, summary.recorded = collected.read, collected.recorded
    summary.acked, summary.ack_lost = collected.acked, collected.ack_lost
    summary.unreadable = collected.unrecorded
    summary.price_usd_per_message, summary.price_source = publish_price(queue)
    rows = store.rows(
        target,
        message_id=selection.message_id,
        key=selection.key,
        job=selection.job,
        limit=max_messages,
    )
    summary.selected = len(rows)
    summary.not_selected = store.unresolved_count(target) - len(rows)
    for done, row in enumerate(rows, start=1):
        if progress is not None:
            progress(done)
        if row.redrivable:
            summary.skipped.append({"message_id": row.message_id, "reason": row.redrivable})
            continue
        judged, key = forecast(row, key_of=key_of, admin=admin, reopen_failed=reopen_failed)
        if judged.verdict is not Verdict.RUN and not include_bouncing:
            summary.held_back.append(judged.entry(row, key))
            continue
        if dry_run:
            summary.seen.append(judged.entry(row, key))
            continue
        if short_of_time():
            break
        if row.held_by_ledger and admin is None:
            summary.skipped.append({"message_id": row.message_id, "reason": _NEEDS_LEDGER})
            continue
        if reopen_failed or row.held_by_ledger:
            # A letter the ledger held is its own failed claim's: without the reopen, the new
            # copy would meet that claim and walk to Infrai's DLQ instead of running.
            assert admin is not None
            summary.reopened.extend(_reopen(admin, row.message_id, row.body, actor=actor))
        if store.redrive(row.message_id, _publisher(queue, target), actor=actor, note="redrive"):
            summary.published += 1
    _log_outcome(summary)
    logger.info("redrive finished", extra={"action": "redrive_summary", **summary.as_dict()})
    return summary


def _refuse_an_unknown_job(selection: Selection, known_jobs: Callable[[str], str] | None) -> None:
    if selection.job is not None and known_jobs is not None:
        unknown = known_jobs(selection.job)
        if unknown:
            raise ConfigurationError(f"redrive --job: {unknown}")


def _log_outcome(summary: RedriveSummary) -> None:
    if summary.stopped:
        logger.warning(
            "redrive stopped before the invocation's time ran out; invoke it again for the rest",
            extra={"action": "redrive_stopped", "moved": summary.published},
        )
    if summary.held_back:
        logger.warning(
            "redrive held back dead letters whose copies would not run",
            extra={"action": "redrive_held_back", "causes": summary.held_back_by_cause()},
        )
    if summary.unreadable or summary.skipped:
        logger.error(
            "redrive could not move every dead letter; the rest stay unresolved",
            extra={
                "action": "redrive_incomplete",
                "unreadable": len(summary.unreadable),
                "skipped": len(summary.skipped),
            },
        )


def _publisher(queue: QueuePort, target: str) -> Callable[[Any], None]:
    def publish(payload: Any) -> None:
        # Retrying the publish is safe here: the drain's claims absorb a duplicate.
        queue.publish(target, payload, retry=True)

    return publish


def _reopen(admin: ClaimsAdmin, message_id: str, payload: Any, *, actor: str) -> list[str]:
    # Unrepresentable work has no fingerprint: its claim is matched by message id alone.
    fingerprint = _fingerprint(payload)
    return admin.reopen_failed(message_id=message_id, fingerprint=fingerprint, actor=actor)
