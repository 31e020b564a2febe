"""Typed, frozen views of what Infrai answers, each field checked here once so the rest of the
package can trust them; a shape outside the contract raises ``InfraiInvalidResponse`` naming the
call and the field."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal, InvalidOperation
from typing import Any, Generic, TypeVar

from infrai_jobs.errors import InfraiInvalidResponse

JsonValue = Any
"""A decoded JSON value; payloads are the producer's data and may be any JSON type."""

T = TypeVar("T")


class Pending(Generic[T]):
    """A queue call that was sent and whose answer is read by ``wait()``, once: the drain's next
    consume and a batch's acks travel while it works, with no thread per call. ``wait()`` does
    what the plain call would (retries included); ``wait(retry=False)`` reads the sent
    request's answer alone, raising its error instead of retrying."""

    __slots__ = ("_finish", "_first")

    def __init__(self, finish: Callable[[], T], first: Callable[[], T] | None = None) -> None:
        self._finish: Callable[[], T] | None = finish
        self._first = first or finish

    def wait(self, *, retry: bool = True) -> T:
        finish, self._finish = self._finish, None
        if finish is None:
            raise RuntimeError("this call's answer was already read")
        return finish() if retry else self._first()


@dataclass(frozen=True, slots=True)
class QueueMessage:
    """One consumed delivery of a message."""

    message_id: str
    queue: str
    payload: JsonValue
    delivery_count: int
    published_at: datetime | None
    receipt_handle: str

    @classmethod
    def from_api(cls, item: object, *, queue: str) -> QueueMessage:
        call = "consume"
        item = _require_object(item, "an item", call)
        message_id = _require_id(item.get("message_id"), "message_id", call)
        delivery_count = item.get("delivery_count", 1)
        if isinstance(delivery_count, bool) or not isinstance(delivery_count, int):
            raise _invalid(call, f"item {message_id}: delivery_count is not an integer")
        if delivery_count < 1:
            raise _invalid(call, f"item {message_id}: delivery_count {delivery_count} is below 1")
        # The notes' worker acks with the message id; a separate handle wins when Infrai sends one.
        if (handle := item.get("receipt_handle")) is not None:
            handle = _require_id(handle, f"item {message_id}: receipt_handle", call)
        return cls(
            message_id=message_id,
            queue=_require_text(item.get("queue", queue), f"item {message_id}: queue", call),
            payload=item.get("payload"),
            delivery_count=delivery_count,
            published_at=_parse_timestamp(item.get("published_at")),
            receipt_handle=handle or message_id,
        )


_COUNTS = ("message_count", "available_count", "in_flight_count", "delayed_count", "dlq_count")


@dataclass(frozen=True, slots=True)
class QueueStats:
    """The counters of ``GET /v1/queue/stats/{queue}``."""

    queue: str
    message_count: int
    available_count: int
    in_flight_count: int
    delayed_count: int
    dlq_count: int
    oldest_message_age_seconds: float

    @classmethod
    def from_api(cls, data: object, *, queue: str) -> QueueStats:
        call = "stats"
        data = _require_object(data, "the answer", call)
        counts = {name: _require_count(data, name, call) for name in _COUNTS}
        # Required like the counts: read as 0 when missing, it would tell the watcher that a
        # lagging drain is "keeping up again".
        age = data.get("oldest_message_age_seconds")
        if isinstance(age, bool) or not isinstance(age, int | float) or not 0 <= age < math.inf:
            raise _invalid(call, "oldest_message_age_seconds is missing or not a number >= 0")
        name = data.get("queue", queue)
        return cls(
            queue=name if isinstance(name, str) else queue,
            oldest_message_age_seconds=float(age),
            **counts,
        )


@dataclass(frozen=True, slots=True)
class PublishPrice:
    """Today's price of one publish, read from discovery's ``queue.publish`` capability."""

    usd_per_message: Decimal
    billing: Mapping[str, JsonValue]


# Discovery's billing object is not specified field by field; these are the names we accept for
# the per-message price, most specific first.
_PRICE_FIELDS = ("price_usd", "usd_per_message", "unit_price_usd", "price", "amount_usd", "usd")


def parse_publish_price(data: object) -> PublishPrice:
    call = "discovery"
    capabilities = _require_object(data, "the answer", call).get("capabilities")
    if not isinstance(capabilities, list):
        raise _invalid(call, "capabilities is not a list")
    for capability in capabilities:
        if isinstance(capability, Mapping) and capability.get("id") == "queue.publish":
            billing = capability.get("billing")
            if not isinstance(billing, Mapping):
                raise _invalid(call, "queue.publish has no billing object")
            for field in _PRICE_FIELDS:
                if field in billing:
                    return PublishPrice(_parse_price(billing[field], call), dict(billing))
            raise _invalid(call, f"queue.publish billing has none of {', '.join(_PRICE_FIELDS)}")
    raise _invalid(call, "no queue.publish capability")


def _parse_price(value: object, call: str) -> Decimal:
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise _invalid(call, "the publish price is not a number")
    try:
        price = Decimal(str(value))
    except InvalidOperation as exc:
        raise _invalid(call, f"the publish price {value!r} is not a number") from exc
    if not price.is_finite() or price < 0:
        raise _invalid(call, f"the publish price {value!r} is not a finite amount >= 0")
    return price


def _parse_timestamp(value: object) -> datetime | None:
    # A missing or odd timestamp is informational only; it never blocks processing.
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


def _require_id(value: object, field: str, call: str) -> str:
    """An id the ledger and the logs can hold: a non-empty string, no NUL, no lone surrogates."""
    text = _require_text(value, field, call)
    if "\x00" in text:
        raise _invalid(call, f"{field} contains a NUL character")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise _invalid(call, f"{field} is not valid Unicode") from None
    return text


def _require_object(value: object, what: str, call: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise _invalid(call, f"{what} is a {type(value).__name__}, not an object")
    return value


def _require_text(value: object, field: str, call: str) -> str:
    if not isinstance(value, str) or not value:
        what = "missing" if value is None else "not a non-empty string"
        raise _invalid(call, f"{field} is {what}")
    return value


def _require_count(data: Mapping[str, object], field: str, call: str) -> int:
    value = data.get(field)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _invalid(call, f"{field} is missing or not an integer >= 0")
    return value


def _invalid(call: str, detail: str) -> InfraiInvalidResponse:
    return InfraiInvalidResponse("INVALID_RESPONSE", detail, 0, call=call)
