"""RedriveFunction's event: what it may ask for, and the clear error for what it may not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from infrai_jobs.errors import ConfigurationError
from infrai_jobs.operations.redrive import RedriveRequest, Selection
from infrai_local.operator.cli_ops import describe_selection

EVENTS = Path(__file__).resolve().parents[2] / "events"


def test_the_sample_events_parse_into_what_they_say() -> None:
    looking = RedriveRequest.from_event(json.loads((EVENTS / "redrive-dry-run.json").read_text()))
    assert (looking.dry_run, looking.selection) == (True, Selection())
    selected = RedriveRequest.from_event(json.loads((EVENTS / "redrive-selected.json").read_text()))
    assert selected.selection == Selection(job="invoice.finalize")
    assert selected.dry_run is False


def test_an_event_selects_by_key_job_and_message_id_together() -> None:
    request = RedriveRequest.from_event(
        {"key": "invoice.finalize:inv_1", "job": "invoice.finalize", "message_id": "qmsg_1"}
    )
    assert request.selection.as_dict() == {
        "key": "invoice.finalize:inv_1",
        "job": "invoice.finalize",
        "message_id": "qmsg_1",
    }
    assert describe_selection(request.selection) == (
        "--key invoice.finalize:inv_1 --job invoice.finalize --message-id qmsg_1"
    )


def test_an_event_may_ask_to_publish_the_letters_that_would_bounce() -> None:
    assert RedriveRequest.from_event({"include_bouncing": True}).include_bouncing is True
    assert RedriveRequest.from_event({}).include_bouncing is False


@pytest.mark.parametrize(
    ("event", "message"),
    [
        ({"key": 7}, "key must be a non-empty string"),
        ({"job": " "}, "job must be a non-empty string"),
        ({"message_id": ["qmsg_1"]}, "message_id must be a non-empty string"),
        ({"queue": "other"}, "unknown redrive event field(s): queue"),
        ({"include_bouncing": "yes"}, "include_bouncing must be true or false"),
    ],
)
def test_a_bad_selection_is_refused_by_name(event: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigurationError) as raised:
        RedriveRequest.from_event(event)
    assert str(raised.value) == message


@pytest.mark.parametrize(
    ("event", "note"),
    [
        ({}, "redrive"),
        ({"dry_run": True, "max_messages": 5}, "redrive"),
        ({"reopen_failed": True}, "redrive --reopen-failed"),
        ({"include_bouncing": True, "job": "test.db"}, "redrive --include-bouncing --job test.db"),
        (
            {"reopen_failed": True, "include_bouncing": True, "key": "k:1"},
            "redrive --reopen-failed --include-bouncing --key k:1",
        ),
    ],
)
def test_the_history_note_says_the_redrive_as_given_and_nothing_else(
    event: dict[str, object], note: str
) -> None:
    # Given a redrive asked for by an event (the command line's flags build the same request)
    request = RedriveRequest.from_event(event)
    # Then its note names what was given that decides a letter's fate, and only that
    assert request.given() == note
