"""What DrainFunction and ``infrai-jobs drain`` share. A warm Lambda keeps one ``DrainService``:
its HTTP pool and database connection live across invocations (the connection is re-established
when the server has closed it)."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field

from infrai_jobs.config.settings import DrainSettings
from infrai_jobs.drain.fan_out import FanOutPolicy, FleetMembership
from infrai_jobs.drain.features import (
    ClosableLedger,
    IdlePolling,
    Lanes,
    SecondLayerFeature,
    SecondLayerGuard,
)
from infrai_jobs.drain.flow import FlowControl, flow_control
from infrai_jobs.drain.loop import budget_shortfall, drain_invocation, stopped_before_receiving
from infrai_jobs.drain.model import DrainConfig, DrainFeature, DrainRun, DrainSummary
from infrai_jobs.drain.ports import DrainFleetPort, DrainStarterPort
from infrai_jobs.errors import ConfigurationError, DatabaseBusy, LedgerError, LedgerUnavailable
from infrai_jobs.flow.policies import parse_job_policies, policies_in_force
from infrai_jobs.jobs.policy import JobPolicy
from infrai_jobs.jobs.registry import JobRegistry
from infrai_jobs.ledger.job_schema import JobMigrationName
from infrai_jobs.queue.ports import QueuePort
from infrai_jobs.runtime.factory import (
    make_drain_fleet,
    make_drain_starter,
    make_effect_guard,
    make_ledger,
    make_queue_client,
    with_secrets,
)
from infrai_jobs.runtime.observability import MessageSpan, MessageTracing
from infrai_jobs.work.ledger import PostgresLedger

logger = logging.getLogger(__name__)

# The drain's first connection waits for a full database at most this share of the time left,
# this long at most, tried again after a back-off doubled from the first to the last (jittered,
# so drains refused together come back apart).
CONNECT_WAIT_SHARE = 0.25
CONNECT_WAIT_SECONDS = 30
CONNECT_BACKOFF_SECONDS = (0.2, 3.2)


@dataclass
class DrainService:
    settings: DrainSettings
    queue: QueuePort
    ledger: PostgresLedger
    registry: JobRegistry
    features: list[DrainFeature] = field(default_factory=list)
    # How the wait for a full database sleeps (a test's fake).
    sleep: Callable[[float], None] = time.sleep

    @classmethod
    def from_settings(
        cls,
        settings: DrainSettings,
        registry: JobRegistry,
        *,
        starter: DrainStarterPort | None = None,
        message_span: MessageSpan | None = None,
        job_migrations: Sequence[JobMigrationName] = (),
    ) -> DrainService:
        """A job setting or secret missing from ``settings`` (``DrainSettings.from_env(
        job_settings=..., job_secrets=...)``) is a ``ConfigurationError`` naming it and its jobs,
        before anything is built or consumed. ``starter`` replaces Lambda's for local runs."""
        job_settings = settings.require_job_settings()
        policies = job_policies(settings, registry)
        resolved, refresh = with_secrets(settings)
        registry.bind_settings(job_settings, secrets=resolved.require_job_secrets())
        url_hook, key_hook = refresh.database_url, refresh.api_key
        flow = flow_control(registry, policies, queue=resolved.queue)
        return cls(
            settings=resolved,
            queue=make_queue_client(resolved, refresh_api_key=key_hook),
            ledger=make_ledger(resolved, refresh_url=url_hook, job_migrations=job_migrations),
            registry=registry,
            features=drain_features(
                resolved,
                make_lane_ledger=lambda: make_ledger(resolved, refresh_url=url_hook),
                second_layer=make_effect_guard(resolved),
                fleet=make_drain_fleet(resolved, refresh_url=url_hook),
                starter=starter or make_drain_starter(resolved),
                message_span=message_span,
                flow=flow,
            ),
        )

    def close(self) -> None:
        self.ledger.close()
        for feature in self.features:
            feature.close()

    def config(self, max_batches: int | None = None, *, fanned_out: bool = False) -> DrainConfig:
        """``fanned_out``: a drain a fan-out started goes without the features that say so (idle
        polling: it drains a backlog and stops; the scheduled drains poll)."""
        return DrainConfig(
            queue=self.settings.queue,
            batch_budget_ms=self.settings.batch_budget_ms,
            lease_grace_seconds=self.settings.lease_grace_seconds,
            visibility_timeout_seconds=self.settings.visibility_timeout_seconds,
            max_batches=max_batches,
            features=tuple(f for f in self.features if f.in_fanned_out_drains or not fanned_out),
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
        function's Errors alarm fires instead of the invocation looking healthy."""
        config = self.config(max_batches, fanned_out=fan_out_slot is not None)
        check_time_budget(config, time_left_ms())
        stop = stop_requested or (lambda: False)
        run = DrainRun(self.queue, self.ledger, config, time_left_ms, stop, fan_out_slot)
        try:
            self._first_connection(time_left_ms, stop)
        except LedgerError as exc:
            summary = stopped_before_receiving(exc)
        else:
            # The Infrai client (behind any wrapper) retries only while the invocation has time.
            retries_within = getattr(self.queue, "retries_within", None)
            with retries_within(time_left_ms) if retries_within else nullcontext():
                summary = drain_invocation(run, self.registry)
        if summary.stopped == "ledger_unavailable":
            raise LedgerUnavailable(ledger_outage_message(summary))
        return summary

    def _first_connection(self, time_left_ms: Callable[[], int], stop: Callable[[], bool]) -> None:
        """The drain's own connection, open and answering before anything is consumed: while the
        database is full (``DatabaseBusy``), tried again as the CONNECT_* constants say or until
        ``stop()``, then the last refusal raised. Any other failure is raised at once."""
        patience = min(time_left_ms() * CONNECT_WAIT_SHARE / 1000, CONNECT_WAIT_SECONDS)
        give_up_below, delay = time_left_ms() - patience * 1000, CONNECT_BACKOFF_SECONDS[0]
        while True:
            try:
                return self.ledger.ping()
            except DatabaseBusy as exc:
                if stop() or time_left_ms() - delay * 1000 < give_up_below:
                    raise
                if delay == CONNECT_BACKOFF_SECONDS[0]:
                    logger.warning(
                        "the ledger database is full; waiting up to %.1f s for a connection",
                        patience,
                        extra={"action": "connection_wait", "detail": str(exc)},
                    )
            self.sleep(delay * random.uniform(0.5, 1.0))
            delay = min(delay * 2, CONNECT_BACKOFF_SECONDS[1])

    def take_second_layer_hits(self) -> int:
        """Effects the second layer replayed instead of repeating, since the last call."""
        return sum(f.guard.take_hits() for f in self.features if isinstance(f, SecondLayerFeature))


def drain_features(
    settings: DrainSettings,
    *,
    make_lane_ledger: Callable[[], ClosableLedger],
    second_layer: SecondLayerGuard | None = None,
    fleet: DrainFleetPort | None = None,
    starter: DrainStarterPort | None = None,
    message_span: MessageSpan | None = None,
    flow: FlowControl | None = None,
) -> list[DrainFeature]:
    """The features ``settings`` switch on, outermost first; an adapter passed as None turns its
    feature off. ``make_lane_ledger`` opens each lane's connection beyond the first."""
    # Flow control outermost: each invocation runs the due deferred work around everything
    # else, and its gates come before a handler's span.
    features: list[DrainFeature] = [flow] if flow is not None else []
    if second_layer is not None:
        features.append(SecondLayerFeature(second_layer))
    if settings.drain_idle_poll_ms > 0:
        features.append(
            IdlePolling(settings.drain_idle_poll_ms, settings.drain_idle_window_seconds)
        )
    if fleet is not None:
        policy = FanOutPolicy(
            queue=settings.queue,
            max_concurrency=settings.drain_max_concurrency,
            after_seconds=settings.drain_fan_out_after_seconds,
        )
        features.append(FleetMembership(policy, fleet, starter))
    if settings.drain_lanes > 1:
        features.append(Lanes(settings.drain_lanes, make_lane_ledger))
    if message_span is not None:
        features.append(MessageTracing(message_span))
    return features


def job_policies(settings: DrainSettings, registry: JobRegistry) -> dict[str, JobPolicy]:
    """What the jobs declare, with ``JOB_POLICIES`` applied (malformed: a ``ConfigurationError``
    naming the job and the field)."""
    overrides = parse_job_policies(settings.job_policies, [job.name for job in registry])
    return policies_in_force(registry, overrides)


def ledger_outage_message(summary: DrainSummary) -> str:
    if summary.consumed == 0:
        return (
            "the ledger database is unreachable, so the drain received nothing: every message "
            "is still waiting in the queue; check DATABASE_URL (or DATABASE_SECRET_ARN) and the "
            "database"
        )
    unsettled = summary.consumed - summary.acked
    return (
        f"the ledger database failed mid-drain, after {summary.consumed} message(s) received in "
        f"{summary.batches} batch(es): {summary.done} done, {summary.duplicates} duplicate(s), "
        f"{summary.acked} acked; the {unsettled} not acked come back after the visibility timeout"
    )


def check_time_budget(config: DrainConfig, time_budget_ms: int) -> None:
    """Refuse a drain whose time cannot hold one batch (``budget_shortfall``)."""
    if shortfall := budget_shortfall(config.batch_budget_ms, time_budget_ms):
        logger.error(
            "the drain's time cannot hold one batch; nothing was received",
            extra={"action": "time_budget_too_short", "detail": shortfall},
        )
        raise ConfigurationError(
            f"{shortfall}; nothing was received. Give the drain more time, or lower "
            "DRAIN_BATCH_BUDGET_MS to what one batch of the slowest job needs"
        )
