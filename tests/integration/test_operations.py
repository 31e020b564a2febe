"""On-call operations: redrive, dlq inspection, claims resolve/release/prune, cost."""

from __future__ import annotations

import argparse
import io
import itertools
import json
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from drainkit import DLQ, OPERATOR, QUEUE, Harness, harness, run_until_killed
from fixture_project import fixture_jobs_as_jobs

from infrai_jobs.errors import ClaimChanged, ClaimNotFound, LedgerUnavailable, PermanentJobError
from infrai_jobs.jobs.registry import Effect, JobContext, JsonValue, Payload
from infrai_jobs.operations.dead_letters import DeadLetterStore
from infrai_jobs.operations.redrive import JobsKnowledge, RedriveRequest, redrive
from infrai_jobs.work.admin import WorkStore
from infrai_local.cli import main as cli
from infrai_local.operator import cli_ops
from infrai_local.operator.verbs import OperatorLedger

HERE = Path(__file__).parent
ROOT = HERE.parent.parent


@pytest.fixture
def kit(database_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Harness]:
    # The CLI runs in this process: its jobs package is the harness's, the fixture jobs'
    with harness(database_url) as h, fixture_jobs_as_jobs():
        monkeypatch.setenv("INFRAI_BASE_URL", h.server.url)
        monkeypatch.setenv("INFRAI_API_KEY", "test-key")
        monkeypatch.setenv("DATABASE_URL", database_url)
        monkeypatch.setenv("OPERATOR", OPERATOR)
        monkeypatch.chdir(ROOT)
        yield h


def _run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, Any]:
    code = cli(list(argv))
    out = capsys.readouterr().out
    return code, json.loads(out) if "--json" in argv else out


# --- redrive ---------------------------------------------------------------------------------

# A redrive killed at its fifth publish, after the message went out and before its dead letter
# was marked redriven in the ledger.
REDRIVE_KILLED_AFTER_FIFTH_PUBLISH = textwrap.dedent(
    """
    import os, signal, sys
    from infrai_jobs.operations.dead_letters import DeadLetterStore
    from infrai_jobs.work.admin import WorkStore
    from infrai_jobs.queue.client import InfraiClient
    from infrai_jobs.operations.redrive import RedriveRequest, redrive

    client = InfraiClient(sys.argv[1], "test-key")
    published = []
    real_publish = client.publish
    def publish(queue, body, **options):
        answer = real_publish(queue, body, **options)
        published.append(body)
        if len(published) == 5:
            os.kill(os.getpid(), signal.SIGKILL)
        return answer
    client.publish = publish
    store = DeadLetterStore(WorkStore(sys.argv[2]))
    request = RedriveRequest(max_messages=1000).to(
        source="billing-jobs-dlq", target="billing-jobs", actor="on-call@example.com"
    )
    redrive(client, store, request)
    """
)


@pytest.mark.slow
def test_redrive_of_250_dead_letters_runs_every_key_once_even_after_a_crash(kit: Harness) -> None:
    payloads = [{"job": "test.db", "id": f"r{n}"} for n in range(250)]
    # Given 50 of the jobs already done before they were dead-lettered
    for payload in payloads[:50]:
        kit.publish(payload)
    assert kit.drain().done == 50
    # And all 250 sitting in the DLQ
    for payload in payloads:
        kit.client.publish(DLQ, payload)
    # When a redrive is killed after its fifth publish, before that dead letter is marked ...
    run_until_killed(REDRIVE_KILLED_AFTER_FIFTH_PUBLISH, kit.server.url, kit.database_url)
    assert kit.sql("SELECT count(*) FROM dead_letters WHERE resolution IS NULL") == [(246,)]
    # ... and redriven again to the end
    summary = redrive(
        kit.client,
        _store(kit),
        RedriveRequest(source=DLQ, target=QUEUE, max_messages=1000, actor=OPERATOR),
    )
    assert (summary.consumed, summary.published, summary.complete) == (0, 246, True)
    drained = kit.drain()
    # Then nothing is left in the DLQ or unresolved in the ledger, every key is done, and no
    # effect ran twice (the fifth was published twice; its claim absorbed the copy)
    stats = kit.client.stats(QUEUE)
    assert (stats.message_count, stats.dlq_count) == (0, 0)
    resolved = kit.sql("SELECT resolution, count(*) FROM dead_letters GROUP BY resolution")
    assert resolved == [("redriven", 250)]
    done = kit.sql("SELECT count(*) FROM job_claims WHERE state = 'done' AND job = 'test.db'")
    assert done == [(250,)]
    counts = dict(kit.sql("SELECT idem_key, count(*) FROM test_effects GROUP BY idem_key"))
    assert counts == {f"test.db:r{n}": 1 for n in range(250)}
    assert drained.done == 200
    assert (drained.consumed, drained.duplicates) == (251, 51)


def _store(kit: Harness) -> DeadLetterStore:
    return DeadLetterStore(WorkStore(kit.database_url))


def test_redrive_reopens_failed_claims_and_holds_back_stuck_ones(kit: Harness) -> None:
    broken = {"on": True}

    def switch(payload: Payload, ctx: JobContext) -> JsonValue:
        if broken["on"]:
            raise PermanentJobError("the downstream rejected it (bug #42)")
        return {"fixed": True}

    kit.registry.job("test.switch", effect=Effect.EXTERNAL, identity=("id",))(switch)
    # Given a job that failed permanently and was dead-lettered
    kit.publish({"job": "test.switch", "id": "a"})
    assert kit.drain().outcomes == {"failed": 1}
    for _ in range(2):
        kit.advance()
        kit.drain()
    kit.advance()
    assert kit.client.stats(QUEUE).dlq_count == 1
    # And a stuck irreversible job dead-lettered too
    kit.publish({"job": "test.ext", "id": "s", "mode": "uncertain"})
    kit.drain()
    for _ in range(2):
        kit.advance()
        kit.drain()
    kit.advance()
    assert kit.client.stats(QUEUE).dlq_count == 2
    # When the bug is fixed and the DLQ redriven with --reopen-failed (by the harness's jobs)
    broken["on"] = False
    redriven = redrive(
        kit.client,
        _store(kit),
        RedriveRequest(
            source=DLQ, target=QUEUE, max_messages=100, actor=OPERATOR, reopen_failed=True
        ),
        jobs=JobsKnowledge(key_of=lambda payload: kit.registry.derive(payload).idem_key),
        admin=WorkStore(kit.database_url),
    )
    document = redriven.as_dict()
    assert document["published"] == 1
    assert document["reopened"] == ["test.switch:a"]
    assert document["held_back_by_cause"] == {"stuck": 1}
    assert document["price_source"] == "discovery"
    assert document["cost_usd"] == "0.00002"
    # Then the failed job runs again and is done; the stuck one stays stuck, untouched, its
    # dead letter unresolved for a human
    summary = kit.drain()
    assert summary.outcomes == {"done": 1}
    assert kit.external_effects("test.ext:s") == 1
    assert kit.row("test.ext:s") is not None
    assert kit.sql("SELECT count(*) FROM dead_letters WHERE resolution IS NULL") == [(1,)]
    history = OperatorLedger(kit.database_url).history("test.switch:a")
    # (the failed claim reopened, then its dead letter redriven, both by the operator)
    assert [h["action"] for h in history] == ["reopen", "redrive"]
    assert {h["actor"] for h in history} == {"on-call@example.com"}


def test_dlq_shows_keys_ledger_rows_and_reads_the_same_twice(
    kit: Harness, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given a failed invoice job and an unknown job in the DLQ
    bad = {"job": "invoice.finalize", "invoice_id": "inv_bad", "amount_cents": 1}
    kit.sql(
        "INSERT INTO job_claims (idem_key, state, message_id, error) VALUES"
        " ('invoice.finalize:inv_bad', 'failed', 'qmsg_x', 'PermanentJobError: no such customer')"
    )
    kit.client.publish(DLQ, bad)
    kit.client.publish(DLQ, {"job": "nope"})
    # When inspected, Then each message shows its key, the ledger's state and the reason
    code, document = _run_cli(capsys, "dlq", "--json")
    assert code == 0
    first, second = document["messages"]
    assert (first["idem_key"], first["state"]) == ("invoice.finalize:inv_bad", "failed")
    assert "no such customer" in first["reason"]
    assert second["idem_key"] is None
    assert "unknown job 'nope'" in second["reason"]
    assert "2 unresolved dead letter(s) of billing-jobs in the ledger" in document["notice"]
    assert kit.client.stats(QUEUE).dlq_count == 0
    # The human form, read right after, is a table with the same facts: nothing was hidden
    code, text = _run_cli(capsys, "dlq")
    assert "IDEM_KEY" in text
    assert "invoice.finalize:inv_bad" in text
    assert "unknown job 'nope'" in text


def test_a_redrive_short_of_time_stops_early_and_the_rest_waits(kit: Harness) -> None:
    # Given 60 dead letters
    payloads = [{"job": "test.db", "id": f"t{n}"} for n in range(60)]
    for payload in payloads:
        kit.client.publish(DLQ, payload)
    # And an invocation whose time runs out after about forty of them are read (each look at
    # the clock finds a second less left)
    looks = itertools.count()
    time_left = lambda: 60_000 - 1_000 * next(looks)  # noqa: E731
    # When it redrives
    summary = redrive(
        kit.client,
        _store(kit),
        RedriveRequest(source=DLQ, target=QUEUE, max_messages=100, actor=OPERATOR),
        time_left_ms=time_left,
    )
    # Then it stopped before the budget ran out, and says so
    assert summary.stopped == "time_budget"
    assert summary.as_dict()["stopped"] == "time_budget"
    assert summary.complete is False
    assert 0 < summary.recorded < 60
    assert summary.acked == summary.recorded
    assert summary.published < 60
    # And it read nothing it did not record: the rest is in the DLQ, none of it hidden
    assert kit.client.stats(QUEUE).dlq_count == 60 - summary.recorded
    assert kit.client.stats(DLQ).available_count == 60 - summary.recorded
    # When a second redrive runs at once, with time to spare
    rest = redrive(
        kit.client,
        _store(kit),
        RedriveRequest(source=DLQ, target=QUEUE, max_messages=100, actor=OPERATOR),
    )
    # Then it moves the rest, and the drain runs every job once
    assert (rest.stopped, rest.published) == ("", 60 - summary.published)
    assert kit.drain().done == 60
    counts = dict(kit.sql("SELECT idem_key, count(*) FROM test_effects GROUP BY idem_key"))
    assert counts == {f"test.db:t{n}": 1 for n in range(60)}


def test_redrive_dry_run_publishes_nothing_and_leaves_the_letter_listed(
    kit: Harness, capsys: pytest.CaptureFixture[str]
) -> None:
    kit.client.publish(DLQ, {"job": "invoice.finalize", "invoice_id": "inv_x", "amount_cents": 1})
    code, text = _run_cli(capsys, "redrive", "--dry-run")
    assert code == 0
    assert "would publish 1 dead letter(s)" in text
    assert "invoice.finalize:inv_x" in text
    assert "publish cost: 0 x" in text
    assert kit.client.stats(QUEUE).message_count == 0
    # The dead letter moved into the ledger, unresolved: `dlq discard` right after finds it
    code, document = _run_cli(capsys, "dlq", "--json")
    assert [m["idem_key"] for m in document["messages"]] == ["invoice.finalize:inv_x"]
    code, discarded = _run_cli(
        capsys, "dlq", "discard", "--key", "invoice.finalize:inv_x", "--json"
    )
    assert code == 0
    assert [d["idem_key"] for d in discarded["discarded"]] == ["invoice.finalize:inv_x"]


# --- claims -----------------------------------------------------------------------------------


def _stuck_claim(kit: Harness, key: str = "receipt.send:inv_1") -> str:
    kit.sql(
        "INSERT INTO job_claims (idem_key, state, message_id, effect, claim_token, error,"
        " lease_until) VALUES (%s, 'running', 'qmsg_1', 'external', gen_random_uuid(),"
        " 'effect uncertain', now() - interval '1 second')",
        (key,),
    )
    return str(kit.sql("SELECT claim_token FROM job_claims WHERE idem_key = %s", (key,))[0][0])


def test_resolve_done_records_the_verdict_and_its_history(
    kit: Harness, capsys: pytest.CaptureFixture[str]
) -> None:
    token = _stuck_claim(kit)
    code, stuck = _run_cli(capsys, "claims", "stuck", "--json")
    assert code == 0
    assert [c["idem_key"] for c in stuck] == ["receipt.send:inv_1"]
    code, document = _run_cli(
        capsys,
        "claims",
        "resolve",
        "receipt.send:inv_1",
        "--done",
        "--result",
        '{"provider_message_id": "mail_77"}',
        "--token",
        token,
        "--note",
        "found it in the provider's log",
        "--json",
    )
    assert code == 0
    assert document["action"] == "resolved"
    assert document["claim"]["state"] == "done"
    assert document["claim"]["result"] == {"provider_message_id": "mail_77"}
    code, shown = _run_cli(capsys, "claims", "show", "receipt.send:inv_1", "--json")
    ((entry,),) = [shown["history"]]
    assert entry["action"] == "resolve_done"
    assert entry["actor"] == "on-call@example.com"
    assert entry["before"]["state"] == "running"
    assert entry["after"]["state"] == "done"
    assert entry["note"] == "found it in the provider's log"


def test_fenced_actions_fail_clearly_when_the_claim_moved_on(
    kit: Harness, capsys: pytest.CaptureFixture[str]
) -> None:
    _stuck_claim(kit)
    admin = OperatorLedger(kit.database_url)
    # A token the operator looked at, then the claim was taken over
    import uuid  # noqa: PLC0415

    with pytest.raises(ClaimChanged, match="changed since you looked"):
        admin.resolve("receipt.send:inv_1", done=True, expected_token=uuid.uuid4(), actor=OPERATOR)
    admin.resolve("receipt.send:inv_1", done=False, error="never sent", actor=OPERATOR)
    # Once failed, it cannot be resolved again, only released
    with pytest.raises(ClaimChanged) as refused:
        admin.resolve("receipt.send:inv_1", done=True, actor=OPERATOR)
    assert "is failed; `infrai-jobs claims resolve --done` needs a running claim" in str(
        refused.value
    )
    # And the command line says the same, in one line, exit 3
    code = cli(["claims", "resolve", "receipt.send:inv_1", "--done"])
    assert code == 3
    assert str(refused.value) in capsys.readouterr().err
    released = admin.release("receipt.send:inv_1", actor=OPERATOR, note="retry after fix")
    assert released.state == "failed"  # the row as it was before the delete
    with pytest.raises(ClaimNotFound):
        admin.show("receipt.send:inv_1")
    actions = [h["action"] for h in admin.history("receipt.send:inv_1")]
    assert actions == ["resolve_failed", "release"]


def test_release_and_resolve_failed_forget_the_second_layer_record_first(kit: Harness) -> None:
    # Given a stuck claim, and a second-layer store that cannot be reached at first
    key = "receipt.send:inv_1"
    _stuck_claim(kit, key)
    admin = OperatorLedger(kit.database_url)
    forgotten: list[str] = []
    reachable = False

    def forget(k: str) -> None:
        if not reachable:
            raise LedgerUnavailable("the second layer's store is unreachable")
        forgotten.append(k)

    def claims(command: str) -> int:
        args = argparse.Namespace(ops_command=command, key=key, token=None, note="", json=False)
        if command == "claims_resolve":
            args.done, args.failed, args.result, args.error = False, True, None, "not sent"
        return cli_ops._claims(args, admin, io.StringIO(), forget)

    for command in ("claims_release", "claims_resolve"):
        reachable = False
        # When the operator releases it (or resolves it failed) while the store is down
        with pytest.raises(LedgerUnavailable):
            claims(command)
        # Then nothing changed in the ledger, so running the command again is all it takes
        assert kit.row(key) is not None
        assert kit.row(key).state == "running"  # type: ignore[union-attr]
        # When it is run again with the store back
        reachable = True
        assert claims(command) == 0
        # Then the record was forgotten, and the ledger changed
        assert forgotten[-1] == key
        if command == "claims_release":
            assert kit.row(key) is None
            _stuck_claim(kit, key)  # again, for resolve
        else:
            assert kit.row(key).state == "failed"  # type: ignore[union-attr]
    # And resolving a claim that is no longer running (refused) keeps its record
    forgotten.clear()
    with pytest.raises(ClaimChanged):
        claims("claims_resolve")
    assert forgotten == []
    # And so does releasing, without its token, a claim under a live lease (refused too)
    kit.sql(
        "UPDATE job_claims SET state = 'running', error = NULL,"
        " lease_until = now() + interval '5 minutes' WHERE idem_key = %s",
        (key,),
    )
    with pytest.raises(ClaimChanged, match="live lease"):
        claims("claims_release")
    assert forgotten == []


def test_a_claim_under_a_live_lease_is_never_acted_on_even_with_its_token(
    kit: Harness, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given an external claim whose delivery holds a live lease (it may be inside the effect)
    kit.sql(
        "INSERT INTO job_claims (idem_key, state, message_id, effect, claim_token, lease_until)"
        " VALUES ('receipt.send:live', 'running', 'qmsg_1', 'external', gen_random_uuid(),"
        " now() + interval '5 minutes')"
    )
    (token,) = kit.sql("SELECT claim_token FROM job_claims WHERE idem_key = 'receipt.send:live'")[0]
    # When an operator releases it without the token
    code = cli(["claims", "release", "receipt.send:live"])
    # Then it is refused (the claim is not what an unseen release assumes), and kept
    assert code == 3
    assert "live lease" in capsys.readouterr().err
    assert kit.row("receipt.send:live") is not None
    # When the operator passes the token they looked at
    code = cli(["claims", "release", "receipt.send:live", "--token", str(token)])
    # Then it is still refused: only the delivery holding the lease settles it; once the
    # lease is over, the release goes ahead
    assert code == 3
    assert kit.row("receipt.send:live") is not None
    kit.sql(
        "UPDATE job_claims SET lease_until = now() - interval '1 second'"
        " WHERE idem_key = 'receipt.send:live'"
    )
    assert cli(["claims", "release", "receipt.send:live", "--token", str(token)]) == 0
    assert kit.row("receipt.send:live") is None


def test_history_is_append_only(kit: Harness) -> None:
    _stuck_claim(kit)
    OperatorLedger(kit.database_url).release("receipt.send:inv_1", actor=OPERATOR)
    with pytest.raises(psycopg.errors.RaiseException, match="append-only"):
        kit.sql("UPDATE claim_history SET actor = 'someone else'")
    with pytest.raises(psycopg.errors.RaiseException, match="append-only"):
        kit.sql("DELETE FROM claim_history")


def test_prune_removes_only_old_settled_rows_in_batches(
    kit: Harness, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given 2,500 old done/failed rows, an old running row and a recent done row
    kit.sql(
        "INSERT INTO job_claims (idem_key, state, message_id, claimed_at, updated_at)"
        " SELECT 'old:' || g, CASE WHEN g % 2 = 0 THEN 'done' ELSE 'failed' END, 'm',"
        " now() - interval '40 days', now() - interval '40 days' FROM generate_series(1, 2500) g"
    )
    kit.sql(
        "INSERT INTO job_claims (idem_key, state, message_id, claimed_at) VALUES"
        " ('old:running', 'running', 'm', now() - interval '90 days'),"
        " ('recent:done', 'done', 'm', now() - interval '1 day')"
    )
    # When pruned with 30 days' retention in batches of 1,000
    code, document = _run_cli(
        capsys, "claims", "prune", "--older-than", "30d", "--batch-size", "1000", "--json"
    )
    # Then exactly the old settled rows are gone, in three batches
    assert code == 0
    assert document == {"deleted": 2500, "batches": 3, "older_than_days": 30}
    left = sorted(k for (k,) in kit.sql("SELECT idem_key FROM job_claims"))
    assert left == ["old:running", "recent:done"]


@pytest.mark.parametrize("older_than", ["47h", "30", "0d"])
def test_prune_refuses_a_retention_it_would_have_to_round(
    kit: Harness, capsys: pytest.CaptureFixture[str], older_than: str
) -> None:
    # Given a done claim 30 hours old
    kit.sql(
        "INSERT INTO job_claims (idem_key, state, message_id, claimed_at) VALUES"
        " ('young:done', 'done', 'm', now() - interval '30 hours')"
    )
    # When pruning is asked for a retention that is not whole days (47 hours; 30 seconds)
    code = cli(["claims", "prune", "--older-than", older_than])
    # Then it refuses as bad usage, naming the form it takes, and deletes nothing (rounding
    # 47h down to a day would have deleted this row)
    assert code == 2
    assert "whole days" in capsys.readouterr().err
    assert kit.sql("SELECT idem_key FROM job_claims") == [("young:done",)]


def test_list_filters_and_prints_a_table(kit: Harness, capsys: pytest.CaptureFixture[str]) -> None:
    kit.publish({"job": "test.db", "id": "1"})
    kit.publish({"job": "test.db", "id": "2", "mode": "permanent"})
    kit.drain()
    code, failed = _run_cli(capsys, "claims", "list", "--state", "failed", "--json")
    assert code == 0
    assert [c["idem_key"] for c in failed] == ["test.db:2"]
    _code, text = _run_cli(capsys, "claims", "list", "--job", "test.db")
    assert text.splitlines()[0].split()[:2] == ["IDEM_KEY", "STATE"]
    assert "test.db:1" in text
    assert "test.db:2" in text


def test_unknown_claim_exits_3_and_missing_database_exits_2(
    kit: Harness, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert cli(["claims", "show", "nope"]) == 3
    assert "no claim with key 'nope'" in capsys.readouterr().err
    monkeypatch.delenv("DATABASE_URL")
    assert cli(["claims", "list"]) == 2
    assert "DATABASE_URL is not set" in capsys.readouterr().err


# --- cost -------------------------------------------------------------------------------------


def test_cost_reads_the_live_price_and_falls_back_with_a_note(
    kit: Harness, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    code, document = _run_cli(capsys, "cost", "--messages-per-day", "100000", "--json")
    assert code == 0
    assert document["price_source"] == "discovery"
    assert document["usd_total"] == "60.00000"
    monkeypatch.setenv("INFRAI_BASE_URL", "http://127.0.0.1:9")
    code, text = _run_cli(capsys, "cost", "--messages-per-day", "100000")
    assert code == 0
    assert "$60.00" in text
    assert "discovery could not be reached" in text
