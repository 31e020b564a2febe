"""The demo's story as a test: the same scenario, assertions instead of prints."""

from __future__ import annotations

from pathlib import Path

import pytest

from infrai_local.demo import DemoReport, run_story

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_field_notes_story_holds(capsys: pytest.CaptureFixture[str]) -> None:
    # Given a fresh stage, When the story runs through DrainFunction
    facts = run_story(ROOT, DemoReport()).facts

    # Then the producer retry finalized the invoice once and acked both copies
    retry = facts["retry"]
    assert retry["claims"] == [("invoice.finalize:inv_8812", "done")]
    assert retry["invoice"] == ("final", 4900)
    assert retry["invoice_updates"] == 1
    assert retry["summary"]["acked"] == 2
    assert retry["queue_after"] == 0

    # And the redelivery after a crash between commit and ack was skipped and acked
    crash = facts["crash"]
    assert crash["exit_code"] == -9
    assert crash["redelivered"] == 1
    assert crash["summary"]["outcomes"] == {"duplicate": 1}
    assert crash["invoice_updates"] == 1

    # And the poison message reached the DLQ with no claim left behind
    assert facts["poison"] == {"dlq_count": 1, "claim": None}

    # And the receipt with an unknown outcome stays running and flagged
    state, _attempts, error = facts["uncertain"]["claim"]
    assert state == "running"
    assert error.startswith("effect uncertain")
    assert facts["uncertain"]["summary"]["acked"] == 0

    # And the story was told on stdout
    assert "A producer retry" in capsys.readouterr().out
