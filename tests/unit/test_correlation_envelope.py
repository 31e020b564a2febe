"""A producer's correlation id and traceparent: read from the envelope, bounded, not work."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
from fixture_jobs import build_registry
from hypothesis import given
from hypothesis import strategies as st
from notes_example import NOTES_PAYLOAD

from infrai_jobs.jobs.correlation import (
    CORRELATION_FIELD,
    MAX_CORRELATION_ID_LENGTH,
    TRACEPARENT_FIELD,
    correlation_of,
    log_fields,
    traceparent_trace_id,
    with_correlation_id,
)
from infrai_jobs.jobs.keys import NO_KEY_RULES, derive_key, payload_fingerprint
from infrai_jobs.jobs.registry import JobContext

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"
# A job without a key rule: keyed by the fingerprint of its work.
CONTENT_KEYED = {"job": "report.export", "month": "2026-11"}

BAD_CORRELATION_IDS: list[Any] = [
    "",
    "x" * (MAX_CORRELATION_ID_LENGTH + 1),
    "line\nbreak",
    "tab\there",
    "nul\x00",
    "\ud800",
    " padded",
    "padded ",
    "\u202e",
    42,
    None,
    True,
    ["order-1"],
    {"id": "order-1"},
]
BAD_TRACEPARENTS: list[Any] = [
    "",
    "not-a-traceparent",
    TRACEPARENT.upper(),
    f"ff-{TRACE_ID}-00f067aa0ba902b7-01",  # version ff is forbidden
    f"00-{'0' * 32}-00f067aa0ba902b7-01",  # all-zero trace id
    f"00-{TRACE_ID}-{'0' * 16}-01",  # all-zero parent id
    f"00-{TRACE_ID}-00f067aa0ba902b7-01-extra",  # version 00 has exactly four fields
    f"00-{TRACE_ID[:-1]}-00f067aa0ba902b7-01",
    f" {TRACEPARENT}",
    f"{TRACEPARENT}\n",
    "01-" + TRACE_ID + "-00f067aa0ba902b7-01-" + "x" * 600,
    7,
    None,
    [TRACEPARENT],
]


def test_a_correlation_id_is_taken_as_sent() -> None:
    # Given a body whose producer set a correlation id
    body = {**NOTES_PAYLOAD, CORRELATION_FIELD: "order-7431"}
    # When its envelope is read
    correlation = correlation_of(body)
    # Then the id is the producer's, nothing was ignored, and log lines carry it
    assert correlation.correlation_id == "order-7431"
    assert correlation.ignored == ""
    assert log_fields(correlation) == {"message_correlation_id": "order-7431"}


def test_a_traceparent_gives_its_trace_id_unless_a_correlation_id_is_set() -> None:
    # Given a body with a traceparent only, and one with both
    only_trace = correlation_of({**NOTES_PAYLOAD, TRACEPARENT_FIELD: TRACEPARENT})
    both = correlation_of(
        {**NOTES_PAYLOAD, TRACEPARENT_FIELD: TRACEPARENT, CORRELATION_FIELD: "order-7431"}
    )
    # Then the trace id is the correlation id of the first, and the producer's id wins in the
    # second, whose trace id is still known
    assert (only_trace.correlation_id, only_trace.trace_id) == (TRACE_ID, TRACE_ID)
    assert only_trace.traceparent == TRACEPARENT
    assert (both.correlation_id, both.trace_id) == ("order-7431", TRACE_ID)
    assert log_fields(both) == {
        "message_correlation_id": "order-7431",
        "message_trace_id": TRACE_ID,
    }


def test_a_later_traceparent_version_may_carry_more_fields() -> None:
    assert traceparent_trace_id(f"01-{TRACE_ID}-00f067aa0ba902b7-01-future") == TRACE_ID


@pytest.mark.parametrize("value", BAD_CORRELATION_IDS, ids=repr)
def test_a_correlation_id_that_does_not_fit_is_ignored_with_a_reason(value: Any) -> None:
    correlation = correlation_of({**NOTES_PAYLOAD, CORRELATION_FIELD: value})
    assert correlation.correlation_id is None
    assert CORRELATION_FIELD in correlation.ignored
    assert log_fields(correlation) == {}


@pytest.mark.parametrize("value", BAD_TRACEPARENTS, ids=repr)
def test_a_traceparent_that_does_not_fit_is_ignored_with_a_reason(value: Any) -> None:
    # Given a valid correlation id beside the bad traceparent
    correlation = correlation_of(
        {**NOTES_PAYLOAD, CORRELATION_FIELD: "order-1", TRACEPARENT_FIELD: value}
    )
    # Then the traceparent alone is dropped
    assert (correlation.traceparent, correlation.trace_id) == (None, None)
    assert correlation.correlation_id == "order-1"
    assert TRACEPARENT_FIELD in correlation.ignored


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(), st.lists))
def test_reading_the_envelope_never_raises(value: Any) -> None:
    for body in (value, {CORRELATION_FIELD: value}, {TRACEPARENT_FIELD: value}):
        correlation = correlation_of(body)
        if correlation.correlation_id is not None:
            assert 0 < len(correlation.correlation_id) <= MAX_CORRELATION_ID_LENGTH
            assert correlation.correlation_id.isprintable()


@given(
    correlation_id=st.text(min_size=1, max_size=MAX_CORRELATION_ID_LENGTH),
    trace_id=st.from_regex(r"[0-9a-f]{32}", fullmatch=True),
)
def test_the_key_and_fingerprint_do_not_change_with_the_envelope(
    correlation_id: str, trace_id: str
) -> None:
    envelope = {
        CORRELATION_FIELD: correlation_id,
        TRACEPARENT_FIELD: f"00-{trace_id}-00f067aa0ba902b7-01",
    }
    # Given a naturally keyed payload (the example jobs' registry)
    registry = build_registry()
    plain = registry.derive(NOTES_PAYLOAD)
    # When the same work carries a correlation id and a traceparent
    enveloped = registry.derive({**NOTES_PAYLOAD, **envelope})
    # Then it is claimed under the same key, with the same fingerprint
    assert enveloped.idem_key == plain.idem_key == "invoice.finalize:inv_8812"
    assert enveloped.fingerprint == plain.fingerprint
    # And so is a content-keyed one (no key rule: the key is the work's hash)
    content = derive_key(CONTENT_KEYED, NO_KEY_RULES)
    assert derive_key({**CONTENT_KEYED, **envelope}, NO_KEY_RULES) == content
    assert payload_fingerprint({**CONTENT_KEYED, **envelope}) == payload_fingerprint(CONTENT_KEYED)


def test_publishing_adds_a_fresh_id_or_keeps_the_one_given() -> None:
    # A body without one gets a fresh uuid4 hex, the original left alone
    body, fresh = with_correlation_id(NOTES_PAYLOAD)
    assert body[CORRELATION_FIELD] == fresh
    assert len(fresh) == 32
    assert int(fresh, 16) >= 0
    assert CORRELATION_FIELD not in NOTES_PAYLOAD
    assert with_correlation_id(NOTES_PAYLOAD)[1] != fresh
    # The body's own id, or its traceparent's trace id, is kept
    assert with_correlation_id({**NOTES_PAYLOAD, CORRELATION_FIELD: "mine"})[1] == "mine"
    traced, trace = with_correlation_id({**NOTES_PAYLOAD, TRACEPARENT_FIELD: TRACEPARENT})
    assert (trace, traced[CORRELATION_FIELD]) == (TRACE_ID, TRACE_ID)
    # An id given explicitly wins over the body's
    assert with_correlation_id({**NOTES_PAYLOAD, CORRELATION_FIELD: "mine"}, "given")[1] == "given"


@pytest.mark.parametrize(
    ("body", "given"),
    [
        ({**NOTES_PAYLOAD, CORRELATION_FIELD: "x" * 129}, None),
        ({**NOTES_PAYLOAD, TRACEPARENT_FIELD: "nope"}, None),
        (NOTES_PAYLOAD, "two\nlines"),
        (NOTES_PAYLOAD, ""),
    ],
)
def test_publishing_refuses_what_the_drain_would_ignore(
    body: dict[str, Any], given: str | None
) -> None:
    with pytest.raises(ValueError, match=r"correlation|traceparent"):
        with_correlation_id(body, given)


TRACING_CHECK = """
import os, sys
os.environ["POWERTOOLS_SERVICE_NAME"] = "t"
os.environ["POWERTOOLS_TRACE_DISABLED"] = "true"
from infrai_jobs.runtime.observability import message_annotations, message_tracing
print(message_tracing() is None, "aws_xray_sdk" in sys.modules)
"""


def test_with_tracing_off_there_is_no_span_and_no_sdk() -> None:
    finished = subprocess.run(
        [sys.executable, "-c", TRACING_CHECK],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert finished.stdout.strip() == "True False"


def test_a_handler_runs_span_is_annotated_with_the_producers_ids() -> None:
    from infrai_jobs.runtime.observability import message_annotations  # noqa: PLC0415

    # Given a run whose message carried a correlation id and a traceparent
    ctx = JobContext(
        idem_key="k",
        job="receipt.send",
        message_id="m-1",
        delivery_count=1,
        deadline=0.0,
        correlation_id="order-7431",
        traceparent=TRACEPARENT,
    )
    # Then its span is findable by either, in W3C's and X-Ray's spelling of the trace id
    assert message_annotations(ctx) == {
        "job": "receipt.send",
        "message_id": "m-1",
        "correlation_id": "order-7431",
        "trace_id": TRACE_ID,
        "xray_trace_id": "1-4bf92f35-77b34da6a3ce929d0e0e4736",
    }
    # And a run whose message carried none is annotated with its own ids only
    bare = JobContext(idem_key="k", job="j", message_id="m-2", delivery_count=1, deadline=0.0)
    assert message_annotations(bare) == {"job": "j", "message_id": "m-2"}
