"""The operator's commands as a person on call types them: ``infrai-jobs`` in a child process,
against a real PostgreSQL and the emulator over HTTP.

What each command prints is the contract here: the reasons behind a drain's problem messages,
dead letters that cannot be read or conflict with done work, discards and selective redrives
recorded in ``claim_history``, and errors that name the commands users type.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from drainkit import Harness, harness

ROOT = Path(__file__).resolve().parents[2]
INFRAI_JOBS = str(Path(sys.executable).parent / "infrai-jobs")
OPERATOR = "on-call@example.com"

# A jobs package of its own (``--jobs-path``): one job per way a handler can end.
JOBS_PACKAGE = textwrap.dedent(
    """
    from infrai_jobs.errors import PermanentJobError
    from infrai_jobs.jobs import Effect, JobRegistry


    def build_registry(provider_url):
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

        return registry
    """
)


@pytest.fixture
def kit(database_url: str) -> Iterator[Harness]:
    with harness(database_url) as h:
        yield h


@pytest.fixture
def jobs_path(tmp_path: Path) -> str:
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "__init__.py").write_text(JOBS_PACKAGE)
    return str(tmp_path)


def run_cli(kit: Harness, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``infrai-jobs ARGS`` from the project root, configured for the harness's emulator,
    ledger and provider sink."""
    environment = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("INFRAI_", "DATABASE_", "PROVIDER_", "IDEMPOTENCY_"))
    }
    environment.update(
        INFRAI_BASE_URL=kit.server.url,
        INFRAI_API_KEY="test-key",
        DATABASE_URL=kit.database_url,
        PROVIDER_URL=kit.sink.url,
        OPERATOR=OPERATOR,
        **env,
    )
    return subprocess.run(
        [INFRAI_JOBS, *args],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def lines_with(text: str, word: str) -> list[str]:
    return [line for line in text.splitlines() if line.split()[:1] == [word]]


def fields_of(line: str) -> dict[str, str]:
    """``retry key=a message_id=b delivery=1 reason=free text`` -> the fields by name."""
    head, _, reason = line.partition(" reason=")
    fields = dict(part.split("=", 1) for part in head.split()[1:] if "=" in part)
    if reason:
        fields["reason"] = reason
    return fields


# --- drain --------------------------------------------------------------------------------------


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
    (retry,) = lines_with(err, "retry")
    assert fields_of(retry) == {
        "key": "cli.flaky:f",
        "message_id": ids["flaky"],
        "delivery": "1",
        "reason": "RuntimeError: the upstream timed out (second line of the reason)",
    }
    (failed,) = lines_with(err, "failed")
    assert fields_of(failed) == {
        "key": "cli.broken:b",
        "message_id": ids["broken"],
        "delivery": "1",
        "reason": "PermanentJobError: the customer does not exist",
    }
    (conflict,) = lines_with(err, "conflict")
    assert fields_of(conflict)["key"] == "cli.ok:done-before"
    assert fields_of(conflict)["message_id"] == ids["conflict"]
    (rejected,) = lines_with(err, "rejected")
    assert fields_of(rejected)["key"] == "-"
    assert fields_of(rejected)["message_id"] == ids["rejected"]
    assert "unknown job 'no.such.job'" in fields_of(rejected)["reason"]
    # And nothing about the message that simply ran, and no bare "message rejected" line
    assert ids["ok"] not in err
    assert "message rejected" not in err
    # And the summary in words says which come back by themselves and which need a human
    (drained,) = [line for line in err.splitlines() if line.startswith("drained ")]
    assert "1 done" in drained
    assert "1 retried, 1 failed, 2 parked" in drained
    assert "walk to the DLQ" in err


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
    (ack_failed,) = lines_with(finished.stderr, "ack_failed")
    assert fields_of(ack_failed)["message_id"] == message_id
    assert json.loads(finished.stdout)["ack_failed"] == 1
