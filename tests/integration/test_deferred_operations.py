"""The operator's side of flow control: deferred work listed, run now or cancelled from the
command line (recorded in ``claim_history``), a deferred job that runs out of attempts held by the
ledger as a dead letter (listed, paged on, discarded or redriven to run once), and the watcher's
deferred metrics. Against a real PostgreSQL, the emulator over HTTP and ``infrai-jobs`` in a
child process."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

import psycopg
import pytest
from drainkit import (
    OPERATOR,
    QUEUE,
    TEST_JOBS_CODE,
    Harness,
    RecordingAlerter,
    run_cli,
    watcher_metrics,
)

from infrai_jobs.operations.alerting import AlertCheck, AlertThresholds
from infrai_jobs.work import store as flow


def _payload(name: str) -> dict[str, Any]:
    return {"job": "test.db", "id": name}


def _json(kit: Harness, *args: str) -> Any:
    finished = run_cli(kit, *args, "--json")
    assert finished.returncode == 0, finished.stderr
    return json.loads(finished.stdout)


# --- claims list --state deferred, run-now, cancel ----------------------------------------------


def test_claims_list_shows_the_deferred_work_with_attempts_run_after_and_last_error(
    kit: Harness,
) -> None:
    # Given two deferred jobs, one due sooner, and one whose deferred life ended
    later = kit.defer("later", delay=7200)
    sooner = kit.defer("sooner", delay=60)
    ended = kit.defer("ended")
    kit.take_and_fail(ended, "gave up")
    # When an operator lists the deferred claims, for a script and for a person
    rows = _json(kit, "claims", "list", "--state", "deferred")
    human = run_cli(kit, "claims", "list", "--state", "deferred")
    # Then the waiting work is listed, the next due first, with what an operator needs
    assert [row["idem_key"] for row in rows] == [sooner, later]
    assert {row["state"] for row in rows} == {"deferred"}
    assert all(row["attempts"] == 1 and row["last_error"] == "upstream 503" for row in rows)
    assert rows[0]["run_after"] < rows[1]["run_after"]
    assert rows[0]["payload"] == _payload("sooner")
    # And the table names the same columns and keys, without the ended one
    assert human.returncode == 0, human.stderr
    header, *lines = human.stdout.splitlines()
    assert header.split() == ["IDEM_KEY", "JOB", "STATE", "ATTEMPTS", "RUN_AFTER", "LAST_ERROR"]
    assert [line.split()[0] for line in lines] == [sooner, later]
    assert ended not in human.stdout
    # And --job filters
    assert _json(kit, "claims", "list", "--state", "deferred", "--job", "other.job") == []


def test_run_now_makes_waiting_work_due_and_cancel_stops_it_both_recorded(kit: Harness) -> None:
    # Given two jobs deferred for an hour
    soon, never = kit.defer("soon"), kit.defer("never")
    # When an operator runs one now and cancels the other
    ran = _json(kit, "claims", "run-now", soon, "--note", "provider is back")
    cancelled = run_cli(kit, "claims", "cancel", never)
    # Then the first is due now: a drain takes it at once
    assert ran["action"] == "run_now"
    assert ran["deferred"]["state"] == "deferred"
    with psycopg.connect(kit.database_url, autocommit=True) as conn:
        taken = flow.take_due(conn, 10, lease_seconds=60)
    assert [job.idem_key for job in taken] == [soon]
    # And the second is cancelled, said in one line
    assert cancelled.returncode == 0, cancelled.stderr
    assert cancelled.stdout.startswith(f"cancelled: {never}:")
    assert kit.sql("SELECT state FROM job_claims WHERE idem_key = %s", (never,)) == [("cancelled",)]
    # And claim_history records each, with the operator as actor
    assert kit.history(soon) == [("run_now", OPERATOR, "provider is back")]
    assert kit.history(never) == [("cancel", OPERATOR, None)]


@pytest.mark.parametrize("command", ["run-now", "cancel"])
def test_a_missing_key_or_a_running_job_is_refused_in_one_line_exit_3(
    kit: Harness, command: str
) -> None:
    # Given a deferred job a drain is running now
    running = kit.defer("running")
    kit.sql("UPDATE job_claims SET run_after = now() WHERE idem_key = %s", (running,))
    with psycopg.connect(kit.database_url, autocommit=True) as conn:
        assert flow.take_due(conn, 1, lease_seconds=60)
    # When an operator acts on it, and on a key no deferred job has
    refused = run_cli(kit, "claims", command, running)
    missing = run_cli(kit, "claims", command, "test.db:nope")
    as_json = run_cli(kit, "claims", command, "test.db:nope", "--json")
    # Then each is one line on stderr, exit 3, no traceback, and nothing changed
    for finished in (refused, missing, as_json):
        assert finished.returncode == 3, finished.stderr
        assert len(finished.stderr.strip().splitlines()) == 1, finished.stderr
        assert "Traceback" not in finished.stderr
    # And the running one's refusal says until when its lease runs and what to do, as a
    # release's does
    ((lease_until,),) = kit.sql(
        "SELECT lease_until FROM job_claims WHERE idem_key = %s", (running,)
    )
    assert f"is running under a live lease until {lease_until.isoformat()}" in refused.stderr
    assert f"then run `infrai-jobs claims {command} {running}` again" in refused.stderr
    assert "no deferred job with key 'test.db:nope'" in missing.stderr
    assert "claims list --state deferred" in missing.stderr
    assert json.loads(as_json.stdout)["error"]["exit_code"] == 3
    assert kit.sql("SELECT state FROM job_claims WHERE idem_key = %s", (running,)) == [("running",)]
    assert kit.history(running) == []


def test_the_new_claims_commands_explain_themselves(kit: Harness) -> None:
    # When an operator asks for help
    listing = run_cli(kit, "claims", "list", "--help")
    run_now = run_cli(kit, "claims", "run-now", "--help")
    cancel = run_cli(kit, "claims", "cancel", "--help")
    # Then each says what it does
    assert listing.returncode == run_now.returncode == cancel.returncode == 0
    assert "deferred" in listing.stdout
    assert "due at once" in run_now.stdout
    assert "never runs" in cancel.stdout


# --- Dead letters the ledger holds --------------------------------------------------------------


def test_failing_a_deferred_job_records_its_dead_letter_in_the_same_transaction(
    kit: Harness,
) -> None:
    # Given two deferred jobs taken by a drain
    kept, rolled_back = kit.defer("kept"), kit.defer("rolled-back")
    # When one fails for good, and the other's failure is rolled back with its transaction
    assert kit.take_and_fail(kept, "out of attempts: upstream 503")
    with psycopg.connect(kit.database_url, autocommit=True) as conn:
        conn.execute("UPDATE job_claims SET run_after = now() WHERE idem_key = %s", (rolled_back,))
        (taken,) = flow.take_due(conn, 1, lease_seconds=60)

        def fail_then_roll_back() -> None:
            with conn.transaction():
                assert flow.fail(conn, rolled_back, taken.claim_token or uuid.uuid4(), "x")
                raise RuntimeError("the drain's transaction failed")

        with pytest.raises(RuntimeError):
            fail_then_roll_back()
        # And a fail whose token no longer holds the job changes nothing
        assert not flow.fail(conn, rolled_back, uuid.uuid4(), "stale")
    # Then only the first left an unresolved dead letter, under its queue and message id
    letters = kit.sql(
        "SELECT message_id, queue, idem_key, state, reason, resolution FROM dead_letters"
    )
    assert letters == [
        (
            "qmsg-kept",
            QUEUE,
            kept,
            "failed",
            "deferred job failed after 2 attempt(s): out of attempts: upstream 503",
            None,
        )
    ]


def test_work_deferred_without_a_queue_is_held_under_the_queue_the_drain_names(
    kit: Harness,
) -> None:
    # Given deferred work that recorded no queue
    key = kit.defer("no-queue", queue=None)
    # When it fails for good, the drain naming its queue
    assert kit.take_and_fail(key, "final", queue=QUEUE)
    # Then its dead letter is listed under that queue
    assert kit.sql("SELECT queue FROM dead_letters WHERE idem_key = %s", (key,)) == [(QUEUE,)]


def test_a_deferred_job_out_of_attempts_pages_until_discarded_or_redriven_and_then_runs_once(
    kit: Harness,
) -> None:
    # Given two deferred jobs that ran out of attempts, and a watcher
    redriven, discarded = kit.failed_for_good("redriven", "discarded")
    alerter = RecordingAlerter()
    watcher = AlertCheck(kit.client, kit.database_url, alerter, AlertThresholds())
    # When the watcher checks and an operator lists the dead letters
    report = watcher.run([QUEUE])
    listed = _json(kit, "dlq")
    # Then both page, though Infrai's DLQ is empty, and both are listed as the ledger's own
    assert report.as_dict()["queues"][0]["dead_letters"] == 2
    assert alerter.sent == [f"[infrai-jobs] 2 new dead letter(s) on {QUEUE}"]
    by_key = {row["idem_key"]: row for row in listed["messages"]}
    assert set(by_key) == {redriven, discarded}
    assert all(row["held_by_ledger"] and row["state"] == "failed" for row in by_key.values())
    assert "upstream 503" in by_key[redriven]["reason"]
    # When one is discarded: the alert stays open for the other
    assert run_cli(kit, "dlq", "discard", "--key", discarded).returncode == 0
    watcher.run([QUEUE])
    assert len(alerter.sent) == 1
    # When the other is redriven (no --reopen-failed needed: its failed claim is reopened)
    # (with a jobs package that knows test.db, as the drain's does: a redrive judges each letter)
    summary = _json(kit, "redrive", "--key", redriven, "--jobs-path", str(TEST_JOBS_CODE))
    # Then its payload is published again and its failed claim reopened, recorded
    assert (summary["published"], summary["reopened"]) == (1, [redriven])
    assert kit.row(redriven) is None
    assert ("reopen", OPERATOR) in [row[:2] for row in kit.history(redriven)]
    # And a drain runs the new copy once
    drained = kit.drain()
    assert drained.outcomes == {"done": 1}
    assert kit.effects(redriven) == 1
    row = kit.row(redriven)
    assert row is not None
    assert row.state == "done"
    # And with both resolved, the alert resolves once
    watcher.run([QUEUE])
    assert alerter.sent[-1] == f"[infrai-jobs] RESOLVED: no dead letters left on {QUEUE}"


def test_releasing_deferred_work_out_of_attempts_says_its_dead_letter_runs_it_again(
    kit: Harness,
) -> None:
    # Given two pieces of deferred work a drain failed for good: their messages were acked when
    # the ledger took them over, and the ledger holds their dead letters
    key, other = kit.failed_for_good("released-after-failing", "released-by-a-script")
    # When an operator releases each failed claim, one for a person and one for a script
    released = run_cli(kit, "claims", "release", key)
    as_json = _json(kit, "claims", "release", other)
    # Then the claims are gone, recorded, and each answer says that no delivery runs the work
    # again but its dead letter does, and how
    assert released.returncode == 0, released.stderr
    assert kit.row(key) is kit.row(other) is None
    assert kit.history(key)[-1][:2] == kit.history(other)[-1][:2] == ("release", OPERATOR)
    said = released.stdout
    assert f"released {key} (recorded in claim_history)" in said
    assert "no next delivery" in said
    assert f"`infrai-jobs redrive --key {key}`" in said
    assert "no next delivery" in as_json["next"]
    assert f"`infrai-jobs redrive --key {other}`" in as_json["next"]
    # And `claims show` says the same of the key, with the claim as it was before the release
    shown = run_cli(kit, "claims", "show", key)
    assert shown.returncode == 0, shown.stderr
    assert f"no claim with key {key!r} now: release by {OPERATOR}" in shown.stdout
    assert f"`infrai-jobs redrive --key {key}`" in shown.stdout
    assert "a new delivery claims it afresh" not in shown.stdout
    assert re.search(r"^state +failed$", shown.stdout, re.MULTILINE), shown.stdout
    # And `dlq` still lists the letter, with the claim's state as it was recorded then
    letters = {row["idem_key"]: row for row in _json(kit, "dlq")["messages"]}
    assert (letters[key]["state"], letters[key]["held_by_ledger"]) == ("failed", True)
    # When the letter is redriven, the work runs once
    summary = _json(kit, "redrive", "--key", key, "--jobs-path", str(TEST_JOBS_CODE))
    assert summary["published"] == 1
    assert kit.drain().outcomes == {"done": 1}
    assert kit.effects(key) == 1


# --- The watcher's deferred metrics ---------------------------------------------------------------


def test_the_watcher_reports_the_deferred_backlog_and_its_oldest_age(
    kit: Harness, capsys: pytest.CaptureFixture[str]
) -> None:
    watcher = AlertCheck(kit.client, kit.database_url, RecordingAlerter(), AlertThresholds())

    def emitted() -> dict[str, Any]:
        report = watcher.run([QUEUE])
        documents = watcher_metrics(report, capsys)
        ledger: dict[str, Any] = next(d for d in documents if "StuckClaims" in d)
        return {"report": report.as_dict(), "metrics": ledger}

    # Given no deferred work: zeros are emitted, so the series stays steady
    empty = emitted()
    assert (empty["report"]["deferred_backlog"], empty["metrics"]["DeferredBacklog"]) == (0, [0.0])
    assert empty["metrics"]["OldestDeferredAgeSeconds"] == [0.0]
    # Given two deferred jobs, the older first deferred ten minutes ago
    older = kit.defer("older")
    kit.defer("newer")
    kit.sql(
        "UPDATE job_claims SET deferred_at = now() - interval '10 minutes' WHERE idem_key = %s",
        (older,),
    )
    # When the watcher checks
    seen = emitted()
    # Then it emits the backlog and the oldest age, in seconds, with the ledger's figures
    assert seen["metrics"]["DeferredBacklog"] == [2.0]
    (age,) = seen["metrics"]["OldestDeferredAgeSeconds"]
    assert 600 <= age < 3600
    assert seen["report"]["oldest_deferred_age_seconds"] == pytest.approx(age)
    units = {
        m["Name"]: m["Unit"] for m in seen["metrics"]["_aws"]["CloudWatchMetrics"][0]["Metrics"]
    }
    assert (units["DeferredBacklog"], units["OldestDeferredAgeSeconds"]) == ("Count", "Seconds")


# --- JOB_POLICIES at CLI start ------------------------------------------------------------------


def test_a_drain_with_a_malformed_job_policies_document_stops_before_anything_runs(
    kit: Harness,
) -> None:
    # Given a job waiting, and a JOB_POLICIES document with a wrong field
    kit.publish(_payload("waiting"))
    document = json.dumps({"digest.build": {"retry": {"attempts": 0}}})
    # When the drain starts with it
    finished = run_cli(kit, "drain", JOB_POLICIES=document)
    # Then it stops in one line naming the job and the field, exit 2, and nothing was consumed
    assert finished.returncode == 2, finished.stderr
    assert len(finished.stderr.strip().splitlines()) == 1, finished.stderr
    assert "'digest.build'" in finished.stderr
    assert "retry.attempts" in finished.stderr
    assert kit.client.stats(QUEUE).available_count == 1


@pytest.mark.parametrize(
    ("policy", "job", "field"),
    [
        (
            {"retry": {"attempts": 5, "first_delay_seconds": 1e-300, "max_delay_seconds": 1e300}},
            "digest.build",
            "retry.first_delay_seconds",
        ),
        ({"retry": {"attempts": 5, "max_delay_seconds": 1e300}}, "digest.build", "retry."),
        ({"retry": {"attempts": 10**12}}, "digest.build", "retry.attempts"),
        ({"rate": {"per_second": 10**29}}, "receipt.send", "rate.per_second"),
        ({"concurrency": {"key": ["tenant"], "max_running": 1}}, "digest.build", "'tenant_id'"),
        ({"concurrency": {"key": ["tenant_id"], "max_running": 10**20}}, "digest.build", "max"),
    ],
)
def test_a_policy_past_what_the_code_or_the_database_holds_stops_the_drain_at_start(
    kit: Harness, policy: dict[str, Any], job: str, field: str
) -> None:
    # Given a job waiting, and a JOB_POLICIES document that parses but that no run could keep
    kit.publish(_payload("waiting"))
    document = json.dumps({job: policy})
    # When the drain starts with it
    finished = run_cli(kit, "drain", JOB_POLICIES=document)
    # Then it stops at once in one line naming the job and the field, exit 2, no traceback,
    # and the message is still in the queue
    assert finished.returncode == 2, finished.stderr
    assert len(finished.stderr.strip().splitlines()) == 1, finished.stderr
    assert "Traceback" not in finished.stderr
    assert f"'{job}'" in finished.stderr
    assert field in finished.stderr
    assert kit.client.stats(QUEUE).available_count == 1
