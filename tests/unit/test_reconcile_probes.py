"""Reconcile probes without a database: who may declare one, what a probe is given, and how its
failures become unknown answers."""

from __future__ import annotations

import time

import pytest
from fixture_jobs import build_registry

from infrai_jobs.errors import ConfigurationError
from infrai_jobs.jobs.keys import identity_from_key, natural_key
from infrai_jobs.jobs.probes import Done, NotDone, ProbeAnswer, Unknown
from infrai_jobs.jobs.registry import Effect, JobContext, JobRegistry, JsonValue, Payload
from infrai_jobs.operations.reconcile import ask, history_note
from infrai_local.operator.cli_ops import answer_of


def handler(payload: Payload, ctx: JobContext) -> JsonValue:
    return None


def nothing_there(payload: Payload, ctx: JobContext) -> ProbeAnswer:
    return NotDone()


def context(key: str = "k") -> JobContext:
    return JobContext(idem_key=key, job="j", message_id="m", delivery_count=0, deadline=0.0)


@pytest.mark.parametrize("effect", [Effect.EXTERNAL, Effect.EXTERNAL_IDEMPOTENT])
def test_an_external_job_may_declare_a_probe(effect: Effect) -> None:
    registry = JobRegistry()
    registry.job("ext.job", effect=effect, identity=("id",), probe=nothing_there)(handler)
    definition = registry.get("ext.job")
    assert definition is not None
    assert definition.probe is nothing_there


def test_a_database_job_with_a_probe_is_refused_at_registration() -> None:
    registry = JobRegistry()
    with pytest.raises(ConfigurationError, match="probe needs an external effect"):
        registry.job("db.job", effect=Effect.DATABASE, identity=("id",), probe=nothing_there)(
            handler
        )
    assert registry.get("db.job") is None


def test_the_example_external_jobs_declare_probes() -> None:
    registry = build_registry()
    probed = {job.name for job in registry if job.probe is not None}
    assert probed == {"receipt.send", "digest.build"}


@pytest.mark.parametrize(
    ("fields", "payload"),
    [
        (("invoice_id",), {"invoice_id": "inv:with:colons"}),
        (("invoice_id",), {"invoice_id": 8812}),
        (("tenant_id", "period"), {"tenant_id": "t_1", "period": "2026:11"}),
    ],
)
def test_a_natural_key_gives_back_its_identity_fields(
    fields: tuple[str, ...], payload: dict[str, object]
) -> None:
    key = natural_key("some.job", fields, payload)
    assert identity_from_key("some.job", fields, key) == {f: str(payload[f]) for f in fields}


@pytest.mark.parametrize("key", ["sha256:abc", "other.job:1", "some.job:", "some.job:only"])
def test_a_key_that_is_not_the_jobs_natural_key_gives_nothing(key: str) -> None:
    assert identity_from_key("some.job", ("tenant_id", "period"), key) is None


def test_a_probe_that_raises_is_unknown_with_the_reason() -> None:
    def broken(payload: Payload, ctx: JobContext) -> ProbeAnswer:
        raise ValueError("provider said nonsense")

    answer = ask(broken, {}, context(), timeout=1.0)
    assert answer == Unknown("the probe raised ValueError: provider said nonsense")


def test_a_probe_that_answers_something_else_is_unknown() -> None:
    def sloppy(payload: Payload, ctx: JobContext) -> ProbeAnswer:
        return True  # type: ignore[return-value]

    answer = ask(sloppy, {}, context(), timeout=1.0)
    assert isinstance(answer, Unknown)
    assert "answered bool" in answer.reason


def test_a_slow_probe_is_unknown_once_its_time_is_up() -> None:
    def slow(payload: Payload, ctx: JobContext) -> ProbeAnswer:
        time.sleep(2)
        return Done({"late": True})

    started = time.monotonic()
    answer = ask(slow, {}, context(), timeout=0.1)
    assert time.monotonic() - started < 1
    assert answer == Unknown("the probe did not answer within 0.1 s")


@pytest.mark.parametrize(
    ("answer", "detail"),
    [("done", {"id": "x"}), ("not_done", None), ("unknown", "HTTP 503")],
)
def test_each_answer_is_read_back_from_its_history_note(answer: str, detail: object) -> None:
    assert answer_of(history_note(answer, detail)) == answer


def test_a_note_that_is_not_an_answer_reads_as_none() -> None:
    assert answer_of("redrive --reopen-failed") is None
    assert answer_of(None) is None


def test_the_watcher_binds_only_probe_settings_and_drops_a_probe_missing_one() -> None:
    # Given the example jobs, and a watcher environment with the mail provider only
    registry = build_registry()
    assert registry.declared_settings(probes_only=True) == {
        "MAIL_PROVIDER_URL": ("receipt.send",),
        "DIGEST_PROVIDER_URL": ("digest.build",),
    }
    # When their probe settings are bound
    unprobed = registry.bind_probe_settings({"MAIL_PROVIDER_URL": "https://mail.example.com"})
    # Then the digest job loses its probe, said so, and the receipt job keeps its own
    assert unprobed == {"digest.build": ("DIGEST_PROVIDER_URL",)}
    digest, receipt = registry.get("digest.build"), registry.get("receipt.send")
    assert digest is not None
    assert receipt is not None
    assert digest.probe is None
    assert receipt.probe is not None
    assert registry.settings_of("receipt.send") == {"MAIL_PROVIDER_URL": "https://mail.example.com"}
