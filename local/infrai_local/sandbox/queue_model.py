"""Infrai's queue semantics in memory: the one model the emulator serves over HTTP and the
in-memory fake (``InMemoryQueue`` in ``tests/fakes.py``) serves to unit tests.

What docs/infrai-api.md promises, and the emulator's choices where it is silent (the client must not
depend on them):

- every publish is a new message with a new ``qmsg_`` id (no producer-side deduplication);
- a consume serves up to ``CONSUME_CAP`` available messages, oldest first (the order in which
  they entered the queue), and hides them for the visibility timeout; each receive adds one to
  ``delivery_count``;
- a message whose third delivery lapses unacked moves to the queue's DLQ, where its count starts
  again; in a DLQ (or a queue without one) a lapsed message becomes available again and keeps
  counting: nothing is ever dropped silently;
- expiry is lazy: every call first moves lapsed in-flight and delayed messages on;
- an ack succeeds for any message the queue holds, in any state; then 404
  ``QUEUE_MESSAGE_NOT_FOUND``;
- what publish accepts, consume can serve: a body nested deeper than ``MAX_BODY_DEPTH`` or longer
  than ``MAX_SERVED_BODY_BYTES`` as a consume answer spells it is refused (``VALIDATION_ERROR``),
  and every item is built before a delivery is counted.

Errors are ``ApiError`` (status, Infrai's code, message): the emulator answers them as error
envelopes, the fake raises them as the client's exceptions. The model keeps one lock; its clock
and its id source are the caller's (real time and random ids for the emulator, a fake clock and
counted ids for the fake).
"""

from __future__ import annotations

import functools
import heapq
import json
import math
import re
import secrets
import string
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final, Literal

from infrai_jobs.queue_contract import (
    CONSUME_CAP,
    MAX_DELAY_SECONDS,
    MAX_RECEIVE_COUNT,
)

# What publish accepts, consume can serve: a body nested deeper than this, or longer than this
# as a consume answer spells it, is refused at publish (VALIDATION_ERROR) instead of breaking
# every consume answer it would be part of. Both leave room under the client's limits (its
# JSON parser's nesting and a 16 MiB answer).
MAX_BODY_DEPTH: Final = 800
MAX_SERVED_BODY_BYTES: Final = 12 * 1024 * 1024
MESSAGE_ID_PREFIX: Final = "qmsg_"
MESSAGE_ID_LENGTH: Final = 24
# The publish price the notes verified; a deployed client reads the live one from discovery.
DEFAULT_PUBLISH_PRICE_USD: Final = "0.00002"
QUEUE_TYPES: Final = frozenset({"standard"})

_BASE62: Final = string.digits + string.ascii_uppercase + string.ascii_lowercase
# Every possible id suffix: one uniform draw below this is 24 independent uniform base62 digits.
_MESSAGE_ID_SPACE: Final = len(_BASE62) ** MESSAGE_ID_LENGTH
_QUEUE_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,79}")
# The envelope needs no spaces; the same settings as json.dumps(separators=...), built once.
_ANSWER_ENCODER: Final = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)
_ASCII_ANSWER_ENCODER: Final = json.JSONEncoder(separators=(",", ":"))

JsonObject = dict[str, Any]
MessageState = Literal["available", "in_flight", "delayed"]


class ApiError(Exception):
    """An error as Infrai answers it: an HTTP status, a code and a message."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message

    def envelope(self) -> JsonObject:
        return {"ok": False, "error": {"code": self.code, "message": self.message}}


def invalid(message: str) -> ApiError:
    return ApiError(400, "VALIDATION_ERROR", message)


def format_timestamp(unix_seconds: float) -> str:
    """The notes' shape: microseconds and a Z, e.g. ``2026-07-26T00:38:42.320888Z``."""
    return datetime.fromtimestamp(unix_seconds, tz=UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def new_message_id() -> str:
    """``qmsg_`` + 24 base62 characters from a CSPRNG, so ids never collide in practice.

    One draw from the CSPRNG, spelled in base62: the same uniform ids as a draw per character,
    for one urandom call instead of 24 (that was a sixth of a publish's CPU).
    """
    number = secrets.randbelow(_MESSAGE_ID_SPACE)
    digits: list[str] = []
    for _ in range(MESSAGE_ID_LENGTH):
        number, digit = divmod(number, len(_BASE62))
        digits.append(_BASE62[digit])
    return MESSAGE_ID_PREFIX + "".join(digits)


def counted_message_id(number: int) -> str:
    """``qmsg_`` + ``number`` in base62, padded: ids that count up keep test output stable."""
    digits = ""
    while number:
        number, rest = divmod(number, len(_BASE62))
        digits = _BASE62[rest] + digits
    return MESSAGE_ID_PREFIX + digits.rjust(MESSAGE_ID_LENGTH, "0")


@dataclass
class Message:
    """One message as a queue holds it.

    The payload is kept as JSON text so nobody holding a consumed item can change the stored
    message by mutating the dict they were given.
    """

    message_id: str
    payload_json: str
    published_wall: float
    published_mono: float
    state: MessageState = "available"
    # When a delayed or in-flight message becomes available (monotonic clock).
    visible_at: float = 0.0
    delivery_count: int = 0
    # Bumped on every reschedule so stale heap entries can be told apart from the live one.
    timer_generation: int = 0

    @functools.cached_property
    def published_at(self) -> str:
        """``published_wall`` as the notes spell it; formatted once, not on every delivery."""
        return format_timestamp(self.published_wall)


@dataclass
class Queue:
    """A named queue: its messages in arrival order and a heap of pending state changes."""

    name: str
    type: str
    dlq: str | None
    visibility_timeout: float
    messages: dict[str, Message] = field(default_factory=dict)
    timers: list[tuple[float, int, str]] = field(default_factory=list)

    def schedule(self, message: Message, state: MessageState, until: float) -> None:
        """Hide a message until ``until``; the sweep brings it back."""
        message.state = state
        message.visible_at = until
        message.timer_generation += 1
        heapq.heappush(self.timers, (until, message.timer_generation, message.message_id))

    def pop_due(self, now: float) -> list[Message]:
        """Messages whose delay or visibility lapsed by ``now``, in deadline order."""
        due: list[Message] = []
        while self.timers and self.timers[0][0] <= now:
            _, generation, message_id = heapq.heappop(self.timers)
            message = self.messages.get(message_id)
            if (
                message is not None
                and message.state != "available"
                and message.timer_generation == generation
            ):
                due.append(message)
        return due

    def counts(self) -> Counter[str]:
        """How many messages are in each state."""
        return Counter(message.state for message in self.messages.values())

    def describe(self) -> JsonObject:
        """The queue as ``create`` answers it."""
        return {
            "name": self.name,
            "type": self.type,
            "dlq": self.dlq,
            "visibility_timeout_default": json_number(self.visibility_timeout),
            "max_receive_count": MAX_RECEIVE_COUNT,
        }

    def summary(self) -> JsonObject:
        """The queue as the emulator's state dump shows it."""
        counts = self.counts()
        return {
            "type": self.type,
            "dlq": self.dlq,
            "visibility_timeout_default": json_number(self.visibility_timeout),
            "message_count": sum(counts.values()),
            "available": counts["available"],
            "in_flight": counts["in_flight"],
            "delayed": counts["delayed"],
        }


class QueueModel:
    """Every queue, behind one lock; each call first moves lapsed messages on."""

    def __init__(
        self,
        *,
        visibility_timeout: float,
        monotonic: Callable[[], float],
        wall: Callable[[], float],
        new_id: Callable[[], str] = new_message_id,
    ) -> None:
        if not math.isfinite(visibility_timeout) or visibility_timeout <= 0:
            raise ValueError("visibility_timeout must be a finite number of seconds above 0")
        self.visibility_timeout = float(visibility_timeout)
        self._monotonic = monotonic
        self._wall = wall
        self._new_id = new_id
        self._lock = threading.Lock()
        self._queues: dict[str, Queue] = {}

    def __repr__(self) -> str:
        return f"QueueModel(queues={len(self._queues)})"

    def create(self, name: str, queue_type: str = "standard", dlq: str | None = None) -> JsonObject:
        """Create a queue (and its DLQ); 409 ``QUEUE_ALREADY_EXISTS`` for a taken name."""
        check_queue_name(name, "name")
        if queue_type not in QUEUE_TYPES:
            raise invalid(f"type must be one of {sorted(QUEUE_TYPES)}")
        if dlq is not None:
            check_queue_name(dlq, "dlq")
            if dlq == name:
                raise invalid("dlq must name a different queue")
        with self._lock:
            if name in self._queues:
                raise ApiError(409, "QUEUE_ALREADY_EXISTS", f"queue {name!r} already exists")
            if dlq is not None and dlq not in self._queues:
                self._queues[dlq] = Queue(dlq, queue_type, None, self.visibility_timeout)
            queue = Queue(name, queue_type, dlq, self.visibility_timeout)
            self._queues[name] = queue
            return queue.describe()

    def publish(self, queue: str, payload: object, delay_seconds: int = 0) -> str:
        """Add a new message holding any JSON value the queue can serve (publish's route takes
        objects only; the fake hands out odd payloads on purpose)."""
        if isinstance(delay_seconds, bool) or not isinstance(delay_seconds, int):
            raise invalid("delay_seconds must be an integer")
        if not 0 <= delay_seconds <= MAX_DELAY_SECONDS:
            raise invalid(f"delay_seconds must be an integer from 0 to {MAX_DELAY_SECONDS}")
        payload_json = servable_json(payload)
        with self._lock:
            self._sweep()
            target = self._queue(queue)
            now = self._monotonic()
            message = Message(self._new_id(), payload_json, self._wall(), now)
            target.messages[message.message_id] = message
            if delay_seconds > 0:
                target.schedule(message, "delayed", now + delay_seconds)
            return message.message_id

    def consume(self, queue: str, max_messages: int = 1) -> list[JsonObject]:
        """Deliver up to ``min(max_messages, 10)`` available messages, oldest first."""
        if max_messages < 1:
            raise invalid("max_messages must be an integer >= 1")
        with self._lock:
            self._sweep()
            source = self._queue(queue)
            chosen = _first_available(source, min(max_messages, CONSUME_CAP))
            hidden_until = self._monotonic() + source.visibility_timeout
            # Every item is built before any delivery is counted: a message that could not be
            # served must not spend one.
            items = [_item(source, message, message.delivery_count + 1) for message in chosen]
            for message in chosen:
                message.delivery_count += 1
                source.schedule(message, "in_flight", hidden_until)
            return items

    def ack(self, queue: str, receipt_handle: str) -> JsonObject:
        """Delete a held message; 404 ``QUEUE_MESSAGE_NOT_FOUND`` once it is gone."""
        with self._lock:
            self._sweep()
            target = self._queue(queue)
            message = target.messages.pop(receipt_handle, None)
            if message is None:
                raise ApiError(
                    404,
                    "QUEUE_MESSAGE_NOT_FOUND",
                    f"queue {queue!r} holds no message for this receipt handle "
                    "(already acked, dead-lettered, or never published there)",
                )
            return {"acked": True, "queue": queue, "message_id": message.message_id}

    def stats(self, queue: str) -> JsonObject:
        """The counters of one queue, in the notes' field order."""
        with self._lock:
            self._sweep()
            target = self._queue(queue)
            counts = target.counts()
            dlq = self._queues.get(target.dlq) if target.dlq else None
            return {
                "queue": target.name,
                "message_count": sum(counts.values()),
                "available_count": counts["available"],
                "in_flight_count": counts["in_flight"],
                "delayed_count": counts["delayed"],
                "dlq_count": len(dlq.messages) if dlq is not None else 0,
                "oldest_message_age_seconds": self._oldest_age(target),
            }

    def summaries(self) -> dict[str, JsonObject]:
        """Every queue as the emulator's state dump shows it."""
        with self._lock:
            self._sweep()
            return {name: queue.summary() for name, queue in self._queues.items()}

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._queues)

    def clear(self) -> None:
        """Forget every queue."""
        with self._lock:
            self._queues.clear()

    # -- internals (call with the lock held) ----------------------------------------------------

    def _queue(self, name: str) -> Queue:
        queue = self._queues.get(name)
        if queue is None:
            raise ApiError(404, "QUEUE_NOT_FOUND", f"queue {name!r} does not exist")
        return queue

    def _sweep(self) -> None:
        now = self._monotonic()
        for queue in list(self._queues.values()):
            for message in queue.pop_due(now):
                self._lapse(queue, message)

    def _lapse(self, queue: Queue, message: Message) -> None:
        """A delay ended or a visibility timeout ran out unacked."""
        dlq = self._queues.get(queue.dlq) if queue.dlq else None
        exhausted = message.state == "in_flight" and message.delivery_count >= MAX_RECEIVE_COUNT
        if exhausted and dlq is not None:
            del queue.messages[message.message_id]
            dlq.messages[message.message_id] = Message(
                message.message_id,
                message.payload_json,
                message.published_wall,
                message.published_mono,
            )
            return
        message.state = "available"

    def _oldest_age(self, queue: Queue) -> int:
        if not queue.messages:
            return 0
        oldest = min(message.published_mono for message in queue.messages.values())
        return max(0, math.floor(self._monotonic() - oldest))


def _first_available(queue: Queue, limit: int) -> list[Message]:
    chosen: list[Message] = []
    for message in queue.messages.values():
        if len(chosen) >= limit:
            break
        if message.state == "available":
            chosen.append(message)
    return chosen


def _item(queue: Queue, message: Message, delivery_count: int) -> JsonObject:
    """A consumed item exactly as the notes show it, plus ``receipt_handle``."""
    return {
        "message_id": message.message_id,
        "queue": queue.name,
        "payload": json.loads(message.payload_json),
        "status": "in_flight",
        "delivery_count": delivery_count,
        "published_at": message.published_at,
        "receipt_handle": message.message_id,
    }


def servable_json(body: object) -> str:
    """The body as stored, once it is known that a consume answer can carry it."""
    depth = _depth(body)
    if depth > MAX_BODY_DEPTH:
        raise invalid(f"body is nested {depth} levels deep; at most {MAX_BODY_DEPTH} are served")
    try:
        payload_json = json.dumps(body, allow_nan=False, ensure_ascii=False, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError):
        raise invalid("body must be representable as JSON") from None
    try:
        served = len(payload_json.encode("utf-8"))
    except UnicodeEncodeError:  # a lone surrogate: served with escapes (see encode_answer)
        served = len(json.dumps(body, separators=(",", ":")))
    if served > MAX_SERVED_BODY_BYTES:
        raise invalid(
            f"body is {served} bytes as a consume answer spells it (JSON escapes included); "
            f"at most {MAX_SERVED_BODY_BYTES} are served"
        )
    return payload_json


def _depth(value: object) -> int:
    """How deeply objects and arrays nest in a parsed JSON value (a scalar is 0), without
    recursion: the values measured are the ones too deep for a recursive walk."""
    deepest = 0
    pending: list[tuple[object, int]] = [(value, 1)]
    while pending:
        current, level = pending.pop()
        children: Iterable[object]
        if isinstance(current, dict):
            children = current.values()
        elif isinstance(current, list):
            children = current
        else:
            continue
        deepest = max(deepest, level)
        pending.extend((child, level + 1) for child in children)
    return deepest


def encode_answer(document: object) -> bytes:
    """An answer's body: UTF-8, as JSON APIs send it, so non-ASCII text is not tripled by
    ``\\u`` escapes. Text that UTF-8 cannot carry (a lone surrogate, which JSON can spell
    as an escape) is sent with escapes instead."""
    text = _ANSWER_ENCODER.encode(document)
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        return _ASCII_ANSWER_ENCODER.encode(document).encode("ascii")


def check_queue_name(name: str, field_name: str) -> None:
    if not _QUEUE_NAME.fullmatch(name):
        raise invalid(
            f"{field_name} must be 1-80 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )


def json_number(value: float) -> int | float:
    """Whole numbers as JSON integers, so the default reads ``300`` like the notes."""
    return int(value) if float(value).is_integer() else value
