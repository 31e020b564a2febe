"""The test kit runs the drain DrainFunction runs: a job's declared retry policy defers its
failure past Infrai's deliveries in the kit as in ``infrai-jobs drain``, a rate limit spaces its
starts, a concurrency key holds it back, a probe's answer settles it, and the kit has an
assertion for each. Fixture jobs of the test's own, on the kit's real PostgreSQL and emulator.
"""

from __future__ import annotations

import json
from urllib.parse import quote

import pytest
import redis

from infrai_jobs.aws.second_layer import KEY_PREFIX
from infrai_jobs.jobs.http_pool import LazyPool
from infrai_jobs.jobs.policy import ConcurrencyLimit, RateLimit, RetryPolicy
from infrai_jobs.jobs.probes import Done, NotDone, ProbeAnswer, Unknown
from infrai_jobs.jobs.registry import Effect, JobContext, JobRegistry, JsonValue, Payload
from infrai_local.testkit import JobKit, JobKitError, Route, open_job_kit

FLAKY = {"job": "kit.flaky", "id": "f1"}
PLAIN = {"job": "kit.plain", "id": "p1"}


def _call(payload: Payload, ctx: JobContext) -> JsonValue:
    return {"called": payload["id"]}


@pytest.fixture
def job_kit_registry() -> JobRegistry:
    registry = JobRegistry()
    registry.job(
        "kit.flaky",
        effect=Effect.EXTERNAL_IDEMPOTENT,
        identity=("id",),
        retry=RetryPolicy(attempts=5, first_delay_seconds=1, max_delay_seconds=1),
    )(_call)
    registry.job("kit.plain", effect=Effect.EXTERNAL_IDEMPOTENT, identity=("id",))(_call)
    registry.job(
        "kit.rated", effect=Effect.EXTERNAL_IDEMPOTENT, identity=("id",), rate=RateLimit(10)
    )(_call)
    registry.job(
        "kit.tenant",
        effect=Effect.EXTERNAL_IDEMPOTENT,
        identity=("id",),
        fields={"id": str, "tenant_id": str},
        concurrency=ConcurrencyLimit(key=("tenant_id",), max_running=2),
    )(_call)
    registry.job("kit.mail", effect=Effect.EXTERNAL, identity=("id",), probe=_was_mailed)(_mail)
    registry.job(
        "kit.webhook",
        effect=Effect.EXTERNAL,
        identity=("delivery_id",),
        fields={"delivery_id": str, "subscriber_id": str},
        settings=(HOOK_URL,),
        probe=_find_delivery,
    )(_deliver)
    registry.job("kit.unrouted", effect=Effect.EXTERNAL, identity=("id",), settings=(HOOK_URL,))(
        _call_a_path_nobody_serves
    )
    registry.job("kit.customer", effect=Effect.EXTERNAL, identity=("id",))(_look_up_a_customer)
    return registry


# A webhook provider of the test's own, as a team's would be: deliveries are POSTed to the
# subscriber's path, and looked up by the delivery id the job sent.
HOOK_URL = "HOOK_URL"
_http = LazyPool(connect_s=2.0, read_s=5.0)


@pytest.fixture
def job_kit_provider_routes() -> list[Route]:
    return [
        Route("POST", "/hooks/{subscriber}", key="header:X-Delivery-Id"),
        Route("GET", "/deliveries/{id}", lookup=True),
    ]


def _deliver(payload: Payload, ctx: JobContext) -> JsonValue:
    response = _http.call(
        "POST",
        f"{ctx.settings[HOOK_URL]}/hooks/{payload['subscriber_id']}",
        provider="the subscriber",
        body=json.dumps(dict(payload)),
        headers={"X-Delivery-Id": ctx.idem_key, "Content-Type": "application/json"},
    )
    return {"delivered": json.loads(response.data)["id"]}


def _find_delivery(payload: Payload, ctx: JobContext) -> ProbeAnswer:
    url = f"{ctx.settings[HOOK_URL]}/deliveries/{quote(ctx.idem_key, safe='')}"
    response = _http.request("GET", url)
    match response.status:
        case 200:
            return Done({"delivered": json.loads(response.data)["id"]})
        case 404:
            return NotDone()
        case status:
            return Unknown(f"the lookup answered HTTP {status}")


def _call_a_path_nobody_serves(payload: Payload, ctx: JobContext) -> JsonValue:
    _http.call("POST", f"{ctx.settings[HOOK_URL]}/webhooks/{payload['id']}", provider="x")
    return None


def _look_up_a_customer(payload: Payload, ctx: JobContext) -> JsonValue:
    customers: dict[str, str] = {}  # nobody created the customer the payload names
    return {"customer": customers[payload["id"]]}


# The fixture mail provider: what it has sent, which its probe asks.
MAILED: set[str] = set()


def _mail(payload: Payload, ctx: JobContext) -> JsonValue:
    MAILED.add(ctx.idem_key)
    return {"mailed": payload["id"]}


def _was_mailed(payload: Payload, ctx: JobContext) -> ProbeAnswer:
    return Done({"found": ctx.idem_key}) if ctx.idem_key in MAILED else NotDone()


def test_a_retry_policy_jobs_failure_is_deferred_in_the_kit_as_in_the_drain(
    job_kit: JobKit,
) -> None:
    # Given a job whose retry policy outlasts Infrai's three deliveries
    # When the kit is asked to see it retried into the DLQ
    with pytest.raises(JobKitError) as refused:
        job_kit.assert_retried_then_dead_lettered(FLAKY, raising=RuntimeError("down"))
    # Then it does not hold: the production drain deferred it, and the kit says so
    assert "deferred" in str(refused.value)
    assert job_kit.queue_counts() == (0, 0)


def test_the_kit_asserts_deferral_then_done(job_kit: JobKit) -> None:
    # Given the same job failing for its three deliveries, then its provider recovering
    # When the kit drains it, Then it is deferred (acked, never dead-lettered) and, when due,
    # runs once and is done
    claim = job_kit.assert_deferred_then_done(FLAKY, raising=RuntimeError("down"))
    assert claim.state == "done"
    assert job_kit.completed[job_kit.key(FLAKY)] == 1


def test_deferral_is_refused_for_a_job_without_a_retry_policy(job_kit: JobKit) -> None:
    # Given a job with no policy: its failures walk to the DLQ in three deliveries
    with pytest.raises(JobKitError) as refused:
        job_kit.assert_deferred_then_done(PLAIN, raising=RuntimeError("down"))
    assert "retry policy" in str(refused.value)
    # And the assertion that fits it holds
    job_kit.assert_retried_then_dead_lettered({**PLAIN, "id": "p2"}, raising=RuntimeError("x"))


def test_the_kit_asserts_a_rate_limit_spaces_the_starts(job_kit: JobKit) -> None:
    # Given five jobs of a job limited to 10 starts a second, published at once
    payloads = [{"job": "kit.rated", "id": f"r{n}"} for n in range(5)]
    # When the kit drains them, Then each runs once and their starts are 100 ms apart or more
    claims = job_kit.assert_rate_limited(payloads)
    assert [c.state for c in claims] == ["done"] * 5


def test_the_kit_asserts_a_concurrency_key_holds_a_job_back(job_kit: JobKit) -> None:
    # Given a tenant whose two slots other runs hold
    # When the kit drains its job, Then it is deferred uncalled, and runs once a slot is free
    claim = job_kit.assert_held_back_by_concurrency(
        {"job": "kit.tenant", "id": "t1", "tenant_id": "acme"}
    )
    assert claim.state == "done"


@pytest.mark.parametrize("effect_happened", [True, False])
def test_the_kit_asserts_what_each_reconcile_answer_does(
    job_kit: JobKit, effect_happened: bool
) -> None:
    # Given an irreversible job whose outcome is unknown: mailed with its answer lost, or not
    payload = {"job": "kit.mail", "id": f"m-{effect_happened}"}
    # When its probe is asked once the lease is over, Then it is done once either way: settled
    # from the probe's answer, or released and run by the next delivery
    claim = job_kit.assert_reconciled(payload, effect_happened=effect_happened)
    assert claim is not None
    assert claim.state == "done"
    assert job_kit.completed[job_kit.key(payload)] == 1


def test_the_kit_refuses_a_limit_assertion_for_a_job_without_that_limit(job_kit: JobKit) -> None:
    with pytest.raises(JobKitError, match="no rate limit"):
        job_kit.assert_rate_limited([PLAIN])
    with pytest.raises(JobKitError, match="no concurrency key"):
        job_kit.assert_held_back_by_concurrency(PLAIN)
    with pytest.raises(JobKitError, match="no reconcile probe"):
        job_kit.assert_reconciled(PLAIN, effect_happened=True)


@pytest.mark.parametrize("job_kit_second_layer", [{}], indirect=False)
def test_the_kit_runs_without_the_second_layer_unless_its_settings_say(
    job_kit: JobKit, job_kit_second_layer: dict[str, str]
) -> None:
    assert not job_kit.second_layer_on
    job_kit.assert_runs_once({**PLAIN, "id": "off"})


def test_the_kit_runs_a_job_under_the_second_layer_its_settings_switch_on(
    job_kit_server_url: str,
    job_kit_registry: JobRegistry,
    job_kit_provider_url: str,
    redis_url: str,
) -> None:
    # Given the kit's drain with the Redis second layer on, as DrainFunction's settings say
    client = redis.Redis.from_url(redis_url)

    def records() -> int:
        return sum(1 for _ in client.scan_iter(match=f"{KEY_PREFIX}#*", count=1000))

    before = records()
    try:
        with open_job_kit(
            job_kit_server_url,
            job_kit_registry,
            job_kit_provider_url,
            second_layer={"IDEMPOTENCY_BACKEND": "redis", "REDIS_URL": redis_url},
        ) as kit:
            # When a job is published twice, Then its effect happens once, and the drain that
            # ran it wrapped the call in the second layer: one more record in Redis
            assert kit.second_layer_on
            kit.assert_runs_once({**PLAIN, "id": "second-layer"})
        assert records() == before + 1
    finally:
        client.close()


WEBHOOK = {"job": "kit.webhook", "delivery_id": "d1", "subscriber_id": "sub-7"}


def test_a_job_with_a_provider_of_its_own_runs_once_against_its_stand_in(
    job_kit: JobKit,
) -> None:
    # Given a webhook job whose provider's routes the test gave the kit (its own URL path)
    # When it is published twice and drained
    job_kit.assert_runs_once(WEBHOOK)
    # Then the stand-in received one delivery, on the subscriber's path, under the job's key
    state = job_kit.provider_state()
    key = job_kit.key(WEBHOOK)
    assert state["effects"] == {f"/hooks/sub-7 {key}": 1}
    assert [call["path"] for call in state["received"][key]] == ["/hooks/sub-7"]


@pytest.mark.parametrize("effect_happened", [True, False])
def test_a_jobs_probe_asks_its_own_lookup_route_and_the_kit_settles_it(
    job_kit: JobKit, effect_happened: bool
) -> None:
    # Given the webhook job's delivery outcome is unknown: delivered with its answer lost, or not
    payload = {**WEBHOOK, "delivery_id": f"d-{effect_happened}"}
    # When its probe asks the stand-in's lookup route (GET /deliveries/<id>), answered from what
    # the stand-in received, Then it is done once either way
    claim = job_kit.assert_reconciled(payload, effect_happened=effect_happened)
    assert claim.state == "done"
    assert job_kit.completed[job_kit.key(payload)] == 1
    assert job_kit.provider_state()["calls"]["GET /deliveries/{id}"] == 1


def test_a_failing_provider_stand_in_sends_the_job_to_a_human(job_kit: JobKit) -> None:
    # Given the stand-in answering 503 to every call (it may have acted: the pool says uncertain)
    job_kit.provider_faults(fail_rate=1.0)
    # When the webhook job runs, Then it is stuck for a human, never called again
    claim = job_kit.assert_stuck_when_uncertain({**WEBHOOK, "delivery_id": "d-503"})
    assert claim.error is not None
    assert job_kit.provider_state()["effects"] == {}


def test_a_job_calling_a_path_its_stand_in_lacks_fails_saying_which_and_how_to_add_it(
    job_kit: JobKit,
) -> None:
    # Given a job that calls a path no route of its stand-in serves
    with pytest.raises(JobKitError) as failed:
        job_kit.assert_runs_once({"job": "kit.unrouted", "id": "u1"})
    # Then the failure names the request and the fixture that gives the stand-in a route
    assert "no route for POST /webhooks/u1" in str(failed.value)
    assert "job_kit_provider_routes" in str(failed.value)


def test_a_handler_that_raises_fails_the_kit_naming_what_it_raised(job_kit: JobKit) -> None:
    # Given a job whose handler raises KeyError on every delivery
    # When the kit asserts it runs once
    with pytest.raises(JobKitError) as failed:
        job_kit.assert_runs_once({"job": "kit.customer", "id": "c_404"})
    # Then the failure says it never completed, and names what the handler last raised
    assert "completed 0 times, not once" in str(failed.value)
    assert "the handler last raised KeyError: 'c_404'" in str(failed.value)
    assert "traceback: the drain's log record" in str(failed.value)
