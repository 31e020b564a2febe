"""The operator's commands as a person on call types them: ``infrai-jobs`` in a child process,
against a real PostgreSQL and the emulator over HTTP.

What each command prints is the contract here: the reasons behind a drain's problem messages,
dead letters that cannot be read or conflict with done work, discards and selective redrives
recorded in ``claim_history``, and errors that name the commands users type.
"""

from __future__ import annotations

import json
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import pytest
from drainkit import (
    DLQ,
    INFRAI_JOBS,
    OPERATOR,
    QUEUE,
    ROOT,
    TEST_JOBS_CODE,
    Harness,
    cli_environment,
    code_root,
    run_cli,
    start_cli,
)

from infrai_jobs.jobs.registry import Payload
from infrai_local.operator.verbs import OperatorLedger

# A jobs package of its own (``--jobs-path``): one job per way a handler can end.
JOBS_PACKAGE = textwrap.dedent(
    """
    import pathlib
    import time

    from infrai_jobs.errors import PermanentJobError
    from infrai_jobs.jobs.registry import Effect, JobRegistry


    def build_registry():
        registry = JobRegistry()

        @registry.job("cli.ok", effect=Effect.DATABASE, identity=("id",))
        def ok(payload, ctx):
            return {"id": payload["id"]}

        @registry.job("cli.flaky", effect=Effect.DATABASE, identity=("id",))
        def flaky(payload, ctx):
            raise RuntimeError("the upstream timed out\\n(second line of the reason)")

        @registry.job("cli.broken", effect=Effect.EXTERNAL, identity=("id",))
        def broken(payload, ctx):
            raise PermanentJobError("the customer does not exist")

        @registry.job("cli.slow", effect=Effect.EXTERNAL, identity=("id",))
        def slow(payload, ctx):
            # Says it started (the test signals the drain then), then takes its time.
            pathlib.Path(payload["started"]).write_text("started")
            time.sleep(payload["seconds"])
            return {"id": payload["id"]}

        return registry
    """
)


@pytest.fixture
def jobs_path(tmp_path: Path) -> str:
    return str(code_root(tmp_path, JOBS_PACKAGE))


def lines_with(text: str, word: str) -> list[str]:
    return [line for line in text.splitlines() if line.split()[:1] == [word]]


def fields_of(line: str) -> dict[str, str]:
    """``retry key=a message_id=b delivery=1 reason=free text`` -> the fields by name."""
    head, _, reason = line.partition(" reason=")
    fields = dict(part.split("=", 1) for part in head.split()[1:] if "=" in part)
    if reason:
        fields["reason"] = reason
    return fields


def fields_of_the_line(text: str, word: str) -> dict[str, str]:
    """The fields of the one line of ``text`` starting with ``word`` (asserting there is one)."""
    (line,) = lines_with(text, word)
    return fields_of(line)


# --- drain --------------------------------------------------------------------------------------


def drain_within(
    kit: Harness, jobs_path: str, seconds: str, **env: str
) -> subprocess.CompletedProcess[str]:
    """``infrai-jobs drain`` of the test's jobs with ``--time-budget-seconds SECONDS``."""
    return run_cli(kit, "drain", "--jobs-path", jobs_path, "--time-budget-seconds", seconds, **env)


def test_drain_prints_each_problem_message_with_its_reason_and_tells_retries_from_failures(
    kit: Harness, jobs_path: str
) -> None:
    # Given a done job, and a batch holding one message per kind of problem
    kit.publish({"job": "cli.ok", "id": "done-before"})
    assert run_cli(kit, "drain", "--jobs-path", jobs_path).returncode == 0
    ids = {
        "ok": kit.publish({"job": "cli.ok", "id": "fresh"})[0],
        "flaky": kit.publish({"job": "cli.flaky", "id": "f"})[0],
        "broken": kit.publish({"job": "cli.broken", "id": "b"})[0],
        "conflict": kit.publish({"job": "cli.ok", "id": "done-before", "extra": 1})[0],
        "rejected": kit.publish({"job": "no.such.job"})[0],
    }
    # When the operator drains
    finished = run_cli(kit, "drain", "--jobs-path", jobs_path)
    # Then it succeeds, and the JSON summary tells the retry from the permanent failure
    assert finished.returncode == 0, finished.stderr
    summary = json.loads(finished.stdout)
    assert (summary["done"], summary["retried"], summary["failed"], summary["parked"]) == (
        1,
        1,
        1,
        2,
    )
    err = finished.stderr
    # And each problem message has one line: outcome, key, message id, delivery, reason
    assert fields_of_the_line(err, "retry") == {
        "key": "cli.flaky:f",
        "message_id": ids["flaky"],
        "delivery": "1",
        "reason": "RuntimeError: the upstream timed out (second line of the reason)",
    }
    assert fields_of_the_line(err, "failed") == {
        "key": "cli.broken:b",
        "message_id": ids["broken"],
        "delivery": "1",
        "reason": "PermanentJobError: the customer does not exist",
    }
    conflict = fields_of_the_line(err, "conflict")
    assert (conflict["key"], conflict["message_id"]) == ("cli.ok:done-before", ids["conflict"])
    rejected = fields_of_the_line(err, "rejected")
    assert (rejected["key"], rejected["message_id"]) == ("-", ids["rejected"])
    assert "unknown job 'no.such.job'" in rejected["reason"]
    # And nothing about the message that simply ran, and no bare "message rejected" line
    assert ids["ok"] not in err
    assert "message rejected" not in err
    # And the tracebacks the log records carry stay out of the terminal: one line per problem
    assert "Traceback" not in err
    # And the summary in words says which come back by themselves and which need a human
    (drained,) = [line for line in err.splitlines() if line.startswith("drained ")]
    assert "1 done" in drained
    assert "1 retried, 1 failed, 2 parked" in drained
    assert "walk to the DLQ" in err


def test_a_drain_whose_budget_cannot_hold_one_batch_refuses_and_says_why(
    kit: Harness, jobs_path: str
) -> None:
    # Given three messages waiting, and the default batch budget of 20 s
    for n in range(3):
        kit.publish({"job": "cli.ok", "id": f"w{n}"})
    # When the operator drains with 5 s, then with 19 s
    for budget in ("5", "19"):
        finished = drain_within(kit, jobs_path, budget)
        # Then the drain fails with a usage error saying why and what to change, never a
        # success that left the messages untouched
        assert finished.returncode == 2, finished.stdout + finished.stderr
        assert "Traceback" not in finished.stderr
        assert f"a time budget of {budget} s cannot hold one batch" in finished.stderr
        assert "DRAIN_BATCH_BUDGET_MS is 20000 ms" in finished.stderr
        assert "--time-budget-seconds 20 or more" in finished.stderr
        assert finished.stdout == ""
    # And nothing was received: every message is still waiting, none spent a delivery
    stats = kit.client.stats(QUEUE)
    assert (stats.available_count, stats.in_flight_count) == (3, 0)
    # And a batch budget that fits the 5 s drains them
    fitted = drain_within(kit, jobs_path, "5", DRAIN_BATCH_BUDGET_MS="4000")
    assert fitted.returncode == 0, fitted.stderr
    assert json.loads(fitted.stdout)["done"] == 3


def test_idle_polling_that_cannot_poll_says_so(kit: Harness, jobs_path: str) -> None:
    # Given idle polling every 200 ms, and a budget that leaves no poll after a batch budget
    # When the operator drains an empty queue
    finished = drain_within(kit, jobs_path, "20.1", DRAIN_IDLE_POLL_MS="200")
    # Then the drain runs, and a warning says that and why it did not poll
    assert finished.returncode == 0, finished.stderr
    (line,) = lines_with(finished.stderr, "idle_polling_off")
    assert "DRAIN_IDLE_POLL_MS=200" in line
    assert "cannot poll" in line
    assert json.loads(finished.stdout)["idle_polls"] == 0


def _interrupt_during_a_slow_handler(
    kit: Harness, jobs_path: str, tmp_path: Path, *, seconds: float, sig: signal.Signals, grace: str
) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """A drain of a slow external job and 14 quick ones, sent ``sig`` once the slow handler
    has started; what it printed, and the ids published. It exits 128 + ``sig`` (as a shell
    reports a process the signal stopped) without a traceback."""
    started = tmp_path / "started"
    ids = kit.publish({"job": "cli.slow", "id": "s", "seconds": seconds, "started": str(started)})
    for n in range(14):
        ids += kit.publish({"job": "cli.ok", "id": f"q{n}"})
    drain = start_cli(kit, "drain", "--jobs-path", jobs_path, "--interrupt-grace-seconds", grace)
    try:
        deadline = time.monotonic() + 60
        while not started.exists():
            assert drain.poll() is None, drain.communicate()
            assert time.monotonic() < deadline, "the slow handler never started"
            time.sleep(0.05)
        drain.send_signal(sig)
        out, err = drain.communicate(timeout=60)
    finally:
        if drain.poll() is None:
            drain.kill()
            drain.communicate()
    assert drain.returncode == 128 + sig, out + err
    assert "Traceback" not in err
    return subprocess.CompletedProcess(drain.args, drain.returncode, out, err), ids


def test_an_interrupted_drain_settles_what_it_holds_and_reports_then_exits_130(
    kit: Harness, jobs_path: str, tmp_path: Path
) -> None:
    # Given a slow external job (1.5 s) among 15 messages, two batches' worth
    # When the drain gets SIGINT while the slow handler runs
    finished, _ids = _interrupt_during_a_slow_handler(
        kit, jobs_path, tmp_path, seconds=1.5, sig=signal.SIGINT, grace="30"
    )
    # Then it exits 130 without a traceback, having settled and acked what it held
    summary = json.loads(finished.stdout)
    assert summary["stopped"] == "interrupted"
    assert summary["consumed"] == summary["acked"] > 0
    assert "stopped: interrupted" in finished.stderr
    assert "interrupted by SIGINT: stopped receiving" in finished.stderr
    assert "in flight: none" in finished.stderr
    assert "left running: no claim" in finished.stderr
    assert summary["interrupted"]["in_flight"] == []
    assert summary["interrupted"]["left_running"] == []
    # And the slow job is done, not left running
    row = kit.row("cli.slow:s")
    assert row is not None
    assert row.state == "done"
    # And nothing it did not ack is hidden: what it did not receive is still available
    stats = kit.client.stats(QUEUE)
    assert stats.in_flight_count == 0
    assert stats.available_count == 15 - summary["consumed"]


def test_a_drain_interrupted_past_its_grace_names_what_is_in_flight_and_left_running(
    kit: Harness, jobs_path: str, tmp_path: Path
) -> None:
    # Given a slow external job (60 s) among 15 messages, and a grace of 1 s
    # When the drain gets SIGTERM while the slow handler runs
    finished, ids = _interrupt_during_a_slow_handler(
        kit, jobs_path, tmp_path, seconds=60, sig=signal.SIGTERM, grace="1"
    )
    # Then it exits 143 within the grace, without a traceback
    err = finished.stderr
    assert "interrupted by SIGTERM" in err
    assert "did not settle within the 1 s grace" in err
    assert "summary so far:" in err
    # And it lists every message it received and did not ack, and when each comes back
    report = json.loads(finished.stdout)["interrupted"]
    held = [m["message_id"] for m in report["in_flight"]]
    assert held
    assert set(held) <= set(ids)
    (line,) = [line for line in err.splitlines() if line.startswith("in flight:")]
    assert f"in flight: {len(held)} message(s)" in line
    assert "after its visibility timeout" in line
    assert all(message_id in line for message_id in held)
    assert kit.client.stats(QUEUE).in_flight_count == len(held)
    # And the slow job's claim, left running, is named with the command to inspect it
    assert report["left_running"] == ["cli.slow:s"]
    assert "left running: 1 claim(s)" in err
    assert "  infrai-jobs claims show cli.slow:s" in err.splitlines()
    row = kit.row("cli.slow:s")
    assert row is not None
    assert row.state == "running"


def test_a_handler_still_running_at_its_deadline_ends_the_drain_before_its_lease_ends(
    kit: Harness, jobs_path: str, tmp_path: Path
) -> None:
    # Given a slow external job (60 s) and a drain with 3 s to run (batches of 1 s), as an
    # operator runs one during DrainSilentAlarm
    kit.publish({"job": "cli.slow", "id": "s", "seconds": 60, "started": str(tmp_path / "go")})
    # When its handler is still running at its deadline
    finished = drain_within(kit, jobs_path, "3", DRAIN_BATCH_BUDGET_MS="1000")
    # Then the drain ends there, as DrainFunction's timeout would: exit 1, no traceback
    assert finished.returncode == 1, finished.stdout + finished.stderr
    assert "Traceback" not in finished.stderr
    (line,) = [x for x in finished.stderr.splitlines() if x.startswith("stopped: a handler")]
    assert "still running at its deadline" in line
    assert "cli.slow (cli.slow:s)" in line
    assert "  infrai-jobs claims show cli.slow:s" in finished.stderr.splitlines()
    report = json.loads(finished.stdout)
    assert report["stopped"] == "handler_overran"
    assert [h["idem_key"] for h in report["overran"]["handlers"]] == ["cli.slow:s"]
    assert report["overran"]["left_running"] == ["cli.slow:s"]
    # And it ended before the claim's lease did (LEASE_GRACE_SECONDS, 60, after the
    # deadline): no operator release or later delivery can meet the handler still running
    rows = kit.sql(
        "SELECT state, lease_until > now() FROM job_claims WHERE idem_key = %s", ("cli.slow:s",)
    )
    assert rows == [("running", True)]


def test_a_drain_past_a_handlers_deadline_ends_even_when_its_output_was_closed(
    kit: Harness, jobs_path: str, tmp_path: Path
) -> None:
    # Given a slow external job (60 s), a drain of two lanes with 3 s to run, and a reader of
    # its output that has gone (`... | head -c0`)
    kit.publish({"job": "cli.slow", "id": "p", "seconds": 60, "started": str(tmp_path / "go")})
    drain = start_cli(
        kit,
        "drain",
        "--jobs-path",
        jobs_path,
        "--time-budget-seconds",
        "3",
        DRAIN_BATCH_BUDGET_MS="1000",
        DRAIN_LANES="2",
    )
    assert drain.stdout is not None
    drain.stdout.close()
    try:
        # When its handler is still running at its deadline
        _, err = drain.communicate(timeout=40)
    finally:
        if drain.poll() is None:
            drain.kill()
            drain.communicate()
    # Then the process ended all the same, before the handler's 60 s and the claim's lease
    assert drain.returncode == 1, err
    assert "Traceback" not in err
    rows = kit.sql(
        "SELECT state, lease_until > now() FROM job_claims WHERE idem_key = %s", ("cli.slow:p",)
    )
    assert rows == [("running", True)]


def test_a_drain_with_the_ledger_down_from_the_start_says_nothing_was_received(
    kit: Harness, jobs_path: str
) -> None:
    # Given a message waiting, and a DATABASE_URL with nothing listening
    kit.publish({"job": "cli.ok", "id": "waiting"})
    # When the operator drains
    finished = run_cli(
        kit, "drain", "--jobs-path", jobs_path, DATABASE_URL="postgresql://nobody@127.0.0.1:1/none"
    )
    # Then it fails saying plainly that nothing was received, not "mid-drain" with a dict
    assert finished.returncode == 1, finished.stderr
    assert "Traceback" not in finished.stderr
    (line,) = [line for line in finished.stderr.splitlines() if line.startswith("error: ")]
    assert "unreachable, so the drain received nothing" in line
    assert "mid-drain" not in finished.stderr
    assert "{" not in line
    assert kit.client.stats(QUEUE).available_count == 1


def test_publish_says_how_many_went_out_when_its_output_is_cut(kit: Harness) -> None:
    # Given a publish of 2000 copies whose reader stops after the first id
    body = json.dumps({"job": "cli.ok", "id": "cut"})
    command = f"{INFRAI_JOBS} publish --unchecked --count 2000 '{body}' | head -1"
    # When it runs
    finished = subprocess.run(
        ["bash", "-c", command],
        env=cli_environment(kit),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    # Then one id reached the reader, and stderr says how many were published, which is what
    # the queue holds
    assert len(finished.stdout.split()) == 1
    (line,) = [line for line in finished.stderr.splitlines() if line.startswith("error: ")]
    published = int(line.split("error: the output was closed: ", 1)[1].split(" of 2000 ")[0])
    assert f"the other {2000 - published} were not published" in line
    assert kit.client.stats(QUEUE).message_count == published
    assert "Traceback" not in finished.stderr


def test_drain_shows_every_retried_infrai_call(kit: Harness, jobs_path: str) -> None:
    # Given one job, and an Infrai whose ack route fails every time
    message_id = kit.publish({"job": "cli.ok", "id": "a"})[0]
    kit.faults(error_rate=1.0, routes=["ack"])
    # When the operator drains
    finished = run_cli(kit, "drain", "--jobs-path", jobs_path)
    kit.faults()
    # Then each retry of the ack is on the terminal, and the ack that failed after them
    assert finished.returncode == 0, finished.stderr
    retries = lines_with(finished.stderr, "http_retry")
    assert len(retries) == 3, finished.stderr
    assert all("call=ack" in line and "code=INTERNAL" in line for line in retries)
    assert fields_of_the_line(finished.stderr, "ack_failed")["message_id"] == message_id
    assert json.loads(finished.stdout)["ack_failed"] == 1


def _seed_settled_claim(
    kit: Harness,
    payload: Payload,
    state: str,
    *,
    message_id: str,
    effect: str | None = None,
    error: str | None = None,
) -> None:
    """The claim an earlier delivery of ``payload`` left ``state``: under the payload's key,
    with its fingerprint."""
    derived = kit.registry.derive(payload)
    kit.sql(
        "INSERT INTO job_claims (idem_key, state, message_id, effect, error, payload_sha256,"
        " lease_until) VALUES (%s, %s, %s, %s, %s, %s, now() - interval '1 second')",
        (derived.idem_key, state, message_id, effect, error, derived.fingerprint),
    )


# --- dlq: what each dead letter really is -------------------------------------------------------


def test_dlq_shows_a_same_key_different_work_dead_letter_as_a_conflict(kit: Harness) -> None:
    # Given an invoice finalized for 4,900 cents, and a dead letter for the same invoice with
    # another amount (the drain refused it: same key, different work)
    done = {"job": "invoice.finalize", "invoice_id": "inv_1", "amount_cents": 4900}
    _seed_settled_claim(kit, done, "done", message_id="qmsg_first")
    message_id = kit.client.publish(DLQ, {**done, "amount_cents": 5900})
    # When the operator lists the DLQ
    listed = run_cli(kit, "dlq", "--json")
    # Then the dead letter is a conflict with the done key, not "done" with no reason
    assert listed.returncode == 0, listed.stderr
    (row,) = json.loads(listed.stdout)["messages"]
    assert row["message_id"] == message_id
    assert (row["state"], row["claim_state"]) == ("conflict", "done")
    assert row["reason"] == "conflict with invoice.finalize:inv_1 (done, different work)"
    # And the table, read right after, says the same, in full
    table = run_cli(kit, "dlq")
    assert "conflict with invoice.finalize:inv_1 (done, different work)" in table.stdout


# --- dlq discard --------------------------------------------------------------------------------


def test_dlq_discard_by_message_id_records_the_payload_and_resolves_the_row(
    kit: Harness,
) -> None:
    # Given a job that cannot ever run, dead-lettered beside another
    doomed = {"job": "invoice.finalize", "invoice_id": "inv_gone", "amount_cents": 1}
    doomed_id = kit.client.publish(DLQ, doomed)
    kept_id = kit.client.publish(DLQ, {"job": "test.db", "id": "kept"})
    # When the operator discards it by its message id
    finished = run_cli(
        kit, "dlq", "discard", "--message-id", doomed_id, "--note", "customer deleted"
    )
    # Then both left Infrai's DLQ for the ledger, and only the other is still listed
    assert finished.returncode == 0, finished.stderr
    assert f"discarded {doomed_id} (key invoice.finalize:inv_gone)" in finished.stdout
    assert kit.client.stats(QUEUE).dlq_count == 0
    listed = json.loads(run_cli(kit, "dlq", "--json").stdout)
    assert [m["message_id"] for m in listed["messages"]] == [kept_id]
    # And the ledger keeps the discarded one, resolved: who, when, why
    everything = json.loads(run_cli(kit, "dlq", "--all", "--json").stdout)["messages"]
    (gone,) = [m for m in everything if m["message_id"] == doomed_id]
    assert (gone["resolution"], gone["resolved_by"], gone["resolution_note"]) == (
        "discarded",
        OPERATOR,
        "customer deleted",
    )
    assert gone["resolved_at"] is not None
    # And the discard, who did it, why, and the payload are in claim_history under its key
    shown = json.loads(run_cli(kit, "claims", "show", "invoice.finalize:inv_gone", "--json").stdout)
    ((entry,),) = [shown["history"]]
    assert (entry["action"], entry["actor"], entry["note"]) == (
        "discard",
        OPERATOR,
        "customer deleted",
    )
    assert entry["before"]["dead_letter"]["payload"] == doomed
    assert entry["before"]["dead_letter"]["message_id"] == doomed_id
    assert entry["before"]["claim"] is None
    human = run_cli(kit, "claims", "show", "invoice.finalize:inv_gone")
    assert "now: discard by on-call@example.com" in human.stdout


def test_dlq_discard_by_key_takes_every_copy_and_keeps_unkeyed_records_by_message_id(
    kit: Harness,
) -> None:
    # Given two copies of one job and a message with no key, dead-lettered
    copy = {"job": "invoice.finalize", "invoice_id": "inv_2", "amount_cents": 3}
    first, second = kit.client.publish(DLQ, copy), kit.client.publish(DLQ, copy)
    unkeyed = kit.client.publish(DLQ, {"job": "no.such.job", "text": "nul \u0000 inside"})
    # When the operator discards the key
    by_key = run_cli(kit, "dlq", "discard", "--key", "invoice.finalize:inv_2", "--json")
    # Then both copies are discarded, and the unkeyed one is still listed
    assert by_key.returncode == 0, by_key.stderr
    document = json.loads(by_key.stdout)
    assert [d["message_id"] for d in document["discarded"]] == [first, second]
    listed = json.loads(run_cli(kit, "dlq", "--json").stdout)["messages"]
    assert [m["message_id"] for m in listed] == [unkeyed]
    history = OperatorLedger(kit.database_url).history("invoice.finalize:inv_2")
    assert [h["before"]["dead_letter"]["message_id"] for h in history] == [first, second]
    # When the unkeyed one is discarded by its id
    by_id = run_cli(kit, "dlq", "discard", "--message-id", unkeyed)
    # Then it is recorded under its message id, its payload kept even where jsonb cannot
    assert by_id.returncode == 0, by_id.stderr
    (entry,) = OperatorLedger(kit.database_url).history(unkeyed)
    assert "nul" in json.dumps(entry["before"]["dead_letter"]["payload"])
    assert kit.client.stats(QUEUE).dlq_count == 0


def test_dlq_all_shows_how_each_dead_letter_was_resolved(kit: Harness) -> None:
    # Given three dead letters: one the operator discards, one redriven, one left alone
    ids = {
        name: kit.client.publish(DLQ, {"job": "test.db", "id": name})
        for name in ("discarded", "redriven", "open")
    }
    test_jobs = str(TEST_JOBS_CODE)
    discarded = run_cli(kit, "dlq", "discard", "--message-id", ids["discarded"])
    assert discarded.returncode == 0, discarded.stderr
    redriven = run_cli(kit, "redrive", "--message-id", ids["redriven"], INFRAI_JOBS_PATH=test_jobs)
    assert redriven.returncode == 0, redriven.stderr
    # When the operator lists them all
    listed = run_cli(kit, "dlq", "--all", INFRAI_JOBS_PATH=test_jobs)
    # Then a RESOLUTION column says how each was resolved, and is empty for the open one
    assert listed.returncode == 0, listed.stderr
    header, *rows = listed.stdout.split("\n\n", 1)[0].splitlines()
    assert header.split() == [
        "MESSAGE_ID",
        "DELIVERIES",
        "IDEM_KEY",
        "STATE",
        "FIRST_SEEN",
        "RESOLUTION",
        "REASON",
    ]
    start = header.index("RESOLUTION")
    resolution = {row.split()[0]: row[start:].split(" ", 1)[0] for row in rows}
    assert resolution == {
        ids["discarded"]: "discarded",
        ids["redriven"]: "redriven",
        ids["open"]: "",
    }
    # And without --all the open one alone is listed, with no such column
    plain = run_cli(kit, "dlq", INFRAI_JOBS_PATH=test_jobs)
    assert "RESOLUTION" not in plain.stdout
    assert ids["open"] in plain.stdout
    assert ids["discarded"] not in plain.stdout


def test_dlq_discard_of_nothing_matching_fails_and_changes_nothing(kit: Harness) -> None:
    kit.client.publish(DLQ, {"job": "test.db", "id": "x"})
    finished = run_cli(kit, "dlq", "discard", "--message-id", "qmsg_nope")
    assert finished.returncode == 3
    assert (
        "no unresolved dead letter of billing-jobs matched --message-id qmsg_nope"
        in finished.stderr
    )
    assert "Traceback" not in finished.stderr
    assert kit.sql("SELECT count(*) FROM claim_history") == [(0,)]
    assert kit.sql("SELECT count(*) FROM dead_letters WHERE resolution IS NULL") == [(1,)]


# --- selective redrive --------------------------------------------------------------------------


def test_redrive_moves_only_the_selected_dead_letters(kit: Harness) -> None:
    # Given dead letters of three jobs
    receipt = {"job": "receipt.send", "invoice_id": "inv_5", "email": "a@example.com"}
    ids = {
        "receipt": kit.client.publish(DLQ, receipt),
        "invoice": kit.client.publish(
            DLQ, {"job": "invoice.finalize", "invoice_id": "inv_5", "amount_cents": 1}
        ),
        "db": kit.client.publish(DLQ, {"job": "test.db", "id": "a"}),
        "db2": kit.client.publish(DLQ, {"job": "test.db", "id": "b"}),
    }
    # (the CLI judges each letter by a jobs package that knows test.db, as the drain's does)
    test_jobs = str(TEST_JOBS_CODE)
    # When the operator redrives one key (a job with its own identity rule)
    by_key = run_cli(kit, "redrive", "--key", "receipt.send:inv_5", "--json")
    # Then only that one moved; the others stay unresolved in the ledger
    assert by_key.returncode == 0, by_key.stderr
    summary = json.loads(by_key.stdout)
    assert (summary["published"], summary["not_selected"]) == (1, 3)
    assert summary["selection"] == {"key": "receipt.send:inv_5"}
    assert [m.payload for m in kit.client.consume(QUEUE)] == [receipt]
    # When, right after, the operator redrives one message id, then one job
    by_id = run_cli(kit, "redrive", "--message-id", ids["invoice"])
    assert by_id.returncode == 0, by_id.stderr
    assert (
        f"published 1 dead letter(s) of the ledger -> {QUEUE} (--message-id {ids['invoice']})"
        in by_id.stdout
    )
    by_job = run_cli(kit, "redrive", "--job", "test.db", "--json", INFRAI_JOBS_PATH=test_jobs)
    # Then each moved exactly what it named, and nothing is left unresolved
    assert json.loads(by_job.stdout)["published"] == 2
    assert kit.client.stats(QUEUE).dlq_count == 0
    assert json.loads(run_cli(kit, "dlq", "--json").stdout)["messages"] == []


def test_redrive_function_moves_only_the_job_its_event_selects(kit: Harness, project: Path) -> None:
    from infrai_local.sandbox.invoke import invoke, resolve  # noqa: PLC0415

    # Given dead letters of two jobs
    kit.client.publish(DLQ, {"job": "invoice.finalize", "invoice_id": "inv_7", "amount_cents": 1})
    kit.client.publish(DLQ, {"job": "test.db", "id": "stays"})
    # When RedriveFunction is invoked with events/redrive-selected.json (job invoice.finalize)
    spec = resolve("RedriveFunction", root=project, env_vars=ROOT / "events" / "env.json")
    result = invoke(spec, ROOT / "events" / "redrive-selected.json", extra_env=kit.services)
    # Then it moved the invoice job only, and says what it left
    assert result.ok, result.payload
    assert result.payload["selection"] == {"job": "invoice.finalize"}
    assert (result.payload["published"], result.payload["not_selected"]) == (1, 1)
    assert result.payload["complete"] is True
    (moved,) = kit.client.consume(QUEUE)
    assert moved.payload["job"] == "invoice.finalize"


def test_redrive_function_derives_a_jobs_own_key_with_the_shared_jobs_package(
    kit: Harness, tmp_path: Path, project: Path
) -> None:
    from infrai_local.sandbox.invoke import invoke, resolve  # noqa: PLC0415

    # Given three receipts dead-lettered (receipt.send keys by invoice_id, a rule of the jobs
    # package): the wanted one failed in the ledger; a later one for the same invoice, to a
    # corrected address (other work under the same key), never reached the ledger
    wanted = {"job": "receipt.send", "invoice_id": "inv_8", "email": "a@example.com"}
    twin = {"job": "receipt.send", "invoice_id": "inv_8", "email": "a@example.org"}
    other = {"job": "receipt.send", "invoice_id": "inv_9", "email": "b@example.com"}
    _seed_settled_claim(
        kit, wanted, "failed", message_id="qmsg_old", effect="external", error="bounced"
    )
    kit.client.publish(DLQ, other)
    kit.client.publish(DLQ, wanted)
    kit.client.publish(DLQ, twin)
    event = tmp_path / "redrive-key.json"
    event.write_text(json.dumps({"key": "receipt.send:inv_8", "reopen_failed": True}))
    # When RedriveFunction is asked for that key
    spec = resolve("RedriveFunction", root=project, env_vars=ROOT / "events" / "env.json")
    result = invoke(spec, event, extra_env=kit.services)
    # Then it moved both receipts of that key, the one the ledger never saw included (the key
    # comes from the job's own rule, as the drain derives it), and reopened the failed claim
    assert result.ok, result.payload
    assert (result.payload["published"], result.payload["not_selected"]) == (2, 1)
    assert result.payload["reopened"] == ["receipt.send:inv_8"]
    moved = kit.client.consume(QUEUE)
    assert sorted(m.payload["email"] for m in moved) == ["a@example.com", "a@example.org"]
    # And the ledger records the function by its name, for the rows it redrove and the claim
    # it reopened (the operator's name is the command line's, never looked up in the layer)
    assert kit.sql(
        "SELECT DISTINCT resolved_by FROM dead_letters WHERE resolution IS NOT NULL"
    ) == [("RedriveFunction",)]
    assert kit.sql("SELECT actor FROM claim_history WHERE action = 'reopen'") == [
        ("RedriveFunction",)
    ]


# --- claims -----------------------------------------------------------------------------------


def _seed_claim(kit: Harness, key: str, state: str, error: str | None = None) -> str:
    kit.sql(
        "INSERT INTO job_claims (idem_key, state, message_id, effect, claim_token, error,"
        " lease_until) VALUES (%s, %s, 'qmsg_seeded', 'external', gen_random_uuid(), %s,"
        " now() - interval '1 second')",
        (key, state, error),
    )
    return str(kit.sql("SELECT claim_token FROM job_claims WHERE idem_key = %s", (key,))[0][0])


def test_claims_show_keeps_showing_a_released_claim_and_its_history(kit: Harness) -> None:
    # Given a failed claim that an operator released for a retry
    key = "receipt.send:inv_9"
    _seed_claim(kit, key, "failed", "PermanentJobError: mailbox full")
    released = run_cli(kit, "claims", "release", key, "--note", "mailbox emptied")
    assert released.returncode == 0, released.stderr
    # When the operator looks at the key
    shown = run_cli(kit, "claims", "show", key)
    # Then it is not "no claim": the release, who did it, and the claim as it was are shown
    assert shown.returncode == 0, shown.stderr
    assert f"no claim with key '{key}' now: release by {OPERATOR}" in shown.stdout
    assert "PermanentJobError: mailbox full" in shown.stdout
    assert "mailbox emptied" in shown.stdout
    # And the JSON form has no claim and the whole history
    document = json.loads(run_cli(kit, "claims", "show", key, "--json").stdout)
    assert document["claim"] is None
    ((entry,),) = [document["history"]]
    assert (entry["action"], entry["before"]["state"], entry["after"]) == (
        "release",
        "failed",
        None,
    )
    # And a key nobody ever claimed or touched is still missing (exit 3)
    missing = run_cli(kit, "claims", "show", "receipt.send:never")
    assert missing.returncode == 3
    assert "no claim with key 'receipt.send:never'" in missing.stderr


def test_claims_show_after_a_redrive_reopened_the_failed_claim(kit: Harness) -> None:
    # Given a failed invoice job in the DLQ, with its failed claim
    payload = {"job": "invoice.finalize", "invoice_id": "inv_404", "amount_cents": 5}
    _seed_settled_claim(kit, payload, "failed", message_id="qmsg_gone", error="no such invoice")
    kit.client.publish(DLQ, payload)
    # When it is redriven with --reopen-failed
    redriven = run_cli(kit, "redrive", "--reopen-failed", "--json")
    assert redriven.returncode == 0, redriven.stderr
    assert json.loads(redriven.stdout)["reopened"] == ["invoice.finalize:inv_404"]
    # Then claims show tells the redrive, the reopen and the failure before it
    shown = run_cli(kit, "claims", "show", "invoice.finalize:inv_404")
    assert shown.returncode == 0, shown.stderr
    assert "now: redrive by" in shown.stdout
    assert "reopen" in shown.stdout
    assert "no such invoice" in shown.stdout


def test_history_notes_name_exactly_the_redrive_flags_given(kit: Harness) -> None:
    # Given a failed invoice job in the DLQ, with its failed claim
    invoice = {"job": "invoice.finalize", "invoice_id": "inv_noted", "amount_cents": 5}
    _seed_settled_claim(kit, invoice, "failed", message_id="qmsg_noted", error="no such invoice")
    kit.client.publish(DLQ, invoice)
    # And deferred work a drain failed for good: the ledger holds its dead letter
    (deferred_key,) = kit.failed_for_good("noted", error="gave up")
    test_jobs = str(TEST_JOBS_CODE)
    # When the operator redrives the invoice with --reopen-failed, by its key
    key = "invoice.finalize:inv_noted"
    explicit = run_cli(kit, "redrive", "--reopen-failed", "--key", key, INFRAI_JOBS_PATH=test_jobs)
    # And the deferred work's job with a plain redrive
    plain = run_cli(kit, "redrive", "--job", "test.db", INFRAI_JOBS_PATH=test_jobs)
    # Then each history note says exactly what was given, and only that
    assert explicit.returncode == 0, explicit.stdout + explicit.stderr
    assert plain.returncode == 0, plain.stdout + plain.stderr
    given = f"redrive --reopen-failed --key {key}"
    assert [(row[0], row[2]) for row in kit.history(key)] == [("reopen", given), ("redrive", given)]
    notes = {action: note for action, _, note in kit.history(deferred_key)}
    assert notes["redrive"] == "redrive --job test.db"
    assert notes["reopen"].startswith("redrive --job test.db: ")
    assert "--reopen-failed" not in notes["reopen"]


def test_claims_resolve_failed_needs_a_reason(kit: Harness) -> None:
    # Given a stuck claim
    key = "receipt.send:inv_3"
    _seed_claim(kit, key, "running", "effect uncertain")
    # When an operator resolves it failed without saying why
    finished = run_cli(kit, "claims", "resolve", key, "--failed")
    # Then it is refused as bad usage, naming the flag, and the claim is untouched
    assert finished.returncode == 2
    assert "--failed needs --error" in finished.stderr
    assert "Traceback" not in finished.stderr
    assert kit.row(key).state == "running"  # type: ignore[union-attr]
    # And with a reason it goes through, recorded under the verdict
    finished = run_cli(kit, "claims", "resolve", key, "--failed", "--error", "never sent")
    assert finished.returncode == 0, finished.stderr
    assert kit.row(key).error == "never sent"  # type: ignore[union-attr]


def test_refusals_name_the_commands_operators_type(kit: Harness) -> None:
    # Given a failed claim, and a running one under a live lease
    _seed_claim(kit, "receipt.send:failed", "failed", "bounced")
    kit.sql(
        "INSERT INTO job_claims (idem_key, state, message_id, effect, claim_token, lease_until)"
        " VALUES ('receipt.send:live', 'running', 'qmsg_1', 'external', gen_random_uuid(),"
        " now() + interval '5 minutes')"
    )
    # When an operator asks for what each cannot take
    resolve = run_cli(kit, "claims", "resolve", "receipt.send:failed", "--done")
    release = run_cli(kit, "claims", "release", "receipt.send:live")
    # Then each refusal (exit 3) says which command needs what, in the words typed
    assert resolve.returncode == release.returncode == 3
    assert "`infrai-jobs claims resolve --done` needs a running claim" in resolve.stderr
    assert "wait for the lease to end" in release.stderr
    assert "`infrai-jobs claims release receipt.send:live` again" in release.stderr
    for finished in (resolve, release):
        assert "resolve_done" not in finished.stderr
        assert "Traceback" not in finished.stderr


# --- cost ---------------------------------------------------------------------------------------


def test_cost_with_a_wrong_api_key_says_so_and_fails(kit: Harness) -> None:
    from infrai_local.sandbox.emulator import start_in_thread  # noqa: PLC0415

    # Given an Infrai that takes only its own API key
    guarded = start_in_thread(api_key="the-right-key")
    try:
        # When cost is asked with another key
        finished = run_cli(kit, "cost", "--messages-per-day", "1000", INFRAI_BASE_URL=guarded.url)
    finally:
        guarded.stop()
    # Then it fails, naming the 401 and the key to check, and prints no made-up total
    assert finished.returncode == 1
    assert "UNAUTHORIZED" in finished.stderr
    assert "401" in finished.stderr
    assert "INFRAI_API_KEY" in finished.stderr
    assert "could not be reached" not in finished.stdout + finished.stderr
    assert "$" not in finished.stdout


def test_a_retried_infrai_call_is_a_warning_naming_the_call_and_queue(
    kit: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    import logging  # noqa: PLC0415

    from infrai_jobs.errors import InfraiUnavailable  # noqa: PLC0415
    from infrai_jobs.queue.client import HttpRetryPolicy, InfraiClient  # noqa: PLC0415

    # Given an Infrai failing every ack
    kit.faults(error_rate=1.0, routes=["ack"])
    client = InfraiClient(kit.server.url, "test-key", retry=HttpRetryPolicy(base_delay=0.001))
    try:
        # When an ack is retried until it gives up
        with (
            caplog.at_level(logging.WARNING, logger="infrai_jobs"),
            pytest.raises(InfraiUnavailable, match="INTERNAL"),
        ):
            client.ack(QUEUE, "qmsg_any")
    finally:
        client.close()
        kit.faults()
    # Then each retry was a WARNING (what the person on call filters on) with call and queue
    retries = [r for r in caplog.records if getattr(r, "action", "") == "http_retry"]
    assert len(retries) == 3
    assert {r.levelno for r in retries} == {logging.WARNING}
    assert {(r.call, r.queue) for r in retries} == {("ack", QUEUE)}  # type: ignore[attr-defined]


def test_claims_show_of_a_key_without_a_claim_says_where_a_released_ones_error_is(
    kit: Harness,
) -> None:
    # Given a key with no claim and no history: a job whose handler raised releases its claim
    # When it is shown
    shown = run_cli(kit, "claims", "show", "receipt.send:inv_released")
    # Then it is missing (exit 3), in one line that says where such a job's error is
    assert shown.returncode == 3, shown.stdout + shown.stderr
    (line,) = shown.stderr.splitlines()
    assert line.startswith("error: no claim with key 'receipt.send:inv_released'")
    assert "the drain's log lines with action retry and this idem_key" in line


def test_claims_show_says_in_one_line_when_no_history_is_recorded(kit: Harness) -> None:
    # Given a done claim nobody acted on
    key = "receipt.send:inv_quiet"
    _seed_claim(kit, key, "done")
    # When it is shown
    shown = run_cli(kit, "claims", "show", key)
    # Then its history is said to be empty once, in words
    assert shown.returncode == 0, shown.stderr
    assert "history: none recorded" in shown.stdout
    assert "(none)" not in shown.stdout
