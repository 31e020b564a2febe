"""Redrive knows what would bounce: each dead letter is judged against the claim ledger and the
registry as they are now, before anything is published.

A letter whose copy would come straight back to the DLQ (its claim failed and is not reopened,
its claim is stuck, its payload is rejected, its job is unknown, its key holds other work) costs
a publish, three deliveries and a new page for nothing; a letter whose work is done already
would only be acked as a duplicate. Real PostgreSQL, the emulator over HTTP, fixture jobs only.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from drainkit import DLQ, OPERATOR, QUEUE, Harness, code_root, harness, run_cli

from infrai_jobs.jobs.keys import payload_fingerprint
from infrai_jobs.operations.dead_letters import DeadLetterStore
from infrai_jobs.operations.redrive import JobsKnowledge, RedriveRequest, RedriveSummary, redrive
from infrai_jobs.work.admin import WorkStore

RUNS = {"job": "test.db", "id": "runs"}
DONE = {"job": "test.db", "id": "done"}
FAILED = {"job": "test.db", "id": "failed"}
STUCK = {"job": "test.ext", "id": "stuck"}
CONFLICT = {"job": "test.db", "id": "conflict"}
UNKNOWN = {"job": "test.dbb", "id": "typo"}
REJECTED = {"job": "test.db", "name": "no id field"}


@pytest.fixture
def kit(database_url: str) -> Iterator[Harness]:
    with harness(database_url) as h:
        yield h


def _claim(kit: Harness, key: str, state: str, payload: Any, *, error: str | None = None) -> None:
    kit.sql(
        "INSERT INTO job_claims (idem_key, state, message_id, job, effect, payload_sha256,"
        " error, claim_token) VALUES (%s, %s, 'qmsg_before', %s, 'external', %s, %s,"
        " gen_random_uuid())",
        (key, state, payload["job"], payload_fingerprint(payload), error),
    )


def _mixed_dead_letters(kit: Harness) -> dict[str, str]:
    """One dead letter of each kind in Infrai's DLQ; their message ids by name."""
    _claim(kit, "test.db:done", "done", DONE)
    _claim(kit, "test.db:failed", "failed", FAILED, error="the downstream said no")
    _claim(kit, "test.ext:stuck", "running", STUCK, error="effect uncertain")
    _claim(kit, "test.db:conflict", "done", {"job": "test.db", "id": "conflict", "x": 1})
    letters = {
        "runs": RUNS,
        "done": DONE,
        "failed": FAILED,
        "stuck": STUCK,
        "conflict": CONFLICT,
        "unknown": UNKNOWN,
        "rejected": REJECTED,
    }
    return {name: kit.client.publish(DLQ, body) for name, body in letters.items()}


def _redrive(kit: Harness, **options: Any) -> RedriveSummary:
    admin = WorkStore(kit.database_url)
    request = RedriveRequest(max_messages=100, **options)
    return redrive(
        kit.client,
        DeadLetterStore(admin),
        request.to(source=DLQ, target=QUEUE, actor=OPERATOR),
        admin=admin,
        jobs=JobsKnowledge(key_of=lambda payload: kit.registry.derive(payload).idem_key),
    )


def test_dry_run_says_of_each_letter_whether_it_runs_is_skipped_or_bounces_and_why(
    kit: Harness,
) -> None:
    # Given a mix of dead letters: one that would run, one done, and five that would bounce
    ids = _mixed_dead_letters(kit)
    # When the operator looks first
    summary = _redrive(kit, dry_run=True)
    # Then each one is judged, with its reason
    judged = {entry["message_id"]: entry for entry in summary.seen + summary.held_back}
    verdicts = {name: (judged[mid]["verdict"], judged[mid]["cause"]) for name, mid in ids.items()}
    assert verdicts == {
        "runs": ("run", "no_claim"),
        "done": ("skip", "done"),
        "failed": ("bounce", "failed"),
        "stuck": ("bounce", "stuck"),
        "conflict": ("bounce", "conflict"),
        "unknown": ("bounce", "unknown_job"),
        "rejected": ("bounce", "rejected"),
    }
    assert "--reopen-failed" in judged[ids["failed"]]["why"]
    assert "did you mean 'test.db'" in judged[ids["unknown"]]["why"]
    assert [entry["message_id"] for entry in summary.seen] == [ids["runs"]]
    # And nothing was published
    assert (summary.published, kit.client.stats(QUEUE).message_count) == (0, 0)


def test_a_plain_redrive_publishes_only_what_would_run_and_counts_what_it_held_back(
    kit: Harness,
) -> None:
    # Given the same mix
    ids = _mixed_dead_letters(kit)
    # When the operator redrives with --reopen-failed
    summary = _redrive(kit, reopen_failed=True)
    # Then the letter with no claim and the reopened failed one went back; the rest did not
    assert summary.published == 2
    assert summary.reopened == ["test.db:failed"]
    held = {entry["message_id"]: entry["cause"] for entry in summary.held_back}
    assert held == {
        ids["done"]: "done",
        ids["stuck"]: "stuck",
        ids["conflict"]: "conflict",
        ids["unknown"]: "unknown_job",
        ids["rejected"]: "rejected",
    }
    assert summary.complete
    drained = kit.drain()
    assert drained.outcomes == {"done": 2}
    assert kit.client.stats(QUEUE).dlq_count == 0
    # And the letters held back stay unresolved in the ledger for a human
    unresolved = kit.sql("SELECT count(*) FROM dead_letters WHERE resolution IS NULL")
    assert unresolved == [(5,)]


def test_a_redrive_asked_to_include_bouncing_letters_publishes_them_too(kit: Harness) -> None:
    # Given the same mix
    _mixed_dead_letters(kit)
    # When the operator insists
    summary = _redrive(kit, include_bouncing=True)
    # Then every readable letter is published, as before
    assert (summary.published, summary.held_back) == (7, [])


def test_a_running_claim_is_judged_by_its_lease_on_the_database_clock_not_by_its_age(
    kit: Harness,
) -> None:
    # Given two running claims: a long run that renewed its lease a moment ago (claimed and last
    # touched 20 minutes back), and a notes' worker's row (no lease) claimed 10 minutes ago,
    # whose implied lease (claimed_at + visibility) is over
    long_run = {"job": "test.ext", "id": "long"}
    gone = {"job": "test.ext", "id": "gone"}
    insert = (
        "INSERT INTO job_claims (idem_key, state, message_id, job, effect, payload_sha256,"
        " claim_token, claimed_at, updated_at, lease_until) VALUES (%s, 'running', 'qmsg_before',"
        " 'test.ext', 'external', %s, gen_random_uuid(), now() - %s::interval,"
        " now() - %s::interval, now() + %s::interval)"
    )
    ago, renewed = "20 minutes", "10 minutes"
    kit.sql(insert, ("test.ext:long", payload_fingerprint(long_run), ago, ago, renewed))
    kit.sql(
        insert.replace("now() + %s::interval", "NULL"),
        ("test.ext:gone", payload_fingerprint(gone), renewed, renewed),
    )
    ids = {
        name: kit.client.publish(DLQ, body) for name, body in (("long", long_run), ("gone", gone))
    }
    # When the operator looks
    summary = _redrive(kit, dry_run=True)
    judged = {entry["message_id"]: entry for entry in summary.seen + summary.held_back}
    # Then the live lease means a delivery holds it (the copy meets its outcome), and the lease
    # that is over means nobody does: a human decides first, as `claims stuck` lists it
    assert (judged[ids["long"]]["verdict"], judged[ids["long"]]["cause"]) == ("run", "in_flight")
    assert (judged[ids["gone"]]["verdict"], judged[ids["gone"]]["cause"]) == ("bounce", "stuck")


# --- the command line, with a jobs package of the test's own ------------------------------------

FIXTURE_JOBS = """
from infrai_jobs.jobs.registry import Effect, JobRegistry


def build_registry() -> JobRegistry:
    registry = JobRegistry()

    @registry.job("refund.issue", effect=Effect.DATABASE, identity=("refund_id",))
    def issue(payload, ctx):
        return None

    return registry
"""


@pytest.fixture
def fixture_jobs(tmp_path: Path) -> Path:
    return code_root(tmp_path / "code", FIXTURE_JOBS)


def test_redrive_job_with_a_typo_exits_2_with_did_you_mean(
    kit: Harness, fixture_jobs: Path
) -> None:
    # Given a dead letter of refund.issue
    kit.client.publish(DLQ, {"job": "refund.issue", "refund_id": "r1"})
    # When the operator mistypes the job
    finished = run_cli(kit, "redrive", "--job", "refund.isue", "--jobs-path", str(fixture_jobs))
    # Then it is a usage error naming the close match, and nothing was read or published
    assert finished.returncode == 2, finished.stdout
    assert "did you mean 'refund.issue'" in finished.stderr
    assert "Traceback" not in finished.stderr
    assert kit.client.stats(QUEUE).message_count == 0
    assert kit.sql("SELECT count(*) FROM dead_letters") == [(0,)]


def test_redrive_dry_run_on_the_command_line_lists_each_verdict(
    kit: Harness, fixture_jobs: Path
) -> None:
    # Given one refund that would run and one of a job the package lacks
    kit.client.publish(DLQ, {"job": "refund.issue", "refund_id": "r1"})
    kit.client.publish(DLQ, {"job": "refund.gone", "refund_id": "r2"})
    # When the operator looks, then redrives
    looked = run_cli(kit, "redrive", "--dry-run", "--jobs-path", str(fixture_jobs))
    moved = run_cli(kit, "redrive", "--json", "--jobs-path", str(fixture_jobs))
    # Then the dry run says which would run and which would bounce, and why
    assert looked.returncode == 0, looked.stderr
    assert "would publish 1 dead letter(s)" in looked.stdout
    assert "would hold back 1: 1 unknown_job" in looked.stdout
    assert "unknown job 'refund.gone'" in looked.stdout
    # And the plain redrive published only the one that runs, and said what it held back
    assert moved.returncode == 0, moved.stderr
    document = json.loads(moved.stdout)
    assert document["published"] == 1
    assert [entry["cause"] for entry in document["held_back"]] == ["unknown_job"]
