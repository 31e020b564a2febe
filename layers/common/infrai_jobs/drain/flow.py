"""Flow control in the drain (docs/flow-control.md): ``flow``'s policies and ledger, plugged in as
one ``DrainFeature``. Only jobs with a policy in force reach it (others make no extra round trip).
A job its limits hold back is deferred in one statement fenced by the claim's token; before and
after what it consumes, the drain runs due deferred jobs (``take_due``: never one another drain
holds) under a new token and lease on the same row."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import psycopg

from infrai_jobs.drain.batch import describe_error, run_handler
from infrai_jobs.drain.model import DrainFeature, DrainRun, DrainSummary, HandlerAttempt, NextDrain
from infrai_jobs.errors import (
    ConfigurationError,
    EffectUncertain,
    InvalidPayload,
    KeyDerivationError,
    LedgerError,
    PermanentJobError,
)
from infrai_jobs.flow import limits as flow_limits
from infrai_jobs.flow.policies import concurrency_value, is_final_error, next_delay
from infrai_jobs.jobs.policy import JobPolicy, RetryPolicy
from infrai_jobs.jobs.registry import Effect, JobContext, JobDefinition, JobRegistry, JsonValue
from infrai_jobs.queue_contract import MAX_RECEIVE_COUNT
from infrai_jobs.work import store as flow_ledger
from infrai_jobs.work.states import ClaimRow, JobRun, RunKind
from infrai_jobs.work.store import DeferOutcome, DeferredWork

logger = logging.getLogger(__name__)

# A job held back by its concurrency key is tried again this much later.
CONCURRENCY_RETRY_SECONDS = 1.0
# A rate-limit wait is taken in the invocation only when this much time is still left after it.
HANDLER_RESERVE_SECONDS = 2.0
# Deferred jobs taken from the ledger at a time.
DUE_BATCH = 10
# A job deferred by a limit, with no retry policy of its own: Infrai's three attempts.
LIMITED_JOB_RETRY = RetryPolicy(
    attempts=MAX_RECEIVE_COUNT, first_delay_seconds=30.0, factor=2.0, max_delay_seconds=300.0
)


def flow_control(
    registry: JobRegistry, policies: Mapping[str, JobPolicy], *, queue: str
) -> FlowControl | None:
    """The feature for the jobs with a policy in force (``JOB_POLICIES`` applied), or None."""
    if not policies:
        return None
    database = sorted(
        name
        for name in policies
        if (definition := registry.get(name)) is not None and definition.effect is Effect.DATABASE
    )
    if database:
        raise ConfigurationError(
            f"flow control applies to external jobs only; {', '.join(database)} "
            "(effect 'database') rolls back with its batch's transaction, so it keeps Infrai's "
            "three deliveries: remove its retry, rate and concurrency policy"
        )
    return FlowControl(policies, registry, queue=queue)


class FlowControl(DrainFeature):
    """Retry policies, rate limits and concurrency keys. Deliveries and deferred runs go through
    one port: every statement runs on the lane's own ledger connection (each ``work.store`` and
    ``flow.limits`` call a short transaction of its own), so flow control holds no connection."""

    def __init__(
        self, policies: Mapping[str, JobPolicy], registry: JobRegistry, *, queue: str
    ) -> None:
        self.policies = dict(policies)
        self._registry = registry
        self._queue = queue
        self._lock = threading.Lock()
        self._counters: Counter[str] = Counter()
        self._prepared: set[str] = set()

    def around_drain(self, run: DrainRun, next_drain: NextDrain) -> DrainSummary:
        counters: Counter[str] = Counter()
        self._run_due(run, counters)
        summary = next_drain(run)
        self._run_due(run, counters)
        with self._lock:
            counters.update(self._counters)
            self._counters.clear()
        summary.counters.update(counters)
        return summary

    def around_handler(self, attempt: HandlerAttempt, run: Callable[[], JobRun]) -> JobRun:
        if (policy := self.policies.get(attempt.ctx.job)) is None:
            return run()
        ctx = attempt.ctx
        try:
            self._prepare(attempt.derived.definition, policy)
        except Exception as exc:  # noqa: BLE001 - a job's own set-up failing is its transient failure
            return JobRun(RunKind.TRANSIENT, error=f"prepare: {describe_error(exc)}")
        try:
            conn = attempt.ledger.connection()
            wait, reason = self._gate(
                conn, ctx, policy, attempt.derived.payload, slot_token=attempt.claim_token
            )
        except LedgerError as exc:
            # Released, not deferred: its message carries the work, as without flow control.
            return JobRun(RunKind.TRANSIENT, error=f"flow control: {exc}")
        except InvalidPayload as exc:
            return JobRun(RunKind.PERMANENT, error=describe_error(exc))
        if wait is not None:
            return self._defer(
                conn, attempt, attempts=ctx.delivery_count - 1, error=reason, delay=wait
            )
        result = run()
        if policy.concurrency is not None:  # its settle frees the slot it took
            result = replace(result, held_slot=True)
        retry, attempts = policy.retry, ctx.delivery_count
        # Deferred at the first transient failure: the ledger then owns the work, so a drain dying
        # in a later attempt never spends the message's last delivery. Out of attempts: the DLQ.
        if result.kind is RunKind.TRANSIENT and retry is not None and attempts < retry.attempts:
            return self._defer(
                conn,
                attempt,
                attempts=attempts,
                error=result.error or "transient failure",
                delay=next_delay(retry, attempts),
                fallback=result,
            )
        return result

    def around_effect(
        self, ctx: JobContext, fingerprint: str, call: Callable[[], JsonValue]
    ) -> JsonValue:
        policy = self.policies.get(ctx.job)
        retry = policy.retry if policy is not None else None
        try:
            return call()
        except (PermanentJobError, EffectUncertain):
            raise
        except Exception as exc:
            if retry is not None and is_final_error(retry, exc):
                raise PermanentJobError(
                    f"final for its retry policy: {describe_error(exc)}"
                ) from exc
            raise

    def _prepare(self, definition: JobDefinition, policy: JobPolicy) -> None:
        """Ready a rate-limited job's client once, before its first start is reserved."""
        if policy.rate is None or definition.prepare is None:
            return
        with self._lock:
            if definition.name in self._prepared:
                return
            definition.prepare()
            self._prepared.add(definition.name)

    def _gate(
        self,
        conn: psycopg.Connection[Any],
        ctx: JobContext,
        policy: JobPolicy,
        payload: Mapping[str, Any],
        *,
        slot_token: uuid.UUID,
    ) -> tuple[float | None, str]:
        """Take the concurrency slot (held by ``slot_token``, the running claim's, until it is
        settled or its lease ends) and the rate-limit start, both in one round trip: (None, "")
        to run now, or (seconds, why) to run that much later."""
        if policy.rate is None and policy.concurrency is None:
            return None, ""  # a retry policy alone: no round trip
        limit = policy.concurrency
        key = (concurrency_value(limit, payload), limit.max_running) if limit else None
        fits = ctx.deadline - HANDLER_RESERVE_SECONDS - time.time()
        admission = flow_limits.admit(
            conn,
            ctx.job,
            token=slot_token,
            idem_key=ctx.idem_key,
            holder=ctx.message_id,
            concurrency=key,
            rate=policy.rate,
            max_wait=fits,
        )
        if not admission.slot_free and key is not None:
            return CONCURRENCY_RETRY_SECONDS, f"concurrency key {key[0]} has {key[1]} running"
        if not admission.start_fits and policy.rate is not None:
            return admission.wait, f"rate limit of {policy.rate.limit} starts reached"
        if admission.wait > 0:
            # Its start is reserved: the call leaves when it comes, not before.
            with self._lock:
                self._counters["rate_limit_waits"] += 1
            time.sleep(admission.wait)
        return None, ""

    def _defer(
        self,
        conn: psycopg.Connection[Any],
        attempt: HandlerAttempt,
        *,
        attempts: int,
        error: str,
        delay: float,
        fallback: JobRun | None = None,
    ) -> JobRun:
        """Record the work and release its claim in one transaction; failing that, ``fallback``
        (a released claim: its message carries the work)."""
        ctx, derived = attempt.ctx, attempt.derived
        work = DeferredWork(
            idem_key=ctx.idem_key,
            job=ctx.job,
            effect=derived.definition.effect.value,
            payload=derived.payload,
            message_id=ctx.message_id,
            fingerprint=derived.fingerprint,
            queue=self._queue,
        )
        unchanged = fallback or JobRun(RunKind.TRANSIENT, error=error)
        try:
            outcome = flow_ledger.defer(
                conn,
                work,
                attempts=max(attempts, 0),
                error=error,
                delay_seconds=delay,
                claim_token=attempt.claim_token,
            )
        except LedgerError as exc:
            msg = "could not defer a job; its message carries it on"
            self._ledger_failed(msg, "defer_failed", exc, idem_key=ctx.idem_key)
            return unchanged
        if outcome is DeferOutcome.CLAIM_LOST:
            return unchanged
        return JobRun(RunKind.DEFERRED, error=f"runs again in {delay:.1f} s: {error}")

    def _run_due(self, run: DrainRun, counters: Counter[str]) -> None:
        lease = run.config.batch_budget_ms / 1000 + run.config.lease_grace_seconds
        jobs = sorted(self.policies)
        while run.time_left_ms() > run.config.batch_budget_ms and not run.stop_requested():
            try:
                conn = run.ledger.connection()
                due = flow_ledger.take_due(conn, DUE_BATCH, lease_seconds=lease, jobs=jobs)
            except LedgerError as exc:
                self._ledger_failed("could not take deferred jobs", "deferred_take_failed", exc)
                return
            if not due:
                return
            for job in due:
                try:
                    self._run_one(conn, job, run, counters)
                except LedgerError as exc:
                    # Its lease runs out; a non-external job is taken again after it.
                    msg, key = "could not settle a deferred job", job.idem_key
                    self._ledger_failed(msg, "deferred_settle_failed", exc, idem_key=key)
                    return

    def _run_one(
        self, conn: psycopg.Connection[Any], job: ClaimRow, run: DrainRun, counters: Counter[str]
    ) -> None:
        assert job.claim_token is not None  # take_due leases every job it returns
        token = job.claim_token
        try:
            derived = self._registry.derive(job.payload)
        except (KeyDerivationError, ConfigurationError) as exc:
            self._fail(conn, job, f"cannot run: {exc}", counters)
            return
        if derived.idem_key != job.idem_key:
            self._fail(
                conn, job, f"its payload now derives another key ({derived.idem_key})", counters
            )
            return
        policy = self.policies.get(derived.definition.name, JobPolicy())
        ctx = JobContext(
            idem_key=job.idem_key,
            job=derived.definition.name,
            message_id=job.message_id,
            delivery_count=job.attempts or 1,
            deadline=time.time() + run.config.batch_budget_ms / 1000,
            settings=derived.settings,
            secrets=derived.secrets,
        )
        try:
            self._prepare(derived.definition, policy)
        except Exception as exc:  # noqa: BLE001 - a job's own set-up failing is its transient failure
            flow_ledger.postpone(
                conn,
                job.idem_key,
                token,
                error=f"prepare: {describe_error(exc)}",
                delay_seconds=CONCURRENCY_RETRY_SECONDS,
                ran=False,
            )
            return
        try:
            wait, reason = self._gate(conn, ctx, policy, derived.payload, slot_token=token)
        except InvalidPayload as exc:
            self._fail(conn, job, describe_error(exc), counters)
            return
        if wait is not None:
            # It did not run: the attempt take_due counted is given back.
            flow_ledger.postpone(
                conn, job.idem_key, token, error=None, delay_seconds=wait, ran=False
            )
            logger.info(
                "a deferred job waits for its limit",
                extra={"action": "deferred_held", "idem_key": job.idem_key, "detail": reason},
            )
            return
        # An external run is marked begun before its call: were its drain to die after this,
        # its effect may have happened and it is never taken again; before this, it is. A run
        # that lost its claim did so at the end of its lease, which its slot's ends with.
        if job.effect == Effect.EXTERNAL.value and not flow_ledger.begin(conn, job.idem_key, token):
            return
        counters["deferred_ran"] += 1
        result = run_handler(derived, ctx, run.config.features)
        self._settle(conn, job, result, policy.retry or LIMITED_JOB_RETRY, counters)

    def _settle(
        self,
        conn: psycopg.Connection[Any],
        job: ClaimRow,
        result: JobRun,
        retry: RetryPolicy,
        counters: Counter[str],
    ) -> None:
        assert job.claim_token is not None
        token = job.claim_token
        if result.kind is RunKind.SUCCEEDED:
            if flow_ledger.finish(conn, job.idem_key, token, result.result):
                counters["deferred_done"] += 1
            return
        error = result.error or result.kind.value
        if result.kind is RunKind.PERMANENT:
            self._fail(conn, job, error, counters)
        elif result.kind is RunKind.UNCERTAIN and job.effect == Effect.EXTERNAL.value:
            # Never repeated: flagged, it stays running, and no drain takes it again.
            flow_ledger.flag_uncertain(conn, job.idem_key, token, error)
            logger.error(
                "a deferred external job's outcome is unknown: it stays running for a human",
                extra={"action": "deferred_stuck", "idem_key": job.idem_key, "detail": error},
            )
        elif (attempts := job.attempts or 1) >= retry.attempts:
            self._fail(conn, job, f"out of attempts ({attempts}): {error}", counters)
        else:
            flow_ledger.postpone(
                conn, job.idem_key, token, error=error, delay_seconds=next_delay(retry, attempts)
            )

    def _fail(
        self, conn: psycopg.Connection[Any], job: ClaimRow, reason: str, counters: Counter[str]
    ) -> None:
        assert job.claim_token is not None
        if flow_ledger.fail(conn, job.idem_key, job.claim_token, reason):
            counters["deferred_failed"] += 1
            logger.error(
                "deferred job failed",
                extra={"action": "deferred_failed", "idem_key": job.idem_key, "detail": reason},
            )

    def _ledger_failed(self, message: str, action: str, exc: LedgerError, **fields: str) -> None:
        # A broken connection is reopened by the ledger on its next use.
        logger.warning(message, extra={"action": action, **fields, "detail": str(exc)})
