"""Turning dead letters, stuck claims and a lagging drain into pages a human can act on. Each check
reads queue stats, unresolved dead letters (after resolving those of work the ledger shows done)
and stuck claims (after a reconcile pass, when given one), then ``decide``s per signal. The last
alerted value of each signal lives in ``alert_state``, locked in the decision's transaction: a
cold start does not re-alert, and two concurrent checks send one alert."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any, Final, LiteralString, Protocol

import psycopg

from infrai_jobs.config.settings import AlertSettings
from infrai_jobs.errors import InfraiError, LedgerError
from infrai_jobs.ledger.dead_letter_rows import UNRESOLVED_DEAD_LETTERS
from infrai_jobs.ledger.postgres import LedgerAdapter
from infrai_jobs.operations.dead_letters import DeadLetterStore
from infrai_jobs.operations.reconcile import Reconciler, ReconcileReport
from infrai_jobs.queue.models import QueueStats
from infrai_jobs.queue.ports import QueuePort
from infrai_jobs.work.admin import WorkStore
from infrai_jobs.work.statements import STUCK_CLAIM_COUNT as _STUCK
from infrai_jobs.work.store import DeferredStats, deferred_stats

logger = logging.getLogger(__name__)

LEDGER_SCOPE = "ledger"
WATCHER_ACTOR = "DlqAlertFunction"
SNS_SUBJECT_LIMIT = 100
# The thresholds' defaults: DlqAlertFunction's, declared once with the variables that set them.
_DEFAULT: Final = AlertSettings()


class Signal(StrEnum):
    DLQ = "dlq"  # a queue's dead letters: in Infrai's DLQ plus unresolved in the ledger
    STUCK = "stuck"  # running claims older than the threshold, or flagged
    BACKLOG = "backlog"  # the oldest message is older than the threshold: the drain lags


class Verdict(StrEnum):
    QUIET = "quiet"
    ALERT = "alert"  # appeared or grew
    REMIND = "remind"  # unchanged and still bad after the reminder interval
    RESOLVED = "resolved"  # back to zero


@dataclass(frozen=True, slots=True)
class AlertState:
    value: int = 0
    alerted_at: datetime | None = None


@dataclass(frozen=True, slots=True)
class AlertThresholds:
    stuck_claim_seconds: int = _DEFAULT.stuck_claim_seconds
    backlog_age_seconds: int = _DEFAULT.backlog_age_seconds
    reminder_seconds: int = _DEFAULT.alert_reminder_seconds
    # Of the function's 60 s, how long a check may probe stuck claims before counting them.
    reconcile_budget_seconds: float = 30.0
    visibility: float = _DEFAULT.visibility_timeout_seconds


def decide(previous: AlertState, value: int, now: datetime, reminder_seconds: int) -> Verdict:
    """Rising edge alerts, an unchanged bad value reminds after an interval, zero resolves once.
    A value that falls but stays above zero is quiet: the last alert already told a human."""
    if value > previous.value:
        return Verdict.ALERT
    if value == 0:
        return Verdict.RESOLVED if previous.value > 0 else Verdict.QUIET
    due = previous.alerted_at is None or (
        now - previous.alerted_at >= timedelta(seconds=reminder_seconds)
    )
    return Verdict.REMIND if due else Verdict.QUIET


class Alerter(Protocol):
    """Where alerts go; SNS in AWS."""

    def publish(self, subject: str, message: str) -> None: ...


@dataclass(frozen=True, slots=True)
class StuckClaims:
    count: int
    oldest_running_age_seconds: float


@dataclass(frozen=True, slots=True)
class Observation:
    """One signal's new value, in one scope (a queue name, or the ledger)."""

    scope: str
    signal: Signal
    value: int
    stats: QueueStats | None = None
    # For the DLQ signal: the unresolved dead letters the ledger holds (value = dlq_count + this).
    in_ledger: int = 0


@dataclass
class AlertReport:
    """What one check saw and did; the handler turns it into metrics and a return value."""

    stats: list[QueueStats] = field(default_factory=list)
    stuck: StuckClaims = field(default_factory=lambda: StuckClaims(0, 0.0))
    ledger_dead_letters: dict[str, int] = field(default_factory=dict)
    sent: list[dict[str, Any]] = field(default_factory=list)
    started: datetime | None = None
    reconciled: ReconcileReport | None = None  # None: no job has a probe
    deferred: DeferredStats = field(default_factory=lambda: DeferredStats(0, 0.0))

    def as_dict(self) -> dict[str, Any]:
        queues = []
        for s in self.stats:
            in_ledger = self.ledger_dead_letters.get(s.queue, 0)
            dead = {"ledger_dead_letters": in_ledger, "dead_letters": s.dlq_count + in_ledger}
            queues.append({**asdict(s), **dead})
        return {
            "queues": queues,
            "stuck_claims": self.stuck.count,
            "oldest_running_claim_age_seconds": self.stuck.oldest_running_age_seconds,
            "deferred_backlog": self.deferred.backlog,
            "oldest_deferred_age_seconds": self.deferred.oldest_age_seconds,
            "reconciled": self.reconciled.as_dict() if self.reconciled else None,
            "alerts": self.sent,
        }


_ENSURE_STATE: LiteralString = """
INSERT INTO alert_state (scope, signal) VALUES (%(scope)s, %(signal)s)
ON CONFLICT (scope, signal) DO NOTHING
"""
_LOCK_STATE: LiteralString = """
SELECT value, alerted_at, now(), updated_at FROM alert_state
WHERE scope = %(scope)s AND signal = %(signal)s FOR UPDATE
"""
_SAVE_STATE: LiteralString = """
UPDATE alert_state
SET value = %(value)s, alerted_at = %(alerted_at)s, updated_at = now()
WHERE scope = %(scope)s AND signal = %(signal)s
"""


class AlertCheck(LedgerAdapter):
    """The watcher's check over the watched queues and the ledger; one connection per run."""

    APPLICATION_NAME = "infrai-jobs-watcher"

    def __init__(
        self,
        queue: QueuePort,
        database_url: str,
        alerter: Alerter,
        thresholds: AlertThresholds,
        *,
        reconciler: Reconciler | None = None,
        **options: Any,
    ) -> None:
        super().__init__(database_url, **options)
        self._queue, self._alerter, self._thresholds = queue, alerter, thresholds
        self._reconciler = reconciler
        work = WorkStore(database_url, visibility_timeout=thresholds.visibility, **options)
        # One connector for the check and its letters: a rotated secret is fetched once a run.
        self._letters, self._connector = DeadLetterStore(work), work.connector

    def run(self, watched: Sequence[str]) -> AlertReport:
        """Check every watched queue; raise rather than report zeros when a source fails."""
        report = AlertReport()
        unread: list[InfraiError] = []
        report.reconciled = self._reconcile(watched)
        with self._connector.session("alert check") as conn:
            # A signal saved by another run after this moment holds a newer observation.
            (report.started,) = conn.execute("SELECT now()").fetchone() or (None,)
            # Stats before any verdict. A queue whose stats cannot be read gets no verdict
            # at all (never a "resolved" on missing data); the others are still judged, and
            # the run raises at the end so the function's Errors alarm fires.
            for name in watched:
                try:
                    report.stats.append(self._queue.stats(name))
                except InfraiError as exc:
                    logger.error(
                        "cannot read a watched queue's stats; it is not judged this run",
                        extra={"action": "stats_unread", "queue": name, "detail": str(exc)},
                    )
                    unread.append(exc)
            limits = self._thresholds
            params = {"threshold": limits.stuck_claim_seconds, "visibility": limits.visibility}
            count, oldest = conn.execute(_STUCK, params).fetchone() or (0, 0)
            report.stuck = StuckClaims(int(count), float(oldest))
            report.deferred = deferred_stats(conn)
            seen: list[Observation] = []
            for stats in report.stats:
                lagging = int(stats.oldest_message_age_seconds > limits.backlog_age_seconds)
                # The watcher never reads the DLQ itself (that would consume it): it adds the
                # letters already moved into the ledger. One moved but not yet acked counts
                # twice for a moment: more, never fewer, so nothing resolves early.
                row = conn.execute(UNRESOLVED_DEAD_LETTERS, {"queue": stats.queue}).fetchone()
                in_ledger = int(row[0]) if row else 0
                report.ledger_dead_letters[stats.queue] = in_ledger
                dead = stats.dlq_count + in_ledger
                seen.append(Observation(stats.queue, Signal.DLQ, dead, stats, in_ledger))
                seen.append(Observation(stats.queue, Signal.BACKLOG, lagging, stats))
            seen.append(Observation(LEDGER_SCOPE, Signal.STUCK, report.stuck.count))
            for observation in seen:
                self._evaluate(conn, report, observation)
        if unread:
            raise unread[0]
        return report

    def _reconcile(self, watched: Sequence[str]) -> ReconcileReport | None:
        """Before counting, probe stuck claims and resolve the dead letters of work done; a ledger
        failure is logged and the check goes on (the count then fails the run the same way)."""
        reconciled = None
        try:
            if self._reconciler is not None and self._reconciler.probed_jobs():
                reconciled = self._reconciler.run_all(
                    threshold_seconds=self._thresholds.stuck_claim_seconds,
                    budget_seconds=self._thresholds.reconcile_budget_seconds,
                )
            for name in watched:
                self._letters.resolve_done(name, actor=WATCHER_ACTOR)
        except LedgerError as exc:
            logger.error(
                "cannot reconcile stuck claims or dead letters of done work: counted as they are",
                extra={"action": "reconcile_failed", "detail": str(exc)},
            )
        return reconciled

    def _evaluate(
        self, conn: psycopg.Connection[Any], report: AlertReport, seen: Observation
    ) -> None:
        key = {"scope": seen.scope, "signal": seen.signal.value}
        with conn.transaction():
            created = conn.execute(_ENSURE_STATE, key).rowcount == 1
            row = conn.execute(_LOCK_STATE, key).fetchone()
            assert row is not None  # ensured just above, in this transaction
            previous = AlertState(int(row[0]), row[1])
            now: datetime = row[2]
            if not created and report.started is not None and row[3] > report.started:
                # Overlapping runs (a repeated schedule event): the other one looked later and
                # has spoken for this signal. Judging our older numbers against its state
                # would alert on what it just saw resolved.
                logger.info(
                    "a later watcher run already recorded this signal",
                    extra={"action": "alert_skipped", "signal": seen.signal.value},
                )
                return
            verdict = decide(previous, seen.value, now, self._thresholds.reminder_seconds)
            alerted_at = previous.alerted_at
            if verdict is not Verdict.QUIET:
                subject, message = compose(
                    verdict,
                    seen,
                    before=previous.value,
                    stuck=report.stuck,
                    thresholds=self._thresholds,
                    reconciled=report.reconciled,
                )
                # Inside the lock: a concurrent check waits here, then finds nothing new.
                # If publishing fails the state is not saved, so the next run alerts again.
                self._alerter.publish(subject, message)
                alerted_at = now
                change: dict[str, Any] = {"signal": seen.signal.value, "scope": seen.scope}
                change |= {"verdict": verdict.value, "from": previous.value, "to": seen.value}
                report.sent.append({**change, "subject": subject, "message": message})
                logger.warning(subject, extra={"action": f"alert_{verdict.value}", **change})
            conn.execute(_SAVE_STATE, {**key, "value": seen.value, "alerted_at": alerted_at})


def compose(
    verdict: Verdict,
    seen: Observation,
    *,
    before: int,
    stuck: StuckClaims,
    thresholds: AlertThresholds,
    reconciled: ReconcileReport | None = None,
) -> tuple[str, str]:
    """The subject and body of one alert: what, how much, since when, and what to run next."""
    signal, scope, after, stats = seen.signal, seen.scope, seen.value, seen.stats
    if signal is Signal.DLQ:
        subject = {
            Verdict.ALERT: f"{after - before} new dead letter(s) on {scope}",
            Verdict.REMIND: f"still {after} dead letter(s) on {scope}",
            Verdict.RESOLVED: f"no dead letters left on {scope}",
        }[verdict]
        in_dlq = stats.dlq_count if stats else 0
        body = [
            f"Dead letters of {scope} went from {before} to {after}: {in_dlq} in the "
            f"dead-letter queue of {scope} (dlq_count), {seen.in_ledger} moved into the ledger "
            "and not yet redriven or discarded (nor found done).",
            "Each message there failed three deliveries, or was left unacked on purpose "
            "(a conflict, a stuck irreversible job, an unknown job).",
        ]
        next_steps = [
            f"infrai-jobs dlq --queue {scope}   # what is there, and the ledger's reason",
            "infrai-jobs dlq discard --key KEY   # work that must not run again",
            "infrai-jobs redrive --dry-run   # after the fix: what a redrive would do",
        ]
    elif signal is Signal.BACKLOG:
        age = stats.oldest_message_age_seconds if stats else 0.0
        subject = {
            Verdict.ALERT: f"{scope} is falling behind (oldest {age:.0f} s)",
            Verdict.REMIND: f"{scope} is still behind (oldest {age:.0f} s)",
            Verdict.RESOLVED: f"{scope} is keeping up again",
        }[verdict]
        body = [
            f"The oldest message on {scope} is {age:.0f} s old "
            f"(threshold {thresholds.backlog_age_seconds} s).",
            f"available {stats.available_count if stats else 0}, "
            f"in flight {stats.in_flight_count if stats else 0}.",
        ]
        next_steps = [
            f"infrai-jobs stats --queue {scope}",
            "check DrainFunction's Errors alarm and its logs; consider more DrainLanes",
        ]
    else:
        subject = {
            Verdict.ALERT: f"{after - before} new stuck claim(s) in the ledger",
            Verdict.REMIND: f"still {after} stuck claim(s) in the ledger",
            Verdict.RESOLVED: "no stuck claims",
        }[verdict]
        body = [
            f"Stuck claims went from {before} to {after}: running longer than "
            f"{thresholds.stuck_claim_seconds} s or flagged (an irreversible effect whose "
            "outcome is unknown). They are never retried automatically.",
            f"Oldest running claim: {stuck.oldest_running_age_seconds:.0f} s.",
        ]
        if reconciled is not None and (reconciled.outcomes or reconciled.skipped):
            counts = reconciled.by_answer()
            body.append(
                f"Probed first: the providers answered done for {counts['done']} (settled), "
                f"not done for {counts['not_done']} (released for a retry) and unknown for "
                f"{counts['unknown']}; {reconciled.skipped} left unprobed for lack of time. "
                "Only what is still stuck is counted here."
            )
        next_steps = [
            "infrai-jobs claims stuck   # which keys, and why",
            "infrai-jobs claims show KEY   # its history and what its probe answered",
            "infrai-jobs claims resolve KEY --done   # after checking the downstream system",
        ]
    if verdict is Verdict.RESOLVED:
        subject = f"RESOLVED: {subject}"
        next_steps = []
    text = "\n".join(
        [*body, *(["", "Next:", *[f"  {s}" for s in next_steps]] if next_steps else [])]
    )
    return f"[infrai-jobs] {subject}"[:SNS_SUBJECT_LIMIT], text


class SnsAlerter:
    """Publishes to an SNS topic through boto3 (imported only when an alert is sent)."""

    def __init__(self, topic_arn: str, *, region: str | None = None) -> None:
        self._topic_arn, self._region = topic_arn, region
        self._client: Any = None

    def publish(self, subject: str, message: str) -> None:
        if self._client is None:
            import boto3  # noqa: PLC0415 - boto3 only when a feature needs it

            self._client = boto3.client("sns", region_name=self._region)
        self._client.publish(TopicArn=self._topic_arn, Subject=subject, Message=message)


class PrintingAlerter:
    """Locally: prints each alert, and keeps them for whoever asks."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str]] = []

    def publish(self, subject: str, message: str) -> None:
        self.sent.append((subject, message))
        print(f"ALERT {subject}\n{message}\n", flush=True)
