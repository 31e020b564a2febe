"""One batch: derive every message's key, claim, run and settle by effect class, and decide each
message's ``Outcome`` (``infrai_jobs.work.outcomes``). One bad message never stops the others."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, Any

import psycopg

from infrai_jobs.drain.model import HandlerAttempt
from infrai_jobs.errors import (
    ConfigurationError,
    EffectUncertain,
    KeyDerivationError,
    LedgerError,
    PermanentJobError,
)
from infrai_jobs.jobs.correlation import NO_CORRELATION, Correlation, log_fields, read_correlation
from infrai_jobs.jobs.registry import DerivedJob, Effect, JobContext, JobRegistry, JsonValue
from infrai_jobs.queue.models import QueueMessage
from infrai_jobs.work.outcomes import (
    ACKED_OUTCOMES,
    CLAIM_OUTCOMES,
    OUTCOME_RULES,
    SETTLE_OUTCOMES,
    Outcome,
)
from infrai_jobs.work.ports import LedgerPort
from infrai_jobs.work.states import (
    ClaimDecision,
    ClaimRequest,
    ClaimStatus,
    JobRun,
    RunKind,
    Settlement,
)

if TYPE_CHECKING:
    from infrai_jobs.drain.model import DrainConfig, DrainFeature

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class MessageResult:
    message: QueueMessage
    outcome: Outcome
    idem_key: str | None = None
    job: str | None = None
    detail: str = ""
    # As its ClaimDecision's takeover and redelivered_early_after (work.states) said.
    takeover: bool = False
    visibility_mismatch: bool = False
    # The producer's correlation id and traceparent, from the message's envelope.
    correlation: Correlation = NO_CORRELATION
    exception: BaseException | None = field(default=None, compare=False)  # as JobRun's

    @property
    def ack(self) -> bool:
        return self.outcome in ACKED_OUTCOMES


def process_batch(
    messages: Sequence[QueueMessage],
    ledger: LedgerPort,
    registry: JobRegistry,
    deadline: float,
    config: DrainConfig,
    *,
    visible_until: float | None = None,
    clock: Callable[[], float] = time.time,
) -> list[MessageResult]:
    """Decide every message of one batch. ``visible_until`` (``clock`` seconds): when the queue
    may deliver them again, which no lease outlives (None: a visibility timeout from the claim)."""
    return _Batch(messages, ledger, registry, deadline, config, visible_until, clock).process()


@dataclass(slots=True)
class _Batch:
    messages: Sequence[QueueMessage]
    ledger: LedgerPort
    registry: JobRegistry
    deadline: float
    config: DrainConfig
    visible_until: float | None
    clock: Callable[[], float]
    results: dict[str, MessageResult] = field(init=False, default_factory=dict)
    # Each key's judged message (at first its first one); the key's other copies follow it.
    primaries: dict[str, tuple[QueueMessage, DerivedJob]] = field(init=False, default_factory=dict)
    copies: list[tuple[QueueMessage, DerivedJob]] = field(init=False, default_factory=list)
    # Per key, the messages judged; the copies found holding their key's claim, judged next.
    judged: dict[str, set[str]] = field(init=False, default_factory=dict)
    holders: dict[str, tuple[QueueMessage, DerivedJob]] = field(init=False, default_factory=dict)
    # Messages back while their own claim's lease was live: the seconds since they claimed.
    early: dict[str, float] = field(init=False, default_factory=dict)
    takeovers: set[str] = field(init=False, default_factory=set)
    # Each message's correlation (messages whose envelope carries one only).
    correlations: dict[str, Correlation] = field(init=False, default_factory=dict)
    # Set once a claim failed for the ledger: the rest of the batch is not tried.
    ledger_failed: str = field(init=False, default="")

    def process(self) -> list[MessageResult]:
        self._derive_keys()
        keys = list(self.primaries)
        while keys:
            requests = [self._request(key) for key in keys]
            self._run_database([r for r in requests if r.effect is Effect.DATABASE])
            self._run_external([r for r in requests if r.effect is not Effect.DATABASE])
            keys = self._judge_holders_next()
        self._mirror_copies()
        return [self.results[m.message_id] for m in self.messages]

    def _derive_keys(self) -> None:
        for message in self.messages:
            correlation = read_correlation(
                message.payload,
                message_id=message.message_id,
                delivery_count=message.delivery_count,
            )
            if correlation is not NO_CORRELATION:
                self.correlations[message.message_id] = correlation
            try:
                derived = self.registry.derive(message.payload)
            except (KeyDerivationError, ConfigurationError) as exc:
                # The job's configuration error, not the batch's: this message walks to the DLQ.
                self._set(MessageResult(message, Outcome.REJECTED, detail=str(exc)))
                continue
            if derived.idem_key in self.primaries:
                self.copies.append((message, derived))
            else:
                self.primaries[derived.idem_key] = (message, derived)

    def _request(self, key: str) -> ClaimRequest:
        message, derived = self.primaries[key]
        self.judged.setdefault(key, set()).add(message.message_id)
        effect, now = derived.definition.effect, self.clock()
        return ClaimRequest(
            idem_key=key,
            message_id=message.message_id,
            job=derived.definition.name,
            effect=effect,
            fingerprint=derived.fingerprint,
            # How long the run may take, as a span: the ledger sets its end on its own clock.
            lease_seconds=(
                None
                if effect is Effect.DATABASE
                else self.deadline - now + self.config.lease_grace_seconds
            ),
            visibility_left=None if self.visible_until is None else self.visible_until - now,
        )

    def _run(self, request: ClaimRequest, db: psycopg.Connection[Any] | None) -> JobRun:
        message, derived = self.primaries[request.idem_key]
        correlation = self.correlations.get(message.message_id, NO_CORRELATION)
        ctx = JobContext(
            idem_key=request.idem_key,
            job=derived.definition.name,
            message_id=message.message_id,
            delivery_count=message.delivery_count,
            deadline=self.deadline,
            db=db,
            settings=derived.settings,
            secrets=derived.secrets,
            correlation_id=correlation.correlation_id,
            traceparent=correlation.traceparent,
        )
        features = self.config.features
        # Only an external job's effect is wrapped: a database job's rolls back with its claim.
        effect_features = features if request.effect is not Effect.DATABASE else ()
        run = partial(run_handler, derived, ctx, effect_features)
        attempt = HandlerAttempt(ctx, derived, request.claim_token, self.ledger)
        for feature in reversed(features):
            run = partial(feature.around_handler, attempt, run)
        return run()

    def _run_database(self, requests: list[ClaimRequest]) -> None:
        """Claim, run and settle in one transaction for the whole batch."""
        if not requests:
            return
        try:
            decisions, settlements = self.ledger.run_database_batch(requests, self._run)
        except LedgerError as exc:
            self._unavailable(requests, str(exc))
            return
        self._record(decisions, settlements)

    def _run_external(self, requests: list[ClaimRequest]) -> None:
        """Commit claims, then run and settle each job. Key-passing jobs are claimed together (a
        later delivery takes a claim over once its lease ends); irreversible ones one by one, so
        a crash leaves for a human only the claim whose call had begun."""
        if idempotent := [r for r in requests if r.effect is Effect.EXTERNAL_IDEMPOTENT]:
            self._claim_and_run(idempotent)
        for request in (r for r in requests if r.effect is Effect.EXTERNAL):
            if self.ledger_failed:
                self._unavailable([request], self.ledger_failed)
            else:
                self._claim_and_run([request])

    def _claim_and_run(self, requests: list[ClaimRequest]) -> None:
        try:
            decisions = self.ledger.claim(requests)
        except LedgerError as exc:
            self.ledger_failed = str(exc)
            self._unavailable(requests, self.ledger_failed)
            return
        self.takeovers |= {d.request.idem_key for d in decisions if d.takeover}
        settlements: list[Settlement] = []
        for decision in decisions:
            if decision.status is not ClaimStatus.WON:
                continue
            run = self._run(decision.request, None)
            try:
                settlements.append(self.ledger.settle(decision.request, run))
            except LedgerError as exc:
                # The effect may have happened and its claim stays running: a human decides.
                outcome = Outcome.STUCK if run.kind is not RunKind.TRANSIENT else Outcome.RETRY
                detail = f"handler {run.kind}, then settling failed: {exc}"
                self._set_for(decision.request, outcome, detail, run.exception)
        self._record(decisions, settlements)

    def _unavailable(self, requests: list[ClaimRequest], detail: str) -> None:
        for request in requests:
            self._set_for(request, Outcome.LEDGER_UNAVAILABLE, detail)

    def _record(
        self, decisions: Sequence[ClaimDecision], settlements: Sequence[Settlement]
    ) -> None:
        stuck_reasons: dict[str, str] = {}
        for decision in decisions:
            self._note_early_redelivery(decision)
            outcome = CLAIM_OUTCOMES.get(decision.status)
            if outcome is None:  # WON: its settlement decides
                if decision.takeover:
                    self.takeovers.add(decision.request.idem_key)
                continue
            if self._held_by_a_copy(decision):
                continue  # the holder is judged next; this message follows it
            if outcome is Outcome.STUCK:
                stuck_reasons[decision.request.idem_key] = decision.detail
            self._set_for(decision.request, outcome, decision.detail)
        for s in settlements:
            self._set_for(s.request, SETTLE_OUTCOMES[s.status], s.run.error, s.run.exception)
        if stuck_reasons:
            try:
                self.ledger.flag_stuck(stuck_reasons)
            except LedgerError as exc:
                logger.warning(
                    "could not flag stuck claims",
                    extra={"action": "flag_failed", "detail": str(exc)},
                )

    def _held_by_a_copy(self, decision: ClaimDecision) -> bool:
        """Whether another copy of this key in the batch holds its claim: it is judged next, as
        the key's own redelivery (docs/design.md, "Copies follow the claim's holder")."""
        key = decision.request.idem_key
        holder = decision.holder
        if holder is None or holder in self.judged.get(key, ()):
            return False
        for copy in self.copies:
            if copy[0].message_id == holder and copy[1].idem_key == key:
                self.holders[key] = copy
                return True
        return False

    def _judge_holders_next(self) -> list[str]:
        """Make each copy found holding its key's claim that key's judged message."""
        for key, holder in self.holders.items():
            self.copies.remove(holder)
            self.copies.append(self.primaries[key])
            self.primaries[key] = holder
        keys = list(self.holders)
        self.holders.clear()
        return keys

    def _note_early_redelivery(self, decision: ClaimDecision) -> None:
        if (seconds := decision.redelivered_early_after) is None:
            return
        message = decision.request.message_id
        self.early[message] = seconds
        logger.error(
            "message %s came back %.0f s after it claimed, while its claim's lease was live: "
            "the queue hides messages for less time than the drain's visibility timeout "
            "(%d s, INFRAI_VISIBILITY_TIMEOUT_SECONDS) says",
            message,
            seconds,
            self.config.visibility_timeout_seconds,
            extra={
                "action": "visibility_mismatch",
                "idem_key": decision.request.idem_key,
                "message_id": message,
                "job": decision.request.job,
                "visibility_timeout_seconds": self.config.visibility_timeout_seconds,
                "redelivered_after_seconds": round(seconds, 1),
                **log_fields(self.correlations.get(message, NO_CORRELATION)),
            },
        )

    def _mirror_copies(self) -> None:
        """A second copy of a key in the same batch never runs; it follows the first."""
        for message, derived in self.copies:
            first_message, first_derived = self.primaries[derived.idem_key]
            first = self.results[first_message.message_id]
            if derived.fingerprint != first_derived.fingerprint:
                outcome = Outcome.CONFLICT
                detail = f"same key as {first_message.message_id} in this batch, different work"
            elif first.ack or first.outcome is Outcome.RETRY:
                # The first copy's message carries the work (or its retries) from here on.
                outcome = Outcome.IN_FLIGHT
                detail = f"copy of {first_message.message_id} in the same batch"
            else:
                outcome = Outcome.BATCH_DUPLICATE
                detail = f"copy of {first_message.message_id}, which ended {first.outcome}"
            job = derived.definition.name
            self._set(MessageResult(message, outcome, derived.idem_key, job, detail))

    def _set_for(
        self, request: ClaimRequest, outcome: Outcome, detail: str, exc: BaseException | None = None
    ) -> None:
        key = request.idem_key
        message, derived = self.primaries[key]
        takeover, early = key in self.takeovers, message.message_id in self.early
        if takeover:
            detail = f"lease takeover; {detail}" if detail else "lease takeover"
        job = derived.definition.name
        self._set(MessageResult(message, outcome, key, job, detail, takeover, early, exception=exc))

    def _set(self, result: MessageResult) -> None:
        # The first decision about a message stands (a settle failure is recorded first).
        message_id = result.message.message_id
        if message_id not in self.results:
            if (correlation := self.correlations.get(message_id)) is not None:
                result = replace(result, correlation=correlation)
            self.results[message_id] = result
            level, action = OUTCOME_RULES[result.outcome].level, result.outcome.value
            log_message(
                logger, level, "message %s", result, action, detail=result.detail, acked=result.ack
            )


def run_handler(
    derived: DerivedJob, ctx: JobContext, features: Sequence[DrainFeature] = ()
) -> JobRun:
    """Run one handler through each feature's ``around_effect`` (the first outermost) and turn
    whatever it does into a ``JobRun``: the one place that catches every exception."""
    call: Callable[[], JsonValue] = partial(derived.definition.handler, derived.payload, ctx)
    for feature in reversed(features):
        call = partial(feature.around_effect, ctx, derived.fingerprint, call)
    try:
        result = call()
    except Exception as exc:  # noqa: BLE001 - the one place a handler's failure becomes an outcome
        kind = next((k for t, k in _FAILURE_KINDS if isinstance(exc, t)), RunKind.TRANSIENT)
        return JobRun(kind, error=describe_error(exc), exception=exc)
    return JobRun(RunKind.SUCCEEDED, result=_jsonable(result))


_FAILURE_KINDS = ((PermanentJobError, RunKind.PERMANENT), (EffectUncertain, RunKind.UNCERTAIN))


def log_message(
    log: logging.Logger,
    level: int,
    text: str,
    result: MessageResult,
    action: str,
    *,
    detail: str,
    **fields: object,
) -> None:
    """One line about a message (its outcome, or its ack's), naming its key, job and correlation;
    an outcome's, with what its handler raised and its traceback (no acked outcome has one)."""
    extra = {
        "action": action,
        "idem_key": result.idem_key,
        "message_id": result.message.message_id,
        "delivery_count": result.message.delivery_count,
        "job": result.job,
        **fields,
        "detail": detail,
        **log_fields(result.correlation),
    }
    log.log(level, text, action, exc_info=result.exception, extra=extra)


def describe_error(exc: BaseException) -> str:
    text = storable_text(f"{type(exc).__name__}: {exc}")
    return text if len(text) <= 2000 else text[:1997] + "..."


def storable_text(text: str) -> str:
    """Text PostgreSQL accepts: no NUL characters, no lone surrogates."""
    return text.replace("\x00", "\ufffd").encode("utf-8", "replace").decode("utf-8")


# Built once: json.dumps with any option builds a new encoder per call (about 1.5 µs).
_RESULT_JSON = json.JSONEncoder(allow_nan=False, ensure_ascii=False)


def _jsonable(result: JsonValue) -> JsonValue:
    """The handler's result as jsonb can store it. The effect has happened, so a result that
    cannot be stored is replaced by a printable description, never turned into a retry."""
    try:
        text = _RESULT_JSON.encode(result)
        text.encode("utf-8")  # lone surrogates
        storable = "\\u0000" not in text  # jsonb refuses the NUL escape
    except (TypeError, ValueError, RecursionError):
        storable = False
    return result if storable else {"unserializable_result": _safe_repr(result)}


def _safe_repr(value: object) -> str:
    try:
        text = repr(value)
    except RecursionError:
        text = f"<{type(value).__name__} nested too deeply to print>"
    return storable_text(text[:1000])
