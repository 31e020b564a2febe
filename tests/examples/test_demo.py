"""The demo's story as a test: the same scenario, assertions instead of prints, told by the
installed ``infrai-jobs demo`` started in a folder that is not the project."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

INFRAI_JOBS = str(Path(sys.executable).parent / "infrai-jobs")


@pytest.mark.slow
def test_the_field_notes_story_holds_when_told_from_any_folder(tmp_path: Path) -> None:
    # Given a fresh stage, and an operator in a folder that holds no project
    # When the story runs through DrainFunction, started from there
    env = {k: v for k, v in os.environ.items() if k != "INFRAI_JOBS_PATH"}
    told = subprocess.run(
        [INFRAI_JOBS, "demo", "--json"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=240,
    )
    assert told.returncode == 0, told.stdout[-3000:] + told.stderr[-3000:]
    facts = json.loads(told.stdout.strip().splitlines()[-1])

    # Then the producer retry finalized the invoice once and acked both copies
    retry = facts["retry"]
    assert retry["claims"] == [["invoice.finalize:inv_8812", "done"]]
    assert retry["invoice"] == ["final", 4900]
    assert retry["invoice_updates"] == 1
    assert retry["summary"]["acked"] == 2
    assert retry["queue_after"] == 0

    # And the redelivery after a crash between commit and ack was skipped and acked
    crash = facts["crash"]
    assert crash["exit_code"] == -9
    assert crash["redelivered"] == 1
    assert crash["summary"]["outcomes"] == {"duplicate_done": 1}
    assert crash["invoice_updates"] == 1

    # And the poison message reached the DLQ with no claim left behind
    assert facts["poison"] == {"dlq_count": 1, "claim": None}

    # And the receipt with an unknown outcome stays running and flagged
    state, _attempts, error = facts["uncertain"]["claim"]
    assert state == "running"
    assert error.startswith("effect uncertain")
    assert facts["uncertain"]["summary"]["acked"] == 0

    # And the producer's three enqueues of one intent made one outbox row and one publish,
    # published by the relay although the producer never published anything itself
    produced = facts["outbox"]
    assert produced["outbox_rows"] == 1
    assert produced["published_by_producer"] == 0
    assert produced["relay"]["published"] == 1
    assert produced["summary"]["outcomes"] == {"done": 1}
    assert produced["claim"][0] == "done"

    # And the story was told on stdout, claims and outcomes in words, never as Python values
    assert "A producer retry" in told.stdout
    story = told.stdout.strip().rsplit("\n", 1)[0]
    assert "claim: done (attempt 1)" in story
    assert "claim running (attempt 1): effect uncertain" in story
    assert "('" not in story
    assert "{'" not in story
