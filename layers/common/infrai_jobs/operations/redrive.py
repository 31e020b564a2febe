"""Redrive: dead letters back to the main queue after a fix, the third source of duplicates. Each
selected row is first judged (``forecast``): its copy would run, be skipped or bounce back; only
what would run is published unless ``include_bouncing``. The verdicts: docs/operations.md, "Dead
letters: the steps"."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from decimal import Decimal
from enum import StrEnum
from functools import partial
from typing import Any

from infrai_jobs.errors import (
    ConfigurationError,
    InfraiInvalidResponse,
    InfraiUnavailable,
    KeyDerivationError,
    UnknownJob,
)
from infrai_jobs.operations.dead_letters import (
    DeadLetterRow,
    DeadLetterStore,
    KeyOf,
    RetryOf,
    collect,
    fingerprint_or_none,
    other_work,
)
from infrai_jobs.queue.ports import QueuePort
from infrai_jobs.work.admin import WorkStore
from infrai_jobs.work.states import ClaimRow

logger = logging.getLogger(__name__)

# The field notes' price, verified 2026-07-26; used only when discovery cannot be reached.
FALLBACK_PUBLISH_PRICE_USD = Decimal("0.00002")

MAX_REDRIVE_PER_CALL = 10_000
# A dead letter is read or published only while this much of the invocation is left (a call
# or two each, plus a few retries).
MESSAGE_BUDGET_MS = 20_000

_LEDGER_HELD_NOTE = "a dead letter the ledger held (out of attempts) reopens its failed claim"
_NEEDS_LEDGER = "held by the ledger: its failed claim must be reopened, and no ledger was given"


class Verdict(StrEnum):
    """What a published copy of a dead letter would meet in the drain."""

    RUN = "run"  # the job runs (again)
    SKIP = "skip"  # the copy would be acked as a duplicate: nothing to publish for
    BOUNCE = "bounce"  # the copy would come straight back to the DLQ


@dataclass(frozen=True, slots=True)
class Forecast:
    verdict: Verdict
    # One word for the reason, for counting: no_claim, reopened, in_flight, done, deferred, failed,
    # resolved_failed, stuck, conflict, rejected, unknown_job, unknown (no key, no ledger to ask).
    cause: str
    why: str

    def entry(self, row: DeadLetterRow, key: str | None) -> dict[str, Any]:
        entry = {"message_id": row.message_id, "idem_key": key, "state": row.state}
        return {**entry, "reason": row.reason, **asdict(self), "verdict": str(self.verdict)}


def forecast(
    row: DeadLetterRow, *, key_of: KeyOf | None, admin: WorkStore | None, reopen_failed: bool
) -> tuple[Forecast, str | None]:
    """What a copy of ``row`` published now would meet, and the key it would be claimed by:
    derived again (the registry may have changed since), else the row's. Without a key or a
    ledger, it is judged to run."""
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
    human = claim.state == "failed" and admin.failed_by_human(key)
    return _against_claim(row, claim, reopen_failed, human=human), key


def _against_claim(
    row: DeadLetterRow, claim: ClaimRow, reopen_failed: bool, *, human: bool
) -> Forecast:
    if other_work(claim, row.body):
        why = (
            f"conflict: {claim.idem_key} is claimed by different work ({claim.state}); the "
            "copy would be rejected as a payload mismatch"
        )
        return Forecast(Verdict.BOUNCE, "conflict", why)
    if claim.state == "done":
        why = "done already: the copy would be acked as a duplicate"
        return Forecast(Verdict.SKIP, "done", why)
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
        # A human's verdict stands, whichever dead letter asks: only the flag reopens it.
        if reopen_failed or (row.held_by_ledger and not human):
            return Forecast(Verdict.RUN, "reopened", "its failed claim is reopened: it runs")
        if human:
            why = (
                f"an operator resolved it failed ({claim.error or 'no reason recorded'}): a plain "
                "redrive never reopens a human's verdict; `redrive --reopen-failed` does"
            )
            return Forecast(Verdict.BOUNCE, "resolved_failed", why)
        why = (
            f"its claim failed ({claim.error or 'no error recorded'}): without "
            "--reopen-failed the copy is a duplicate of the failure and returns to the DLQ"
        )
        return Forecast(Verdict.BOUNCE, "failed", why)
    # Whether the lease is over is the database's answer (read with the row), never this clock's.
    if claim.error is not None or claim.lease_live is False:
        why = (
            f"its claim is stuck ({claim.error or 'running, untouched'}): a human decides "
            "first (`infrai-jobs claims resolve`)"
        )
        return Forecast(Verdict.BOUNCE, "stuck", why)
    why = "a delivery holds its claim now: the copy meets its outcome"
    return Forecast(Verdict.RUN, "in_flight", why)


@dataclass(frozen=True, slots=True)
class Selection:
    """Which dead letters a redrive moves: those matching every filter given (all when none)."""

    key: str | None = None
    job: str | None = None
    message_id: str | None = None

    def as_dict(self) -> dict[str, str]:
        return {name: value for name, value in asdict(self).items() if value is not None}


_EVENT_FLAGS = ("reopen_failed", "dry_run", "include_bouncing")
_EVENT_FILTERS = ("key", "job", "message_id")


@dataclass(frozen=True, slots=True)
class RedriveRequest:
    """One redrive: what RedriveFunction's event (see events/redrive.json) or the command line
    asks for; the caller names where and for whom (``to``)."""

    max_messages: int = 100
    reopen_failed: bool = False
    dry_run: bool = False
    include_bouncing: bool = False
    selection: Selection = field(default_factory=Selection)
    source: str = ""
    target: str = ""
    actor: str = ""

    def given(self) -> str:
        """What its history notes say: this redrive in the command line's words, as given."""
        flags = {"--reopen-failed": self.reopen_failed, "--include-bouncing": self.include_bouncing}
        chosen = [f"--{n.replace('_', '-')} {v}" for n, v in self.selection.as_dict().items()]
        return " ".join(["redrive", *(flag for flag, on in flags.items() if on), *chosen])

    def to(self, *, source: str, target: str, actor: str) -> RedriveRequest:
        return replace(self, source=source, target=target, actor=actor)

    @classmethod
    def from_event(cls, event: object) -> RedriveRequest:
        if not isinstance(event, Mapping):
            raise ConfigurationError("the redrive event must be a JSON object")
        unknown = sorted(set(event) - {"max_messages", *_EVENT_FLAGS, *_EVENT_FILTERS})
        if unknown:
            raise ConfigurationError(f"unknown redrive event field(s): {', '.join(unknown)}")
        max_messages = event.get("max_messages", 100)
        if isinstance(max_messages, bool) or not isinstance(max_messages, int):
            raise ConfigurationError("max_messages must be an integer")
        if not 1 <= max_messages <= MAX_REDRIVE_PER_CALL:
            raise ConfigurationError(f"max_messages must be between 1 and {MAX_REDRIVE_PER_CALL}")
        flags = {name: event.get(name, False) for name in _EVENT_FLAGS}
        for name, value in flags.items():
            if not isinstance(value, bool):
                raise ConfigurationError(f"{name} must be true or false")
        filters = {name: event[name] for name in _EVENT_FILTERS if event.get(name) is not None}
        for name, value in filters.items():
            if not isinstance(value, str) or not value.strip():
                raise ConfigurationError(f"{name} must be a non-empty string")
        return cls(max_messages=max_messages, selection=Selection(**filters), **flags)


@dataclass(frozen=True, slots=True)
class JobsKnowledge:
    """What the jobs package tells a redrive: each letter's key (``key_of``), whether a
    selection's job exists (``known_jobs``: "" when it does, else what to say), and each job's
    retry policy (``retry_of``: a letter with attempts left is taken back as deferred work)."""

    key_of: KeyOf | None = None
    known_jobs: Callable[[str], str] | None = None
    retry_of: RetryOf | None = None


@dataclass
class RedriveSummary:
    source: str
    target: str
    dry_run: bool
    # Collected from Infrai's DLQ first (dead_letters.Collected): read, newly recorded, acked.
    consumed: int = 0
    recorded: int = 0
    acked: int = 0
    ack_lost: int = 0
    selected: int = 0
    published: int = 0
    reopened: list[str] = field(default_factory=list)
    # Selected rows it cannot publish (unreadable, not a JSON object) or would not (their
    # copies would not run): left unresolved, for a human.
    skipped: list[dict[str, str]] = field(default_factory=list)
    held_back: list[dict[str, Any]] = field(default_factory=list)
    # Unreadable answers from the DLQ that named no message (Collected.unrecorded).
    unreadable: list[dict[str, Any]] = field(default_factory=list)
    not_selected: int = 0  # unresolved rows it did not select (by filter, or max_messages)
    selection: dict[str, str] = field(default_factory=dict)
    seen: list[dict[str, Any]] = field(default_factory=list)
    stopped: str = ""  # "time_budget" when the invocation ran short and it stopped early
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
        return dict(sorted(Counter(entry["cause"] for entry in self.held_back).items()))

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(held_back_by_cause=self.held_back_by_cause(), complete=self.complete)
        out.update(price_usd_per_message=str(self.price_usd_per_message))
        return {**out, "cost_usd": str(self.cost_usd)}


def publish_price(queue: QueuePort) -> tuple[Decimal, str]:
    """Discovery's live price, or the documented fallback when discovery cannot be reached or
    read. Any other error (a 401: the key is wrong) is raised: every other call would fail
    the same way."""
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
    admin: WorkStore | None = None,
    jobs: JobsKnowledge | None = None,
    time_left_ms: Callable[[], int] | None = None,
) -> RedriveSummary:
    """Collect new dead letters of ``request.source``, then publish up to ``max_messages`` of
    the unresolved rows its ``selection`` matches to ``request.target`` as ``request.actor``.
    An unknown selected job is refused before anything is read; a ``dry_run`` lists in ``seen``
    what it would publish. ``time_left_ms`` (the Lambda context's) stops it while it can still
    report (``MESSAGE_BUDGET_MS``, ``stopped``)."""
    jobs = jobs or JobsKnowledge()
    source, target, actor = request.source, request.target, request.actor
    if not (source and target and actor):
        raise ValueError("a redrive names its source, target and actor (RedriveRequest.to)")
    if request.reopen_failed and admin is None:
        raise ValueError("reopen_failed needs the ledger (admin)")
    selection, given = request.selection, request.given()
    unknown = jobs.known_jobs(selection.job) if selection.job and jobs.known_jobs else ""
    if unknown:
        raise ConfigurationError(f"redrive --job: {unknown}")
    summary = RedriveSummary(source, target, request.dry_run, selection=selection.as_dict())

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
        key_of=jobs.key_of,
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
        limit=request.max_messages,
    )
    summary.selected = len(rows)
    summary.not_selected = store.unresolved_count(target) - len(rows)
    # Retrying the publish is safe here: the drain's claims absorb a duplicate.
    publish = partial(queue.publish, target, retry=True)
    for row in rows:
        if row.redrivable:
            summary.skipped.append({"message_id": row.message_id, "reason": row.redrivable})
            continue
        judged, key = forecast(
            row, key_of=jobs.key_of, admin=admin, reopen_failed=request.reopen_failed
        )
        if judged.verdict is not Verdict.RUN and not request.include_bouncing:
            summary.held_back.append(judged.entry(row, key))
            continue
        if request.dry_run:
            summary.seen.append(judged.entry(row, key))
            continue
        if short_of_time():
            break
        if row.held_by_ledger and admin is None:
            summary.skipped.append({"message_id": row.message_id, "reason": _NEEDS_LEDGER})
            continue
        if judged.cause == "reopened":
            # A letter the ledger held is its own failed claim's: without the reopen, the new
            # copy would meet that claim and walk to Infrai's DLQ instead of running.
            # Unrepresentable work has no fingerprint: its claim is matched by message id alone.
            assert admin is not None
            reopened = admin.reopen_failed(
                message_id=row.message_id,
                fingerprint=fingerprint_or_none(row.body),
                actor=actor,
                note=given if request.reopen_failed else f"{given}: {_LEDGER_HELD_NOTE}",
            )
            summary.reopened.extend(reopened)
        if store.redrive(row.message_id, publish, actor=actor, note=given):
            summary.published += 1
    _log_outcome(summary)
    logger.info("redrive finished", extra={"action": "redrive_summary", **summary.as_dict()})
    return summary


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
        incomplete = {"unreadable": len(summary.unreadable), "skipped": len(summary.skipped)}
        logger.error(
            "redrive could not move every dead letter; the rest stay unresolved",
            extra={"action": "redrive_incomplete", **incomplete},
        )
