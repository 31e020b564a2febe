"""The job registry: matching payloads to jobs and deriving keys, with clear refusals."""

from __future__ import annotations

import pytest
from job_modes import noop

from infrai_jobs.errors import ConfigurationError, KeyDerivationError
from infrai_jobs.jobs.registry import Effect, JobRegistry


@pytest.fixture
def registry() -> JobRegistry:
    registry = JobRegistry()
    registry.job(
        "invoice.finalize",
        effect=Effect.DATABASE,
        identity=("invoice_id",),
        required=("amount_cents",),
    )(noop)
    registry.job(
        "digest.build", effect=Effect.EXTERNAL_IDEMPOTENT, identity=("tenant_id", "period")
    )(noop)
    registry.job("report.render", effect=Effect.EXTERNAL)(noop)
    return registry


def test_the_notes_payload_gets_the_notes_key(registry: JobRegistry) -> None:
    derived = registry.derive(
        {"job": "invoice.finalize", "invoice_id": "inv_8812", "amount_cents": 4900}
    )
    assert derived.idem_key == "invoice.finalize:inv_8812"
    assert derived.definition.effect is Effect.DATABASE
    assert len(derived.fingerprint) == 64


def test_tenant_and_period_jobs_are_keyed_by_both(registry: JobRegistry) -> None:
    derived = registry.derive(
        {"job": "digest.build", "tenant_id": "tenant_42", "period": "2026-07-25"}
    )
    assert derived.idem_key == "digest.build:tenant_42:2026-07-25"


def test_jobs_without_identity_are_keyed_by_content(registry: JobRegistry) -> None:
    a = registry.derive({"job": "report.render", "q": 1, "_trace": "x"})
    b = registry.derive({"q": 1, "job": "report.render", "_trace": "y"})
    assert a.idem_key == b.idem_key
    assert a.idem_key.startswith("sha256:")


def test_a_producer_key_wins(registry: JobRegistry) -> None:
    derived = registry.derive({"job": "report.render", "_idempotency_key": "order-77"})
    assert derived.idem_key == "order-77"


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ([1, 2], "not a JSON object \\(got array\\)"),
        (None, "got null"),
        ("text", "got string"),
        ({"invoice_id": "inv_1"}, "no 'job' string"),
        ({"job": "nope"}, "unknown job 'nope'"),
        ({"job": "invoice.finalize", "invoice_id": "inv_1"}, "missing field\\(s\\): amount_cents"),
        ({"job": "invoice.finalize", "amount_cents": 1}, "missing field\\(s\\): invoice_id"),
    ],
)
def test_payloads_without_a_key_are_refused_with_the_reason(
    registry: JobRegistry, payload: object, message: str
) -> None:
    with pytest.raises(KeyDerivationError, match=message):
        registry.derive(payload)


def test_a_job_cannot_be_registered_twice(registry: JobRegistry) -> None:
    with pytest.raises(ConfigurationError, match="registered twice"):
        registry.job("report.render", effect=Effect.EXTERNAL)(noop)


@pytest.mark.parametrize(
    ("name", "fields", "message"),
    [
        ("billing:finalize", {"identity": ("invoice_id",)}, "free of ':'"),
        ("", {}, "non-empty name"),
        ("invoice.void", {"identity": "invoice_id"}, r"identity must list field names"),
        ("invoice.void", {"required": "amount_cents"}, r"required must list field names"),
    ],
)
def test_a_job_that_could_never_key_a_message_is_refused_when_registered(
    name: str, fields: dict[str, object], message: str
) -> None:
    # Given an empty registry
    registry = JobRegistry()
    # When a job is registered that no message of it could ever be keyed for
    # Then the registration fails at start-up, naming the fix, and nothing is registered
    with pytest.raises(ConfigurationError, match=message):
        registry.job(name, effect=Effect.DATABASE, **fields)(noop)  # type: ignore[arg-type]
    assert len(registry) == 0
