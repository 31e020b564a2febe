"""A producer's correlation id, read from a message's envelope (``_correlation_id``, else the
trace id of a W3C ``_traceparent``) so it follows the job, into the log lines about the message
and the handler's ``ctx``. Envelope fields never change the key or the fingerprint, and a value
that does not fit is ignored with a WARNING: a message never fails for its envelope."""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

CORRELATION_FIELD: Final = "_correlation_id"
TRACEPARENT_FIELD: Final = "_traceparent"
# Any id scheme in use fits; a hostile value cannot swell every log line about its message.
MAX_CORRELATION_ID_LENGTH: Final = 128
# Version 00 is exactly 55 characters; a later version may append fields, but not this many.
_MAX_TRACEPARENT_LENGTH: Final = 512
# Version ff and all-zero trace or parent ids are invalid (W3C Trace Context, level 1).
_TRACEPARENT = re.compile(
    r"(?P<version>(?!ff)[0-9a-f]{2})-(?P<trace_id>(?!0{32})[0-9a-f]{32})"
    r"-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}(?P<rest>-[^\s]*)?"
)

# Why an envelope value present in a message is ignored, by field.
_UNFIT: Final = {
    CORRELATION_FIELD: f"is not a string of 1 to {MAX_CORRELATION_ID_LENGTH} printable characters",
    TRACEPARENT_FIELD: "is not a W3C traceparent (version-traceid-parentid-flags, lowercase hex)",
}

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Correlation:
    """Where a message comes from (empty: nothing usable): the producer's id, else the trace id;
    the validated traceparent as sent, and its trace id; why a value was ignored ("" if none)."""

    correlation_id: str | None = None
    traceparent: str | None = None
    trace_id: str | None = None
    ignored: str = ""


NO_CORRELATION: Final = Correlation()


def correlation_of(payload: object) -> Correlation:
    """The correlation a message body carries. Never raises: what does not fit is left out, and
    ``ignored`` says why."""
    if not isinstance(payload, Mapping):
        return NO_CORRELATION
    correlation_id = valid_correlation_id(payload.get(CORRELATION_FIELD))
    trace_id = traceparent_trace_id(payload.get(TRACEPARENT_FIELD))
    read = ((CORRELATION_FIELD, correlation_id), (TRACEPARENT_FIELD, trace_id))
    ignored = [f"{name} {_UNFIT[name]}" for name, value in read if name in payload and not value]
    traceparent = payload[TRACEPARENT_FIELD] if trace_id else None
    return Correlation(correlation_id or trace_id, traceparent, trace_id, "; ".join(ignored))


def valid_correlation_id(value: object) -> str | None:
    if isinstance(value, str) and 0 < len(value) <= MAX_CORRELATION_ID_LENGTH:
        return value if value.isprintable() and value.strip() == value else None
    return None


def traceparent_trace_id(value: object) -> str | None:
    """The trace id of a valid W3C ``traceparent``, else None. Version ``00`` has exactly four
    fields; a later version may carry more after them."""
    if not isinstance(value, str) or len(value) > _MAX_TRACEPARENT_LENGTH:
        return None
    match = _TRACEPARENT.fullmatch(value)
    if match is None or (match["version"] == "00" and match["rest"]):
        return None
    return str(match["trace_id"])


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
    """The fields a log line about the message adds, each when the envelope carried it. Not
    ``correlation_id``: that names the invocation, and one batch holds many messages."""
    fields: dict[str, Any] = {}
    if correlation.correlation_id is not None:
        fields["message_correlation_id"] = correlation.correlation_id
    if correlation.trace_id is not None:
        fields["message_trace_id"] = correlation.trace_id
    return fields


def with_correlation_id(
    payload: Mapping[str, Any], correlation_id: str | None = None
) -> tuple[dict[str, Any], str]:
    """``payload`` (a copy) carrying ``_correlation_id`` (``correlation_id``, else the one it
    carries, else a fresh one), and that id. A producer learns of a value the drain would
    ignore here: ``ValueError`` names it."""
    body = dict(payload)
    carried = correlation_of(body)
    if carried.ignored:
        raise ValueError(carried.ignored)
    if correlation_id is not None and valid_correlation_id(correlation_id) is None:
        raise ValueError(
            f"a correlation id is a string of 1 to {MAX_CORRELATION_ID_LENGTH} printable "
            "characters, without leading or trailing spaces"
        )
    chosen = correlation_id or carried.correlation_id or uuid.uuid4().hex
    body[CORRELATION_FIELD] = chosen
    return body, chosen
