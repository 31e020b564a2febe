"""Rows the field notes' Node worker writes, met by every operator verb, and a human's verdict met
by a later redrive.

The notes' worker claims with ``INSERT INTO job_claims (idem_key, state, message_id) VALUES (...,
'running', ...) ON CONFLICT (idem_key) DO NOTHING``: a running row with no lease. Such a row is
live until its claim time plus the queue's visibility timeout, for every reader (the drain's
claim, the operator's commands, the probe, the stuck listing). Against a real PostgreSQL, the
emulator over HTTP and ``infrai-jobs`` in a child process.
"""

from __future__ import annotations

import json
import uuid
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from claim_requests import claim_request
from consolekit import Session, console
from drainkit import (
    OPERATOR,
    QUEUE,
    TEST_JOBS_CODE,
    VISIBILITY,
    Harness,
    reconciled_under_a_live_lease,
    run_cli,
)

from infrai_jobs.config.settings import (
    AlertSettings,
    CommonSettings,
    PruneSettings,
    RedriveSettings,
)
from infrai_jobs.jobs.registry import Effect
from infrai_jobs.runtime.factory import make_claims_admin
from infrai_jobs.work import store
from infrai_jobs.work.admin import WorkStore
from infrai_jobs.work.states import ClaimStatus

KEY = "invoice.finalize:inv_8812"
NOTES_CLAIM = """
INSERT INTO job_claims (idem_key, state, message_id) VALUES (%s, 'running', 'qmsg_node')
ON CONFLICT (idem_key) DO NOTHING
"""


def _notes_worker_claims(kit: Harness, key: str = KEY, *, seconds_ago: float = 0.0) -> None:
    """The notes' own claim statement, made ``seconds_ago`` (the claim time moved back stands
    for the time that passed)."""
    kit.sql(NOTES_CLAIM, (key,))
    if seconds_ago:
        kit.sql(
            "UPDATE job_claims SET claimed_at = claimed_at - make_interval(secs => %s) "
            "WHERE idem_key = %s",
            (seconds_ago, key),
        )


def _row(kit: Harness, key: str = KEY) -> tuple[Any, ...]:
    (row,) = kit.sql(
        "SELECT state, message_id, claim_token, lease_until, error, result FROM job_claims "
        "WHERE idem_key = %s",
        (key,),
    )
    return row


# --- Every operator verb on a row the notes' worker holds now --------------------------------

VERBS = {
    "release": ("claims", "release", KEY),
    "resolve --done": ("claims", "resolve", KEY, "--done", "--result", '{"ref": "x"}'),
    "resolve --failed": ("claims", "resolve", KEY, "--failed", "--error", "bad"),
}


@pytest.mark.parametrize("verb", VERBS)
def test_a_verb_on_a_row_the_notes_worker_just_claimed_changes_nothing_and_says_until_when(
    kit: Harness, verb: str
) -> None:
    # Given the notes' worker claimed the invoice a moment ago (no lease: live until its claim
    # time plus the visibility timeout)
    _notes_worker_claims(kit)
    before = _row(kit)
    (claimed_at,) = kit.sql("SELECT claimed_at FROM job_claims WHERE idem_key = %s", (KEY,))[0]
    # When an operator releases or resolves it
    finished = run_cli(kit, *VERBS[verb])
    # Then it is refused with exit 3, naming the live lease and when it ends
    assert finished.returncode == 3, finished.stdout + finished.stderr
    said = finished.stderr + finished.stdout
    assert "live lease" in said
    implied_end = claimed_at + timedelta(seconds=VISIBILITY)
    assert implied_end.isoformat(timespec="seconds")[:19] in said, said
    assert "changed while it was being updated" not in said
    assert "Traceback" not in said
    # And the row is as the worker left it, with nothing recorded
    assert _row(kit) == before
    assert kit.history(KEY) == []


@pytest.mark.parametrize("verb", VERBS)
def test_a_verb_on_a_notes_worker_row_past_its_implied_lease_goes_ahead_and_is_recorded(
    kit: Harness, verb: str
) -> None:
    # Given the notes' worker claimed the invoice longer ago than the visibility timeout
    _notes_worker_claims(kit, seconds_ago=VISIBILITY + 5)
    # When an operator releases or resolves it
    finished = run_cli(kit, *VERBS[verb])
    # Then it goes ahead and is recorded with the operator as actor
    assert finished.returncode == 0, finished.stdout + finished.stderr
    action = {"release": "release", "resolve --done": "resolve_done"}.get(verb, "resolve_failed")
    assert [row[:2] for row in kit.history(KEY)] == [(action, OPERATOR)]
    states = kit.sql("SELECT state FROM job_claims WHERE idem_key = %s", (KEY,))
    expected = {"release": [], "resolve --done": [("done",)], "resolve --failed": [("failed",)]}
    assert states == expected[verb]


def test_stuck_lists_no_notes_worker_row_under_its_implied_lease(kit: Harness) -> None:
    # Given one row the notes' worker claimed a moment ago and one claimed long ago
    _notes_worker_claims(kit, "invoice.finalize:live", seconds_ago=5)
    _notes_worker_claims(kit, "invoice.finalize:old", seconds_ago=VISIBILITY + 5)
    kit.sql("UPDATE job_claims SET updated_at = claimed_at")
    # When an operator lists what is stuck for longer than a second
    finished = run_cli(kit, "claims", "stuck", "--older-than", "1", "--json")
    # Then only the one past its implied lease is listed
    assert finished.returncode == 0, finished.stderr
    assert [row["idem_key"] for row in json.loads(finished.stdout)] == ["invoice.finalize:old"]


@pytest.mark.parametrize("verb", ["run-now", "cancel"])
def test_run_now_and_cancel_refuse_a_notes_worker_row(kit: Harness, verb: str) -> None:
    # Given the notes' worker holds the invoice
    _notes_worker_claims(kit)
    before = _row(kit)
    # When an operator tries to steer it as deferred work
    finished = run_cli(kit, "claims", verb, KEY)
    # Then it is refused (it is no deferred job) and nothing changed
    assert finished.returncode == 3, finished.stdout + finished.stderr
    assert "no deferred job" in finished.stderr + finished.stdout
    assert _row(kit) == before


def test_the_drain_and_the_store_read_a_notes_worker_row_as_live(kit: Harness) -> None:
    # Given the notes' worker holds the invoice
    _notes_worker_claims(kit)
    admin = WorkStore(kit.database_url, visibility_timeout=VISIBILITY)
    row = admin.find(KEY)
    assert row is not None
    # When a drain's delivery of another copy claims it, and a probe says "not done"
    request = claim_request(
        KEY, message_id="qmsg_copy", job="invoice.finalize", effect=Effect.DATABASE
    )
    (decision,) = kit.ledger.claim([request])
    probed = admin.apply_probe_answer(row, "not_done", actor="watcher", note="probe: not done")
    # Then the copy meets a live claim, and the probe changes nothing
    assert decision.status is ClaimStatus.LIVE
    assert probed.value == "lease_live"
    assert _row(kit)[0] == "running"


def test_reconcile_of_a_notes_worker_row_under_its_lease_waits_for_it_as_for_a_drains(
    kit: Harness,
) -> None:
    # Given the notes' worker claimed the invoice a moment ago: the row names no job, so no
    # probe can be chosen for it, but under its lease no answer would change anything
    _notes_worker_claims(kit)
    before = _row(kit)
    (claimed_at,) = kit.sql("SELECT claimed_at FROM job_claims WHERE idem_key = %s", (KEY,))[0]
    implied_end = (claimed_at + timedelta(seconds=VISIBILITY)).isoformat()
    # When an operator reconciles it by its key
    # Then it is left to its worker, as a drain's live claim is: exit 0, and when the implied
    # lease ends, the time to ask again
    outcome, runs = reconciled_under_a_live_lease(kit, KEY, implied_end)
    assert outcome["action"] == "lease_live"
    # And nothing changed or was recorded, and nothing claims a reconcile happened
    assert _row(kit) == before
    assert kit.history(KEY) == []
    assert all("reconciled" not in finished.stderr for finished in runs)


@pytest.mark.parametrize("dry_run", [False, True], ids=["reconcile", "reconcile --dry-run"])
def test_reconcile_of_a_notes_worker_row_past_its_lease_says_no_probe_can_be_chosen(
    kit: Harness, dry_run: bool
) -> None:
    # Given a row the notes' worker claimed longer ago than the visibility timeout
    _notes_worker_claims(kit, seconds_ago=VISIBILITY + 5)
    before = _row(kit)
    # When an operator reconciles it by its key
    finished = run_cli(kit, "claims", "reconcile", KEY, *(["--dry-run"] if dry_run else []))
    # Then it is refused in one line, not as a configuration error: the row records no job, so
    # no probe can be chosen, and the operator is told what to do instead
    assert finished.returncode == 3, finished.stdout + finished.stderr
    said = finished.stderr
    assert "records no job" in said
    assert "no probe can be chosen" in said
    assert "check the provider" in said
    assert f"infrai-jobs claims resolve {KEY}" in said
    assert "job None" not in said
    assert "Traceback" not in said
    # And the row is as the worker left it, with nothing recorded
    assert _row(kit) == before
    assert kit.history(KEY) == []


def test_the_consoles_probe_of_notes_worker_rows_answers_as_the_command_does(kit: Harness) -> None:
    # Given one row the notes' worker claimed a moment ago and one claimed long ago, and a
    # console that may act
    live, over = "invoice.finalize:probe_live", "invoice.finalize:probe_over"
    _notes_worker_claims(kit, live)
    _notes_worker_claims(kit, over, seconds_ago=VISIBILITY + 5)
    with console(kit, "--allow-actions") as running:
        session = Session(running)
        # When the operator probes each from the page
        answers = {
            key: session.post(
                "/claims/probe", [("key", key), ("csrf_token", running.token)], Origin=running.base
            )
            for key in (live, over)
        }
    # Then the live one is left to its worker (lease_live), and the other is refused as a
    # claim no probe can be chosen for, not as a bad request
    assert answers[live].status == 200, answers[live].data
    assert "lease_live" in answers[live].data.decode()
    assert answers[over].status == 409, answers[over].data
    assert "records no job" in answers[over].data.decode()
    assert kit.history(live) == kit.history(over) == []


# --- A human's "must not run" stands against a plain redrive --------------------------------------


def _deferred_run_left_for_a_human(kit: Harness, name: str) -> str:
    """Deferred work for ``test.db`` taken by a drain whose outcome is unknown: flagged, its
    lease ended. Its key."""
    payload = {"job": "test.db", "id": name}
    key = kit.registry.derive(payload).idem_key
    work = store.DeferredWork(key, "test.db", "database", payload, f"qmsg-{name}", queue=QUEUE)
    with psycopg.connect(kit.database_url, autocommit=True) as conn:
        assert store.defer(conn, work, attempts=1, error="503", delay_seconds=0) is not None
        (taken,) = store.take_due(conn, 1, lease_seconds=60)
        token = taken.claim_token or uuid.uuid4()
        assert store.flag_uncertain(conn, key, token, "timed out")
    return key


def test_a_plain_redrive_never_reopens_work_a_human_resolved_failed(kit: Harness) -> None:
    # Given a deferred run left for a human, resolved failed by an operator
    key = _deferred_run_left_for_a_human(kit, "must-not-run")
    resolved = run_cli(kit, "claims", "resolve", key, "--failed", "--error", "customer refunded")
    assert resolved.returncode == 0, resolved.stdout + resolved.stderr
    # When a plain redrive runs (no --reopen-failed)
    plain = run_cli(kit, "redrive", "--jobs-path", str(TEST_JOBS_CODE), "--json")
    # Then nothing is published for it, its claim stays failed, and the letter says why
    assert plain.returncode == 0, plain.stdout + plain.stderr
    summary = json.loads(plain.stdout)
    assert summary["published"] == 0
    assert summary["reopened"] == []
    (held,) = [entry for entry in summary["held_back"] if entry["idem_key"] == key]
    assert held["cause"] == "resolved_failed"
    assert "--reopen-failed" in held["why"]
    assert kit.sql("SELECT state FROM job_claims WHERE idem_key = %s", (key,)) == [("failed",)]
    assert "reopen" not in [row[0] for row in kit.history(key)]
    # When the operator asks for it explicitly
    explicit = run_cli(
        kit, "redrive", "--reopen-failed", "--jobs-path", str(TEST_JOBS_CODE), "--json"
    )
    # Then it is reopened and published, and the history names the flag given
    assert explicit.returncode == 0, explicit.stdout + explicit.stderr
    assert json.loads(explicit.stdout)["published"] == 1
    reopen = [row for row in kit.history(key) if row[0] == "reopen"]
    assert [row[2] for row in reopen] == ["redrive --reopen-failed"]


def test_a_plain_redrive_of_work_out_of_attempts_reopens_it_and_says_no_flag(
    kit: Harness,
) -> None:
    # Given deferred work a drain failed for good (out of attempts), held by the ledger
    (key,) = kit.failed_for_good("out-of-attempts", error="gave up")
    # When a plain redrive runs
    plain = run_cli(kit, "redrive", "--jobs-path", str(TEST_JOBS_CODE), "--json")
    # Then it is reopened and published, and the history does not claim a flag that was not given
    assert plain.returncode == 0, plain.stdout + plain.stderr
    assert json.loads(plain.stdout)["reopened"] == [key]
    (reopen,) = [row for row in kit.history(key) if row[0] == "reopen"]
    assert "--reopen-failed" not in (reopen[2] or "")


def test_a_probe_asked_under_a_live_lease_never_acts_after_the_lease_ends(kit: Harness) -> None:
    # Given the notes' worker's claim, read while its implied lease is live
    _notes_worker_claims(kit)
    admin = WorkStore(kit.database_url, visibility_timeout=VISIBILITY)
    read = admin.find(KEY)
    assert read is not None
    assert read.lease_live is True
    # When the probe's "not done" arrives only after the lease has ended (the worker may have
    # made the call in between)
    kit.sql(
        "UPDATE job_claims SET claimed_at = claimed_at - make_interval(secs => %s)",
        (VISIBILITY + 5,),
    )
    write = admin.apply_probe_answer(read, "not_done", actor="watcher", note="probe: not done")
    # Then nothing is released: the answer is as old as the read (and, the claim time moved back
    # standing for the time that passed, the row no longer looks like the one read)
    assert write.value in ("lease_live", "changed")
    assert _row(kit)[0] == "running"
    assert kit.history(KEY) == []


# --- Every function judges a lease-less row by the deployment's visibility timeout -----------


@pytest.mark.parametrize("settings_type", [RedriveSettings, PruneSettings, AlertSettings])
def test_the_functions_outside_the_drain_end_a_lease_less_row_by_the_configured_visibility(
    kit: Harness, settings_type: type[CommonSettings]
) -> None:
    # Given a queue whose visibility timeout is 15 minutes, set for every function, and a row
    # the notes' worker claimed 10 minutes ago
    settings = settings_type.from_env(
        {"DATABASE_URL": kit.database_url, "INFRAI_VISIBILITY_TIMEOUT_SECONDS": "900"}
    )
    _notes_worker_claims(kit, seconds_ago=600)
    # When RedriveFunction, PruneFunction or the watcher judges it
    claim = make_claims_admin(settings).find(KEY)
    # Then its lease is live, as the drain reads it: not the default 5 minutes
    assert claim is not None
    assert claim.lease_live is True
