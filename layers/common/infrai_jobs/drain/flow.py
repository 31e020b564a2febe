"""Flow control in the drain: ``flow``'s policies and ledger, plugged in as one ``DrainFeature``.

Only jobs with a policy in force (``@job(retry=, rate=, concurrency=)``, or ``JOB_POLICIES``)
reach this module; every other job runs exactly as it would without it, with no extra round
trip. Around each handler run of such a job:

1. its concurrency key takes one of the key's slots, or the job is deferred;
2. its rate limit reserves a start, waiting for it when the wait fits the invocation;
   otherwise the job is deferred;
3. a transient failure of a job with a retry policy and attempts left is deferred at once, so
   an outage longer than Infrai's three deliveries, or a drain killed during a later attempt,
   never sends a job with attempts left to the DLQ.

A deferral turns the claim into deferred work (payload, attempts, next run) in one statement
fenced by the claim's token; then the message is acked, and a copy of it is a duplicate
(the claim statement sees the work the ledger holds). Around the invocation, the drain takes
the due deferred jobs (``take_due``: never one another drain holds) and runs them under the
same time budget, before and after what it consumes, each under a new token and lease on the
same row.

An ``external`` job's effect is never repeated when its outcome is unknown: an uncertain run
is flagged and stays ``running``, and a run that began and whose lease ran out is never taken
again, so ``claims stuck`` and the watcher find it for a human. Database jobs keep Infrai's
deliveries: their effect rolls back with the batch's transaction, which a deferral cannot
join, so a policy on one is a configuration error.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import psycopg

from infrai_jobs.drain.batch import describe_error, run_handler
from infrai_jobs.drain.model import (
    DrainFeature,
    DrainRun,
    DrainSummary,
    HandlerAttempt,
    NextDrain,
)
from infrai_jobs.errors import (
    ConfigurationError,
    EffectUncertain,
    InvalidPayload,
    KeyDerivationError,
    LedgerError,
    PermanentJobError,
)
from infrai_jobs.flow import ledger as flow_ledger
from infrai_jobs.flow import limits as flow_limits
from infrai_jobs.flow.ledger import DeferOutcome, DeferredWork
from infrai_jobs.flow.policies import concurrency_value, is_final_error, next_delay
from infrai_jobs.jobs.policy import JobPolicy, RetryPolicy
from infrai_jobs.jobs.registry import Effect, JobContext, JobDefinition, JobRegistry, JsonValue
from infrai_jobs.ledger.claims import ClaimRow, JobRun, RunKind
from infrai_jobs.queue_contract import MAX_RECEIVE_COUNT

logger = logging.getLogger(__name__)

# A job held back by its concurrency key is tried again this much later.
CONCURRENCY_RETRY_SECONDS = 1.0
# A rate-limit wait is taken in the invocation only when this much time is still left after it.
HANDLER_RESERVE_SECONDS = 2.0
# Deferred jobs taken from the ledger at a time.
DUE_BATCH = 10
# A job deferred by a limit, with no retry policy of its own, gets Infrai's three attempts in
# the ledger, a visibility timeout apart at most.
LIMITED_JOB_RETRY = RetryPolicy(
    attempts=MAX_RECEIVE_COUNT, first_delay_seconds=30.0, factor=2.0, max_delay_seconds=300.0
)


def flow_control(
    registry: JobRegistry,
    policies: Mapping[str, JobPolicy],
    connect: Callable[[], psycopg.Connection[Any]],
    *,
    queue: str,
) -> FlowControl | None:
    """The feature for ``registry``'s jobs with a policy in force (``policies``: what the code
    declares, with ``JOB_POLICIES`` applied), or None when no job has one."""
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
    return FlowControl(
        policies,
        registry,
        connect,
        queue=queue,
    )


class FlowControl(DrainFeature):
    """Retry policies past Infrai's deliveries, rate limits and concurrency keys (see above).

    Each lane's thread gets its own connection to the ledger's database (autocommit; every
    ``flow.ledger`` call is a short transaction of its own)."""

    def __init__(
        self,
        policies: Mapping[str, JobPolicy],
        registry: JobRegistry,
        connect: Callable[[], psycopg.Connection[Any]],
        *,
        queue: str,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.policies = dict(policies)
        self._registry = registry
        self._connect = connect
        self._queue = queue
        self._clock = clock
        self._sleep = sleep
        self._local = threading.local()
        self._lock = threading.Lock()
        self._opened: list[psycopg.Connection[Any]] = []
        self._counters: Counter[str] = Counter()
        self._prepared: set[str] = set()

    # --- the hooks ------------------------------------------------------------------------

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
        policy = self.policies.get(attempt.ctx.job)
        if policy is None:
            return run()
        ctx = attempt.ctx
        try:
            self._prepare(attempt.derived.definition, policy)
        except Exception as exc:  # noqa: BLE001 - a job's own set-up failing is its transient failure
            return JobRun(RunKind.TRANSIENT, error=f"prepare: {describe_error(exc)}")
        try:
            conn = self._conn()
            slot, wait, reason = self._gate(
                conn,
                ctx,
                policy,
                attempt.derived.payload,
                slot_token=attempt.claim_token,
            )
        except LedgerError as exc:
            self._drop()
            # Released, not deferred: its message carries the work, as without flow control.
            return JobRun(RunKind.TRANSIENT, error=f"flow control: {exc}")
        except InvalidPayload as exc:
            return JobRun(RunKind.PERMANENT, error=describe_error(exc))
        if wait is not None:
            return self._defer(
                conn, attempt, attempts=ctx.delivery_count - 1, error=reason, delay=wait
            )
        try:
            result = run()
        finally:
            if slot:
                self._release_slot(conn, attempt.claim_token)
        if result.kind is RunKind.TRANSIENT and policy.retry is not None:
            delay = self._deferral_delay(policy.retry, ctx.delivery_count)
            if delay is not None:
                return self._defer(
                    conn,
                    attempt,
                    attempts=ctx.delivery_count,
                    error=result.error or "transient failure",
                    delay=delay,
                    fallback=result,
                )
        return result

    def around_effect(
        self, ctx: JobContext, fingerprint: str, call: Callable[[], JsonValue]
    ) -> JsonValue:
        policy = self.policies.get(ctx.job)
        retry = policy.retry if policy is not None else None
        if retry is None or not retry.final_errors:
            return call()
        try:
            return call()
        except (PermanentJobError, EffectUncertain):
            raise
        except Exception as exc:
            if is_final_error(retry, exc):
                raise PermanentJobError(
                    f"final for its retry policy: {describe_error(exc)}"
                ) from exc
            raise

    def close(self) -> None:
        with self._lock:
            opened, self._opened = self._opened, []
        for conn in opened:
            conn.close()

    # --- deciding -------------------------------------------------------------------------

    def _prepare(self, definition: JobDefinition, policy: JobPolicy) -> None:
        """Ready a rate-limited job's client once, before its first start is reserved."""
        if policy.rate is None or definition.prepare is None:
            return
        with self._lock:
            if definition.name in self._prepared:
                return
            definition.prepare()
            self._prepared.add(definition.name)

    @staticmethod
    def _deferral_delay(retry: RetryPolicy, attempts: int) -> float | None:
        """After ``attempts`` failed runs: the delay before the next one, or None when the
        policy is out of attempts (the DLQ takes it). The first transient failure is deferred,
        not left to Infrai's redeliveries: from then on the ledger owns the work, so a drain
        that dies during a later attempt never spends the message's last delivery (which
        would dead-letter a job with attempts left)."""
        if attempts >= retry.attempts:
            return None
        return next_delay(retry, attempts)

    def _gate(
        self,
        conn: psycopg.Connection[Any],
        ctx: JobContext,
        policy: JobPolicy,
        payload: Mapping[str, Any],
        *,
        slot_token: uuid.UUID,
    ) -> tuple[bool, float | None, str]:
        """Take the concurrency slot (held by ``slot_token``: the token of the claim that runs
        it, for as long as that claim's stored lease) and the rate-limit start a run
        needs: (slot taken, None, "") to run now, or (False, seconds, why) to run that much
        later. A killed run's slot frees itself when the run's lease ends."""
        slot = False
        if policy.concurrency is not None:
            value = concurrency_value(policy.concurrency, payload)
            slot = flow_limits.acquire_concurrency(
                conn,
                ctx.job,
                value,
                policy.concurrency.max_running,
                holder=ctx.message_id,
                idem_key=ctx.idem_key,
                token=slot_token,
            )
            if not slot:
                return (
                    False,
                    CONCURRENCY_RETRY_SECONDS,
                    f"concurrency key {value} has {policy.concurrency.max_running} running",
                )
        if policy.rate is not None:
            fits = ctx.deadline - HANDLER_RESERVE_SECONDS - self._clock()
            reserved, wait = flow_limits.reserve_start(conn, ctx.job, policy.rate, max_wait=fits)
            if not reserved:
                if slot:
                    flow_limits.release_concurrency(conn, slot_token)
                return False, wait, f"rate limit of {policy.rate.limit} starts reached"
            if wait > 0:
                # Its start is reserved: the call leaves when it comes, not before.
                with self._lock:
                    self._counters["rate_limit_waits"] += 1
                self._sleep(wait)
        return slot, None, ""

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
        """Record the work and release its claim in one transaction; the message is then
        acked. When that fails, ``fallback`` (a released claim: the message carries the work
        on, as it would without flow control)."""
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
            self._drop()
            logger.warning(
                "could not defer a job; its message carries it on",
                extra={"action": "defer_failed", "idem_key": ctx.idem_key, "detail": str(exc)},
            )
            return unchanged
        if outcome is DeferOutcome.CLAIM_LOST:
            return unchanged
        return JobRun(RunKind.DEFERRED, error=f"runs again in {delay:.1f} s: {error}")

    # --- running due deferred work --------------------------------------------------------

    def _run_due(self, run: DrainRun, counters: Counter[str]) -> None:
        lease = run.config.batch_budget_ms / 1000 + run.config.lease_grace_seconds
        jobs = sorted(self.policies)
        while run.time_left_ms() > run.config.batch_budget_ms and not run.stop_requested():
            try:
                conn = self._conn()
                due = flow_ledger.take_due(conn, DUE_BATCH, lease_seconds=lease, jobs=jobs)
            except LedgerError as exc:
                self._drop()
                logger.warning(
                    "could not take deferred jobs",
                    extra={"action": "deferred_take_failed", "detail": str(exc)},
                )
                return
            if not due:
                return
            for job in due:
                try:
                    self._run_one(conn, job, run, counters)
                except LedgerError as exc:
                    # Its lease runs out; a non-external job is taken again after it.
                    self._drop()
                    logger.warning(
                        "could not settle a deferred job",
                        extra={
                            "action": "deferred_settle_failed",
                            "idem_key": job.idem_key,
                            "detail": str(exc),
                        },
                    )
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
            deadline=self._clock() + run.config.batch_budget_ms / 1000,
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
            slot, wait, reason = self._gate(conn, ctx, policy, derived.payload, slot_token=token)
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
        # its effect may have happened and it is never taken again; before this, it is.
        if job.effect == Effect.EXTERNAL.value and not flow_ledger.begin(conn, job.idem_key, token):
            if slot:
                self._release_slot(conn, token)
            return
        counters["deferred_ran"] += 1
        try:
            result = run_handler(derived, ctx, run.config.features)
        finally:
            if slot:
                self._release_slot(conn, token)
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
                conn,
                job.idem_key,
                token,
                error=error,
                delay_seconds=next_delay(retry, attempts),
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

    # --- connections ----------------------------------------------------------------------

    def _release_slot(self, conn: psycopg.Connection[Any], token: uuid.UUID) -> None:
        try:
            flow_limits.release_concurrency(conn, token)
        except LedgerError as exc:
            # The slot is freed when its lease ends.
            self._drop()
            logger.warning(
                "could not release a concurrency slot",
                extra={"action": "slot_release_failed", "detail": str(exc)},
            )

    def _conn(self) -> psycopg.Connection[Any]:
        conn: psycopg.Connection[Any] | None = getattr(self._local, "conn", None)
        if conn is None or conn.closed:
            conn = self._connect()
            self._local.conn = conn
            with self._lock:
                self._opened.append(conn)
        return conn

    def _drop(self) -> None:
        conn: psycopg.Connection[Any] | None = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            conn.close()
