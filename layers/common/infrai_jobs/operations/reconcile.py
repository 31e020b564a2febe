"""Reconcile before paging: ask the provider about the stuck claims of jobs with a probe
(``infrai_jobs.jobs.probes``), and act on what it knows, fenced by the claim token it was asked
about; what each answer does, and how it is recorded: docs/operations.md, "Stuck claims"."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Final

from infrai_jobs.errors import ClaimChanged, ConfigurationError, SecondLayerUnavailable
from infrai_jobs.jobs.keys import identity_from_key
from infrai_jobs.jobs.probes import (
    ANSWERS,
    DONE,
    NOT_DONE,
    UNKNOWN,
    Done,
    NotDone,
    ProbeAnswer,
    Unknown,
)
from infrai_jobs.jobs.registry import JobContext, JobRegistry
from infrai_jobs.work.admin import ReconcileWrite, WorkStore
from infrai_jobs.work.states import ClaimRow

logger = logging.getLogger(__name__)

# How long one probe may take before its answer counts as unknown.
PROBE_TIMEOUT_SECONDS: Final = 10.0

# The reason given for a row that records no job, under its lease (``Reconciler.probe``).
_NO_JOB: Final = "no probe asked: the row records no job, and its worker's lease is live"

# How much of a probe's reason or result a history note keeps.
_NOTE_DETAIL_CHARS: Final = 500


@dataclass(frozen=True, slots=True)
class ProbeOutcome:
    idem_key: str
    job: str
    answer: str
    detail: Any  # the provider's result (done) or the reason (unknown)
    action: str  # a ``ReconcileWrite`` value, or in a dry run what the answer would do


@dataclass
class ReconcileReport:
    outcomes: list[ProbeOutcome] = field(default_factory=list)
    # Candidates left unprobed because the pass ran out of time (still stuck).
    skipped: int = 0
    dry_run: bool = False

    def by_answer(self) -> dict[str, int]:
        """How many claims got each answer (every answer present, zero included)."""
        counts = Counter(outcome.answer for outcome in self.outcomes)
        return {answer: counts[answer] for answer in ANSWERS}

    def as_dict(self) -> dict[str, Any]:
        report = {"dry_run": self.dry_run, "by_answer": self.by_answer(), "skipped": self.skipped}
        return {**report, "claims": [asdict(outcome) for outcome in self.outcomes]}


def history_note(answer: str, detail: Any) -> str:
    """The ``claim_history`` note of one answer: the answer first, then what came with it."""
    if answer == UNKNOWN:
        return f"{UNKNOWN}: {str(detail)[:_NOTE_DETAIL_CHARS]}"
    if answer == DONE:
        text = json.dumps(detail, default=str, ensure_ascii=False)
        cut = text if len(text) <= _NOTE_DETAIL_CHARS else text[: _NOTE_DETAIL_CHARS - 3] + "..."
        return f"{DONE}: provider result {cut}"
    return f"{NOT_DONE}: the provider has no trace of it"


def ask(
    probe: Callable[..., Any], payload: Mapping[str, Any], ctx: JobContext, timeout: float
) -> ProbeAnswer:
    """Run one probe on its own thread for ``timeout`` s at most; a failure is an ``Unknown``."""
    box: list[ProbeAnswer] = []

    def run() -> None:
        try:
            answer = probe(payload, ctx)
        # The one place a probe's failure becomes an answer, as the drain does for a handler.
        except Exception as exc:  # noqa: BLE001
            box.append(Unknown(f"the probe raised {type(exc).__name__}: {exc}"))
            return
        if not isinstance(answer, Done | NotDone | Unknown):
            answer = Unknown(
                f"the probe answered {type(answer).__name__}, not Done, NotDone or Unknown"
            )
        box.append(answer)

    # A daemon thread: a probe stuck in a call cannot hold the function past its own timeout.
    worker = threading.Thread(target=run, name=f"probe {ctx.idem_key}", daemon=True)
    worker.start()
    worker.join(timeout)
    return box[0] if box else Unknown(f"the probe did not answer within {timeout:g} s")


class Reconciler:
    """Probes stuck claims and acts on the answers as ``actor``. ``forget`` (the second layer's)
    drops a key's stored "uncertain" before its release, or the retry would be parked again."""

    def __init__(
        self,
        admin: WorkStore,
        registry: JobRegistry,
        *,
        actor: str,
        probe_timeout: float = PROBE_TIMEOUT_SECONDS,
        forget: Callable[[str], None] | None = None,
    ) -> None:
        self.admin, self._registry, self._actor = admin, registry, actor
        self._probe_timeout, self._forget = probe_timeout, forget

    def probed_jobs(self) -> list[str]:
        return [job.name for job in self._registry if job.probe is not None]

    def run_all(
        self, *, threshold_seconds: int, limit: int = 100, budget_seconds: float | None = None
    ) -> ReconcileReport:
        """Probe every stuck claim of a job with a probe (up to ``limit``, oldest first), while
        ``budget_seconds`` lasts; the rest stay stuck, counted as ``skipped``."""
        report = ReconcileReport()
        jobs = self.probed_jobs()
        if not jobs:
            return report
        candidates = self.admin.stuck(jobs, threshold_seconds=threshold_seconds, limit=limit)
        ends = None if budget_seconds is None else time.monotonic() + budget_seconds
        for index, claim in enumerate(candidates):
            if ends is not None and time.monotonic() + self._probe_timeout > ends:
                report.skipped = len(candidates) - index
                break
            report.outcomes.append(self.reconcile(claim))
        return report

    def probe(self, claim: ClaimRow) -> tuple[ProbeAnswer, Any]:
        """Ask ``claim``'s probe, changing nothing: its answer, and the result or reason with it.
        A row that records no job (the field notes' worker's) has none: unknown under its lease,
        when no answer could change anything, and refused (``ClaimChanged``) after it."""
        key = claim.idem_key
        if claim.job is None and claim.lease_live is not False:
            return Unknown(_NO_JOB), _NO_JOB
        if claim.job is None:
            raise ClaimChanged(
                f"claim {key!r} was written by a worker that records no job (as the field notes' "
                "Node worker does), so no probe can be chosen; its lease (claim time + visibility) "
                f"is over: check the provider, then `infrai-jobs claims resolve {key} --done` or "
                f"`--failed --error TEXT`, or `infrai-jobs claims release {key}` to run it again"
            )
        definition = self._registry.get(claim.job)
        if definition is None or definition.probe is None:
            raise ConfigurationError(
                f"claim {key!r} is of job {claim.job!r}, which declares no reconcile "
                "probe: check the provider, then `infrai-jobs claims resolve`"
            )
        job = definition.name
        identity = identity_from_key(job, definition.identity, key) or {}
        ctx = JobContext(
            idem_key=key,
            job=job,
            message_id=claim.message_id,
            delivery_count=0,
            deadline=time.time() + self._probe_timeout,
            settings=self._registry.settings_of(job),
            secrets=self._registry.secrets_of(job),
        )
        answer = ask(definition.probe, {"job": job, **identity}, ctx, self._probe_timeout)
        detail = answer.result if isinstance(answer, Done) else getattr(answer, "reason", None)
        return answer, detail

    def reconcile(self, claim: ClaimRow) -> ProbeOutcome:
        """Probe one stuck claim (a delivery's, or deferred work's) and act on the answer."""
        (answer, detail), key, job = self.probe(claim), claim.idem_key, claim.job or ""
        if claim.job is None:  # under its lease: nothing was asked, and nothing may change
            return ProbeOutcome(key, job, answer.answer, detail, ReconcileWrite.LEASE_LIVE.value)
        extra = {"idem_key": key, "job": job, "answer": answer.answer}
        # The lease as the database judged it when the claim was read; the write is fenced
        # again on its clock.
        if isinstance(answer, NotDone) and self._forget is not None and claim.lease_live is False:
            # Before the release, as `claims release` does. Under a live lease nothing is
            # released. A store that cannot be reached leaves the claim unchanged, still stuck
            # (and paged), rather than released in the ledger only; the pass goes on.
            try:
                self._forget(key)
            except SecondLayerUnavailable as exc:
                unchanged = ReconcileWrite.UNCHANGED.value
                logger.warning(
                    "stuck claim left stuck: the second layer could not drop its record",
                    extra={"action": "reconciled", "write": unchanged, "detail": str(exc), **extra},
                )
                return ProbeOutcome(key, job, answer.answer, str(exc), unchanged)
        settled = detail if isinstance(answer, Done) else None
        note = history_note(answer.answer, detail)
        write = self.admin.apply_probe_answer(
            claim, answer.answer, result=settled, actor=self._actor, note=note
        )
        # Only a change is a reconcile (under a live lease, or on a claim that moved on, none is).
        logged = {"action": "reconciled", "write": write.value, **extra}
        if write in (ReconcileWrite.SETTLED, ReconcileWrite.RELEASED):
            logger.info("stuck claim reconciled", extra=logged)
        elif write is ReconcileWrite.UNCHANGED:
            logger.warning("stuck claim left stuck: its probe could not say", extra=logged)
        return ProbeOutcome(key, job, answer.answer, detail, write.value)
