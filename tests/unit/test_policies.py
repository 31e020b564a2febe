"""Flow policies: what a job declares, the JOB_POLICIES document that overrides it, back-off
delays and concurrency key values."""

from __future__ import annotations

import json

import pytest
from job_modes import noop

from infrai_jobs.errors import ConfigurationError, InvalidPayload, PermanentJobError
from infrai_jobs.flow.policies import (
    ConcurrencyLimit,
    JobPolicy,
    RateLimit,
    RetryPolicy,
    concurrency_value,
    declared_policy,
    effective_policy,
    is_final_error,
    next_delay,
    parse_job_policies,
    policies_in_force,
)
from infrai_jobs.jobs.registry import Effect, JobRegistry

# The issue's example document, exactly as operators are told to write it.
EXAMPLE = (
    '{"digest.build": {"retry": {"attempts": 12, "first_delay_seconds": 1, "factor": 2,'
    ' "max_delay_seconds": 3}, "concurrency": {"key": ["tenant_id"], "max_running": 1}},'
    ' "receipt.send": {"rate": {"per_second": 20}}}'
)
JOBS = ("digest.build", "receipt.send", "invoice.finalize")


def test_the_issue_example_parses_into_each_jobs_policy() -> None:
    # When the example document is read
    policies = parse_job_policies(EXAMPLE, JOBS)
    # Then each job named gets exactly what it says, and no other job gets anything
    assert policies == {
        "digest.build": JobPolicy(
            retry=RetryPolicy(attempts=12, first_delay_seconds=1, factor=2, max_delay_seconds=3),
            concurrency=ConcurrencyLimit(key=("tenant_id",), max_running=1),
        ),
        "receipt.send": JobPolicy(rate=RateLimit(per_second=20)),
    }
    rate = policies["receipt.send"].rate
    assert rate is not None
    assert (rate.limit, rate.window_seconds) == (20, 1.0)


@pytest.mark.parametrize("text", ["", "   ", None])
def test_no_document_overrides_nothing(text: str | None) -> None:
    assert parse_job_policies(text, JOBS) == {}


def _with(job: str, section: str, body: object) -> str:
    return json.dumps({job: {section: body}})


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ('{"digest.bild": {}}', ["'digest.bild'", "did you mean 'digest.build'"]),
        ('{"digest.build": {"retries": {}}}', ["'digest.build'", "'retries'"]),
        (_with("digest.build", "retry", {"attempts": 0}), ["'digest.build'", "retry.attempts"]),
        (_with("digest.build", "retry", {"attempts": "3"}), ["'digest.build'", "retry.attempts"]),
        (_with("digest.build", "retry", {"attempts": 2.5}), ["'digest.build'", "retry.attempts"]),
        (_with("digest.build", "retry", {"factor": 2}), ["'digest.build'", "retry.attempts"]),
        (
            _with("digest.build", "retry", {"attempts": 3, "first_delay_seconds": -1}),
            ["'digest.build'", "retry.first_delay_seconds"],
        ),
        (
            _with("digest.build", "retry", {"attempts": 3, "factor": 0.5}),
            ["'digest.build'", "retry.factor"],
        ),
        (
            _with("digest.build", "retry", {"attempts": 3, "max_delay_seconds": 0}),
            ["'digest.build'", "retry.max_delay_seconds"],
        ),
        (
            _with("digest.build", "retry", {"attempts": 3, "colour": "red"}),
            ["'digest.build'", "retry.colour"],
        ),
        (
            _with("digest.build", "retry", {"attempts": 3, "final_errors": "ValueError"}),
            ["'digest.build'", "retry.final_errors"],
        ),
        (_with("receipt.send", "rate", {"per_second": 0}), ["'receipt.send'", "rate.per_second"]),
        (
            _with("receipt.send", "rate", {"per_second": True}),
            ["'receipt.send'", "rate.per_second"],
        ),
        (
            _with("receipt.send", "rate", {"per_second": 5, "per_minute": 100}),
            ["'receipt.send'", "per_second or per_minute"],
        ),
        (_with("receipt.send", "rate", 20), ["'receipt.send'", "rate must be an object"]),
        (
            _with("digest.build", "concurrency", {"key": "tenant_id", "max_running": 1}),
            ["'digest.build'", "concurrency.key"],
        ),
        (
            _with("digest.build", "concurrency", {"key": [], "max_running": 1}),
            ["'digest.build'", "concurrency.key"],
        ),
        (
            _with("digest.build", "concurrency", {"key": ["tenant_id"], "max_running": -1}),
            ["'digest.build'", "concurrency.max_running"],
        ),
        (
            _with("digest.build", "concurrency", {"key": ["tenant_id"]}),
            ["'digest.build'", "concurrency.max_running"],
        ),
        ('{"digest.build": 5}', ["'digest.build'", "must be an object"]),
    ],
)
def test_a_malformed_document_names_the_job_and_the_field(text: str, names: list[str]) -> None:
    with pytest.raises(ConfigurationError) as raised:
        parse_job_policies(text, JOBS)
    message = str(raised.value)
    assert message.startswith("JOB_POLICIES")
    for name in names:
        assert name in message


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '"digest.build"'])
def test_a_document_that_is_not_an_object_is_refused(text: str) -> None:
    with pytest.raises(ConfigurationError, match="JOB_POLICIES"):
        parse_job_policies(text, JOBS)


def test_the_document_overrides_what_code_declares_section_by_section() -> None:
    # Given a job that declares a retry policy and a rate limit in code
    declared = JobPolicy(
        retry=RetryPolicy(attempts=3),
        rate=RateLimit(per_minute=600),
    )
    # When JOB_POLICIES gives its own retry, turns the rate limit off and adds a concurrency key
    override = parse_job_policies(
        json.dumps(
            {
                "digest.build": {
                    "retry": {"attempts": 12, "max_delay_seconds": 3},
                    "rate": None,
                    "concurrency": {"key": ["tenant_id"], "max_running": 2},
                }
            }
        ),
        JOBS,
    )["digest.build"]
    policy = effective_policy(declared, override)
    # Then each section the document names wins, and the cleared one is gone
    assert policy == JobPolicy(
        retry=RetryPolicy(attempts=12, max_delay_seconds=3),
        concurrency=ConcurrencyLimit(key=("tenant_id",), max_running=2),
    )
    # And a section the document does not name keeps what the code says
    assert effective_policy(declared, JobPolicy(concurrency=policy.concurrency)).retry == (
        RetryPolicy(attempts=3)
    )
    assert effective_policy(declared, None) is declared


@pytest.mark.parametrize(
    ("attempt", "delay"),
    [(1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (5, 10.0), (6, 10.0), (10_000, 10.0)],
)
def test_back_off_grows_by_the_factor_up_to_the_cap(attempt: int, delay: float) -> None:
    policy = RetryPolicy(attempts=20, first_delay_seconds=1, factor=2, max_delay_seconds=10)
    assert next_delay(policy, attempt) == delay


def test_a_factor_of_one_keeps_the_first_delay() -> None:
    policy = RetryPolicy(attempts=5, first_delay_seconds=7, factor=1, max_delay_seconds=60)
    assert [next_delay(policy, n) for n in (1, 2, 50)] == [7.0, 7.0, 7.0]


def test_the_example_retry_policy_backs_off_one_two_then_three_seconds() -> None:
    retry = parse_job_policies(EXAMPLE, JOBS)["digest.build"].retry
    assert retry is not None
    assert [next_delay(retry, n) for n in range(1, 6)] == [1.0, 2.0, 3.0, 3.0, 3.0]


def test_attempts_count_from_one() -> None:
    with pytest.raises(ValueError, match="from 1"):
        next_delay(RetryPolicy(attempts=3), 0)


class _ProviderRefused(RuntimeError):
    pass


def test_final_errors_match_by_class_by_name_and_by_base() -> None:
    by_class = RetryPolicy(attempts=3, final_errors=(PermanentJobError, LookupError))
    by_name = RetryPolicy(attempts=3, final_errors=("KeyError", f"{__name__}._ProviderRefused"))
    # A subclass of a named class is final too
    assert is_final_error(by_class, KeyError("x"))
    assert is_final_error(by_name, KeyError("x"))
    assert is_final_error(by_name, _ProviderRefused())
    # And anything else is retried
    assert not is_final_error(by_class, TimeoutError())
    assert not is_final_error(by_name, RuntimeError())
    assert not is_final_error(RetryPolicy(attempts=3), KeyError("x"))


def test_a_concurrency_key_is_its_fields_values_in_order_and_typed() -> None:
    limit = ConcurrencyLimit(key=("tenant_id", "region"), max_running=1)
    value = concurrency_value(limit, {"job": "x", "tenant_id": "t42", "region": "eu", "n": 1})
    # The same fields give the same value whatever else the payload holds
    assert value == concurrency_value(limit, {"region": "eu", "tenant_id": "t42", "n": 2})
    assert value == '["t42","eu"]'
    # A number and its digits as a string are different tenants
    single = ConcurrencyLimit(key=("tenant_id",), max_running=1)
    assert concurrency_value(single, {"tenant_id": 42}) != concurrency_value(
        single, {"tenant_id": "42"}
    )


def test_a_payload_without_a_key_field_is_invalid_naming_it() -> None:
    limit = ConcurrencyLimit(key=("tenant_id",), max_running=1)
    with pytest.raises(InvalidPayload, match="'tenant_id'"):
        concurrency_value(limit, {"job": "x"})


def test_a_job_declares_its_policy_in_code_and_jobs_without_one_have_none() -> None:
    # Given a registry with one job that declares every policy and one that declares none
    declared = JobPolicy(
        retry=RetryPolicy(attempts=5, first_delay_seconds=2),
        rate=RateLimit(per_second=3),
        concurrency=ConcurrencyLimit(key=("tenant_id",), max_running=1),
    )
    registry = JobRegistry()
    registry.job(
        "report.render",
        effect=Effect.EXTERNAL_IDEMPOTENT,
        identity=("tenant_id",),
        retry=declared.retry,
        rate=declared.rate,
        concurrency=declared.concurrency,
    )(noop)
    registry.job("invoice.finalize", effect=Effect.DATABASE, identity=("invoice_id",))(noop)
    # Then the declaring job carries it, and the other carries nothing
    render = registry.get("report.render")
    plain = registry.get("invoice.finalize")
    assert render is not None
    assert plain is not None
    assert declared_policy(render) == declared
    assert declared_policy(plain).is_empty
    # And only the job with something to enforce is in force, overrides included
    overrides = parse_job_policies('{"report.render": {"rate": null}}', ["report.render"])
    in_force = policies_in_force(registry, overrides)
    assert set(in_force) == {"report.render"}
    assert in_force["report.render"].rate is None


@pytest.mark.parametrize(
    ("argument", "value", "field"),
    [
        ("retry", RetryPolicy, "retry must be a RetryPolicy"),
        ("rate", {"per_second": 3}, "rate must be a RateLimit"),
        ("concurrency", ("tenant_id",), "concurrency must be a ConcurrencyLimit"),
    ],
)
def test_a_policy_of_the_wrong_kind_fails_at_registration(
    argument: str, value: object, field: str
) -> None:
    registry = JobRegistry()
    with pytest.raises(ConfigurationError, match=f"job 'report.render': {field}"):
        registry.job("report.render", effect=Effect.EXTERNAL, **{argument: value})(noop)
    assert len(registry) == 0


def test_a_policy_that_cannot_hold_fails_where_it_is_written() -> None:
    with pytest.raises(ConfigurationError, match=r"retry\.attempts"):
        RetryPolicy(attempts=0)
    with pytest.raises(ConfigurationError, match="exactly one"):
        RateLimit()
    with pytest.raises(ConfigurationError, match=r"concurrency\.key"):
        ConcurrencyLimit(key=("",), max_running=1)
