"""Flow control through the real drain: the emulator over HTTP, the ledger in PostgreSQL, the
example jobs against the provider sink, and ``JOB_POLICIES`` in the shape the issue gives.

Delays are the database's and a few seconds long at most; where a test must not wait for one,
it does what an operator's ``claims run-now`` does (``OperatorLedger.run_deferred_now``).
"""

from __future__ import annotations

import itertools
import json
import textwrap
import threading
import time
from contextlib import closing
from typing import Any

import psycopg
import pytest
import urllib3
from drainkit import OPERATOR, QUEUE, Harness, harness, run_cli, run_until_killed

from infrai_jobs.drain.features import Lanes
from infrai_jobs.drain.flow import FlowControl, flow_control
from infrai_jobs.drain.loop import drain_invocation
from infrai_jobs.drain.model import DrainConfig, DrainFeature, DrainRun, DrainSummary
from infrai_jobs.errors import ConfigurationError, LedgerUnavailable
from infrai_jobs.flow.policies import parse_job_policies, policies_in_force
from infrai_jobs.jobs.policy import ConcurrencyLimit, RateLimit
from infrai_jobs.jobs.registry import Effect, JobContext, JobRegistry, JsonValue, Payload
from infrai_jobs.queue.client import HttpRetryPolicy, InfraiClient
from infrai_jobs.work import store as flow_ledger
from infrai_jobs.work.ledger import PostgresLedger
from infrai_local.operator.verbs import OperatorLedger

JOB_POLICIES = json.dumps(
    {
        "digest.build": {
            "retry": {
                "attempts": 12,
                "first_delay_seconds": 1,
                "factor": 2,
                "max_delay_seconds": 3,
            },
            "concurrency": {"key": ["tenant_id"], "max_running": 1},
        },
        "receipt.send": {"rate": {"per_second": 20}},
    }
)
DIGEST = {"job": "digest.build", "tenant_id": "tenant_7", "period": "2026-11"}


def flow_for(kit: Harness, overrides: str = JOB_POLICIES) -> FlowControl:
    parsed = policies_in_force(
        kit.registry, parse_job_policies(overrides, [job.name for job in kit.registry])
    )
    flow = flow_control(kit.registry, parsed, queue=QUEUE)
    assert flow is not None
    return flow


def drain_with(
    kit: Harness,
    flow: FlowControl,
    *,
    client: InfraiClient | None = None,
    ledger: PostgresLedger | None = None,
    registry: JobRegistry | None = None,
    lanes: Lanes | None = None,
) -> DrainSummary:
    """One drain invocation as DrainFunction runs it (every feature's around_drain, then the
    lane), with flow control and, when given, lanes as its features."""
    features: list[DrainFeature] = [flow] if lanes is None else [flow, lanes]
    run = DrainRun(
        queue=client or kit.client,
        ledger=ledger or kit.ledger,
        config=DrainConfig(queue=QUEUE, features=features),
        time_left_ms=lambda: 60_000,
        stop_requested=lambda: False,
    )
    return drain_invocation(run, registry or kit.registry)


def sink(kit: Harness, method: str, path: str, **kwargs: Any) -> Any:
    response = urllib3.request(method, f"{kit.sink.url}{path}", **kwargs)
    assert response.status == 200, response.data
    return json.loads(response.data)


def digests_built(kit: Harness) -> int:
    return sum(sink(kit, "GET", "/_sink/state")["digests"].values())


def deferred_row(kit: Harness, key: str) -> dict[str, Any] | None:
    rows = kit.sql("SELECT state, attempts, last_error FROM job_claims WHERE idem_key = %s", (key,))
    return None if not rows else {"state": rows[0][0], "attempts": rows[0][1], "error": rows[0][2]}


def run_now(kit: Harness, key: str) -> None:
    OperatorLedger(kit.database_url).run_deferred_now(key, actor="test")


def deferred_once(kit: Harness, flow: FlowControl) -> str:
    """Publish DIGEST with the digest provider refusing every call, and drain: its first
    delivery is deferred (the ledger holds it); its key."""
    sink(kit, "POST", "/_sink/faults", json={"fail_rate": 1.0})
    kit.publish(DIGEST)
    assert drain_with(kit, flow).outcomes == {"deferred": 1}
    return kit.registry.derive(DIGEST).idem_key


def deferred_after_three_refusals(kit: Harness, flow: FlowControl) -> str:
    """``deferred_once``, then run twice more as deferred work (made due as ``claims run-now``
    does), so it waits with three failed attempts; its key."""
    key = deferred_once(kit, flow)
    for _ in range(2):
        run_now(kit, key)
        assert drain_with(kit, flow).counters["deferred_ran"] == 1
    assert kit.client.stats(QUEUE).available_count == 0
    return key


def assert_built_once_by_a_deferred_run(kit: Harness, key: str, summary: DrainSummary) -> None:
    """The drain that produced ``summary`` finished the deferred digest: built once, claim done."""
    assert summary.counters["deferred_done"] == 1
    assert digests_built(kit) == 1
    claim = kit.row(key)
    assert claim is not None
    assert claim.state == "done"


def taken_external_run(kit: Harness, number: str, *, began: bool) -> str:
    """A deferred ``test.ext`` job taken by a drain that then died (its lease over), after its
    handler was called or before; its key."""
    payload = {"job": "test.ext", "id": number}
    key = kit.registry.derive(payload).idem_key
    with psycopg.connect(kit.database_url, autocommit=True) as conn:
        work = flow_ledger.DeferredWork(key, "test.ext", "external", payload, f"m-{number}")
        flow_ledger.defer(conn, work, attempts=3, error="test", delay_seconds=0)
        (taken,) = flow_ledger.take_due(conn, 1, lease_seconds=60)
        assert taken.idem_key == key
        assert taken.claim_token is not None
        if began:
            assert flow_ledger.begin(conn, key, taken.claim_token)
    kit.sql("UPDATE job_claims SET lease_until = now() - interval '1 second'")
    return key


def drain_with_an_external_retry_policy(kit: Harness) -> DrainSummary:
    """One drain with flow control, ``test.ext`` given a retry policy (so its deferred runs are
    the ledger's to take again)."""
    with closing(flow_for(kit, json.dumps({"test.ext": {"retry": {"attempts": 5}}}))) as flow:
        return drain_with(kit, flow)


@pytest.fixture
def kit(database_url: str) -> Any:
    with harness(database_url) as kit:
        yield kit


def test_an_outage_past_three_deliveries_is_deferred_not_dead_lettered(kit: Harness) -> None:
    # Given the digest provider refusing every call, and digest.build's retry policy
    with closing(flow_for(kit)) as flow:
        sink(kit, "POST", "/_sink/faults", json={"fail_rate": 1.0})
        kit.publish(DIGEST)
        key = kit.registry.derive(DIGEST).idem_key
        # The first delivery fails: the ledger takes the work at once and the message is
        # acked, so no later death can spend the message's last delivery
        summary = drain_with(kit, flow)
        assert summary.outcomes == {"deferred": 1}, summary.as_dict()
        assert summary.acked == 1
        assert summary.deferred == 1
        assert deferred_row(kit, key) == {
            "state": "deferred",
            "attempts": 1,
            "error": "RuntimeError: digest provider answered HTTP 503; will retry",
        }
        # Failing twice more as deferred work, past the three deliveries the message had
        for attempt in (2, 3):
            run_now(kit, key)
            assert drain_with(kit, flow).counters["deferred_ran"] == 1
            assert deferred_row(kit, key)["attempts"] == attempt  # type: ignore[index]
        assert kit.client.stats(QUEUE).dlq_count == 0
        held = kit.row(key)  # the claim waits as deferred work: the ledger owns it
        assert held is not None
        assert held.owned

        # A copy of the deferred job is acked and never runs
        kit.publish(DIGEST)
        summary = drain_with(kit, flow)
        assert summary.outcomes == {"deferred": 1}, summary.as_dict()
        assert summary.counters["deferred_ran"] == 0  # not due yet

        # Still refused when it comes due: postponed, attempt 4 recorded
        run_now(kit, key)
        summary = drain_with(kit, flow)
        assert summary.counters["deferred_ran"] == 1
        assert deferred_row(kit, key)["state"] == "deferred"  # type: ignore[index]
        assert deferred_row(kit, key)["attempts"] == 4  # type: ignore[index]

        # When the provider recovers, it runs once and is done
        sink(kit, "POST", "/_sink/faults", json={"fail_rate": 0.0})
        run_now(kit, key)
        summary = drain_with(kit, flow)
        assert summary.counters["deferred_ran"] == 1
        assert summary.counters["deferred_done"] == 1
        assert deferred_row(kit, key)["state"] == "done"  # type: ignore[index]
        row = kit.row(key)
        assert row is not None
        assert row.state == "done"
        assert digests_built(kit) == 1
        # A later copy is an ordinary duplicate of done
        kit.publish(DIGEST)
        assert drain_with(kit, flow).outcomes == {"duplicate_done": 1}
        assert digests_built(kit) == 1
        assert kit.client.stats(QUEUE).dlq_count == 0


def test_a_job_without_a_policy_still_reaches_the_dlq(kit: Harness) -> None:
    # JOB_POLICIES without digest.build: its three deliveries fail, the DLQ takes it
    with closing(flow_for(kit, json.dumps({"receipt.send": {"rate": {"per_second": 20}}}))) as flow:
        sink(kit, "POST", "/_sink/faults", json={"fail_rate": 1.0})
        kit.publish(DIGEST)
        for _ in range(3):
            assert drain_with(kit, flow).outcomes == {"retry": 1}
            kit.advance()
        assert kit.client.stats(QUEUE).dlq_count == 1
        assert kit.sql("SELECT count(*) FROM job_claims WHERE run_after IS NOT NULL") == [(0,)]


def test_a_deferred_job_out_of_attempts_fails_with_its_reason(kit: Harness) -> None:
    short = json.dumps(
        {"digest.build": {"retry": {"attempts": 4, "first_delay_seconds": 1, "factor": 1}}}
    )
    with closing(flow_for(kit, short)) as flow:
        key = deferred_after_three_refusals(kit, flow)
        assert deferred_row(kit, key)["attempts"] == 3  # type: ignore[index]
        run_now(kit, key)
        summary = drain_with(kit, flow)
        assert summary.counters["deferred_failed"] == 1
        row = deferred_row(kit, key)
        assert row is not None
        assert row["state"] == "failed"
        assert row["error"].startswith("out of attempts (4): RuntimeError")
        claim = kit.row(key)
        assert claim is not None
        assert claim.state == "failed"
        assert digests_built(kit) == 0


def test_a_policy_on_a_database_job_is_refused_naming_it(kit: Harness) -> None:
    with pytest.raises(ConfigurationError, match=r"invoice\.finalize.*database"):
        flow_for(kit, json.dumps({"invoice.finalize": {"retry": {"attempts": 5}}}))


FLOW_RUNS_DDL = (
    "CREATE TABLE IF NOT EXISTS flow_runs (idem_key text PRIMARY KEY, tenant text NOT NULL, "
    "delivery int NOT NULL, started_at timestamptz NOT NULL, ended_at timestamptz)"
)


def add_counted_job(
    registry: JobRegistry, name: str, database_url: str, hold_s: float, **policy: Any
) -> None:
    """An external job that records its start and end on the database's clock, per tenant."""

    def run(payload: Payload, ctx: JobContext) -> JsonValue:
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO flow_runs (idem_key, tenant, delivery, started_at) "
                "VALUES (%s, %s, %s, clock_timestamp())",
                (ctx.idem_key, payload["tenant_id"], ctx.delivery_count),
            )
            time.sleep(hold_s)
            conn.execute(
                "UPDATE flow_runs SET ended_at = clock_timestamp() WHERE idem_key = %s",
                (ctx.idem_key,),
            )
        return {"ok": True}

    registry.job(name, effect=Effect.EXTERNAL, identity=("id",), **policy)(run)


def drains_until_empty(kit: Harness, *, lanes: int = 1) -> None:
    """Four drains at once, each with its own client, ledger and flow control (the policies the
    jobs declare in code), until the queue and the deferred backlog are empty."""
    made = flows(kit, kit.registry, 4)
    try:
        _drains_until_empty(kit, made, lanes)
    finally:
        for flow in made:
            flow.close()


def _drains_until_empty(kit: Harness, flows: list[FlowControl], lanes: int) -> None:

    def one(flow: FlowControl) -> None:
        client = InfraiClient(kit.server.url, "test-key", retry=HttpRetryPolicy(base_delay=0.01))
        ledger = PostgresLedger(kit.database_url)
        lane_feature = Lanes(lanes, lambda: PostgresLedger(kit.database_url)) if lanes > 1 else None
        try:
            for _ in range(200):
                summary = drain_with(kit, flow, client=client, ledger=ledger, lanes=lane_feature)
                with psycopg.connect(kit.database_url) as conn:
                    (waiting,) = conn.execute(
                        "SELECT count(*) FROM job_claims"
                        " WHERE run_after IS NOT NULL AND state IN ('deferred', 'running')"
                    ).fetchone() or (0,)
                if summary.consumed == 0 and waiting == 0:
                    return
                time.sleep(0.05)
        finally:
            if lane_feature is not None:
                lane_feature.close()
            ledger.close()
            client.close()

    threads = [threading.Thread(target=one, args=(flow,)) for flow in flows]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=240)
    assert not any(thread.is_alive() for thread in threads)


def flows(kit: Harness, registry: JobRegistry, count: int) -> list[FlowControl]:
    made = []
    for _ in range(count):
        flow = flow_control(
            registry,
            policies_in_force(registry, {}),  # what the jobs declare in code
            queue=QUEUE,
        )
        assert flow is not None
        made.append(flow)
    return made


def test_a_concurrency_key_never_lets_one_tenant_run_twice_at_once(kit: Harness) -> None:
    kit.sql(FLOW_RUNS_DDL)
    add_counted_job(
        kit.registry,
        "test.tenant",
        kit.database_url,
        0.05,
        concurrency=ConcurrencyLimit(key=("tenant_id",), max_running=1),
    )
    for n in range(24):
        kit.publish({"job": "test.tenant", "id": n, "tenant_id": f"t{n % 3}"})
    drains_until_empty(kit, lanes=2)
    runs = kit.sql("SELECT tenant, started_at, ended_at FROM flow_runs ORDER BY started_at")
    assert len(runs) == 24  # every job ran, once (the primary key refuses a second run)
    overlapping = [
        (a, b) for i, a in enumerate(runs) for b in runs[i + 1 :] if a[0] == b[0] and b[1] < a[2]
    ]
    assert overlapping == []
    assert kit.client.stats(QUEUE).dlq_count == 0


def test_a_rate_limit_holds_across_drains_and_loses_nothing(kit: Harness) -> None:
    # 200 jobs limited to 20 starts a second, run by four drains at once
    kit.sql(FLOW_RUNS_DDL)
    add_counted_job(
        kit.registry, "test.rated", kit.database_url, 0.0, rate=RateLimit(per_second=20)
    )
    for n in range(200):
        kit.publish({"job": "test.rated", "id": n, "tenant_id": "t"})
    drains_until_empty(kit)
    # Every job ran once, from its first delivery: the limit never cost a redelivery
    assert kit.sql("SELECT count(*), max(delivery) FROM flow_runs") == [(200, 1)]
    # No one-second window of the starts the database recorded holds more than 20: start n
    # comes at least n // 20 seconds after the first, so the last at least 9 s after it
    starts = [
        row[0].timestamp()
        for row in kit.sql(
            "SELECT started_at FROM flow_rate_starts WHERE job = 'test.rated' ORDER BY started_at"
        )
    ]
    assert len(starts) == 200
    busiest = max(sum(1 for t in starts[i:] if t < start + 1.0) for i, start in enumerate(starts))
    assert busiest <= 20
    assert starts[-1] - starts[0] >= 9.0
    assert kit.client.stats(QUEUE).dlq_count == 0


def test_jobs_without_a_policy_take_no_flow_control_round_trip(kit: Harness) -> None:
    # With only receipt.send limited, and every time flow control asks the lane's ledger for its
    # connection counted (and refused)
    connects: list[int] = []

    class Refusing(PostgresLedger):
        def connection(self) -> psycopg.Connection[Any]:
            connects.append(1)
            raise LedgerUnavailable("flow control's database is down (test)")

    parsed = policies_in_force(
        kit.registry,
        parse_job_policies(
            json.dumps({"receipt.send": {"rate": {"per_second": 20}}}),
            [job.name for job in kit.registry],
        ),
    )
    flow = flow_control(kit.registry, parsed, queue=QUEUE)
    assert flow is not None
    kit.publish(DIGEST)
    refusing = Refusing(kit.database_url)
    try:
        summary = drain_with(kit, flow, ledger=refusing)
    finally:
        refusing.close()
    # A digest runs as it would without flow control: only the two due-work passes (before and
    # after the consumes) asked for a connection, the digest's run never did
    assert summary.outcomes == {"done": 1}
    assert len(connects) == 2


# A drain process that runs the due deferred work with JOB_POLICIES and SIGKILLs itself right
# after the digest provider answered: the effect happened, the ledger never heard.
KILL_AFTER_THE_CALL = textwrap.dedent(
    """
    import os, signal, sys
    import psycopg
    import fixture_jobs.digest as digest
    from drainkit import QUEUE, add_test_jobs
    from infrai_jobs.drain.flow import flow_control
    from infrai_jobs.drain.loop import drain_invocation
    from infrai_jobs.drain.model import DrainConfig, DrainRun
    from infrai_jobs.flow.policies import parse_job_policies, policies_in_force
    from infrai_jobs.work.ledger import PostgresLedger
    from infrai_jobs.queue.client import InfraiClient
    from fixture_jobs import build_registry

    base_url, database_url, provider_url, policies = sys.argv[1:5]
    call = digest._http.request

    def call_then_die(*args, **kwargs):
        answer = call(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGKILL)
        return answer

    digest._http.request = call_then_die
    registry = build_registry()
    add_test_jobs(registry, database_url)
    registry.bind_settings(dict.fromkeys(registry.declared_settings(), provider_url))
    flow = flow_control(
        registry,
        policies_in_force(registry, parse_job_policies(policies, [job.name for job in registry])),
        queue=QUEUE,
    )
    run = DrainRun(
        queue=InfraiClient(base_url, "test-key"),
        ledger=PostgresLedger(database_url),
        config=DrainConfig(queue=QUEUE, features=[flow]),
        time_left_ms=lambda: 60_000,
        stop_requested=lambda: False,
    )
    drain_invocation(run, registry)
    """
)


def test_a_drain_killed_inside_a_deferred_run_never_repeats_the_effect(kit: Harness) -> None:
    # Given a digest deferred by its retry policy and due now
    with closing(flow_for(kit)) as flow:
        key = deferred_after_three_refusals(kit, flow)
        sink(kit, "POST", "/_sink/faults", json={"fail_rate": 0.0})
        run_now(kit, key)
        # When a drain is SIGKILLed right after the provider built the digest
        run_until_killed(
            KILL_AFTER_THE_CALL, kit.server.url, kit.database_url, kit.sink.url, JOB_POLICIES
        )
        assert deferred_row(kit, key)["state"] == "running"  # type: ignore[index]
        assert digests_built(kit) == 1
        # Then, once its lease is over, a drain takes the key-passing job again; the provider
        # answers with the digest it built, and nothing is built twice
        kit.sql("UPDATE job_claims SET lease_until = now() - interval '1 second'")
        kit.sql("UPDATE flow_concurrency_slots SET lease_until = now() - interval '1 second'")
        summary = drain_with(kit, flow)
        assert deferred_row(kit, key)["state"] == "done"  # type: ignore[index]
        assert_built_once_by_a_deferred_run(kit, key, summary)


def test_a_deferred_job_a_limit_holds_back_keeps_its_attempts_and_its_last_error(
    kit: Harness,
) -> None:
    # Given a digest deferred after three refused deliveries, due now
    with closing(flow_for(kit)) as flow:
        key = deferred_after_three_refusals(kit, flow)
        before = deferred_row(kit, key)
        assert before is not None
        assert before["attempts"] == 3
        sink(kit, "POST", "/_sink/faults", json={"fail_rate": 0.0})
        # and its tenant's one concurrency slot held by another live run
        kit.sql(
            "INSERT INTO flow_concurrency_slots (token, job, key_value, holder, lease_until) "
            "VALUES (gen_random_uuid(), 'digest.build', '[\"tenant_7\"]', 'other', "
            "now() + interval '1 hour')"
        )
        run_now(kit, key)
        # When a drain takes it, it is held back without running, as many times as it takes
        for _ in range(3):
            summary = drain_with(kit, flow)
            assert summary.counters["deferred_ran"] == 0
            run_now(kit, key)
        # Then no attempt was spent and the last failure is still the one shown
        assert deferred_row(kit, key) == before
        assert digests_built(kit) == 0
        # And once the slot is free it runs, and is done
        kit.sql("DELETE FROM flow_concurrency_slots WHERE holder = 'other'")
        summary = drain_with(kit, flow)
        assert summary.counters["deferred_done"] == 1
        assert digests_built(kit) == 1


@pytest.mark.parametrize(
    ("began", "then"),
    [
        # Its run's lease ran out mid-run: no drain runs it again, its effect may have happened
        pytest.param(True, ("deferred_ran", 0, "running", 1), id="began-left-for-a-human"),
        # Its drain died before the call: nothing began, so the next drain runs it, once
        pytest.param(False, ("deferred_done", 1, "done", 0), id="never-began-taken-again"),
    ],
)
def test_an_external_deferred_run_whose_drain_died_runs_again_only_if_it_never_began(
    kit: Harness, began: bool, then: tuple[str, int, str, int]
) -> None:
    counter, effects, state, backlog = then
    # Given an irreversible job the ledger holds, taken by a drain that died
    key = taken_external_run(kit, "x1" if began else "x2", began=began)
    # When the next drain looks for due deferred work
    summary = drain_with_an_external_retry_policy(kit)
    # Then it ran it (once) or left it, as the call began or not
    assert summary.counters[counter] == effects
    assert kit.external_effects(key) == effects
    assert deferred_row(kit, key)["state"] == state  # type: ignore[index]
    with psycopg.connect(kit.database_url, autocommit=True) as conn:
        assert flow_ledger.deferred_stats(conn).backlog == backlog


# --- A deferred run left for a human, and the human's commands ----------------------------------


def test_claims_resolve_done_settles_a_stuck_deferred_run_and_no_drain_runs_it(
    kit: Harness,
) -> None:
    # Given an irreversible deferred run left for a human (it began, then its drain died)
    key = taken_external_run(kit, "h1", began=True)
    # When the on-call looks it up, it is shown as the running deferred work it is
    shown = run_cli(kit, "claims", "show", key)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith(
        "deferred work, owned by the ledger (claims list --state deferred):"
    )
    claim = json.loads(run_cli(kit, "claims", "show", key, "--json").stdout)["claim"]
    assert claim["state"] == "running"
    assert claim["run_after"] is not None
    # And when they check the provider and resolve it as done, with the provider's reference
    finished = run_cli(
        kit, "claims", "resolve", key, "--done", "--result", '{"ref": "p-1"}', "--note", "seen"
    )
    # Then it is done, its claim settled done with the result, and recorded with who did it
    assert finished.returncode == 0, finished.stderr
    assert deferred_row(kit, key)["state"] == "done"  # type: ignore[index]
    assert kit.sql("SELECT state, result FROM job_claims WHERE idem_key = %s", (key,)) == [
        ("done", {"ref": "p-1"})
    ]
    assert kit.history(key)[-1] == ("resolve_done", OPERATOR, "seen")
    # And no drain runs it, and nothing is left in the backlog
    assert drain_with_an_external_retry_policy(kit).counters["deferred_ran"] == 0
    assert kit.external_effects(key) == 0
    with psycopg.connect(kit.database_url, autocommit=True) as conn:
        assert flow_ledger.deferred_stats(conn).backlog == 0


def test_claims_resolve_failed_ends_a_stuck_deferred_run_as_a_dead_letter(kit: Harness) -> None:
    # Given an irreversible deferred run left for a human
    key = taken_external_run(kit, "h2", began=True)
    # When the provider has no trace of it and the on-call gives it up
    finished = run_cli(kit, "claims", "resolve", key, "--failed", "--error", "no trace of it")
    # Then it is failed, and held by the ledger as a dead letter that dlq lists and redrive can
    # publish again
    assert finished.returncode == 0, finished.stderr
    assert deferred_row(kit, key)["state"] == "failed"  # type: ignore[index]
    assert kit.sql(
        "SELECT resolution, reason LIKE '%%no trace of it%%' FROM dead_letters WHERE idem_key = %s",
        (key,),
    ) == [(None, True)]
    assert kit.history(key)[-1] == ("resolve_failed", OPERATOR, None)


def test_claims_release_makes_a_stuck_deferred_run_run_again_once(kit: Harness) -> None:
    # Given an irreversible deferred run left for a human
    key = taken_external_run(kit, "h3", began=True)
    # When the provider has no trace of it and the on-call releases it
    finished = run_cli(kit, "claims", "release", key, "--note", "provider has no trace")
    # Then it waits again, due now, and the next drain runs it once
    assert finished.returncode == 0, finished.stderr
    assert deferred_row(kit, key)["state"] == "deferred"  # type: ignore[index]
    assert kit.history(key)[-1] == ("release", OPERATOR, "provider has no trace")
    assert drain_with_an_external_retry_policy(kit).counters["deferred_done"] == 1
    assert drain_with_an_external_retry_policy(kit).counters["deferred_ran"] == 0
    assert kit.external_effects(key) == 1


def test_a_deferred_run_under_a_live_lease_or_still_waiting_is_refused_in_one_line(
    kit: Harness,
) -> None:
    # Given a deferred run a drain holds right now, and one still waiting
    payload = {"job": "test.ext", "id": "h4"}
    key = kit.registry.derive(payload).idem_key
    with psycopg.connect(kit.database_url, autocommit=True) as conn:
        work = flow_ledger.DeferredWork(key, "test.ext", "external", payload, "m-h4")
        flow_ledger.defer(conn, work, attempts=1, error="test", delay_seconds=0)
        (taken,) = flow_ledger.take_due(conn, 1, lease_seconds=600)
    waiting = flow_ledger.DeferredWork("test.ext:h5", "test.ext", "external", payload, "m-h5")
    with psycopg.connect(kit.database_url, autocommit=True) as conn:
        flow_ledger.defer(conn, waiting, attempts=1, error="test", delay_seconds=3600)
    # When the on-call releases the held one without its token
    held = run_cli(kit, "claims", "release", key)
    # Then it is refused (exit 3) in one line saying to wait for the lease
    assert held.returncode == 3
    assert held.stderr.count("\n") == 1
    assert "wait for the lease to end" in held.stderr
    # And with its token too: only the run holding a live lease changes it
    forced = run_cli(kit, "claims", "release", key, "--token", str(taken.claim_token))
    assert forced.returncode == 3
    assert deferred_row(kit, key)["state"] == "running"  # type: ignore[index]
    # And resolving waiting work is refused, pointing at the commands for it
    early = run_cli(kit, "claims", "resolve", "test.ext:h5", "--done")
    assert early.returncode == 3
    assert "claims run-now" in early.stderr
    assert "claims cancel" in early.stderr
    assert deferred_row(kit, "test.ext:h5")["state"] == "deferred"  # type: ignore[index]


@pytest.mark.parametrize("grace_seconds", [5.0, 240.0])
def test_a_concurrency_slot_lives_exactly_as_long_as_the_lease_its_run_holds(
    kit: Harness, grace_seconds: float
) -> None:
    # Given a job with a concurrency key that, while it runs, reads its slot's lease and the
    # lease its claim stored, under a drain whose lease grace is not the default
    seen: list[tuple[Any, Any]] = []

    def run(payload: Payload, ctx: JobContext) -> JsonValue:
        with psycopg.connect(kit.database_url, autocommit=True) as conn:
            row = conn.execute(
                "SELECT s.lease_until, c.lease_until FROM flow_concurrency_slots s "
                "JOIN job_claims c ON c.claim_token = s.token WHERE c.idem_key = %s",
                (ctx.idem_key,),
            ).fetchone()
        seen.append(row if row is not None else (None, None))
        return {"ok": True}

    kit.registry.job(
        "test.slot",
        effect=Effect.EXTERNAL,
        identity=("id",),
        concurrency=ConcurrencyLimit(key=("tenant_id",), max_running=1),
    )(run)
    (flow,) = flows(kit, kit.registry, 1)
    kit.publish({"job": "test.slot", "id": 1, "tenant_id": "t1"})
    try:
        summary = drain_invocation(
            DrainRun(
                queue=kit.client,
                ledger=kit.ledger,
                config=DrainConfig(queue=QUEUE, features=[flow], lease_grace_seconds=grace_seconds),
                time_left_ms=lambda: 60_000,
                stop_requested=lambda: False,
            ),
            kit.registry,
        )
    finally:
        flow.close()
    # Then the run held a slot whose lease is the claim's own, to the microsecond
    assert summary.done == 1
    ((slot_until, claim_until),) = seen
    assert claim_until is not None
    assert slot_until == claim_until


def test_a_policy_job_killed_in_its_third_run_is_built_once_and_never_dead_lettered(
    kit: Harness,
) -> None:
    # Given a digest with ten attempts whose provider refuses its first two calls
    ten = json.dumps({"digest.build": {"retry": {"attempts": 10, "first_delay_seconds": 1}}})
    with closing(flow_for(kit, ten)) as flow:
        key = deferred_once(kit, flow)
        run_now(kit, key)
        assert drain_with(kit, flow).counters["deferred_ran"] == 1
        # When the drain holding its third run is SIGKILLed inside the provider call
        sink(kit, "POST", "/_sink/faults", json={"fail_rate": 0.0})
        run_now(kit, key)
        run_until_killed(KILL_AFTER_THE_CALL, kit.server.url, kit.database_url, kit.sink.url, ten)
        # And the queue's clock passes every visibility timeout its message could have had,
        # while the watcher collects Infrai's DLQ and drains run after the run's lease is over
        for _ in range(4):
            kit.advance()
        kit.sql("UPDATE job_claims SET lease_until = now() - interval '1 second'")
        collected = run_cli(kit, "dlq", "--json")
        assert collected.returncode == 0, collected.stderr
        summary = drain_with(kit, flow)
        # Then the digest is built once, and neither Infrai nor the ledger holds a dead letter
        assert_built_once_by_a_deferred_run(kit, key, summary)
        assert kit.client.stats(QUEUE).dlq_count == 0
        assert json.loads(collected.stdout)["messages"] == []
        assert kit.sql("SELECT count(*) FROM dead_letters") == [(0,)]


def test_a_rate_limit_holds_where_the_provider_counts_the_calls(kit: Harness) -> None:
    # Given a job limited to 5 starts a second whose "provider" notes when each call arrives
    arrivals: list[float] = []
    guard = threading.Lock()

    def call_the_provider(payload: Payload, ctx: JobContext) -> JsonValue:
        with guard:
            arrivals.append(time.monotonic())
        return {"ok": True}

    kit.registry.job(
        "test.provider", effect=Effect.EXTERNAL, identity=("id",), rate=RateLimit(per_second=5)
    )(call_the_provider)
    for n in range(20):
        kit.publish({"job": "test.provider", "id": n})
    # When four drains of two lanes each run them at once
    drains_until_empty(kit, lanes=2)
    # Then every job ran once, and the starts the ledger reserved are 200 ms apart or more
    assert len(arrivals) == 20
    starts = [
        row[0]
        for row in kit.sql(
            "SELECT started_at FROM flow_rate_starts WHERE job = 'test.provider' ORDER BY 1"
        )
    ]
    assert min((b - a).total_seconds() for a, b in itertools.pairwise(starts)) >= 0.2
    # And no window at the provider holds more than 5 calls: each call leaves when its reserved
    # start comes, so a window of one second less the calls' jitter (allowed: 100 ms, half the
    # spacing) never holds a sixth
    arrivals.sort()
    busiest = max(sum(1 for t in arrivals if a <= t < a + 0.9) for a in arrivals)
    assert busiest <= 5


def test_a_rate_limited_job_is_prepared_once_before_its_first_start_is_reserved(
    kit: Harness,
) -> None:
    # Given a rate-limited job whose client takes a while to build (prepare)
    seen_starts: list[int] = []

    def prepare() -> None:
        ((reserved,),) = kit.sql("SELECT count(*) FROM flow_rate_starts")
        seen_starts.append(int(reserved))
        time.sleep(0.3)

    kit.registry.job(
        "test.prepared",
        effect=Effect.EXTERNAL,
        identity=("id",),
        rate=RateLimit(per_second=50),
        prepare=prepare,
    )(lambda payload, ctx: {"ok": True})
    for n in range(3):
        kit.publish({"job": "test.prepared", "id": n})
    # When a drain runs the jobs
    (flow,) = flows(kit, kit.registry, 1)
    try:
        summary = drain_with(kit, flow)
    finally:
        flow.close()
    # Then it was prepared once, before any start was reserved, and all three ran
    assert summary.done == 3
    assert seen_starts == [0]


def deliveries_all_died(kit: Harness, messages: int) -> None:
    """Consume the queue's ``messages`` three times without acking, the queue's clock moved a
    visibility timeout each time, as drains that all died would: Infrai dead-letters them."""
    for _ in range(3):
        assert len(kit.client.consume(QUEUE)) == messages
        kit.advance()
    assert kit.client.consume(QUEUE) == []


def test_a_policy_job_whose_three_deliveries_all_died_is_taken_back_not_dead_lettered(
    kit: Harness,
) -> None:
    # Given a digest with ten attempts whose three deliveries were each taken by a drain that
    # died before its run ended (consumed, never acked): Infrai moved it to its DLQ
    ten = json.dumps({"digest.build": {"retry": {"attempts": 10, "first_delay_seconds": 1}}})
    key = kit.registry.derive(DIGEST).idem_key
    kit.publish(DIGEST)
    deliveries_all_died(kit, 1)
    assert kit.client.stats(QUEUE).dlq_count == 1
    # When the watcher's `infrai-jobs dlq` moves Infrai's dead letters into the ledger
    collected = run_cli(kit, "dlq", "--json", JOB_POLICIES=ten)
    # Then the digest, with attempts left, is deferred work again, not a dead letter
    assert collected.returncode == 0, collected.stderr
    assert json.loads(collected.stdout)["messages"] == []
    assert kit.client.stats(QUEUE).dlq_count == 0
    assert kit.sql("SELECT count(*) FROM dead_letters") == [(0,)]
    row = deferred_row(kit, key)
    assert row is not None
    assert (row["state"], row["attempts"]) == ("deferred", 3)
    assert [action for action, _actor, _note in kit.history(key)] == ["dead_letter_taken_back"]
    # And a drain builds it once
    with closing(flow_for(kit, ten)) as flow:
        run_now(kit, key)
        assert drain_with(kit, flow).counters["deferred_done"] == 1
    assert digests_built(kit) == 1


def test_a_dead_letter_of_a_job_without_attempts_left_stays_a_dead_letter(kit: Harness) -> None:
    # Given a digest whose policy allows three attempts, dead-lettered after three deliveries
    three = json.dumps({"digest.build": {"retry": {"attempts": 3}}})
    kit.publish(DIGEST)
    deliveries_all_died(kit, 1)
    # When the dead letters are collected
    collected = run_cli(kit, "dlq", "--json", JOB_POLICIES=three)
    # Then it is listed as a dead letter, and no deferred work was made
    assert collected.returncode == 0, collected.stderr
    assert len(json.loads(collected.stdout)["messages"]) == 1
    assert deferred_row(kit, kit.registry.derive(DIGEST).idem_key) is None


def test_a_taken_back_letter_never_takes_an_irreversible_claim_from_a_human(
    kit: Harness,
) -> None:
    # Given a digest (key-passing) and a receipt (irreversible), each with ten attempts, whose
    # drains died inside the call on all three deliveries: each left a running claim, lease over
    receipt = {"job": "receipt.send", "invoice_id": "inv_taken", "email": "a@example.com"}
    policies = json.dumps(
        {name: {"retry": {"attempts": 10}} for name in ("digest.build", "receipt.send")}
    )
    for payload in (DIGEST, receipt):
        derived = kit.registry.derive(payload)
        kit.sql(
            "INSERT INTO job_claims (idem_key, state, message_id, job, effect, claim_token, "
            "lease_until, payload_sha256) VALUES (%s, 'running', 'm', %s, %s, gen_random_uuid(), "
            "now() - interval '1 minute', %s)",
            (
                derived.idem_key,
                derived.definition.name,
                derived.definition.effect.value,
                derived.fingerprint,
            ),
        )
        kit.publish(payload)
    deliveries_all_died(kit, 2)
    # When the dead letters are collected
    collected = run_cli(kit, "dlq", "--json", JOB_POLICIES=policies)
    # Then the digest is deferred work again (its expired claim taken over), while the receipt,
    # whose mail may have gone, stays a dead letter beside its stuck claim
    assert collected.returncode == 0, collected.stderr
    listed = json.loads(collected.stdout)["messages"]
    assert [row["idem_key"] for row in listed] == [kit.registry.derive(receipt).idem_key]
    digest_key = kit.registry.derive(DIGEST).idem_key
    assert deferred_row(kit, digest_key)["state"] == "deferred"  # type: ignore[index]
    digest_claim = kit.row(digest_key)
    assert digest_claim is not None
    assert digest_claim.owned
    receipt_claim = kit.row(kit.registry.derive(receipt).idem_key)
    assert receipt_claim is not None
    assert receipt_claim.state == "running"


def test_a_stale_letter_never_brings_back_work_an_operator_cancelled(kit: Harness) -> None:
    # Given a digest with attempts left whose deferred work an operator cancelled, and a copy
    # of its message that later died in all three deliveries
    ten = json.dumps({"digest.build": {"retry": {"attempts": 10}}})
    with closing(flow_for(kit, ten)) as flow:
        key = deferred_once(kit, flow)
    assert run_cli(kit, "claims", "cancel", key).returncode == 0
    kit.publish(DIGEST)
    deliveries_all_died(kit, 1)
    # When the dead letters are collected
    collected = run_cli(kit, "dlq", "--json", JOB_POLICIES=ten)
    # Then the work stays cancelled, and the letter waits for a human
    assert collected.returncode == 0, collected.stderr
    assert [row["idem_key"] for row in json.loads(collected.stdout)["messages"]] == [key]
    assert deferred_row(kit, key)["state"] == "cancelled"  # type: ignore[index]
