"""JOB_POLICIES at the edge: read once with the settings, parsed against the drain's registry
where the drain is built, and a malformed document refused before anything is built."""

from __future__ import annotations

import json

import pytest
from fixture_jobs import build_registry

from infrai_jobs.config.settings import DrainSettings
from infrai_jobs.errors import ConfigurationError
from infrai_jobs.flow.policies import ConcurrencyLimit, RateLimit
from infrai_jobs.jobs.registry import JobRegistry
from infrai_jobs.runtime.drain_service import DrainService, job_policies

# The issue's document, word for word.
DOCUMENT = (
    '{"digest.build": {"retry": {"attempts": 12, "first_delay_seconds": 1, "factor": 2,'
    ' "max_delay_seconds": 3}, "concurrency": {"key": ["tenant_id"], "max_running": 1}},'
    ' "receipt.send": {"rate": {"per_second": 20}}}'
)


def _registry() -> JobRegistry:
    return build_registry()


def _settings(document: str | None, registry: JobRegistry) -> DrainSettings:
    env = {name: "https://provider.example.com" for name in registry.declared_settings()}
    if document is not None:
        env["JOB_POLICIES"] = document
    return DrainSettings.from_env(env, job_settings=registry.declared_settings())


def test_the_document_is_read_as_written_and_unset_is_empty() -> None:
    registry = _registry()
    assert _settings(DOCUMENT, registry).job_policies == DOCUMENT
    assert _settings(None, registry).job_policies == ""
    assert _settings("  ", registry).job_policies == ""


def test_the_issue_document_sets_each_jobs_policy_and_leaves_the_others_without() -> None:
    # Given the example jobs and the issue's document
    registry = _registry()
    # When the policies in force are read where the drain is built
    policies = job_policies(_settings(DOCUMENT, registry), registry)
    # Then digest.build retries 12 times, one per tenant, and receipt.send starts 20 a second
    digest = policies["digest.build"]
    assert digest.retry is not None
    assert (digest.retry.attempts, digest.retry.max_delay_seconds) == (12, 3)
    assert digest.concurrency == ConcurrencyLimit(key=("tenant_id",), max_running=1)
    assert policies["receipt.send"].rate == RateLimit(per_second=20)
    # And a job the document does not name, and that declares nothing, has no policy
    declaring = {job.name for job in registry if job.retry or job.rate or job.concurrency}
    assert set(policies) == {"digest.build", "receipt.send"} | declaring
    # And without the document only what the code declares is in force
    assert set(job_policies(_settings(None, registry), registry)) == declaring


@pytest.mark.parametrize(
    ("document", "named"),
    [
        ({"digest.build": {"retry": {"attempts": 0}}}, ["'digest.build'", "retry.attempts"]),
        ({"receipt.send": {"rate": {"per_hour": 5}}}, ["'receipt.send'", "rate.per_hour"]),
        ({"digest.build": {"concurrency": {"key": "tenant_id", "max_running": 1}}}, ["key"]),
        ({"digest.biuld": {}}, ["'digest.biuld'", "did you mean 'digest.build'"]),
    ],
)
def test_a_malformed_document_is_refused_naming_the_job_and_the_field(
    document: dict[str, object], named: list[str]
) -> None:
    # Given a document with one mistake
    registry = _registry()
    settings = _settings(json.dumps(document), registry)
    # When the drain is built with it (at the cold start, or `infrai-jobs drain`)
    with pytest.raises(ConfigurationError) as refused:
        DrainService.from_settings(settings, registry)
    # Then it is refused before anything is built, naming the job and the field
    message = str(refused.value)
    assert message.startswith("JOB_POLICIES")
    for part in named:
        assert part in message, message


def test_a_document_that_is_not_json_is_refused() -> None:
    registry = _registry()
    with pytest.raises(ConfigurationError, match="JOB_POLICIES is not valid JSON"):
        job_policies(_settings("{digest.build", registry), registry)
