"""A test kit for your own jobs: run a job through the real drain and assert its guarantees.

Never deployed. Each test gets a fresh database on a real PostgreSQL (``DATABASE_URL`` when set,
else an embedded server for the session), migrated like production (the ledger's migrations,
then the jobs'), the Infrai emulator over HTTP, and the provider sink standing in for every
external endpoint. Messages go through the drain DrainFunction runs: ``DrainService`` built
from settings as the function builds it, so the job's declared retry, rate and concurrency
policies (with ``JOB_POLICIES``, from the ``job_kit_job_policies`` fixture) and flow control's
deferred runs are part of every drain.

Load it from a ``conftest.py``::

    pytest_plugins = ["infrai_local.testkit"]

and assert one guarantee per line::

    def test_refund_issue(job_kit):
        payload = {"job": "refund.issue", "refund_id": "r_1", "amount_cents": 500}
        job_kit.assert_runs_once(payload)                 # published twice -> effect once
        job_kit.assert_conflict(payload, {**payload, "amount_cents": 7})
        job_kit.assert_retried_then_dead_lettered({**payload, "refund_id": "r_2"})
        job_kit.assert_stuck_when_uncertain(...)          # external jobs only
        job_kit.assert_deferred_then_done(...)            # jobs with a retry policy

The registry comes from the ``job_kit_registry`` fixture (the installed ``jobs`` package, as
every function builds it), and the database is prepared by ``job_kit_migrate`` (the ledger's
migrations, then the jobs'); a ``conftest.py`` may override either.

A job that calls a provider of its own gets a stand-in for it from the
``job_kit_provider_routes`` fixture: the routes it calls and the lookups its probe makes, served
by the provider sink behind every declared setting (``provider_sink.Route``)::

    @pytest.fixture
    def job_kit_provider_routes():
        return [
            Route("POST", "/hooks/{subscriber}"),                # the handler's call
            Route("GET", "/deliveries/{id}", lookup=True),       # its probe's lookup
        ]

``job_kit.provider_faults(fail_rate=1.0)`` makes the stand-in fail, ``job_kit.provider_state()``
says what it received.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, LiteralString

import psycopg
import pytest
import urllib3

from infrai_jobs.config.settings import DrainSettings
from infrai_jobs.drain.batch import describe_error
from infrai_jobs.drain.model import DrainSummary
from infrai_jobs.errors import EffectUncertain
from infrai_jobs.flow.policies import concurrency_value
from infrai_jobs.jobs.registry import (
    DerivedJob,
    Effect,
    JobContext,
    JobRegistry,
    JsonValue,
    Payload,
)
from infrai_jobs.operations.reconcile import Reconciler
from infrai_jobs.queue.client import HttpRetryPolicy, InfraiClient
from infrai_jobs.queue_contract import MAX_RECEIVE_COUNT
from infrai_jobs.runtime.drain_service import DrainService, job_policies
from infrai_jobs.work.admin import WorkStore
from infrai_jobs.work.ledger import PostgresLedger
from infrai_jobs.work.statements import END_LEASE
from infrai_jobs.work.states import ClaimRow
from infrai_local.jobs_package import jobs_folder, load_registry
from infrai_local.migrations import migrate_all
from infrai_local.operator.verbs import OperatorLedger, reconcile_one
from infrai_local.public_imports import refused_imports
from infrai_local.sandbox import STAND_IN_SECRET, emulator, provider_sink
from infrai_local.sandbox.embedded_db import postgres_server_url, scratch_database
from infrai_local.sandbox.provider_sink import Route
from infrai_local.sandbox.queues import ensure_queue

QUEUE = "testkit-jobs"
DLQ = "testkit-jobs-dlq"
API_KEY = "testkit-key"
VISIBILITY_SECONDS = 300
# A drain of the kit has time for every batch it receives.
TIME_LEFT_MS = 120_000


class JobKitError(AssertionError):
    """A guarantee did not hold; the message says which, and what the kit saw."""


@dataclasses.dataclass
class _Faults:
    """What the kit makes a job's handler do instead of its own work, by job name."""

    raising: dict[str, BaseException] = dataclasses.field(default_factory=dict)
    # Jobs whose handler does its work, then raises EffectUncertain: the effect happened, and
    # the drain cannot know it.
    uncertain_after: set[str] = dataclasses.field(default_factory=set)


class JobKit:
    """One test's ledger, queue and drain. Every ``assert_*`` uses fresh messages of its own."""

    def __init__(
        self,
        registry: JobRegistry,
        database_url: str,
        client: InfraiClient,
        emulator_url: str,
        provider_url: str,
        *,
        job_policies_document: str = "",
        second_layer: Mapping[str, str] | None = None,
    ) -> None:
        self.database_url = database_url
        self.client = client
        self.provider_url = provider_url
        self.ledger = PostgresLedger(database_url)
        self._emulator_url = emulator_url
        self._control = urllib3.PoolManager()
        self._faults = _Faults()
        # Per key: handler calls that returned (the effect happened) and calls made at all, and
        # what the handler itself last raised (its type and message, as the drain's log says).
        self.completed: Counter[str] = Counter()
        self.attempted: Counter[str] = Counter()
        self.raised: dict[str, str] = {}
        self.registry = self._instrumented(registry)
        # Every setting a job declared points at the provider sink, and every secret it declared
        # holds a stand-in value (the sink checks no credential).
        stand_in_secrets = dict.fromkeys(self.registry.declared_secrets(), STAND_IN_SECRET)
        self.registry.bind_settings(
            dict.fromkeys(self.registry.declared_settings(), provider_url),
            secrets=stand_in_secrets,
        )
        # DrainFunction's settings, for its service: this kit's queue, ledger and provider.
        self.settings = DrainSettings.from_env(
            {
                "INFRAI_BASE_URL": emulator_url,
                "INFRAI_API_KEY": API_KEY,
                "INFRAI_QUEUE": QUEUE,
                "INFRAI_DLQ": DLQ,
                "DATABASE_URL": database_url,
                "JOB_POLICIES": job_policies_document,
                **(second_layer or {}),
                **dict.fromkeys(self.registry.declared_settings(), provider_url),
                **stand_in_secrets,
            },
            job_settings=self.registry.declared_settings(),
            job_secrets=self.registry.declared_secrets(),
        )
        self.policies = job_policies(self.settings, self.registry)
        self._service: DrainService | None = None

    @property
    def second_layer_on(self) -> bool:
        """Whether the drain wraps external effects in the second layer (its settings)."""
        return self.settings.idempotency_backend != "off"

    def close(self) -> None:
        if self._service is not None:
            self._service.close()
        self.ledger.close()
        self._control.clear()

    # --- building blocks --------------------------------------------------------------------

    def publish(self, payload: Payload, times: int = 1) -> list[str]:
        """Publish ``payload`` ``times`` times, as a producer's retries would."""
        return [self.client.publish(QUEUE, dict(payload)) for _ in range(times)]

    def drain(self) -> DrainSummary:
        """One DrainFunction invocation: its service, built once as the function builds it
        (flow control with the policies in force, and what else its settings switch on)."""
        if self._service is None:
            self._service = DrainService.from_settings(self.settings, self.registry)
        return self._service.run(lambda: TIME_LEFT_MS)

    def run_deferred_now(self, payload: Payload) -> None:
        """Make the payload's deferred work due at once, as ``claims run-now`` does."""
        OperatorLedger(self.database_url).run_deferred_now(self.key(payload), actor="job-kit")

    def redeliver(self) -> None:
        """Let every unacked message's visibility lapse, so the next drain receives it again."""
        response = self._control.request(
            "POST",
            f"{self._emulator_url}/_emulator/clock",
            json={"advance_seconds": VISIBILITY_SECONDS + 1},
        )
        if response.status != 200:
            raise JobKitError(f"the emulator refused to advance its clock: {response.status}")

    def key(self, payload: Payload) -> str:
        return self._derive(payload).idem_key

    def claim(self, payload: Payload) -> ClaimRow | None:
        return self.ledger.get(self.key(payload))

    def queue_counts(self) -> tuple[int, int]:
        """(messages in the queue, dead letters)."""
        stats = self.client.stats(QUEUE)
        return stats.message_count, stats.dlq_count

    def provider_state(self) -> dict[str, Any]:
        """What the provider sink received: calls and effects per route and key, each key's
        list of the calls a route answered with a 2xx, oldest first, as ``{"path", "id"}``
        (``received``), and the requests no route served (``unrouted``)."""
        response = self._control.request("GET", f"{self.provider_url}/_sink/state")
        state: dict[str, Any] = json.loads(response.data)
        return state

    def provider_faults(self, **faults: float) -> None:
        """Set the provider sink's faults, e.g. ``fail_rate=1.0`` (503, nothing done),
        ``hang_rate``/``hang_seconds`` (done, then no answer in time), ``lookup_status=500``
        (every lookup answers it), ``seed``; none given: no fault."""
        response = self._control.request("POST", f"{self.provider_url}/_sink/faults", json=faults)
        if response.status != 200:
            raise JobKitError(f"the provider sink refused the faults {faults}: {response.status}")

    def sql(self, query: str, params: Any = None) -> list[tuple[Any, ...]]:
        """Run SQL on the test's database, e.g. to read a job's own table."""
        with psycopg.connect(self.database_url, autocommit=True) as conn:
            cursor = conn.execute(query, params)
            return cursor.fetchall() if cursor.description else []

    # --- one line per guarantee -------------------------------------------------------------

    def assert_runs_once(self, payload: Payload, *, times: int = 2) -> ClaimRow:
        """Published ``times`` times, the job's effect happens once and its claim is ``done``."""
        key = self.key(payload)
        dead_before = self.queue_counts()[1]
        self.publish(payload, times=times)
        summaries = self._drain_until_settled()
        claim = self.ledger.get(key)
        self._expect(
            self.completed[key] == 1,
            f"{key}: the handler completed {self.completed[key]} times, not once",
            summaries,
            key,
        )
        self._expect(
            claim is not None and claim.state == "done",
            f"{key}: the claim is {_state(claim)}, not done",
            summaries,
            key,
        )
        self._expect(
            self.queue_counts() == (0, dead_before),
            f"{key}: (queue, DLQ) = {self.queue_counts()}, not (0, {dead_before})",
            summaries,
            key,
        )
        assert claim is not None
        return claim

    def assert_retried_then_dead_lettered(
        self, payload: Payload, *, raising: BaseException | None = None
    ) -> None:
        """The handler raising (its own failure, or ``raising`` injected): each delivery retries
        with the claim released, and the message ends in the DLQ, the job never done."""
        key = self.key(payload)
        name = self._derive(payload).definition.name
        dead_before = self.queue_counts()[1]
        with self._raising(name, raising):
            self.publish(payload)
            summaries = [self._deliver() for _ in range(MAX_RECEIVE_COUNT)]
        if any(s.deferred for s in summaries):
            raise JobKitError(
                f"{key}: flow control deferred it (its retry policy outlasts Infrai's "
                f"{MAX_RECEIVE_COUNT} deliveries): the drain acks it and the ledger runs it "
                "later; assert_deferred_then_done is this job's assertion"
            )
        self._expect_every_delivery(key, "retry", summaries, "one retry each")
        self._expect(
            self.ledger.get(key) is None,
            f"{key}: the claim is {_state(self.ledger.get(key))}, not released",
            summaries,
            key,
        )
        self._expect_dead_lettered(key, dead_before, summaries)

    def assert_deferred_then_done(
        self, payload: Payload, *, raising: BaseException | None = None
    ) -> ClaimRow:
        """A job with a retry policy whose handler raises (``raising`` injected) through
        Infrai's deliveries is deferred, not dead-lettered: the message is acked, the ledger
        holds the work; when it is due and the handler succeeds, it runs once and is done."""
        derived = self._derive(payload)
        key, name = derived.idem_key, derived.definition.name
        policy = self.policies.get(name)
        if policy is None or policy.retry is None:
            raise JobKitError(
                f"{key}: {name} has no retry policy in force, so nothing defers it: its "
                f"failures walk to the DLQ in {MAX_RECEIVE_COUNT} deliveries "
                "(assert_retried_then_dead_lettered)"
            )
        dead_before = self.queue_counts()[1]
        with self._raising(name, raising):
            self.publish(payload)
            summaries = [self._deliver() for _ in range(MAX_RECEIVE_COUNT)]
        self._expect(
            sum(s.deferred for s in summaries) == 1,
            f"{key}: it was deferred {sum(s.deferred for s in summaries)} times, not once",
            summaries,
            key,
        )
        self._expect(
            self.queue_counts() == (0, dead_before),
            f"{key}: (queue, DLQ) = {self.queue_counts()}, not (0, {dead_before}): a deferred "
            "message is acked, never dead-lettered",
            summaries,
            key,
        )
        # When it is due, and the handler no longer raises: it runs once from the ledger.
        self.run_deferred_now(payload)
        ran = self.drain()
        summaries.append(ran)
        claim = self.ledger.get(key)
        self._expect(
            ran.counters["deferred_done"] == 1 and claim is not None and claim.state == "done",
            f"{key}: its deferred run ended {dict(ran.counters)}, the claim {_state(claim)}, "
            "not done",
            summaries,
            key,
        )
        self._expect(
            self.completed[key] == 1,
            f"{key}: the handler completed {self.completed[key]} times, not once",
            summaries,
            key,
        )
        assert claim is not None
        return claim

    def assert_stuck_when_uncertain(self, payload: Payload) -> ClaimRow:
        """An irreversible job whose outcome is unknown (``EffectUncertain``) is left
        ``running``, flagged for a human, never run again: each delivery is stuck, unacked,
        until the message rests in the DLQ beside the flagged claim."""
        derived = self._derive(payload)
        key = derived.idem_key
        if derived.definition.effect is Effect.DATABASE:
            raise JobKitError(
                f"{derived.definition.name} is a database job: its effect rolls back with its "
                "transaction, so an uncertain outcome is retried, never stuck"
            )
        dead_before = self.queue_counts()[1]
        with self._raising(derived.definition.name, EffectUncertain("the kit: outcome unknown")):
            self.publish(payload)
            summaries = [self._deliver()]
        summaries += [self._deliver() for _ in range(MAX_RECEIVE_COUNT - 1)]
        claim = self.ledger.get(key)
        self._expect_every_delivery(key, "stuck", summaries, "stuck each time")
        self._expect(
            claim is not None and claim.state == "running" and claim.error is not None,
            f"{key}: the claim is {_state(claim)}, not running and flagged",
            summaries,
            key,
        )
        self._expect(
            self.attempted[key] == 1,
            f"{key}: the handler was called {self.attempted[key]} times, not once",
            summaries,
            key,
        )
        self._expect_dead_lettered(key, dead_before, summaries)
        assert claim is not None
        return claim

    def assert_rate_limited(self, payloads: Sequence[Payload]) -> list[ClaimRow]:
        """Jobs of one job with a rate limit in force, published at once, all run once, and
        the starts the ledger reserved for them are the limit's spacing apart (1/N s for N a
        second) on the database's clock: no window of the limit's length holds more than N,
        whichever drain started them. Those the limit held past the invocation are deferred,
        and run when due."""
        derived = [self._derive(p) for p in payloads]
        names = {d.definition.name for d in derived}
        if len(names) != 1 or not payloads:
            raise JobKitError("assert_rate_limited takes payloads of one job, at least one")
        (name,) = names
        policy = self.policies.get(name)
        if policy is None or policy.rate is None:
            raise JobKitError(f"{name} has no rate limit in force: nothing spaces its starts")
        for payload in payloads:
            self.publish(payload)
        summaries = self._drain_until_settled()
        keys = [d.idem_key for d in derived]
        for key in keys:
            for _ in range(len(payloads) + 1):
                if (claim := self.ledger.get(key)) is not None and claim.state == "done":
                    break
                self.run_deferred_now_by_key(key)
                summaries.append(self.drain())
        claims = [self.ledger.get(d.idem_key) for d in derived]
        self._expect(
            all(c is not None and c.state == "done" for c in claims),
            f"{name}: claims {[_state(c) for c in claims]}, not all done",
            summaries,
            *keys,
        )
        self._expect(
            all(self.completed[d.idem_key] == 1 for d in derived),
            f"{name}: handler completions {[self.completed[d.idem_key] for d in derived]}, "
            "not once each",
            summaries,
            *keys,
        )
        starts = [
            row[0]
            for row in self.sql(
                "SELECT started_at FROM flow_rate_starts WHERE job = %s ORDER BY started_at",
                (name,),
            )
        ]
        gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(starts)]
        self._expect(
            len(starts) >= len(payloads)
            and min(gaps, default=policy.rate.spacing_seconds)
            >= policy.rate.spacing_seconds - 1e-6,
            f"{name}: {len(starts)} starts reserved, closest {min(gaps, default=0):.6f} s "
            f"apart, not {policy.rate.spacing_seconds:.6f} s",
            summaries,
            *keys,
        )
        return [c for c in claims if c is not None]

    def assert_held_back_by_concurrency(self, payload: Payload) -> ClaimRow:
        """A job with a concurrency key whose slots are all held by other live runs does not
        run: it is deferred (acked, not dead-lettered) with nothing called; once a slot is
        free and it is due, it runs once and is done."""
        derived = self._derive(payload)
        key, name = derived.idem_key, derived.definition.name
        policy = self.policies.get(name)
        if policy is None or policy.concurrency is None:
            raise JobKitError(f"{name} has no concurrency key in force: nothing holds it back")
        value = concurrency_value(policy.concurrency, derived.payload)
        for _ in range(policy.concurrency.max_running):
            self.sql(_HOLD_A_SLOT, {"job": name, "value": value})
        self.publish(payload)
        summaries = [self.drain()]
        self._expect(
            summaries[0].deferred == 1 and self.attempted[key] == 0,
            f"{key}: with every slot of {value} taken it was deferred "
            f"{summaries[0].deferred} times and called {self.attempted[key]} times, not "
            "deferred once and never called",
            summaries,
            key,
        )
        self.sql(_FREE_HELD_SLOTS, {"job": name, "value": value})
        self.run_deferred_now(payload)
        summaries.append(self.drain())
        return self._expect_done_once(key, summaries, "once a slot was free")

    def assert_reconciled(self, payload: Payload, *, effect_happened: bool) -> ClaimRow:
        """An irreversible job whose outcome is unknown is stuck, then its reconcile probe
        settles it as the watcher's pass does, once the drain's lease is over: an effect that
        happened (the call went through, its answer was lost) is settled ``done`` and never run
        again; one that did not is released, and the next delivery runs it once."""
        derived = self._derive(payload)
        key, definition = derived.idem_key, derived.definition
        if definition.probe is None or definition.effect is Effect.DATABASE:
            raise JobKitError(f"{definition.name} declares no reconcile probe")
        faults = self._faults
        if effect_happened:
            faults.uncertain_after.add(definition.name)
            try:
                self.publish(payload)
                summaries = [self.drain()]
            finally:
                faults.uncertain_after.discard(definition.name)
        else:
            with self._raising(definition.name, EffectUncertain("the kit: outcome unknown")):
                self.publish(payload)
                summaries = [self.drain()]
        self._expect(
            summaries[0].outcomes.get("stuck") == 1,
            f"{key}: the uncertain run was not flagged stuck",
            summaries,
            key,
        )
        # The drain's lease runs out (the kit moves it into the past): only then may a probe's
        # answer change the claim.
        self.sql(END_LEASE, {"key": key})
        reconciler = Reconciler(WorkStore(self.database_url), self.registry, actor="job-kit")
        report = reconcile_one(reconciler, key)
        (outcome,) = report.outcomes
        expected = ("done", "settled_done") if effect_happened else ("not_done", "released")
        self._expect(
            (outcome.answer, outcome.action) == expected,
            f"{key}: the probe answered {outcome.answer} ({outcome.action}), not {expected}",
            summaries,
            key,
        )
        if not effect_happened:
            self.redeliver()
            summaries.append(self.drain())
        return self._expect_done_once(key, summaries, "after the reconcile")

    def run_deferred_now_by_key(self, key: str) -> None:
        """``run_deferred_now`` for a key; nothing when the key holds no waiting work."""
        operator = OperatorLedger(self.database_url)
        found = operator.find(key)
        if found is not None and found.owned and found.state == "deferred":
            operator.run_deferred_now(key, actor="job-kit")

    def assert_conflict(self, payload: Payload, different: Payload) -> None:
        """The same key with different work is a conflict on every delivery: never run, never
        acked (it ends in the DLQ), the first work's claim unchanged."""
        key = self.key(payload)
        if self.key(different) != key:
            raise JobKitError(
                f"the two payloads have different keys ({key}, {self.key(different)}): "
                "a conflict needs the same key"
            )
        if self._derive(different).fingerprint == self._derive(payload).fingerprint:
            raise JobKitError("the two payloads are the same work: change a non-identity field")
        self.publish(payload)
        settled = self._drain_until_settled()
        before = self.ledger.get(key)
        completed = self.completed[key]
        dead_before = self.queue_counts()[1]
        self.publish(different)
        conflicts = [self._deliver() for _ in range(MAX_RECEIVE_COUNT)]
        summaries = [*settled, *conflicts]
        outcomes = [(dict(s.outcomes), s.acked) for s in conflicts]
        self._expect(
            outcomes == [({"conflict": 1}, 0)] * MAX_RECEIVE_COUNT,
            f"{key}: the different work's (outcomes, acks) per delivery were {outcomes}, not "
            "an unacked conflict each time",
            summaries,
            key,
        )
        self._expect(
            self.ledger.get(key) == before and self.completed[key] == completed,
            f"{key}: the claim changed or the work ran again",
            summaries,
            key,
        )
        self._expect_dead_lettered(key, dead_before, summaries)

    # --- internals ----------------------------------------------------------------------------

    def _derive(self, payload: Payload) -> DerivedJob:
        return self.registry.derive(payload)

    def _deliver(self) -> DrainSummary:
        summary = self.drain()
        self.redeliver()
        return summary

    def _drain_until_settled(self) -> list[DrainSummary]:
        summaries = [self.drain()]
        for _ in range(MAX_RECEIVE_COUNT):
            if self.queue_counts()[0] == 0:
                break
            self.redeliver()
            summaries.append(self.drain())
        return summaries

    def _raising(self, job: str, exc: BaseException | None) -> _Injected:
        return _Injected(self._faults, job, exc)

    def _instrumented(self, registry: JobRegistry) -> JobRegistry:
        """The same jobs, each handler counted, and failing on demand."""
        counted = JobRegistry()
        for definition in registry:
            counted.register(
                dataclasses.replace(definition, handler=self._counting(definition.handler))
            )
        return counted

    def _counting(
        self, handler: Callable[[Payload, JobContext], JsonValue]
    ) -> Callable[[Payload, JobContext], JsonValue]:
        def run(payload: Payload, ctx: JobContext) -> JsonValue:
            self.attempted[ctx.idem_key] += 1
            injected = self._faults.raising.get(ctx.job)
            if injected is not None:
                raise injected
            try:
                result = handler(payload, ctx)
            except Exception as exc:
                self.raised[ctx.idem_key] = describe_error(exc)
                raise
            self.completed[ctx.idem_key] += 1
            if ctx.job in self._faults.uncertain_after:
                raise EffectUncertain("the kit: the call returned, its answer was lost")
            return result

        return run

    def _expect_every_delivery(
        self, key: str, outcome: str, summaries: list[DrainSummary], expected: str
    ) -> None:
        """Each of the message's ``MAX_RECEIVE_COUNT`` deliveries (a drain each) ended as
        ``outcome``; ``expected`` words that for the failure message."""
        outcomes = [dict(s.outcomes) for s in summaries]
        self._expect(
            outcomes == [{outcome: 1}] * MAX_RECEIVE_COUNT,
            f"{key}: outcomes per delivery were {outcomes}, not {expected}",
            summaries,
            key,
        )

    def _expect_dead_lettered(
        self, key: str, dead_before: int, summaries: list[DrainSummary]
    ) -> None:
        counts = self.queue_counts()
        self._expect(
            counts == (0, dead_before + 1),
            f"{key}: (queue, DLQ) = {counts}, not (0, {dead_before + 1}): the message should "
            "rest in the DLQ",
            summaries,
            key,
        )

    def _expect_done_once(self, key: str, summaries: list[DrainSummary], when: str) -> ClaimRow:
        """The key's claim is ``done`` and its handler completed exactly once; the claim."""
        claim = self.ledger.get(key)
        self._expect(
            claim is not None and claim.state == "done" and self.completed[key] == 1,
            f"{key}: {when} its claim is {_state(claim)} and the handler completed "
            f"{self.completed[key]} times, not done once",
            summaries,
            key,
        )
        assert claim is not None
        return claim

    def _expect(
        self, condition: bool, message: str, summaries: list[DrainSummary], *keys: str
    ) -> None:
        """Fail with ``message`` unless ``condition``, adding what the drains did and what the
        handler of each of ``keys`` (the keys the message is about) last raised."""
        if not condition:
            seen = "; ".join(str(dict(s.outcomes)) for s in summaries)
            raised = self._what_raised(keys)
            raise JobKitError(f"{message} (drain outcomes: {seen}){raised}{self._unrouted()}")

    def _what_raised(self, keys: Sequence[str]) -> str:
        """What a failure adds when a handler raised: the last exception of each key's handler
        (by key when there are several), and where its traceback is."""
        named = len(keys) > 1
        raised = [
            f"; the handler last raised {self.raised[key]}" + (f" ({key})" if named else "")
            for key in keys
            if key in self.raised
        ]
        if not raised:
            return ""
        return "".join(raised) + " (traceback: the drain's log record about it, captured by pytest)"

    def _unrouted(self) -> str:
        """What a failure adds when the provider stand-in was called where it serves nothing."""
        try:
            unrouted = sorted(set(self.provider_state().get("unrouted", [])))
        except (urllib3.exceptions.HTTPError, ValueError, AttributeError):
            return ""  # a provider of the test's own, not the sink: nothing to add
        if not unrouted:
            return ""
        return (
            f"; the provider stand-in has no route for {', '.join(unrouted)}: give it one with "
            'the job_kit_provider_routes fixture (docs/jobs.md, "A provider of the job\'s own")'
        )


# The kit's stand-ins for other live runs of a concurrency key, and the end of a lease.
_HOLD_A_SLOT: LiteralString = """
INSERT INTO flow_concurrency_slots (token, job, key_value, holder, lease_until)
VALUES (gen_random_uuid(), %(job)s, %(value)s, 'job-kit', now() + interval '1 hour')
"""
_FREE_HELD_SLOTS: LiteralString = """
DELETE FROM flow_concurrency_slots
WHERE job = %(job)s AND key_value = %(value)s AND holder = 'job-kit'
"""


class _Injected:
    def __init__(self, faults: _Faults, job: str, exc: BaseException | None) -> None:
        self._faults, self._job, self._exc = faults, job, exc

    def __enter__(self) -> None:
        if self._exc is not None:
            self._faults.raising[self._job] = self._exc

    def __exit__(self, *exc_info: object) -> None:
        self._faults.raising.pop(self._job, None)


def _state(claim: ClaimRow | None) -> str:
    if claim is None:
        return "absent"
    flag = f", flagged: {claim.error}" if claim.error else ""
    return f"{claim.state}{flag}"


# --- pytest fixtures -----------------------------------------------------------------------------


@pytest.fixture(scope="session")
def job_kit_server_url() -> Iterator[str]:
    """A PostgreSQL server: ``DATABASE_URL`` when set, else an embedded one for the session."""
    with postgres_server_url() as url:
        yield url


@pytest.fixture
def job_kit_provider_routes() -> list[Route]:
    """Routes of the jobs' own providers, which the provider sink serves before its built-in
    ones: each a ``Route(method, path, status=, body=, lookup=, key=)``. None unless
    overridden; override to give a job the routes it calls and the lookups its probe makes."""
    return []


@pytest.fixture
def job_kit_provider_url(job_kit_provider_routes: list[Route]) -> Iterator[str]:
    """The provider sink, standing in for every external endpoint the jobs call, serving
    ``job_kit_provider_routes`` too."""
    sink = provider_sink.start_in_thread(routes=job_kit_provider_routes)
    try:
        yield sink.url
    finally:
        sink.stop()


@pytest.fixture
def job_kit_registry() -> JobRegistry:
    """The jobs under test: the project's jobs package, as every function builds it. Override
    to test other jobs."""
    return load_registry()


@pytest.fixture
def job_kit_migrate() -> Callable[[psycopg.Connection[Any]], None]:
    """How a fresh test database is prepared: the ledger's migrations, then the jobs' own
    (``jobs/migrations/``), as ``infrai-jobs migrate`` applies them."""

    def migrate(conn: psycopg.Connection[Any]) -> None:
        migrate_all(conn)

    return migrate


@pytest.fixture
def job_kit_job_policies() -> str:
    """The ``JOB_POLICIES`` document the kit's drain applies over the jobs' declared policies:
    the environment's, as DrainFunction reads its own. Override to test an override."""
    return os.environ.get("JOB_POLICIES", "")


# The second layer's settings, as DrainFunction reads them.
SECOND_LAYER_SETTINGS = (
    "IDEMPOTENCY_BACKEND",
    "IDEMPOTENCY_TABLE",
    "REDIS_URL",
    "REDIS_SECRET_ARN",
)


@pytest.fixture
def job_kit_second_layer() -> dict[str, str]:
    """The second layer the kit's drain runs with: the environment's ``IDEMPOTENCY_BACKEND``
    and its settings, as DrainFunction reads its own (off when unset). Override to test a job
    under the second layer, e.g. ``{"IDEMPOTENCY_BACKEND": "redis", "REDIS_URL": url}``."""
    return {name: os.environ[name] for name in SECOND_LAYER_SETTINGS if os.environ.get(name)}


@contextmanager
def open_job_kit(
    server_url: str,
    registry: JobRegistry,
    provider_url: str,
    *,
    migrate: Callable[[psycopg.Connection[Any]], None] | None = None,
    job_policies: str = "",
    second_layer: Mapping[str, str] | None = None,
) -> Iterator[JobKit]:
    """A ``JobKit`` on a fresh database of ``server_url``'s (migrated as ``infrai-jobs
    migrate`` does, unless ``migrate`` says otherwise), a fresh emulator and the provider sink
    at ``provider_url``; what the ``job_kit`` fixture yields, for a test that needs two kits or
    settings of its own."""
    with ExitStack() as stack:
        database_url = stack.enter_context(scratch_database(server_url))
        with psycopg.connect(database_url, autocommit=True) as conn:
            (migrate or migrate_all)(conn)
        server = emulator.start_in_thread(visibility_timeout=VISIBILITY_SECONDS)
        stack.callback(server.stop)
        client = InfraiClient(server.url, API_KEY, retry=HttpRetryPolicy(base_delay=0.01))
        stack.callback(client.close)
        ensure_queue(client, QUEUE, dlq=DLQ)
        kit = JobKit(
            registry,
            database_url,
            client,
            server.url,
            provider_url,
            job_policies_document=job_policies,
            second_layer=second_layer,
        )
        stack.callback(kit.close)
        yield kit


@pytest.fixture
def job_kit(  # noqa: PLR0917 - pytest hands fixtures in by name
    job_kit_server_url: str,
    job_kit_registry: JobRegistry,
    job_kit_migrate: Callable[[psycopg.Connection[Any]], None],
    job_kit_provider_url: str,
    job_kit_job_policies: str,
    job_kit_second_layer: dict[str, str],
) -> Iterator[JobKit]:
    """A ``JobKit`` on a fresh database, a fresh emulator and the provider sink."""
    with open_job_kit(
        job_kit_server_url,
        job_kit_registry,
        job_kit_provider_url,
        migrate=job_kit_migrate,
        job_policies=job_kit_job_policies,
        second_layer=job_kit_second_layer,
    ) as kit:
        yield kit


def assert_public_imports(*paths: str | Path) -> None:
    """Fail (``JobKitError``) on every import of ``infrai_jobs`` or ``infrai_local`` in
    ``paths`` (files or folders; by default the project's ``jobs`` package) that is not the
    public job API, each named with the public path to use instead (docs/upgrading.md)."""
    folders = [Path(p) for p in paths] or [jobs_folder()]
    refused = refused_imports(folders)
    if refused:
        raise JobKitError(
            "imports outside the public job API, which an upgrade may break "
            "(docs/upgrading.md):\n  " + "\n  ".join(refused)
        )


__all__ = ["JobKit", "JobKitError", "Route", "assert_public_imports", "open_job_kit"]
