"""Reconcile before paging: stuck claims of the example jobs resolve themselves when their
provider can answer, on a real PostgreSQL, the emulator and the provider sink.

Two ways a claim gets stuck are made here: the effect applied but the answer lost (the sink
performs the call and then hangs past the client's timeout, or a worker died after the call),
and the call never applied (a worker died after claiming, before calling). One reconcile pass
must settle the first kind ``done`` with the effect still once, release the second so the next
delivery runs it once, and leave a claim whose probe fails exactly as it was.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any

import psycopg
import pytest
import urllib3
from drainkit import (
    DLQ,
    OPERATOR,
    QUEUE,
    Harness,
    RecordingAlerter,
    reconciled_under_a_live_lease,
    run_cli,
    watcher_metrics,
)

from infrai_jobs.jobs.keys import payload_fingerprint
from infrai_jobs.jobs.probes import NotDone, ProbeAnswer
from infrai_jobs.jobs.registry import Effect, JobContext, JobRegistry, JsonValue, Payload
from infrai_jobs.operations.alerting import WATCHER_ACTOR, AlertCheck, AlertThresholds
from infrai_jobs.operations.reconcile import Reconciler
from infrai_jobs.work import store as flow
from infrai_jobs.work.admin import WorkStore
from infrai_jobs.work.store import DeferredWork
from infrai_local.operator.verbs import reconcile_one

RECEIPT = {"job": "receipt.send", "invoice_id": "inv_1", "email": "ada@example.com"}
DIGEST = {"job": "digest.build", "tenant_id": "t_1", "period": "2026-11"}


def key_of(kit: Harness, payload: Payload) -> str:
    return kit.registry.derive(payload).idem_key


def seed_dead_worker_claim(kit: Harness, payload: Payload, *, lease_live: bool = False) -> str:
    """The claim a worker leaves when it dies after claiming: running, its lease over (unless
    ``lease_live``), flagged stuck by the delivery that found it."""
    derived = kit.registry.derive(payload)
    lease = "now() + interval '10 minutes'" if lease_live else "now() - interval '10 minutes'"
    kit.sql(
        "INSERT INTO job_claims (idem_key, state, message_id, job, effect, claim_token, "
        "lease_until, payload_sha256, error, claimed_at, updated_at) "
        "VALUES (%s, 'running', 'msg-of-a-dead-worker', %s, %s, %s, " + lease + ", %s, "
        "'claim lease expired while running: the effect may have happened', "
        "now() - interval '20 minutes', now() - interval '20 minutes')",
        (
            derived.idem_key,
            derived.definition.name,
            derived.definition.effect.value,
            uuid.uuid4(),
            payload_fingerprint(payload),
        ),
    )
    return derived.idem_key


def sink_call(kit: Harness, method: str, path: str, **kwargs: Any) -> Any:
    response = urllib3.request(method, f"{kit.sink.url}{path}", **kwargs)
    assert response.status == 200, response.data
    return json.loads(response.data)


def sink_faults(kit: Harness, **faults: Any) -> None:
    sink_call(kit, "POST", "/_sink/faults", json=faults)


def provider_mailed(kit: Harness, invoice_id: str) -> None:
    """The provider sends this invoice's receipt, as a worker's call that reached it would."""
    mail = {"to": RECEIPT["email"], "template": "receipt", "invoice_id": invoice_id}
    sink_call(kit, "POST", "/v1/mail/send", json=mail)


def watcher_pass(kit: Harness) -> Reconciler:
    """The watcher's reconcile pass."""
    return Reconciler(WorkStore(kit.database_url), kit.registry, actor=WATCHER_ACTOR)


def watcher_check(kit: Harness) -> tuple[AlertCheck, RecordingAlerter]:
    """The watcher's check, reconciling first, and the alerter it pages."""
    alerter = RecordingAlerter()
    check = AlertCheck(
        kit.client, kit.database_url, alerter, AlertThresholds(), reconciler=watcher_pass(kit)
    )
    return check, alerter


def history(kit: Harness, key: str) -> list[tuple[str, str]]:
    rows = kit.sql("SELECT action, note FROM claim_history WHERE idem_key = %s ORDER BY id", (key,))
    return [(str(action), str(note)) for action, note in rows]


def reconcile_all(kit: Harness, *extra: str) -> dict[str, Any]:
    finished = run_cli(kit, "claims", "reconcile", "--all", "--json", *extra)
    assert finished.returncode == 0, finished.stderr
    assert "Traceback" not in finished.stderr
    report: dict[str, Any] = json.loads(finished.stdout)
    return report


def test_stuck_claims_resolve_themselves_in_one_pass(kit: Harness) -> None:
    # Given a receipt mailed by the provider whose answer never came back: the sink sends,
    # then hangs past the job's 5 s read timeout, so the drain flags the claim stuck
    sent_receipt = {**RECEIPT, "invoice_id": "inv_answer_lost"}
    sink_faults(kit, hang_rate=1.0, hang_seconds=6.5)
    kit.publish(sent_receipt)
    assert kit.drain().outcomes == {"stuck": 1}
    sink_faults(kit)
    # And a digest the provider built for a worker that died before recording it
    built_digest = {**DIGEST, "tenant_id": "t_answer_lost"}
    built_key = key_of(kit, built_digest)
    sink_call(kit, "POST", "/v1/digests", json={}, headers={"Idempotency-Key": built_key})
    seed_dead_worker_claim(kit, built_digest)
    kit.publish(built_digest)
    # And a receipt and a digest whose workers died after claiming, before calling
    unsent_receipt = {**RECEIPT, "invoice_id": "inv_never_sent"}
    unbuilt_digest = {**DIGEST, "tenant_id": "t_never_built"}
    for payload in (unsent_receipt, unbuilt_digest):
        seed_dead_worker_claim(kit, payload)
        kit.publish(payload)
    # ... whose deliveries all find their claims stuck and are left unacked
    assert kit.drain().outcomes == {"stuck": 3}
    assert kit.sink.state.snapshot()["mails"] == {"inv_answer_lost": 1}
    assert kit.sink.state.snapshot()["digests"] == {built_key: 1}

    # When one reconcile pass runs
    report = reconcile_all(kit)

    # Then the provider answered for every claim: two done, two not done
    assert report["by_answer"] == {"done": 2, "not_done": 2, "unknown": 0}
    actions = {c["idem_key"]: c["action"] for c in report["claims"]}
    sent_key, unsent_key = key_of(kit, sent_receipt), key_of(kit, unsent_receipt)
    unbuilt_key = key_of(kit, unbuilt_digest)
    assert actions == {
        sent_key: "settled_done",
        built_key: "settled_done",
        unsent_key: "released",
        unbuilt_key: "released",
    }
    # And the claims whose effect happened are done with the provider's result
    receipt_row = kit.row(sent_key)
    assert receipt_row is not None
    assert receipt_row.state == "done"
    assert (
        receipt_row.result["provider_message_id"] == kit.sink.state.sent["inv_answer_lost"][0]["id"]
    )
    digest_row = kit.row(built_key)
    assert digest_row is not None
    assert digest_row.state == "done"
    assert digest_row.result["digest_id"] == kit.sink.state.replies[built_key]["id"]
    # And the claims whose effect did not happen are released, each recorded
    assert kit.row(unsent_key) is None
    assert kit.row(unbuilt_key) is None
    assert history(kit, unsent_key) == [("reconcile", "not_done: the provider has no trace of it")]
    assert [action for action, _ in history(kit, sent_key)] == ["reconcile"]
    assert history(kit, sent_key)[0][1].startswith("done: provider result")

    # When the unacked messages come back
    kit.advance()
    summary = kit.drain()

    # Then the released work runs once, and the settled work is a duplicate of done
    assert summary.outcomes == {"done": 2, "duplicate_done": 2}
    assert summary.acked == 4
    after = kit.sink.state.snapshot()
    assert after["mails"] == {"inv_answer_lost": 1, "inv_never_sent": 1}
    assert after["digests"] == {built_key: 1, unbuilt_key: 1}
    for key in (sent_key, built_key, unsent_key, unbuilt_key):
        row = kit.row(key)
        assert row is not None, key
        assert row.state == "done", key


def test_a_failing_probe_leaves_its_claim_stuck_and_unchanged(kit: Harness) -> None:
    # Given two stuck claims whose effect never happened, and a provider whose lookups fail
    keys = [
        seed_dead_worker_claim(kit, {**RECEIPT, "invoice_id": "inv_probe_fails"}),
        seed_dead_worker_claim(kit, {**DIGEST, "tenant_id": "t_probe_fails"}),
    ]
    before = [kit.row(key) for key in keys]
    sink_faults(kit, lookup_status=503)

    # When a reconcile pass runs, twice
    first = reconcile_all(kit)
    second = reconcile_all(kit)

    # Then both answers are unknown, with the provider's status as the reason
    assert first["by_answer"] == {"done": 0, "not_done": 0, "unknown": 2}
    assert {c["action"] for c in first["claims"]} == {"unchanged"}
    assert all("HTTP 503" in c["detail"] for c in first["claims"])
    assert second["by_answer"]["unknown"] == 2
    # And the claims are exactly as they were: stuck for a human
    assert [kit.row(key) for key in keys] == before
    # And the answer is recorded once, not once per pass
    for key in keys:
        assert [action for action, _ in history(kit, key)] == ["reconcile"]
        assert history(kit, key)[0][1].startswith("unknown: ")


def test_a_probe_that_raises_or_hangs_is_unknown_and_changes_nothing(
    kit: Harness, database_url: str
) -> None:
    # Given a stuck receipt, and a registry whose mail provider cannot be reached
    key = seed_dead_worker_claim(kit, {**RECEIPT, "invoice_id": "inv_unreachable"})
    row_before = kit.row(key)
    registry = JobRegistry()
    registry_of_kit = kit.registry.get("receipt.send")
    assert registry_of_kit is not None
    registry.register(registry_of_kit)
    registry.bind_settings({"MAIL_PROVIDER_URL": "http://127.0.0.1:9"})
    admin = WorkStore(database_url)

    # When it is reconciled
    report = Reconciler(admin, registry, actor=OPERATOR).run_all(threshold_seconds=900)

    # Then the probe's failure is an unknown answer, and the claim is untouched
    assert [(o.answer, o.action) for o in report.outcomes] == [("unknown", "unchanged")]
    assert "the probe raised" in str(report.outcomes[0].detail)
    assert kit.row(key) == row_before

    # Given a job whose probe takes longer than the time it is given
    slow = JobRegistry()

    def too_slow(payload: Payload, ctx: JobContext) -> ProbeAnswer:
        time.sleep(3)
        return NotDone()

    @slow.job("test.slow", effect=Effect.EXTERNAL, identity=("id",), probe=too_slow)
    def handler(payload: Payload, ctx: JobContext) -> JsonValue:
        return None

    slow_key = seed_dead_worker_claim_for(kit, slow, {"job": "test.slow", "id": "s1"})
    slow_before = kit.row(slow_key)

    # When it is reconciled with a 0.3 s limit
    started = time.monotonic()
    timed = reconcile_one(Reconciler(admin, slow, actor=OPERATOR, probe_timeout=0.3), slow_key)

    # Then the pass did not wait for it, counted it unknown, and left the claim alone
    assert time.monotonic() - started < 2
    assert timed.outcomes[0].answer == "unknown"
    assert "did not answer within 0.3 s" in str(timed.outcomes[0].detail)
    assert kit.row(slow_key) == slow_before


def seed_dead_worker_claim_for(kit: Harness, registry: JobRegistry, payload: Payload) -> str:
    saved = kit.registry
    kit.registry = registry
    try:
        return seed_dead_worker_claim(kit, payload)
    finally:
        kit.registry = saved


def test_not_done_never_releases_a_claim_under_a_live_lease(kit: Harness) -> None:
    # Given a flagged receipt claim whose lease is still live: its delivery may be calling now
    key = seed_dead_worker_claim(kit, {**RECEIPT, "invoice_id": "inv_live_lease"}, lease_live=True)
    before = kit.row(key)

    # When every stuck claim is reconciled, and this one by its key, while the provider has no
    # trace of it yet
    report = reconcile_all(kit)
    one = run_cli(kit, "claims", "reconcile", key, "--json")

    # Then the pass does not probe it (it is not stuck while its lease is live), the named
    # reconcile probes it but acts on nothing (an answer asked under a live lease may be stale
    # by the time it is applied), and the claim is as it was
    assert report["claims"] == []
    assert one.returncode == 0, one.stdout + one.stderr
    assert [(c["answer"], c["action"]) for c in json.loads(one.stdout)["claims"]] == [
        ("not_done", "lease_live")
    ]
    assert kit.row(key) == before


def test_a_dry_run_under_a_live_lease_says_nothing_would_change_and_until_when(
    kit: Harness,
) -> None:
    # Given a flagged receipt claim whose lease is still live, and a provider with no trace of it
    key = seed_dead_worker_claim(kit, {**RECEIPT, "invoice_id": "inv_dry_live"}, lease_live=True)
    before = kit.row(key)
    ((lease_until,),) = kit.sql("SELECT lease_until FROM job_claims WHERE idem_key = %s", (key,))
    # When the operator asks what a reconcile of it would do
    # Then it says what the reconcile itself would: nothing changes under the live lease (not
    # "would release"), and when to ask again
    claim, (dry, _) = reconciled_under_a_live_lease(kit, key, lease_until.isoformat(), "--dry-run")
    assert "would release" not in dry.stdout
    assert (claim["answer"], claim["action"]) == ("not_done", "lease_live")
    assert kit.row(key) == before


def test_only_a_claim_the_answer_changed_is_logged_as_reconciled(
    kit: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    # Given two flagged receipt claims the provider has no trace of: one under a live lease
    # (its delivery may be calling now), one whose lease is over
    live = seed_dead_worker_claim(kit, {**RECEIPT, "invoice_id": "inv_log_live"}, lease_live=True)
    over = seed_dead_worker_claim(kit, {**RECEIPT, "invoice_id": "inv_log_over"})
    # When an operator reconciles the live one by its key, and a pass reconciles both
    by_name = run_cli(kit, "claims", "reconcile", live)
    reconciler, actions = watcher_pass(kit), []
    with caplog.at_level(logging.INFO, logger="infrai_jobs"):
        for key in (live, over):
            claim = reconciler.admin.find(key)
            assert claim is not None
            actions.append(reconciler.reconcile(claim).action)
    # Then only the released one is logged as reconciled: the live one changed nothing, and
    # the command's stderr says nothing of a reconcile
    assert by_name.returncode == 0, by_name.stdout + by_name.stderr
    assert "stuck claim reconciled" not in by_name.stderr
    assert actions == ["lease_live", "released"]
    logged = [
        (getattr(r, "idem_key", None), r.levelname)
        for r in caplog.records
        if r.getMessage() == "stuck claim reconciled"
    ]
    assert logged == [(over, "INFO")]


def test_done_under_a_live_lease_advises_when_to_ask_again_not_a_refused_resolve(
    kit: Harness,
) -> None:
    # Given a receipt the provider mailed, whose claim is flagged under a lease still live
    payload = {**RECEIPT, "invoice_id": "inv_done_live"}
    provider_mailed(kit, "inv_done_live")
    key = seed_dead_worker_claim(kit, payload, lease_live=True)
    ((lease_until,),) = kit.sql("SELECT lease_until FROM job_claims WHERE idem_key = %s", (key,))

    # When the operator reconciles it by its key
    # Then the provider answered done, nothing changed, and the advice is to ask again after
    # the lease's end as the database stores it, never the `claims resolve` it would refuse
    outcome, (shown, _) = reconciled_under_a_live_lease(kit, key, lease_until.isoformat())
    assert "claims resolve" not in shown.stdout
    assert (outcome["answer"], outcome["action"]) == ("done", "lease_live")
    claim = kit.row(key)
    assert claim is not None
    assert claim.state == "running"
    # And the resolve the old advice named is refused, naming the same end
    refused = run_cli(kit, "claims", "resolve", key, "--done")
    assert refused.returncode == 3
    assert f"live lease until {lease_until.isoformat()}" in refused.stderr


def test_a_claim_that_moved_on_while_probed_is_fenced_out(kit: Harness, database_url: str) -> None:
    # Given a stuck claim whose probe sees another delivery take the claim over meanwhile
    registry = JobRegistry()
    holder = {"key": ""}

    def taken_over_meanwhile(payload: Payload, ctx: JobContext) -> ProbeAnswer:
        kit.sql(
            "UPDATE job_claims SET claim_token = %s, error = NULL WHERE idem_key = %s",
            (uuid.uuid4(), holder["key"]),
        )
        return NotDone()

    @registry.job(
        "test.moving",
        effect=Effect.EXTERNAL_IDEMPOTENT,
        identity=("id",),
        probe=taken_over_meanwhile,
    )
    def handler(payload: Payload, ctx: JobContext) -> JsonValue:
        return None

    holder["key"] = seed_dead_worker_claim_for(kit, registry, {"job": "test.moving", "id": "m1"})

    # When it is reconciled
    reconciler = Reconciler(WorkStore(database_url), registry, actor=OPERATOR)
    report = reconcile_one(reconciler, holder["key"])

    # Then the release matched nothing: the new holder keeps its claim, nothing is recorded
    assert report.outcomes[0].action == "changed"
    row = kit.row(holder["key"])
    assert row is not None
    assert row.state == "running"
    assert history(kit, holder["key"]) == []


def test_the_operator_sees_what_was_reconciled(kit: Harness) -> None:
    # Given a stuck digest the provider built
    payload = {**DIGEST, "tenant_id": "t_shown"}
    key = seed_dead_worker_claim(kit, payload)
    sink_call(kit, "POST", "/v1/digests", json={}, headers={"Idempotency-Key": key})

    # When the operator first asks what a reconcile would do
    dry = run_cli(kit, "claims", "reconcile", key, "--dry-run")

    # Then it says, and changes and records nothing
    assert dry.returncode == 0, dry.stderr
    assert "would settle done" in dry.stdout
    assert "dry run, nothing changed" in dry.stdout
    row = kit.row(key)
    assert row is not None
    assert row.state == "running"
    assert history(kit, key) == []

    # When the operator reconciles it, then looks at it
    done = run_cli(kit, "claims", "reconcile", key)
    shown = run_cli(kit, "claims", "show", key, "--json")
    human = run_cli(kit, "claims", "show", key)

    # Then the claim is done, and show lists the probe's answer beside the history
    assert done.returncode == 0, done.stderr
    assert "settled_done" in done.stdout
    document = json.loads(shown.stdout)
    assert document["claim"]["state"] == "done"
    assert [p["answer"] for p in document["probes"]] == ["done"]
    assert document["probes"][0]["actor"] == OPERATOR
    assert "reconcile probes" in human.stdout
    assert "done: provider result" in human.stdout

    # When the operator reconciles a claim that is not running, or of a job without a probe
    again = run_cli(kit, "claims", "reconcile", key)
    invoice_key = "invoice.finalize:inv_np"
    kit.sql(
        "INSERT INTO job_claims (idem_key, state, message_id, job, effect, error, lease_until) "
        "VALUES (%s, 'running', 'm', 'invoice.finalize', 'database', 'flagged',"
        " now() - interval '1 second')",
        (invoice_key,),
    )
    no_probe = run_cli(kit, "claims", "reconcile", invoice_key)

    # Then each is refused in one line, with no traceback
    assert again.returncode == 3
    assert "only a running claim is reconciled" in again.stderr
    assert no_probe.returncode == 2
    assert "declares no reconcile probe" in no_probe.stderr
    for finished in (again, no_probe):
        assert "Traceback" not in finished.stderr


def test_the_watcher_reconciles_before_it_counts_stuck_claims(
    kit: Harness, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given three stuck claims: a receipt the provider mailed, a digest it never built, and a
    # receipt keyed by its producer, which its probe cannot look up (unknown)
    mailed = {**RECEIPT, "invoice_id": "inv_watched"}
    provider_mailed(kit, "inv_watched")
    mailed_key = seed_dead_worker_claim(kit, mailed)
    unbuilt_key = seed_dead_worker_claim(kit, {**DIGEST, "tenant_id": "t_watched"})
    unknowable = {**RECEIPT, "invoice_id": "inv_x", "_idempotency_key": "producer-key-7"}
    unknowable_key = seed_dead_worker_claim(kit, unknowable)
    check, alerter = watcher_check(kit)

    # When the watcher runs its check
    report = check.run([QUEUE])

    # Then it probed all three, and counts and pages on the one still stuck
    assert report.reconciled is not None
    assert report.reconciled.by_answer() == {"done": 1, "not_done": 1, "unknown": 1}
    assert report.stuck.count == 1
    (subject, message) = next((s, m) for s, m in alerter.alerts if "stuck" in s)
    assert subject == "[infrai-jobs] 1 new stuck claim(s) in the ledger"
    assert "done for 1 (settled), not done for 1 (released" in message
    assert "unknown for 1" in message
    mailed_row = kit.row(mailed_key)
    assert mailed_row is not None
    assert mailed_row.state == "done"
    assert kit.row(unbuilt_key) is None
    unknown_row = kit.row(unknowable_key)
    assert unknown_row is not None
    assert unknown_row.state == "running"
    # And the answers are recorded as the watcher's
    actors = kit.sql("SELECT DISTINCT actor FROM claim_history WHERE action = 'reconcile'")
    assert actors == [(WATCHER_ACTOR,)]
    # And the metrics count the reconciled claims by answer, beside the stuck count
    documents = watcher_metrics(report, capsys)
    ledger = next(d for d in documents if "StuckClaims" in d)
    assert ledger["StuckClaims"] == [1.0]
    counts = (ledger["ReconciledDone"], ledger["ReconciledNotDone"], ledger["ReconciledUnknown"])
    assert counts == ([1.0], [1.0], [1.0])


def test_a_claim_the_watcher_reconciles_done_takes_its_dead_letter_with_it(kit: Harness) -> None:
    # Given a receipt the provider mailed for a worker that died after the call: its claim is
    # stuck, and its message was dead-lettered beside it
    mailed = {**RECEIPT, "invoice_id": "inv_lettered"}
    provider_mailed(kit, "inv_lettered")
    key = seed_dead_worker_claim(kit, mailed)
    message_id = kit.client.publish(DLQ, mailed)
    # And `dlq` moved the letter into the ledger, unresolved
    (letter,) = json.loads(run_cli(kit, "dlq", "--json").stdout)["messages"]
    assert (letter["message_id"], letter["idem_key"], letter["state"]) == (
        message_id,
        key,
        "running",
    )
    check, alerter = watcher_check(kit)

    # When the watcher runs its check
    report = check.run([QUEUE])

    # Then the probe settled the claim done, and the letter was resolved before counting:
    # no dead letter counts toward the alarm's metric, and none is paged
    claim = kit.row(key)
    assert claim is not None
    assert claim.state == "done"
    (queue,) = report.as_dict()["queues"]
    assert (queue["dead_letters"], queue["ledger_dead_letters"]) == (0, 0)
    assert not [subject for subject in alerter.sent if "dead letter" in subject]
    # And `dlq` lists nothing left to do, while `dlq --all` says it was resolved done, and why
    assert json.loads(run_cli(kit, "dlq", "--json").stdout)["messages"] == []
    everything = run_cli(kit, "dlq", "--all")
    assert everything.returncode == 0, everything.stderr
    (line,) = [row for row in everything.stdout.splitlines() if row.startswith(message_id)]
    assert " done " in line
    assert "1 shown resolved done: the ledger shows their work done" in everything.stdout
    (resolved,) = json.loads(run_cli(kit, "dlq", "--all", "--json").stdout)["messages"]
    assert (resolved["resolution"], resolved["resolved_by"]) == ("done", WATCHER_ACTOR)
    assert "its work is done" in resolved["resolution_note"]
    # And the key's history has the probe's answer, then the letter resolved
    assert [action for action, _ in history(kit, key)] == ["reconcile", "dead_letter_done"]


def seed_stuck_deferred_run(kit: Harness, payload: Payload, *, lease_live: bool = False) -> str:
    """A deferred ``external`` run taken and begun: its drain gone (lease over), or with
    ``lease_live`` a drain inside the provider call right now; its key."""
    derived = kit.registry.derive(payload)
    key = derived.idem_key
    work = DeferredWork(key, derived.definition.name, "external", dict(payload), f"m-{key}")
    with psycopg.connect(kit.database_url, autocommit=True) as conn:
        flow.defer(conn, work, attempts=1, error="mail provider 503", delay_seconds=0)
        (taken,) = flow.take_due(conn, 1, lease_seconds=600)
        assert taken.claim_token is not None
        assert flow.begin(conn, key, taken.claim_token)
    if not lease_live:
        kit.sql(
            "UPDATE job_claims SET lease_until = now() - interval '1 second' WHERE idem_key = %s",
            (key,),
        )
    return key


def deferred_state(kit: Harness, key: str) -> str:
    ((state,),) = kit.sql("SELECT state FROM job_claims WHERE idem_key = %s", (key,))
    return str(state)


def test_deferred_runs_left_for_a_human_resolve_themselves_too(kit: Harness) -> None:
    # Given two deferred receipts whose drains died inside the call: one the provider mailed,
    # one it never saw
    mailed = {**RECEIPT, "invoice_id": "inv_deferred_mailed"}
    unsent = {**RECEIPT, "invoice_id": "inv_deferred_unsent"}
    mailed_key, unsent_key = (
        seed_stuck_deferred_run(kit, mailed),
        seed_stuck_deferred_run(kit, unsent),
    )
    provider_mailed(kit, "inv_deferred_mailed")
    # When the watcher's reconcile pass runs
    report = watcher_pass(kit).run_all(threshold_seconds=900)
    # Then the mailed one is done, its claim settled done with the provider's answer
    actions = {outcome.idem_key: outcome.action for outcome in report.outcomes}
    assert actions == {mailed_key: "settled_done", unsent_key: "released"}
    assert deferred_state(kit, mailed_key) == "done"
    mailed_claim = kit.row(mailed_key)
    assert mailed_claim is not None
    assert mailed_claim.state == "done"
    assert mailed_claim.result["reconciled"] is True
    # And the unsent one waits again, due now, and the next drain mails it once
    assert deferred_state(kit, unsent_key) == "deferred"
    assert [action for action, _ in history(kit, unsent_key)] == ["reconcile"]
    assert history(kit, unsent_key)[0][1].startswith("not_done")
    with psycopg.connect(kit.database_url, autocommit=True) as conn:
        (taken,) = flow.take_due(conn, 10, lease_seconds=60)
    assert taken.idem_key == unsent_key


def test_a_deferred_run_whose_probe_cannot_answer_stays_for_a_human_recorded_once(
    kit: Harness,
) -> None:
    # Given a deferred receipt left for a human, and a provider whose lookups fail
    key = seed_stuck_deferred_run(kit, {**RECEIPT, "invoice_id": "inv_deferred_unknown"})
    sink_faults(kit, lookup_status=503)
    # When a reconcile pass runs twice, from the command line
    first = reconcile_all(kit)
    second = reconcile_all(kit)
    # Then it is unknown both times and unchanged, and the answer is recorded once
    assert first["claims"] == second["claims"]
    assert [(c["idem_key"], c["action"]) for c in first["claims"]] == [(key, "unchanged")]
    assert deferred_state(kit, key) == "running"
    assert [action for action, _ in history(kit, key)] == ["reconcile"]
    # And reconciling that one key by name says the same
    one = run_cli(kit, "claims", "reconcile", key, "--json")
    assert one.returncode == 0, one.stderr
    assert json.loads(one.stdout)["by_answer"] == {"done": 0, "not_done": 0, "unknown": 1}


def test_a_deferred_run_under_a_live_lease_is_neither_released_nor_run_again(
    kit: Harness,
) -> None:
    # Given a deferred receipt a drain is mailing right now: the provider has no trace yet
    key = seed_stuck_deferred_run(
        kit, {**RECEIPT, "invoice_id": "inv_deferred_live"}, lease_live=True
    )
    before = kit.sql("SELECT * FROM job_claims WHERE idem_key = %s", (key,))
    # When an operator reconciles it by name, and releases it, while a second drain looks
    reconciled = run_cli(kit, "claims", "reconcile", key, "--json")
    released = run_cli(kit, "claims", "release", key)
    with psycopg.connect(kit.database_url, autocommit=True) as conn:
        second_drain = flow.take_due(conn, 10, lease_seconds=60)
    # Then the probe's "not done" waits for the lease, the release is refused, and nothing
    # else takes the run: the provider is called once, by the drain that holds it
    assert reconciled.returncode == 0, reconciled.stderr
    claims = json.loads(reconciled.stdout)["claims"]
    assert [(c["answer"], c["action"]) for c in claims] == [("not_done", "lease_live")]
    assert released.returncode == 3, released.stdout
    assert "live lease" in released.stderr
    assert second_drain == []
    assert kit.sql("SELECT * FROM job_claims WHERE idem_key = %s", (key,)) == before


def test_a_probe_that_says_done_under_a_live_lease_leaves_the_run_to_its_drain(
    kit: Harness,
) -> None:
    # Given a live deferred run whose mail the provider already lists (the call just returned)
    invoice = "inv_deferred_live_done"
    key = seed_stuck_deferred_run(kit, {**RECEIPT, "invoice_id": invoice}, lease_live=True)
    provider_mailed(kit, invoice)
    # When the watcher's reconcile pass and an operator's reconcile run meanwhile
    watcher = watcher_pass(kit)
    passed = watcher.run_all(threshold_seconds=900)
    by_name = run_cli(kit, "claims", "reconcile", key, "--json")
    # Then the pass does not pick it (it is not stuck) and the named reconcile changes nothing:
    # only the run that holds the lease settles it
    assert passed.outcomes == []
    assert by_name.returncode == 0, by_name.stderr
    claims = json.loads(by_name.stdout)["claims"]
    assert [(c["answer"], c["action"]) for c in claims] == [("done", "lease_live")]
    assert deferred_state(kit, key) == "running"


def test_claims_stuck_lists_a_deferred_run_left_for_a_human_beside_the_stuck_claims(
    kit: Harness,
) -> None:
    # Given a stuck claim and a deferred receipt run whose drain died inside the call
    claim_key = seed_dead_worker_claim(kit, {**RECEIPT, "invoice_id": "inv_stuck_claim"})
    run_key = seed_stuck_deferred_run(kit, {**RECEIPT, "invoice_id": "inv_stuck_run"})
    # When the on-call lists what is stuck, for a script and for a person
    listed = run_cli(kit, "claims", "stuck", "--json")
    table = run_cli(kit, "claims", "stuck")
    # Then both are there, told apart by kind, and the deferred run says why it waits
    assert listed.returncode == 0, listed.stderr
    rows = {row["idem_key"]: row for row in json.loads(listed.stdout)}
    assert {key: row["kind"] for key, row in rows.items()} == {
        claim_key: "claim",
        run_key: "deferred_run",
    }
    assert rows[run_key]["error"].startswith("deferred run left for a human")
    assert table.returncode == 0, table.stderr
    assert run_key in table.stdout
    assert claim_key in table.stdout
