"""A producer's correlation id, read from a message's envelope so it follows the job.

A producer may set, next to the work, either or both envelope fields (top-level names starting
with ``_`` are envelope: they never change the key or the fingerprint, ``infrai_jobs.jobs.keys``):

* ``_correlation_id``: a string of 1 to ``MAX_CORRELATION_ID_LENGTH`` printable characters;
* ``_traceparent``: a W3C Trace Context ``traceparent`` (``version-traceid-parentid-flags``,
  lowercase hex). Its trace id is the correlation id when ``_correlation_id`` is absent.

Every log line the drain writes about the message carries it as ``message_correlation_id`` (and
the traceparent's trace id as ``message_trace_id``); the handler finds it in
``ctx.correlation_id`` (and the traceparent in ``ctx.traceparent``) to pass it on.
A value that does not fit is ignored with a WARNING: a message never fails for its envelope.
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

CORRELATION_FIELD: Final = "_correlation_id"
TRACEPARENT_FIELD: Final = "_traceparent"
# Long enough for any id scheme in use (a uuid, an X-Ray or W3C trace id, a request id), short
# enough that a hostile value cannot swell every log line about its message.
MAX_CORRELATION_ID_LENGTH: Final = 128
# The log fields that carry them on every line about the message.
LOG_CORRELATION_ID: Final = "message_correlation_id"
LOG_TRACE_ID: Final = "message_trace_id"
# Version 00 is exactly 55 characters; a later version may append fields. Beyond this it is
# not a traceparent.
_MAX_TRACEPARENT_LENGTH: Final = 512
_TRACEPARENT = re.compile(
    r"(?P<version>[0-9a-f]{2})-(?P<trace_id>[0-9a-f]{32})-(?P<parent_id>[0-9a-f]{16})"
    r"-(?P<flags>[0-9a-f]{2})(?P<rest>-[^\s]*)?"
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Correlation:
    """What a message's envelope says about where it comes from; empty when it says nothing
    (or nothing usable)."""

    # The producer's id, or else the traceparent's trace id.
    correlation_id: str | None = None
    # The validated traceparent, as the producer sent it, and its trace id.
    traceparent: str | None = None
    trace_id: str | None = None
    # Why an envelope value was ignored ("" when none was).
    ignored: str = ""


NO_CORRELATION: Final = Correlation()


def correlation_of(payload: object) -> Correlation:
    """The correlation a message body carries. Never raises: a body that is not an object, or
    envelope values that do not fit, give an empty (or partial) ``Correlation`` whose
    ``ignored`` says why."""
    if not isinstance(payload, Mapping):
        return NO_CORRELATION
    reasons: list[str] = []
    correlation_id = _envelope_value(
        payload,
        CORRELATION_FIELD,
        valid_correlation_id,
        f"{CORRELATION_FIELD} is not a string of 1 to {MAX_CORRELATION_ID_LENGTH} "
        "printable characters",
        reasons,
    )
    trace_id = _envelope_value(
        payload,
        TRACEPARENT_FIELD,
        traceparent_trace_id,
        f"{TRACEPARENT_FIELD} is not a W3C traceparent "
        "(version-traceid-parentid-flags, lowercase hex)",
        reasons,
    )
    traceparent = payload[TRACEPARENT_FIELD] if trace_id is not None else None
    return Correlation(
        correlation_id=correlation_id or trace_id,
        traceparent=traceparent,
        trace_id=trace_id,
        ignored="; ".join(reasons),
    )


def _envelope_value(
    payload: Mapping[str, Any],
    field: str,
    read: Callable[[object], str | None],
    unusable: str,
    reasons: list[str],
) -> str | None:
    """What ``read`` makes of the envelope ``field``: None when the body has no such field, or
    when its value does not fit, and then ``unusable`` is added to ``reasons``."""
    if field not in payload:
        return None
    value = read(payload[field])
    if value is None:
        reasons.append(unusable)
    return value


def valid_correlation_id(value: object) -> str | None:
    """``value`` when it is a usable correlation id, else None."""
    if (
        isinstance(value, str)
        and 0 < len(value) <= MAX_CORRELATION_ID_LENGTH
        and value.isprintable()
        and value.strip() == value
    ):
        return value
    return None


def traceparent_trace_id(value: object) -> str | None:
    """The trace id of a valid W3C ``traceparent``, else None.

    Version ``ff`` and all-zero trace or parent ids are invalid (W3C Trace Context, level 1);
    version ``00`` has exactly four fields, a later version may carry more after them."""
    if not isinstance(value, str) or len(value) > _MAX_TRACEPARENT_LENGTH:
        return None
    match = _TRACEPARENT.fullmatch(value)
    if match is None:
        return None
    version, trace_id, parent_id, rest = match.group("version", "trace_id", "parent_id", "rest")
    if version == "ff" or (version == "00" and rest):
        return None
    if trace_id == "0" * 32 or parent_id == "0" * 16:
        return None
    return trace_id


def read_correlation(payload: object, *, message_id: str, delivery_count: int) -> Correlation:
    """``correlation_of``, with a WARNING naming the message when a value was ignored (the
    value itself is not logged: it is the producer's, of any size and content)."""
    correlation = correlation_of(payload)
    if correlation.ignored:
        logger.warning(
            "message %s: envelope value ignored: %s",
            message_id,
            correlation.ignored,
            extra={
                "action": "correlation_ignored",
                "message_id": message_id,
                "delivery_count": delivery_count,
                "detail": correlation.ignored,
                **log_fields(correlation),
            },
        )
    return correlation


def log_fields(correlation: Correlation) -> dict[str, Any]:
    """The fields a log line about the message adds: ``message_correlation_id`` and
    ``message_trace_id``, each when the envelope carried it.

    Not ``correlation_id``: on every line of an invocation that names the invocation (the
    schedule's event id, or a fanned-out drain's slot), and one batch holds many messages."""
    fields: dict[str, Any] = {}
    if correlation.correlation_id is not None:
        fields[LOG_CORRELATION_ID] = correlation.correlation_id
    if correlation.trace_id is not None:
        fields[LOG_TRACE_ID] = correlation.trace_id
    return fields


def new_correlation_id() -> str:
    """A fresh correlation id for a producer that has none: a uuid4 in hex."""
    return uuid.uuid4().hex


def with_correlation_id(
    payload: Mapping[str, Any], correlation_id: str | None = None
) -> tuple[dict[str, Any], str]:
    """``payload`` (a copy) carrying ``_correlation_id``, and that id.

    ``correlation_id`` when given; else the one the payload already carries (its
    ``_correlation_id``, or its traceparent's trace id); else a fresh one. A producer learns of
    a value the drain would ignore here: ``ValueError`` names it, and nothing is chosen."""
    body = dict(payload)
    carried = correlation_of(body)
    if carried.ignored:
        raise ValueError(carried.ignored)
    if correlation_id is not None and valid_correlation_id(correlation_id) is None:
        raise ValueError(
            f"a correlation id is a string of 1 to {MAX_CORRELATION_ID_LENGTH} printable "
            "characters, without leading or trailing spaces"
        )
    chosen = correlation_id or carried.correlation_id or new_correlation_id()
    body[CORRELATION_FIELD] = chosen
    return body, chosen
