"""What DrainFunction and ``infrai-jobs drain`` share: the adapters, built once and reused.

A warm Lambda keeps one ``DrainService``: its HTTP pool and its database connection live across
invocations, and the connection is re-established when the server has closed it.

With ``DRAIN_MAX_CONCURRENCY`` set, every run is counted in the ledger's ``drain_leases``
(``infrai_jobs.drain.fan_out``): a run that would be one drain too many stops at once
(``at_capacity``), and a run that meets a backlog starts more drains, up to that cap.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from infrai_jobs.config.settings import DrainSettings
from infrai_jobs.drain.fan_out import CountingQueue, FanOutPolicy, FleetMonitor
from infrai_jobs.drain.loop import (
    budget_shortfall,
    drain,
    idle_polling_shortfall,
    stopped_before_receiving,
)
from infrai_jobs.drain.model import DrainConfig, DrainSummary, merge_summaries
from infrai_jobs.drain.ports import DrainFleetPort, DrainStarterPort
from infrai_jobs.errors import ConfigurationError, LedgerError, LedgerUnavailable
from infrai_jobs.flow.policies import JobPolicy, parse_job_policies, policies_in_force
from infrai_jobs.jobs.registry import JobContext, JobRegistry
from infrai_jobs.ledger.claim_ledger import PostgresLedger
from infrai_jobs.queue.client import InfraiClient
from infrai_jobs.queue.ports import ForwardingQueue, QueuePort
from infrai_jobs.runtime.factory import (
    make_drain_fleet,
    make_drain_starter,
    make_effect_guard,
    make_ledger,
    make_queue_client,
    with_secrets,
)

if TYPE_CHECKING:
    from infrai_jobs.aws.second_layer import SecondLayer

logger = logging.getLogger(__name__)


@dataclass
class DrainService:
    settings: DrainSettings
    queue: QueuePort
    ledger: PostgresLedger
    registry: JobRegistry
    # The optional second layer (IDEMPOTENCY_BACKEND); None when off.
    effect_guard: SecondLayer | None = None

    # Lanes beyond the first get their own connections, opened on first use.
    extra_ledgers: list[PostgresLedger] = field(default_factory=list)
    make_lane_ledger: Callable[[], PostgresLedger] | None = None
    # The drains alive, counted in the ledger (DRAIN_MAX_CONCURRENCY > 0), and what starts
    # more of them (DRAIN_MAX_CONCURRENCY > 1); None when off.
    fleet: DrainFleetPort | None = None
    starter: DrainStarterPort | None = None
    # The span around each handler run, with tracing on (``observability.message_tracing``).
    message_span: Callable[[JobContext], AbstractContextManager[object]] | None = None
    # The flow policy in force for each job that has one (declared in code, JOB_POLICIES
    # applied); a job absent here has none.
    policies: Mapping[str, JobPolicy] = field(default_factory=dict)

    @classmethod
    def from_settings(
        cls,
        settings: DrainSettings,
        registry: JobRegistry,
        *,
        starter: DrainStarterPort | None = None,
        message_span: Callable[[JobContext], AbstractContextManager[object]] | None = None,
    ) -> DrainService:
        """``registry``'s jobs get the values of the settings they declared, read into
        ``settings`` (``DrainSettings.from_env(job_settings=registry.declared_settings())``): a
        missing one is a ``ConfigurationError`` naming it and its jobs, before anything is
        built or consumed. ``starter`` replaces Lambda's for local runs (the CLI starts drain
        processes). ``message_span``: see ``DrainConfig``."""
        registry.bind_settings(settings.require_job_settings())
        policies = job_policies(settings, registry)
        resolved, refresh = with_secrets(settings).unpacked()
        url_hook, key_hook = refresh.database_url, refresh.api_key
        return cls(
            settings=resolved,
            queue=make_queue_client(resolved, refresh_api_key=key_hook),
            ledger=make_ledger(resolved, refresh_url=url_hook),
            registry=registry,
            effect_guard=make_effect_guard(resolved),
            make_lane_ledger=lambda: make_ledger(resolved, refresh_url=url_hook),
            fleet=make_drain_fleet(resolved, refresh_url=url_hook),
            starter=starter or make_drain_starter(resolved),
            message_span=message_span,
            policies=policies,
        )

    def close(self) -> None:
        for ledger in (self.ledger, *self.extra_ledgers):
            ledger.close()
        close_fleet = getattr(self.fleet, "close", None)
        if close_fleet is not None:
            close_fleet()

    def config(self, max_batches: int | None = None, *, idle_polling: bool = True) -> DrainConfig:
        """``idle_polling`` off for a drain a fan-out started: it drains a backlog and stops,
        and the scheduled drains do the polling."""
        return DrainConfig(
            queue=self.settings.queue,
            batch_budget_ms=self.settings.batch_budget_ms,
            lease_grace_seconds=self.settings.lease_grace_seconds,
            visibility_timeout_seconds=self.settings.visibility_timeout_seconds,
            max_batches=max_batches,
            effect_guard=self.effect_guard,
            idle_poll_ms=self.settings.drain_idle_poll_ms if idle_polling else 0,
            idle_window_seconds=self.settings.drain_idle_window_seconds,
            message_span=self.message_span,
        )

    def run(
        self,
        time_left_ms: Callable[[], int],
        max_batches: int | None = None,
        *,
        fan_out_slot: str | None = None,
        stop_requested: Callable[[], bool] | None = None,
    ) -> DrainSummary:
        """Drain once. A ledger outage is raised after what settled was acked, so the
        function's Errors alarm fires instead of the invocation looking healthy.

        ``fan_out_slot`` is the slot a fan-out reserved for this run (its event says so);
        ``stop_requested`` ends it before its next receive (the CLI, interrupted)."""
        if self.effect_guard is not None:
            # Every run: an in-progress record of a crashed call then expires with this
            # invocation's deadline (in Lambda, time_left_ms is the context's own clock).
            self.effect_guard.register_lambda_context(_TimeLeft(time_left_ms))
        lanes = max(1, self.settings.drain_lanes)
        config = self.config(max_batches, idle_polling=fan_out_slot is None)
        check_time_budget(config, time_left_ms())
        stop = stop_requested or _never
        with _retries_within(self.queue, time_left_ms):
            if self.fleet is None:
                summary = self._drain(self.queue, lanes, config, time_left_ms, stop)
            else:
                summary = self._drain_counted(
                    self.fleet, lanes, config, time_left_ms, fan_out_slot, stop_requested=stop
                )
        if summary.stopped == "ledger_unavailable":
            raise LedgerUnavailable(ledger_outage_message(summary))
        return summary

    def _drain(
        self,
        queue: QueuePort,
        lanes: int,
        config: DrainConfig,
        time_left_ms: Callable[[], int],
        stop_requested: Callable[[], bool],
    ) -> DrainSummary:
        """One drain loop, or several at once on one queue: the claims keep them from
        overlapping.

        Each lane has its own database connection; the HTTP pool is shared (thread-safe).
        """
        if lanes == 1:
            return drain(
                queue,
                self.ledger,
                self.registry,
                config,
                time_left_ms,
                stop_requested=stop_requested,
            )
        while len(self.extra_ledgers) < lanes - 1:
            if self.make_lane_ledger is None:
                raise LedgerUnavailable("DRAIN_LANES > 1 needs a ledger factory")
            self.extra_ledgers.append(self.make_lane_ledger())
        ledgers = [self.ledger, *self.extra_ledgers[: lanes - 1]]
        with ThreadPoolExecutor(max_workers=lanes, thread_name_prefix="lane") as pool:
            futures = [
                pool.submit(
                    drain,
                    queue,
                    ledger,
                    self.registry,
                    config,
                    time_left_ms,
                    stop_requested=stop_requested,
                )
                for ledger in ledgers
            ]
            return merge_summaries([future.result() for future in futures])

    def _drain_counted(
        self,
        fleet: DrainFleetPort,
        lanes: int,
        config: DrainConfig,
        time_left_ms: Callable[[], int],
        fan_out_slot: str | None,
        *,
        stop_requested: Callable[[], bool],
    ) -> DrainSummary:
        """Drain as one of the fleet: join it (or stop at the cap), fan out while draining."""
        settings = self.settings
        policy = FanOutPolicy(
            queue=config.queue,
            max_concurrency=settings.drain_max_concurrency,
            after_seconds=settings.drain_fan_out_after_seconds,
        )
        drain_id = fan_out_slot or str(uuid.uuid4())
        try:
            joined = fleet.join(
                config.queue,
                drain_id,
                origin="fan_out" if fan_out_slot else "schedule",
                lease_seconds=policy.lease_seconds,
                cap=policy.max_concurrency,
            )
        except LedgerError as exc:
            return stopped_before_receiving(exc)
        if not joined:
            logger.info(
                "%d drains of this queue are alive already; this one stops",
                policy.max_concurrency,
                extra={"action": "at_capacity", "queue": config.queue},
            )
            return DrainSummary(stopped="at_capacity")
        counting = CountingQueue(self.queue)
        monitor = FleetMonitor(
            policy,
            drain_id,
            fleet,
            queue=self.queue,
            consumed=counting.consumed,
            starter=self.starter,
        )
        try:
            with monitor.running():
                summary = self._drain(counting, lanes, config, time_left_ms, stop_requested)
        finally:
            try:
                fleet.leave(config.queue, [drain_id])
            except LedgerError as exc:
                # Its lease ends on its own within LEASE_SECONDS.
                logger.warning(
                    "could not give back this drain's lease",
                    extra={"action": "fleet_leave_failed", "detail": str(exc)},
                )
        summary.fanned_out = monitor.fanned_out
        summary.fan_out_throttled = monitor.throttled
        summary.fan_out_failed = monitor.failed
        return summary

    def take_second_layer_hits(self) -> int:
        """Effects the second layer replayed instead of repeating, since the last call."""
        return self.effect_guard.take_hits() if self.effect_guard is not None else 0


def job_policies(settings: DrainSettings, registry: JobRegistry) -> dict[str, JobPolicy]:
    """The flow policies in force: what the jobs declare, with ``JOB_POLICIES`` applied. A
    malformed document is a ``ConfigurationError`` naming the job and the field, raised before
    anything is built or consumed."""
    overrides = parse_job_policies(settings.job_policies, [job.name for job in registry])
    return policies_in_force(registry, overrides)


def ledger_outage_message(summary: DrainSummary) -> str:
    """What a drain stopped by the ledger says: "mid-drain" only when it had received something
    (the summary so far in words); before that, that nothing was received."""
    if summary.consumed == 0:
        return (
            "the ledger database is unreachable, so the drain received nothing: every message "
            "is still waiting in the queue; check DATABASE_URL (or DATABASE_SECRET_ARN) and the "
            "database"
        )
    unsettled = summary.consumed - summary.acked
    return (
        f"the ledger database failed mid-drain, after {summary.consumed} message(s) received "
        f"in {summary.batches} batch(es): {summary.done} done, {summary.duplicates} "
        f"duplicate(s), {summary.acked} acked; the {unsettled} not acked come back after the "
        "visibility timeout"
    )


def check_time_budget(config: DrainConfig, time_budget_ms: int) -> None:
    """Refuse a drain whose time cannot hold one batch (it would stop at once, reporting
    ``time_budget`` with messages waiting untouched); warn when idle polling cannot poll."""
    shortfall = budget_shortfall(config.batch_budget_ms, time_budget_ms)
    if shortfall:
        logger.error(
            "the drain's time cannot hold one batch; nothing was received",
            extra={"action": "time_budget_too_short", "detail": shortfall},
        )
        raise ConfigurationError(
            f"{shortfall}; nothing was received. Give the drain more time, or lower "
            "DRAIN_BATCH_BUDGET_MS to what one batch of the slowest job needs"
        )
    idle = idle_polling_shortfall(config, time_budget_ms)
    if idle:
        logger.warning(
            "this drain does not poll an idle queue",
            extra={"action": "idle_polling_off", "detail": idle},
        )


def _never() -> bool:
    return False


def _retries_within(
    queue: QueuePort, time_left_ms: Callable[[], int]
) -> AbstractContextManager[None]:
    """The Infrai client retries only while the invocation has time for it (looked for behind
    any wrapper that watches its calls); other queues (the in-memory one of the tests) have no
    retries to bound."""
    while isinstance(queue, ForwardingQueue):
        queue = queue.inner
    if isinstance(queue, InfraiClient):
        return queue.retries_within(time_left_ms)
    return nullcontext()


@dataclass(frozen=True, slots=True)
class _TimeLeft:
    """The drain's time budget in the shape Powertools reads from a Lambda context."""

    time_left_ms: Callable[[], int]

    def get_remaining_time_in_millis(self) -> int:
        return self.time_left_ms()
