"""RedriveFunction (manual invoke): move what is new in the DLQ into the ledger's dead letters,
then publish the unresolved ones it selects and mark them redriven (infrai_jobs.operations.redrive).
Its events (events/redrive*.json) and what its answer says ("stopped", "skipped", "held_back",
"complete"): docs/operations.md, "Dead letters: the steps"."""

from __future__ import annotations

from functools import cache
from typing import Any

from aws_lambda_powertools.metrics import MetricUnit
from aws_lambda_powertools.utilities.typing import LambdaContext

from infrai_jobs.config.settings import RedriveSettings
from infrai_jobs.jobs.registry import JobRegistry
from infrai_jobs.operations.dead_letters import DeadLetterStore
from infrai_jobs.operations.redrive import JobsKnowledge, RedriveRequest, redrive
from infrai_jobs.queue.client import InfraiClient
from infrai_jobs.runtime.factory import make_claims_admin, make_queue_client, with_secrets
from infrai_jobs.runtime.observability import function_observability, tracing
from infrai_jobs.work.admin import WorkStore
from jobs import build_registry

logger, metrics = function_observability()

# Who this function's redrives are recorded as (dead letters redriven, claims reopened).
ACTOR = "RedriveFunction"


@cache
def dependencies() -> tuple[RedriveSettings, InfraiClient, WorkStore, JobRegistry]:
    """The settings (read once per warm environment, with their secrets), the queue, the ledger
    (its dead letters, and failed claims for ``reopen_failed``), and the drain's own jobs (the
    shared ``jobs`` package): a dead letter's key is derived here exactly as DrainFunction
    derived it. Only keys are derived: no job runs, so the jobs' settings are neither read nor
    needed."""
    settings, refresh = with_secrets(RedriveSettings.from_env())
    queue = make_queue_client(settings, refresh_api_key=refresh.api_key)
    return settings, queue, make_claims_admin(settings, refresh=refresh), build_registry()


@logger.inject_lambda_context(log_event=True, clear_state=True)
@metrics.log_metrics
@tracing
def lambda_handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    request = RedriveRequest.from_event(event)
    settings, queue, ledger, jobs = dependencies()
    with queue.retries_within(context.get_remaining_time_in_millis):
        summary = redrive(
            queue,
            DeadLetterStore(ledger),
            request.to(source=settings.dlq, target=settings.queue, actor=ACTOR),
            admin=ledger,
            jobs=JobsKnowledge(
                key_of=lambda payload: jobs.derive(payload).idem_key,
                known_jobs=lambda name: "" if jobs.get(name) else jobs.unknown_job(name),
            ),
            time_left_ms=context.get_remaining_time_in_millis,
        )
    metrics.add_dimension(name="queue", value=settings.queue)
    metrics.add_metric(name="MessagesRedriven", unit=MetricUnit.Count, value=summary.published)
    unreadable = len(summary.unreadable)
    metrics.add_metric(name="DeadLettersUnreadable", unit=MetricUnit.Count, value=unreadable)
    return summary.as_dict()
