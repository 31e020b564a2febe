"""A local Infrai queue: the contract in INFRAI_API.md, served over HTTP on loopback.

Tests, the demo and the benchmarks run against this instead of api.infrai.cc, so it must be
faithful to every line of the contract (envelopes, id shapes, timestamps, the consume cap,
visibility, delivery counts, max_receive_count 3, dead-lettering, stats, discovery, error
codes). It adds a control surface under ``/_emulator/`` that the real service does not have:
a clock that can jump forward, fault injection, reset and a state dump.

Choices where the contract is silent (the client must not depend on any of them):

- Expiry is lazy: every request first moves lapsed in-flight and delayed messages on.
- A message whose third delivery lapses goes to the queue's DLQ; in the DLQ (or in a queue
  without a DLQ) a lapsed message simply becomes available again and ``delivery_count`` keeps
  counting (4, 5, ...): nothing is ever dropped silently.
- "Oldest first" means the order in which messages entered the queue (publish order; a
  dead-lettered message enters its DLQ when it is moved there).
- An ack succeeds for any message the queue holds in any state, including one never consumed
  (the handle is the message id, which the producer also knows).
- ``oldest_message_age_seconds`` is an integer (whole seconds, rounded down) over every message
  the queue holds, whatever its state; 0 on an empty queue.
- ``create`` accepts only ``type: "standard"``; names are 1-80 characters of letters, digits,
  ``.``, ``_`` and ``-``. A ``dlq`` naming an existing queue reuses it.
- ``delay_seconds`` is an integer from 0 to 86400. Unknown fields in /v1 bodies are ignored;
  unknown fields in /_emulator bodies are rejected (they are typos).
- A request body over 11 MiB answers 413 ``PAYLOAD_TOO_LARGE``; a chunked body answers 411
  ``LENGTH_REQUIRED``. Unknown routes answer 404 ``NOT_FOUND``, a wrong method 405
  ``METHOD_NOT_ALLOWED``. Auth is checked before routing on every /v1 path.
- Injected faults apply only to /v1 routes, after auth: latency first, then at most one of
  500 ``INTERNAL`` / 429 ``RATE_LIMITED`` (neither applies the call), and a dropped response
  (the call is applied, the connection is closed without an answer). Only a call that succeeded
  has its response dropped: an error answer applied nothing, so it is delivered (a retried ack
  then learns ``QUEUE_MESSAGE_NOT_FOUND``). ``Retry-After`` is a whole number of seconds (0
  allowed) because that is what HTTP allows.

The control surface (no auth, never faulted, answers in the same envelope):

- ``POST /_emulator/clock {"advance_seconds": N}`` -> ``{"offset_seconds", "now"}`` (GET reads it)
- ``POST /_emulator/faults {"latency_ms", "error_rate", "rate_limit_rate",
  "drop_response_rate", "retry_after_seconds", "seed", "routes"}``: replaces the faults in
  effect (every field optional; ``{}`` clears; ``routes`` is a list of ``API_ROUTES`` names,
  absent or null for all) and echoes them (GET reads them)
- ``POST /_emulator/price {"publish_price_usd": "0.00001"}``: the price discovery reports
- ``POST /_emulator/reset``: forget queues, faults, counters, price changes and clock jumps
- ``GET /_emulator/state`` -> ``{"clock", "queues": {name: {type, dlq,
  visibility_timeout_default, message_count, available, in_flight, delayed}}, "requests":
  {route: n}, "connections_accepted", "faults", "faults_injected":
  {"latency"|"error"|"rate_limited"|"drop_response": n}, "publish_price_usd", "auth"}``
"""

from __future__ import annotations

import argparse
import contextlib
import email.parser
import email.utils
import functools
import heapq
import http.client
import io
import json
import math
import random
import re
import secrets
import selectors
import signal
import socket
import string
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from types import FrameType
from typing import Any, Final, Literal, TextIO
from urllib.parse import unquote, urlsplit

from infrai_jobs.queue_contract import (
    CONSUME_CAP,
    DEFAULT_PUBLISH_PRICE_USD,
    DEFAULT_VISIBILITY_TIMEOUT_SECONDS,
    MAX_DELAY_SECONDS,
    MAX_RECEIVE_COUNT,
    MESSAGE_ID_PREFIX,
)

DEFAULT_HOST: Final = "127.0.0.1"
DEFAULT_PORT: Final = 8765
DEFAULT_VISIBILITY_TIMEOUT: Final = float(DEFAULT_VISIBILITY_TIMEOUT_SECONDS)
MAX_BODY_BYTES: Final = 11 * 1024 * 1024
# What publish accepts, consume can serve: a body nested deeper than this, or longer than this
# as a consume answer spells it, is refused at publish (VALIDATION_ERROR) instead of breaking
# every consume answer it would be part of. Both leave room under the client's limits (its
# JSON parser's nesting and a 16 MiB answer).
MAX_BODY_DEPTH: Final = 800
MAX_SERVED_BODY_BYTES: Final = 12 * 1024 * 1024
MAX_LATENCY_MS: Final = 60_000.0
MESSAGE_ID_LENGTH: Final = 24
QUEUE_TYPES: Final = frozenset({"standard"})
# The /v1 route names, as used in fault "routes" lists and the request counters.
API_ROUTES: Final = ("create", "publish", "consume", "ack", "stats", "discovery")

_BASE62: Final = string.digits + string.ascii_uppercase + string.ascii_lowercase
# Every possible id suffix: one uniform draw below this is 24 independent uniform base62 digits.
_MESSAGE_ID_SPACE: Final = len(_BASE62) ** MESSAGE_ID_LENGTH
_QUEUE_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,79}")
_CONTENT_LENGTH: Final = re.compile(r"[0-9]{1,20}")
# Idle keep-alive connections are closed after this long so forgotten clients cannot pile up.
_IDLE_CONNECTION_SECONDS: Final = 60.0
# Bytes a connection may pile up while one of its requests waits out injected latency.
_INBOX_WHILE_BUSY: Final = 1024 * 1024

JsonObject = dict[str, Any]
MessageState = Literal["available", "in_flight", "delayed"]


# --- Errors -----------------------------------------------------------------------------------


class ApiError(Exception):
    """An answer in the error envelope; raised anywhere below the HTTP layer."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{code} (HTTP {status}): {message}")
        self.status = status
        self.code = code
        self.message = message

    def envelope(self) -> JsonObject:
        """The body Infrai sends with a non-2xx status."""
        return {"ok": False, "error": {"code": self.code, "message": self.message}}


def _invalid(message: str) -> ApiError:
    return ApiError(400, "VALIDATION_ERROR", message)


# --- Clock ------------------------------------------------------------------------------------


class EmulatorClock:
    """Real time plus an offset that only moves forward.

    Tests jump past a 300 s visibility timeout by advancing the offset instead of sleeping.
    Visibility and delays run on the monotonic reading so a wall-clock step cannot expire
    messages; ``published_at`` uses the wall reading because it is a calendar timestamp.
    """

    def __init__(
        self,
        monotonic: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._monotonic = monotonic
        self._wall = wall
        self._offset = 0.0
        self._lock = threading.Lock()

    @property
    def offset(self) -> float:
        """Seconds added to real time so far."""
        with self._lock:
            return self._offset

    def monotonic(self) -> float:
        """Seconds on a clock that never steps back; drives visibility, delays and ages."""
        return self._monotonic() + self.offset

    def wall(self) -> float:
        """Unix time as the emulator sees it; stamps ``published_at``."""
        return self._wall() + self.offset

    def advance(self, seconds: float) -> float:
        """Move the clock forward; answers the total offset."""
        if not math.isfinite(seconds) or seconds < 0:
            raise _invalid("advance_seconds must be a finite number >= 0")
        with self._lock:
            self._offset += seconds
            return self._offset

    def reset(self) -> None:
        """Back to real time."""
        with self._lock:
            self._offset = 0.0


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


# --- Queue state ------------------------------------------------------------------------------


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
            "visibility_timeout_default": _number(self.visibility_timeout),
            "max_receive_count": MAX_RECEIVE_COUNT,
        }


def _number(value: float) -> int | float:
    """Whole numbers as JSON integers, so the default reads ``300`` like the notes."""
    return int(value) if float(value).is_integer() else value


# --- Faults -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class FaultConfig:
    """What to inject into /v1 calls; the default injects nothing.

    ``seed`` makes the random choices reproducible; ``routes`` limits the faults to some /v1
    routes (None means all of them).
    """

    latency_ms: float = 0.0
    error_rate: float = 0.0
    rate_limit_rate: float = 0.0
    drop_response_rate: float = 0.0
    retry_after_seconds: int = 1
    seed: int | None = None
    routes: frozenset[str] | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.latency_ms <= MAX_LATENCY_MS:
            raise _invalid(f"latency_ms must be a number from 0 to {MAX_LATENCY_MS:g}")
        for name in ("error_rate", "rate_limit_rate", "drop_response_rate"):
            if not 0 <= getattr(self, name) <= 1:
                raise _invalid(f"{name} must be a probability from 0 to 1")
        if self.retry_after_seconds < 0:
            raise _invalid("retry_after_seconds must be an integer >= 0")
        unknown = sorted((self.routes or frozenset()) - set(API_ROUTES))
        if unknown:
            raise _invalid(f"unknown routes {unknown}; known: {list(API_ROUTES)}")

    def applies_to(self, route: str) -> bool:
        """Whether requests to this /v1 route are eligible for faults."""
        return self.routes is None or route in self.routes

    def as_json(self) -> JsonObject:
        """The configuration as the faults endpoint echoes it."""
        return {
            "latency_ms": _number(self.latency_ms),
            "error_rate": self.error_rate,
            "rate_limit_rate": self.rate_limit_rate,
            "drop_response_rate": self.drop_response_rate,
            "retry_after_seconds": self.retry_after_seconds,
            "seed": self.seed,
            "routes": None if self.routes is None else sorted(self.routes),
        }

    @classmethod
    def from_json(cls, document: Mapping[str, Any]) -> FaultConfig:
        """Parse a faults request body; every field is optional, an empty object clears."""
        _reject_unknown_fields(document, _FAULT_FIELDS)
        routes = document.get("routes")
        if routes is not None and not (
            isinstance(routes, list) and all(isinstance(r, str) for r in routes)
        ):
            raise _invalid("routes must be a list of route names")
        return cls(
            latency_ms=_optional_number(document, "latency_ms", 0.0),
            error_rate=_optional_number(document, "error_rate", 0.0),
            rate_limit_rate=_optional_number(document, "rate_limit_rate", 0.0),
            drop_response_rate=_optional_number(document, "drop_response_rate", 0.0),
            retry_after_seconds=_optional_int(document, "retry_after_seconds", 1),
            seed=_optional_integer(document, "seed"),
            routes=None if routes is None else frozenset(routes),
        )


_FAULT_FIELDS: Final = frozenset(
    {
        "latency_ms",
        "error_rate",
        "rate_limit_rate",
        "drop_response_rate",
        "retry_after_seconds",
        "seed",
        "routes",
    }
)


@dataclass(frozen=True)
class FaultDecision:
    """The faults chosen for one request."""

    latency_seconds: float = 0.0
    error: bool = False
    rate_limited: bool = False
    drop_response: bool = False
    retry_after_seconds: int = 1


# --- The emulator -----------------------------------------------------------------------------


class Emulator:
    """All queue state behind one lock; the HTTP layer only parses and formats.

    The public methods mirror the /v1 calls and the control surface, so tests can also drive
    the emulator in-process. Every queue operation first sweeps lapsed timers (lazy expiry).
    """

    def __init__(
        self,
        *,
        api_key: str | None = None,
        visibility_timeout: float = DEFAULT_VISIBILITY_TIMEOUT,
        publish_price_usd: str | Decimal = DEFAULT_PUBLISH_PRICE_USD,
        clock: EmulatorClock | None = None,
    ) -> None:
        if not math.isfinite(visibility_timeout) or visibility_timeout <= 0:
            raise ValueError("visibility_timeout must be a finite number of seconds above 0")
        self._lock = threading.Lock()
        self._api_key = api_key or None
        self._visibility_timeout = float(visibility_timeout)
        self._default_price = _price_text(publish_price_usd)
        self._price = self._default_price
        self._clock = clock or EmulatorClock()
        self._queues: dict[str, Queue] = {}
        self._faults = FaultConfig()
        self._rng = random.Random()
        self._requests: Counter[str] = Counter()
        self._connections_accepted = 0
        self._faults_injected: Counter[str] = Counter()

    def __repr__(self) -> str:
        # Never the API key: reprs end up in logs and assertion messages.
        auth = "required" if self._api_key else "any bearer token"
        return f"Emulator(queues={len(self._queues)}, api_key={auth})"

    # -- auth -----------------------------------------------------------------------------------

    def accepts_token(self, token: str | None) -> bool:
        """Any non-empty bearer token without an API key; with one, only that key."""
        if not token:
            return False
        if self._api_key is None:
            return True
        return secrets.compare_digest(token.encode(), self._api_key.encode())

    # -- /v1 calls ------------------------------------------------------------------------------

    def create_queue(
        self, name: str, queue_type: str = "standard", dlq: str | None = None
    ) -> JsonObject:
        """Create a queue (and its DLQ); 409 ``QUEUE_ALREADY_EXISTS`` for a taken name."""
        _check_queue_name(name, "name")
        if queue_type not in QUEUE_TYPES:
            raise _invalid(f"type must be one of {sorted(QUEUE_TYPES)}")
        if dlq is not None:
            _check_queue_name(dlq, "dlq")
            if dlq == name:
                raise _invalid("dlq must name a different queue")
        with self._lock:
            if name in self._queues:
                raise ApiError(409, "QUEUE_ALREADY_EXISTS", f"queue {name!r} already exists")
            if dlq is not None and dlq not in self._queues:
                self._queues[dlq] = Queue(dlq, queue_type, None, self._visibility_timeout)
            queue = Queue(name, queue_type, dlq, self._visibility_timeout)
            self._queues[name] = queue
            return queue.describe()

    def publish(self, queue: str, body: JsonObject, delay_seconds: int = 0) -> str:
        """Add a new message (always a new id: no producer-side deduplication)."""
        if not isinstance(body, dict):
            raise _invalid("body must be a JSON object")
        if not 0 <= delay_seconds <= MAX_DELAY_SECONDS:
            raise _invalid(f"delay_seconds must be an integer from 0 to {MAX_DELAY_SECONDS}")
        payload_json = _servable_json(body)
        with self._lock:
            self._sweep()
            target = self._queue(queue)
            now = self._clock.monotonic()
            message = Message(new_message_id(), payload_json, self._clock.wall(), now)
            target.messages[message.message_id] = message
            if delay_seconds > 0:
                target.schedule(message, "delayed", now + delay_seconds)
            return message.message_id

    def consume(self, queue: str, max_messages: int = 1) -> list[JsonObject]:
        """Deliver up to ``min(max_messages, 10)`` available messages, oldest first."""
        if max_messages < 1:
            raise _invalid("max_messages must be an integer >= 1")
        with self._lock:
            self._sweep()
            source = self._queue(queue)
            chosen = _first_available(source, min(max_messages, CONSUME_CAP))
            hidden_until = self._clock.monotonic() + source.visibility_timeout
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

    def discovery(self) -> JsonObject:
        """Capabilities with today's prices; only publishing is metered."""
        with self._lock:
            price = self._price
        return {"capabilities": [_capability(route, price) for route in _CAPABILITIES]}

    # -- control surface ------------------------------------------------------------------------

    @property
    def publish_price_usd(self) -> str:
        """The per-message publish price discovery reports, as a decimal string."""
        with self._lock:
            return self._price

    @publish_price_usd.setter
    def publish_price_usd(self, price: str | Decimal) -> None:
        text = _price_text(price)
        with self._lock:
            self._price = text

    @property
    def clock(self) -> EmulatorClock:
        """The clock visibility, delays and ages run on."""
        return self._clock

    def advance_clock(self, seconds: float) -> JsonObject:
        """Jump forward; lapsed messages move on at the next request."""
        offset = self._clock.advance(seconds)
        return {"offset_seconds": offset, "now": format_timestamp(self._clock.wall())}

    @property
    def faults(self) -> FaultConfig:
        """The faults in effect."""
        with self._lock:
            return self._faults

    def set_faults(self, faults: FaultConfig) -> None:
        """Replace the faults in effect; a seed restarts the random sequence."""
        with self._lock:
            self._faults = faults
            self._rng = random.Random(faults.seed)

    def count_connection(self) -> None:
        """Record one accepted TCP connection (clients that churn connections show here)."""
        with self._lock:
            self._connections_accepted += 1

    def count_request(self, route: str) -> None:
        """Record one /v1 request (for the state dump and chaos reports)."""
        with self._lock:
            self._requests[route] += 1

    def decide_faults(self, route: str) -> FaultDecision:
        """Draw this request's faults; with a seed, the same requests draw the same faults."""
        with self._lock:
            faults = self._faults
            if not faults.applies_to(route):
                return FaultDecision()
            error = self._rng.random() < faults.error_rate
            limited = not error and self._rng.random() < faults.rate_limit_rate
            drop = not (error or limited) and self._rng.random() < faults.drop_response_rate
            decision = FaultDecision(
                latency_seconds=faults.latency_ms / 1000,
                error=error,
                rate_limited=limited,
                drop_response=drop,
                retry_after_seconds=faults.retry_after_seconds,
            )
            self._count_faults(decision)
            return decision

    def record_dropped_response(self) -> None:
        """Count a response actually dropped (only successful calls lose their answer)."""
        with self._lock:
            self._faults_injected["drop_response"] += 1

    def reset(self) -> None:
        """Forget every queue, fault, counter and clock jump; keep the API key."""
        with self._lock:
            self._queues.clear()
            self._faults = FaultConfig()
            self._rng = random.Random()
            self._requests.clear()
            self._connections_accepted = 0
            self._faults_injected.clear()
            self._price = self._default_price
            self._clock.reset()

    def snapshot(self) -> JsonObject:
        """Everything a test or a chaos report may want to look at, in one JSON object."""
        with self._lock:
            self._sweep()
            return {
                "clock": {
                    "offset_seconds": self._clock.offset,
                    "now": format_timestamp(self._clock.wall()),
                },
                "queues": {name: _queue_summary(q) for name, q in self._queues.items()},
                "requests": dict(self._requests),
                "connections_accepted": self._connections_accepted,
                "faults": self._faults.as_json(),
                "faults_injected": dict(self._faults_injected),
                "publish_price_usd": self._price,
                "auth": "api_key" if self._api_key else "any_bearer_token",
            }

    # -- internals (call with the lock held) ----------------------------------------------------

    def _queue(self, name: str) -> Queue:
        queue = self._queues.get(name)
        if queue is None:
            raise ApiError(404, "QUEUE_NOT_FOUND", f"queue {name!r} does not exist")
        return queue

    def _sweep(self) -> None:
        now = self._clock.monotonic()
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
        return max(0, math.floor(self._clock.monotonic() - oldest))

    def _count_faults(self, decision: FaultDecision) -> None:
        if decision.latency_seconds > 0:
            self._faults_injected["latency"] += 1
        for name in ("error", "rate_limited"):
            if getattr(decision, name):
                self._faults_injected[name] += 1


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


def _servable_json(body: JsonObject) -> str:
    """The body as stored, once it is known that a consume answer can carry it."""
    depth = _depth(body)
    if depth > MAX_BODY_DEPTH:
        raise _invalid(f"body is nested {depth} levels deep; at most {MAX_BODY_DEPTH} are served")
    try:
        payload_json = json.dumps(body, allow_nan=False, ensure_ascii=False, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError):
        raise _invalid("body must be representable as JSON") from None
    try:
        served = len(payload_json.encode("utf-8"))
    except UnicodeEncodeError:  # a lone surrogate: served with escapes (see encode_answer)
        served = len(json.dumps(body, separators=(",", ":")))
    if served > MAX_SERVED_BODY_BYTES:
        raise _invalid(
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


def _queue_summary(queue: Queue) -> JsonObject:
    counts = queue.counts()
    return {
        "type": queue.type,
        "dlq": queue.dlq,
        "visibility_timeout_default": _number(queue.visibility_timeout),
        "message_count": sum(counts.values()),
        "available": counts["available"],
        "in_flight": counts["in_flight"],
        "delayed": counts["delayed"],
    }


# (capability id, method, path); queue.publish is the metered one.
_CAPABILITIES: Final = (
    ("queue.create", "POST", "/v1/queue/create"),
    ("queue.publish", "POST", "/v1/queue/publish"),
    ("queue.consume", "POST", "/v1/queue/consume"),
    ("queue.ack", "POST", "/v1/queue/ack"),
    ("queue.stats", "GET", "/v1/queue/stats/{queue}"),
)


def _capability(route: tuple[str, str, str], publish_price: str) -> JsonObject:
    capability_id, method, path = route
    metered = capability_id == "queue.publish"
    billing: JsonObject = {
        "unit": "message" if metered else "call",
        "price_usd": publish_price if metered else "0",
        "currency": "USD",
        "free": not metered,
        "rate_limited": not metered,
    }
    return {"id": capability_id, "method": method, "path": path, "billing": billing}


def _price_text(price: str | Decimal) -> str:
    """A price as a plain decimal string (never ``2E-5``), validated."""
    try:
        value = Decimal(price)
    except (InvalidOperation, TypeError, ValueError):
        raise _invalid("publish_price_usd must be a decimal string like '0.00002'") from None
    if not value.is_finite() or value < 0:
        raise _invalid("publish_price_usd must be a finite decimal >= 0")
    return format(value, "f")


def _check_queue_name(name: str, field_name: str) -> None:
    if not _QUEUE_NAME.fullmatch(name):
        raise _invalid(
            f"{field_name} must be 1-80 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )


# --- Request parsing --------------------------------------------------------------------------


def _reject_constant(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


def parse_json_object(raw: bytes) -> JsonObject:
    """A request body as a JSON object, or a 400 that says what is wrong with it."""
    if not raw.strip():
        raise _invalid("request body is empty; expected a JSON object")
    try:
        document = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise _invalid("request body is not valid JSON") from None
    if not isinstance(document, dict):
        raise _invalid("request body must be a JSON object")
    return document


def _required_str(document: Mapping[str, Any], key: str) -> str:
    if key not in document:
        raise _invalid(f"missing field {key!r}")
    value = document[key]
    if not isinstance(value, str) or not value:
        raise _invalid(f"{key} must be a non-empty string")
    return value


def _optional_str(document: Mapping[str, Any], key: str) -> str | None:
    if document.get(key) is None:
        return None
    return _required_str(document, key)


def _optional_int(document: Mapping[str, Any], key: str, default: int) -> int:
    value = _optional_integer(document, key)
    return default if value is None else value


def _optional_integer(document: Mapping[str, Any], key: str) -> int | None:
    value = document.get(key)
    if value is None:
        return None
    # bool is an int subclass, but ``true`` is not a count.
    if isinstance(value, bool) or not isinstance(value, int):
        raise _invalid(f"{key} must be an integer")
    return value


def _optional_number(document: Mapping[str, Any], key: str, default: float) -> float:
    value = document.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _invalid(f"{key} must be a number")
    if not math.isfinite(value):
        raise _invalid(f"{key} must be finite")
    return float(value)


def _reject_unknown_fields(document: Mapping[str, Any], known: frozenset[str]) -> None:
    unknown = sorted(set(document) - known)
    if unknown:
        raise _invalid(f"unknown fields {unknown}; known: {sorted(known)}")


# --- Routes -----------------------------------------------------------------------------------

# A route handler gets the emulator, the raw body and the path parameter (stats' queue name).
RouteHandler = Callable[[Emulator, bytes, str], JsonObject]


def _api_create(emulator: Emulator, raw: bytes, _param: str) -> JsonObject:
    document = parse_json_object(raw)
    return emulator.create_queue(
        _required_str(document, "name"),
        queue_type=_optional_str(document, "type") or "standard",
        dlq=_optional_str(document, "dlq"),
    )


def _api_publish(emulator: Emulator, raw: bytes, _param: str) -> JsonObject:
    document = parse_json_object(raw)
    queue = _required_str(document, "queue")
    if "body" not in document:
        raise _invalid("missing field 'body'")
    if not isinstance(document["body"], dict):
        raise _invalid("body must be a JSON object")
    delay = _optional_int(document, "delay_seconds", 0)
    return {"message_id": emulator.publish(queue, document["body"], delay_seconds=delay)}


def _api_consume(emulator: Emulator, raw: bytes, _param: str) -> JsonObject:
    document = parse_json_object(raw)
    queue = _required_str(document, "queue")
    max_messages = _optional_int(document, "max_messages", 1)
    return {"items": emulator.consume(queue, max_messages), "next_cursor": None}


def _api_ack(emulator: Emulator, raw: bytes, _param: str) -> JsonObject:
    document = parse_json_object(raw)
    queue = _required_str(document, "queue")
    return emulator.ack(queue, _required_str(document, "receipt_handle"))


def _api_stats(emulator: Emulator, _raw: bytes, queue: str) -> JsonObject:
    return emulator.stats(queue)


def _api_discovery(emulator: Emulator, _raw: bytes, _param: str) -> JsonObject:
    return emulator.discovery()


def _control_clock(emulator: Emulator, raw: bytes, _param: str) -> JsonObject:
    document = parse_json_object(raw)
    _reject_unknown_fields(document, frozenset({"advance_seconds"}))
    if "advance_seconds" not in document:
        raise _invalid("missing field 'advance_seconds'")
    return emulator.advance_clock(_optional_number(document, "advance_seconds", 0.0))


def _control_clock_read(emulator: Emulator, _raw: bytes, _param: str) -> JsonObject:
    return emulator.advance_clock(0.0)


def _control_faults(emulator: Emulator, raw: bytes, _param: str) -> JsonObject:
    emulator.set_faults(FaultConfig.from_json(parse_json_object(raw)))
    return emulator.faults.as_json()


def _control_faults_read(emulator: Emulator, _raw: bytes, _param: str) -> JsonObject:
    return emulator.faults.as_json()


def _control_price(emulator: Emulator, raw: bytes, _param: str) -> JsonObject:
    document = parse_json_object(raw)
    _reject_unknown_fields(document, frozenset({"publish_price_usd"}))
    emulator.publish_price_usd = _required_str(document, "publish_price_usd")
    return {"publish_price_usd": emulator.publish_price_usd}


def _control_reset(emulator: Emulator, _raw: bytes, _param: str) -> JsonObject:
    emulator.reset()
    return {"reset": True}


def _control_state(emulator: Emulator, _raw: bytes, _param: str) -> JsonObject:
    return emulator.snapshot()


@dataclass(frozen=True)
class Endpoint:
    """A path's handlers by HTTP method; ``name`` keys fault routes and request counters."""

    name: str
    handlers: Mapping[str, RouteHandler]

    def allowed(self) -> str:
        """The ``Allow`` header of a 405."""
        return ", ".join(sorted(self.handlers))


_STATS_PREFIX: Final = "/v1/queue/stats/"
_STATS: Final = Endpoint("stats", {"GET": _api_stats})
_API_ENDPOINTS: Final[Mapping[str, Endpoint]] = {
    "/v1/queue/create": Endpoint("create", {"POST": _api_create}),
    "/v1/queue/publish": Endpoint("publish", {"POST": _api_publish}),
    "/v1/queue/consume": Endpoint("consume", {"POST": _api_consume}),
    "/v1/queue/ack": Endpoint("ack", {"POST": _api_ack}),
    "/v1/discovery": Endpoint("discovery", {"GET": _api_discovery}),
}
_CONTROL_ENDPOINTS: Final[Mapping[str, Endpoint]] = {
    "/_emulator/clock": Endpoint("clock", {"GET": _control_clock_read, "POST": _control_clock}),
    "/_emulator/faults": Endpoint("faults", {"GET": _control_faults_read, "POST": _control_faults}),
    "/_emulator/price": Endpoint("price", {"POST": _control_price}),
    "/_emulator/reset": Endpoint("reset", {"POST": _control_reset}),
    "/_emulator/state": Endpoint("state", {"GET": _control_state}),
}


def match_api_route(path: str) -> tuple[Endpoint, str] | None:
    """The /v1 endpoint for a path and its parameter (the URL-decoded queue name for stats)."""
    endpoint = _API_ENDPOINTS.get(path)
    if endpoint is not None:
        return endpoint, ""
    name = path.removeprefix(_STATS_PREFIX)
    if path.startswith(_STATS_PREFIX) and name and "/" not in name:
        return _STATS, unquote(name)
    return None


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, or None."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


# --- HTTP -------------------------------------------------------------------------------------

# The stdlib reads request headers with the email package, which was the largest share of this
# server's CPU per request. The handler below reads them itself and keeps the stdlib's answers
# for everything unusual, so a client sees the same server as before, only cheaper.

# http.client's limits on request headers (its private _MAXLINE and _MAXHEADERS): a longer
# line answers 431 "Line too long"; more lines than this, counting the blank line that ends
# them, answer 431 "Too many headers".
_MAX_HEADER_LINE: Final = 65_536
_MAX_HEADER_LINES: Final = 100
_END_OF_HEADERS: Final = frozenset({b"\r\n", b"\n", b""})
# A header line the email parser reads as plain ``name: value``: a name of visible characters
# other than ':' and a value with no CR or LF inside (the email parser breaks lines at a lone
# CR as well). Any other line (folded, nameless, "From ...", a name with spaces or bytes above
# 0x7e) sends the whole block through the email parser, so it is read exactly as before.
_SIMPLE_HEADER_LINE: Final = re.compile(rb"([!-9;-~]+):[ \t]*([^\r\n]*)\r?\n?")
# The envelope needs no spaces; the same settings as json.dumps(separators=...), built once.
_ANSWER_ENCODER: Final = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)
_ASCII_ANSWER_ENCODER: Final = json.JSONEncoder(separators=(",", ":"))


class RequestHeaders:
    """A request's headers by name, case-insensitive; of repeated names the first one counts
    (as ``email.message.Message.get`` answers, which the handler used before)."""

    __slots__ = ("_values",)

    def __init__(self, pairs: Iterable[tuple[str, str]] = ()) -> None:
        values: dict[str, str] = {}
        for name, value in pairs:
            values.setdefault(name.lower(), value)
        self._values = values

    def get(self, name: str, default: str | None = None) -> str | None:
        """The value of header ``name`` in any case, or ``default``."""
        return self._values.get(name.lower(), default)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in self._values

    def __repr__(self) -> str:
        # Names only: the Authorization value is a secret.
        return f"RequestHeaders({sorted(self._values)})"


def parse_header_lines(lines: Sequence[bytes]) -> RequestHeaders:
    """Headers from the raw lines ``http.client`` would have read, the blank one included.

    Plain ``name: value`` lines are split here; a block with any other line goes through the
    email parser, exactly as ``http.client.parse_headers`` feeds it.
    """
    pairs: list[tuple[str, str]] = []
    for line in lines:
        if line in _END_OF_HEADERS:
            break
        match = _SIMPLE_HEADER_LINE.fullmatch(line)
        if match is None:
            return _parse_with_email(lines)
        pairs.append((match[1].decode("latin-1"), match[2].decode("latin-1")))
    return RequestHeaders(pairs)


def _parse_with_email(lines: Sequence[bytes]) -> RequestHeaders:
    text = b"".join(lines).decode("iso-8859-1")
    message = email.parser.Parser(_class=http.client.HTTPMessage).parsestr(text)
    # Decoded as latin-1, a value never holds surrogates, so every value is a plain str.
    return RequestHeaders((name, str(value)) for name, value in message.items())


def _http_version(text: str) -> tuple[int, int] | None:
    """``HTTP/<major>.<minor>`` as numbers, or None where the stdlib answers "Bad request
    version": exactly one dot, digits only, at most 10 of them on each side."""
    if not text.startswith("HTTP/"):
        return None
    parts = text[len("HTTP/") :].split(".")
    if len(parts) != 2 or not all(part.isdigit() and len(part) <= 10 for part in parts):
        return None
    try:
        return int(parts[0]), int(parts[1])
    except ValueError:
        # isdigit() admits digits int() refuses, such as a latin-1 superscript two.
        return None


@functools.lru_cache(maxsize=4)
def _http_date(unix_second: int) -> str:
    """The Date header; the stdlib formats it anew for every answer, this once a second."""
    return email.utils.formatdate(unix_second, usegmt=True)


@functools.lru_cache(maxsize=64)
def _status_line(protocol: str, status: int) -> str:
    reason = BaseHTTPRequestHandler.responses.get(status, ("",))[0]
    return f"{protocol} {status} {reason}"


class _RequestHandler(BaseHTTPRequestHandler):
    """Parses HTTP, applies faults, formats envelopes; the state lives in the Emulator."""

    protocol_version = "HTTP/1.1"
    server_version = "infrai-emulator/0.1"
    # Set by handle_one_request (typeshed does not declare it) and parse_request; the handler
    # reads headers only through ``request_headers``, never the stdlib's ``headers``.
    raw_requestline: bytes
    request_headers: RequestHeaders
    # Set when the answer waits for injected latency: (seconds, the rest of the request).
    deferred: tuple[float, Callable[[], None]] | None = None
    # Set by the server when it already sent this request's "100 Continue".
    continue_sent: bool = False

    def handle_expect_100(self) -> bool:
        if self.continue_sent:
            return True
        return super().handle_expect_100()

    def version_string(self) -> str:
        # Not the Python version: nothing about the host belongs in a header.
        return self.server_version

    def parse_request(self) -> bool:
        """The stdlib's parse_request with a lean header reader; same limits, same answers.

        On failure an error has been answered (by the stdlib's send_error) or, for an empty
        request line, the connection is to be closed silently.
        """
        if not self._parse_request_line():
            return False
        lines = self._read_header_lines()
        if lines is None:
            return False
        self.request_headers = parse_header_lines(lines)
        connection = (self.request_headers.get("Connection") or "").lower()
        if connection == "close":
            self.close_connection = True
        elif connection == "keep-alive" and self.protocol_version >= "HTTP/1.1":
            self.close_connection = False
        expect = (self.request_headers.get("Expect") or "").lower()
        if (
            expect == "100-continue"
            and self.protocol_version >= "HTTP/1.1"
            and self.request_version >= "HTTP/1.1"
        ):
            return self.handle_expect_100()
        return True

    def _parse_request_line(self) -> bool:
        """``METHOD PATH VERSION`` (or HTTP/0.9's ``GET PATH``), judged as the stdlib does."""
        # The stdlib resets it to None; "" is as good (only send_error reads it, comparing
        # with "HEAD") and keeps the attribute a str.
        self.command = ""
        self.request_version = self.default_request_version
        self.close_connection = True
        requestline = str(self.raw_requestline, "iso-8859-1").rstrip("\r\n")
        self.requestline = requestline
        words = requestline.split()
        if not words:
            return False
        if len(words) >= 3:
            version = words[-1]
            number = _http_version(version)
            if number is None:
                self.send_error(HTTPStatus.BAD_REQUEST, f"Bad request version ({version!r})")
                return False
            if number >= (1, 1) and self.protocol_version >= "HTTP/1.1":
                self.close_connection = False
            if number >= (2, 0):
                self.send_error(
                    HTTPStatus.HTTP_VERSION_NOT_SUPPORTED,
                    f"Invalid HTTP version ({version.split('/', 1)[1]})",
                )
                return False
            self.request_version = version
        if not 2 <= len(words) <= 3:
            self.send_error(HTTPStatus.BAD_REQUEST, f"Bad request syntax ({requestline!r})")
            return False
        command, path = words[:2]
        if len(words) == 2:
            self.close_connection = True
            if command != "GET":
                self.send_error(HTTPStatus.BAD_REQUEST, f"Bad HTTP/0.9 request type ({command!r})")
                return False
        self.command = command
        # As the stdlib does (gh-87389): "//host/x" must not read as a URL without a scheme.
        self.path = "/" + path.lstrip("/") if path.startswith("//") else path
        return True

    def _read_header_lines(self) -> list[bytes] | None:
        """The header lines up to and including the blank one (or EOF), with http.client's
        limits; None after answering 431."""
        lines: list[bytes] = []
        while True:
            line = self.rfile.readline(_MAX_HEADER_LINE + 1)
            if len(line) > _MAX_HEADER_LINE:
                explain = str(http.client.LineTooLong("header line"))
                self.send_error(
                    HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "Line too long", explain
                )
                return None
            lines.append(line)
            if len(lines) > _MAX_HEADER_LINES:
                explain = f"got more than {_MAX_HEADER_LINES} headers"
                self.send_error(
                    HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "Too many headers", explain
                )
                return None
            if line in _END_OF_HEADERS:
                return lines

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_PATCH(self) -> None:
        self._dispatch("PATCH")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def log_message(self, format: str, *args: Any) -> None:
        # Quiet unless --verbose. The request line never holds the token (it is a header).
        if self._http_server.verbose:
            super().log_message(format, *args)

    @property
    def _http_server(self) -> EmulatorHTTPServer:
        server = self.server
        assert isinstance(server, EmulatorHTTPServer)
        return server

    @property
    def _emulator(self) -> Emulator:
        return self._http_server.emulator

    def _dispatch(self, method: str) -> None:
        self.run_guarded(functools.partial(self._serve, method))

    def run_guarded(self, step: Callable[[], None]) -> None:
        """Run a step of serving a request; a bug becomes a 500 instead of a hang."""
        try:
            step()
        except OSError:
            # The client went away or timed out mid-request; nothing left to answer.
            self.close_connection = True
        except Exception:  # noqa: BLE001 - the one place a bug becomes a 500 instead of a hang
            traceback.print_exc(file=sys.stderr)
            self.close_connection = True
            with contextlib.suppress(OSError):
                self._send_error(ApiError(500, "INTERNAL", "emulator bug; see its stderr"))

    def _serve(self, method: str) -> None:
        raw = self._read_body()
        if raw is None:
            return
        path = urlsplit(self.path).path
        if path.startswith("/_emulator/"):
            self._serve_control(method, path, raw)
        elif path == "/v1" or path.startswith("/v1/"):
            self._serve_api(method, path, raw)
        else:
            self._send_error(ApiError(404, "NOT_FOUND", f"no route {method} {path}"))

    def _read_body(self) -> bytes | None:
        """The request body, or None after answering a body we will not read."""
        if self.request_headers.get("Transfer-Encoding"):
            self.close_connection = True
            self._send_error(ApiError(411, "LENGTH_REQUIRED", "send a Content-Length body"))
            return None
        length_header = (self.request_headers.get("Content-Length") or "0").strip()
        if not _CONTENT_LENGTH.fullmatch(length_header):
            self.close_connection = True
            self._send_error(_invalid("Content-Length must be a non-negative integer"))
            return None
        length = int(length_header)
        if length > MAX_BODY_BYTES:
            # Not reading it leaves the connection unusable, so it is closed after the answer.
            self.close_connection = True
            self._send_error(
                ApiError(413, "PAYLOAD_TOO_LARGE", f"request body over {MAX_BODY_BYTES} bytes")
            )
            return None
        return self.rfile.read(length) if length else b""

    def _serve_control(self, method: str, path: str, raw: bytes) -> None:
        endpoint = _CONTROL_ENDPOINTS.get(path)
        if endpoint is None:
            self._send_error(ApiError(404, "NOT_FOUND", f"no route {method} {path}"))
            return
        self._send_answer(*self._apply(endpoint, method, raw, ""))

    def _serve_api(self, method: str, path: str, raw: bytes) -> None:
        matched = match_api_route(path)
        self._emulator.count_request(matched[0].name if matched else "unmatched")
        token = bearer_token(self.request_headers.get("Authorization"))
        if not self._emulator.accepts_token(token):
            # The message is fixed text: whatever token was sent is never echoed.
            self._send_error(ApiError(401, "UNAUTHORIZED", "missing or invalid bearer token"))
            return
        if matched is None:
            self._send_error(ApiError(404, "NOT_FOUND", f"no route {method} {path}"))
            return
        endpoint, param = matched
        if method not in endpoint.handlers:
            self._send_answer(*self._apply(endpoint, method, raw, param))
            return
        decision = self._emulator.decide_faults(endpoint.name)
        if decision.latency_seconds > 0:
            # The answer, and any next request on this connection, wait until the latency has
            # passed; meanwhile the server serves other connections.
            self.deferred = (
                decision.latency_seconds,
                functools.partial(self._finish_api, endpoint, method, raw, param, decision),
            )
            return
        self._finish_api(endpoint, method, raw, param, decision)

    def _finish_api(
        self, endpoint: Endpoint, method: str, raw: bytes, param: str, decision: FaultDecision
    ) -> None:
        if self._answer_injected_fault(decision):
            return
        answer = self._apply(endpoint, method, raw, param)
        if decision.drop_response and answer[0] == 200:
            # The call was applied; the client must not learn it (a lost response).
            self._emulator.record_dropped_response()
            self.close_connection = True
            return
        self._send_answer(*answer)

    def _answer_injected_fault(self, decision: FaultDecision) -> bool:
        """Answer an injected 500 or 429 without applying the call; True if one was sent."""
        if decision.error:
            self._send_error(ApiError(500, "INTERNAL", "injected fault: internal error"))
            return True
        if decision.rate_limited:
            seconds = decision.retry_after_seconds
            self._send_error(
                ApiError(429, "RATE_LIMITED", f"rate limited; retry after {seconds} s"),
                headers={"Retry-After": str(seconds)},
            )
            return True
        return False

    def _apply(
        self, endpoint: Endpoint, method: str, raw: bytes, param: str
    ) -> tuple[int, JsonObject, dict[str, str]]:
        """Run a route; an ApiError becomes its envelope."""
        handler = endpoint.handlers.get(method)
        if handler is None:
            error = ApiError(405, "METHOD_NOT_ALLOWED", f"{method} is not allowed here")
            return error.status, error.envelope(), {"Allow": endpoint.allowed()}
        try:
            return 200, {"ok": True, "data": handler(self._emulator, raw, param)}, {}
        except ApiError as error:
            return error.status, error.envelope(), {}

    def _send_error(self, error: ApiError, headers: Mapping[str, str] | None = None) -> None:
        self._send_answer(error.status, error.envelope(), headers or {})

    def _send_answer(self, status: int, document: JsonObject, headers: Mapping[str, str]) -> None:
        """Status line, headers and body in one write (one syscall), with the bytes the
        stdlib's send_response/send_header/end_headers produced."""
        body = encode_answer(document)
        if self._http_server.verbose:
            self.log_request(status)
        if self.request_version == "HTTP/0.9":
            # Such a request gets the body alone: HTTP/0.9 has no status line or headers.
            self.wfile.write(body)
            return
        lines = [
            _status_line(self.protocol_version, status),
            f"Server: {self.version_string()}",
            f"Date: {_http_date(int(time.time()))}",
            "Content-Type: application/json",
            f"Content-Length: {len(body)}",
        ]
        lines.extend(f"{name}: {value}" for name, value in headers.items())
        if self.close_connection:
            lines.append("Connection: close")
        lines.append("\r\n")
        self.wfile.write("\r\n".join(lines).encode("latin-1") + body)


class _NeedMore(BaseException):
    """The request is not all here yet. Not an ``Exception``: the handler's bug guard must not
    turn it into a 500."""


class _Arrived(io.BytesIO):
    """What a connection has received so far, read as the handler reads a socket: a read that
    wants more than has arrived raises ``_NeedMore`` unless the client has closed its side."""

    def __init__(self, data: bytes, *, eof: bool) -> None:
        super().__init__(data)
        self._eof = eof

    def readline(self, size: int | None = -1, /) -> bytes:
        line = super().readline(size)
        limit_reached = size is not None and size >= 0 and len(line) >= size
        if not line.endswith(b"\n") and not limit_reached and not self._eof:
            raise _NeedMore
        return line

    def read(self, size: int | None = -1, /) -> bytes:
        data = super().read(size)
        if not self._eof and (size is None or size < 0 or len(data) < size):
            raise _NeedMore
        return data


class _Connection:
    """One client connection: bytes received and not yet served, bytes still to send."""

    __slots__ = (
        "address",
        "busy",
        "close_after",
        "continue_sent",
        "eof",
        "events",
        "inbox",
        "last_active",
        "outbox",
        "sock",
    )

    def __init__(self, sock: socket.socket, address: Any) -> None:
        self.sock = sock
        self.address = address
        self.inbox = bytearray()
        self.outbox = bytearray()
        self.eof = False
        # A request of this connection is being served (waiting out injected latency): the
        # next one is not read until its answer is out, as HTTP/1.1 orders them.
        self.busy = False
        self.close_after = False
        # The request waiting for its body was already told "100 Continue".
        self.continue_sent = False
        # What the selector watches this socket for (0: not registered).
        self.events = 0
        self.last_active = time.monotonic()


class EmulatorHTTPServer:
    """HTTP/1.1 with keep-alive on one thread: a selector loop over every connection.

    Requests are parsed and answered by ``_RequestHandler`` (the stdlib's request handler, fed
    from memory), and injected latency is a timer, not a sleeping thread. So a benchmark's
    hundreds of connections cost the machine one thread's worth of switching, not hundreds.
    """

    # A drain opening its lanes' connections at once must not overflow the accept queue: each
    # dropped SYN costs the client a second (the first TCP retransmission).
    request_queue_size = 128

    def __init__(
        self, address: tuple[str, int], emulator: Emulator, *, verbose: bool = False
    ) -> None:
        self.emulator = emulator
        self.verbose = verbose
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.socket.bind(address)
            self.socket.listen(self.request_queue_size)
        except OSError:
            self.socket.close()
            raise
        self.socket.setblocking(False)
        # Loopback needs no name lookup: the address is the name.
        host, port = self.socket.getsockname()[:2]
        self.server_name = str(host)
        self.server_port = int(port)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self.socket, selectors.EVENT_READ, None)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._connections: dict[int, _Connection] = {}
        self._timers: list[tuple[float, int, _Connection, _RequestHandler]] = []
        self._timer_seq = 0
        self._stop_requested = False
        self._stopped = threading.Event()
        self._stopped.set()

    @property
    def url(self) -> str:
        """The base URL clients use, with the real port when 0 was asked for."""
        host = f"[{self.server_name}]" if ":" in self.server_name else self.server_name
        return f"http://{host}:{self.server_port}"

    # --- the loop -------------------------------------------------------------------------

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        """Serve until ``shutdown()``; ``poll_interval`` bounds each wait, as in socketserver."""
        self._stopped.clear()
        try:
            next_sweep = time.monotonic() + 1.0
            while not self._stop_requested:
                now = time.monotonic()
                timeout = poll_interval
                if self._timers:
                    timeout = max(0.0, min(timeout, self._timers[0][0] - now))
                for key, events in self._selector.select(timeout):
                    try:
                        self._handle_event(key, events)
                    except Exception:  # noqa: BLE001 - a bug costs a connection, not the server
                        traceback.print_exc(file=sys.stderr)
                        if isinstance(key.data, _Connection):
                            self._close(key.data)
                self._run_due_timers()
                if time.monotonic() >= next_sweep:
                    self._close_idle()
                    next_sweep = time.monotonic() + 1.0
        finally:
            self._stop_requested = False
            self._stopped.set()

    def _handle_event(self, key: selectors.SelectorKey, events: int) -> None:
        if key.fileobj is self.socket:
            self._accept()
        elif key.fileobj is self._wake_r:
            with contextlib.suppress(OSError):
                self._wake_r.recv(4096)
        else:
            conn = key.data
            if events & selectors.EVENT_WRITE:
                self._flush(conn)
            if events & selectors.EVENT_READ and conn.sock.fileno() >= 0:
                self._receive(conn)

    def shutdown(self) -> None:
        """Stop ``serve_forever`` and wait until it has returned (call from another thread)."""
        self._stop_requested = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        self._stopped.wait()

    def close_connections(self) -> None:
        """Close every client connection (after ``shutdown``)."""
        for conn in list(self._connections.values()):
            self._close(conn)

    def server_close(self) -> None:
        self.close_connections()
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(self.socket)
        self.socket.close()
        self._wake_r.close()
        self._wake_w.close()
        self._selector.close()

    # --- connections ------------------------------------------------------------------------

    def _accept(self) -> None:
        while True:
            try:
                sock, address = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return  # e.g. out of descriptors; the client's connect will time out
            sock.setblocking(False)
            # Answers go out in one write, the stdlib's own error answers in several: with
            # Nagle on, the client's delayed ACK would stall them by ~40 ms. (Some systems
            # refuse it on a connection the peer already closed; that one just ends soon.)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Connection(sock, address)
            self._connections[sock.fileno()] = conn
            self._watch(conn)
            self.emulator.count_connection()

    def _receive(self, conn: _Connection) -> None:
        try:
            data = conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        conn.last_active = time.monotonic()
        if data:
            conn.inbox += data
            if conn.busy:
                self._watch(conn)
        else:
            conn.eof = True
            # Nothing more will arrive: stop watching for it (a closed socket stays readable).
            self._watch(conn)
        self._serve_next(conn)

    def _serve_next(self, conn: _Connection) -> None:
        """Serve the requests that have arrived complete, in order, until one waits."""
        # One copy of what arrived per round: requests pipelined behind each other are read
        # from it at a moving offset, and the served bytes are dropped once, at the end.
        arrived = bytes(conn.inbox)
        offset = 0
        try:
            while not conn.busy and not conn.close_after and conn.sock.fileno() >= 0:
                if offset >= len(arrived):
                    if conn.eof and not conn.outbox:
                        self._close(conn)
                    return
                handler = self._new_handler(conn, arrived, offset)
                try:
                    handler.handle_one_request()
                except _NeedMore:
                    self._send_interim(conn, handler)
                    return
                except Exception:  # noqa: BLE001 - a bug costs this connection, not the server
                    traceback.print_exc(file=sys.stderr)
                    self._close(conn)
                    return
                consumed = handler.rfile.tell() - offset
                if consumed <= 0:  # cannot happen (a request line was read); never spin on it
                    self._close(conn)
                    return
                offset += consumed
                conn.continue_sent = False
                if handler.deferred is not None:
                    conn.busy = True
                    seconds, _rest = handler.deferred
                    self._timer_seq += 1
                    entry = (time.monotonic() + seconds, self._timer_seq, conn, handler)
                    heapq.heappush(self._timers, entry)
                    return
                self._answered(conn, handler)
        finally:
            del conn.inbox[:offset]

    def _new_handler(self, conn: _Connection, arrived: bytes, offset: int) -> _RequestHandler:
        handler = _RequestHandler.__new__(_RequestHandler)
        handler.server = self  # type: ignore[assignment]
        handler.client_address = conn.address
        handler.request = conn.sock
        handler.rfile = _Arrived(arrived, eof=conn.eof)
        handler.rfile.seek(offset)
        handler.wfile = io.BytesIO()
        handler.close_connection = True
        handler.continue_sent = conn.continue_sent
        return handler

    def _send_interim(self, conn: _Connection, handler: _RequestHandler) -> None:
        """A request waiting for its body may have been told "100 Continue": send that now."""
        written = _written(handler)
        if written:
            conn.continue_sent = True
            conn.outbox += written
            self._flush(conn)

    def _run_due_timers(self) -> None:
        now = time.monotonic()
        while self._timers and self._timers[0][0] <= now:
            _due, _seq, conn, handler = heapq.heappop(self._timers)
            assert handler.deferred is not None
            _seconds, rest = handler.deferred
            handler.deferred = None
            if conn.sock.fileno() < 0:
                # The client went away while the request waited: Infrai would still apply a
                # request it had received; the answer has nobody to go to. (Not when stopping.)
                if not self._stop_requested:
                    handler.run_guarded(rest)
                continue
            handler.run_guarded(rest)
            conn.busy = False
            self._answered(conn, handler)
            self._serve_next(conn)

    def _answered(self, conn: _Connection, handler: _RequestHandler) -> None:
        conn.last_active = time.monotonic()  # idle time runs from the answer, not the request
        written = _written(handler)
        if written:
            conn.outbox += written
        if handler.close_connection:
            conn.close_after = True
        self._flush(conn)

    def _flush(self, conn: _Connection) -> None:
        while conn.outbox:
            try:
                sent = conn.sock.send(conn.outbox)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self._close(conn)
                return
            del conn.outbox[:sent]
        if not conn.outbox and (
            conn.close_after or (conn.eof and not conn.busy and not conn.inbox)
        ):
            # Asked to close, or the client is gone and everything it sent was answered
            # (an incomplete request at the end of the stream was answered as such).
            self._close(conn)
            return
        self._watch(conn)

    def _watch(self, conn: _Connection) -> None:
        """Watch the socket for what the connection waits for: more bytes, room to send."""
        if conn.sock.fileno() < 0:
            return
        # A connection waiting out its latency is read on (a reset is noticed) until a client
        # pipelining without end has sent a lot: then the kernel holds the rest back.
        held_back = conn.busy and len(conn.inbox) >= _INBOX_WHILE_BUSY
        events = (0 if conn.eof or held_back else selectors.EVENT_READ) | (
            selectors.EVENT_WRITE if conn.outbox else 0
        )
        if events == conn.events:
            return
        if not conn.events:
            self._selector.register(conn.sock, events, conn)
        elif not events:
            self._selector.unregister(conn.sock)
        else:
            self._selector.modify(conn.sock, events, conn)
        conn.events = events

    def _close_idle(self) -> None:
        cutoff = time.monotonic() - _IDLE_CONNECTION_SECONDS
        for conn in list(self._connections.values()):
            if not conn.busy and not conn.outbox and conn.last_active < cutoff:
                self._close(conn)

    def _close(self, conn: _Connection) -> None:
        fileno = conn.sock.fileno()
        if fileno < 0:
            return
        self._connections.pop(fileno, None)
        if conn.events:
            self._selector.unregister(conn.sock)
            conn.events = 0
        with contextlib.suppress(OSError):
            conn.sock.close()


def _written(handler: _RequestHandler) -> bytes:
    """What the handler wrote so far (its wfile is a BytesIO)."""
    wfile = handler.wfile
    assert isinstance(wfile, io.BytesIO)
    return wfile.getvalue()


class RunningEmulator:
    """An emulator serving in a background thread; ``stop()`` (or ``with``) ends it."""

    def __init__(self, server: EmulatorHTTPServer, thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread
        self._stopped = False

    @property
    def emulator(self) -> Emulator:
        """The state behind the server, for in-process inspection and control."""
        return self._server.emulator

    @property
    def host(self) -> str:
        return self._server.server_name

    @property
    def port(self) -> int:
        return self._server.server_port

    @property
    def url(self) -> str:
        """e.g. ``http://127.0.0.1:8765`` (no trailing slash)."""
        return self._server.url

    def stop(self) -> None:
        """Stop serving, end open connections and wait for the serving thread; idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self._server.shutdown()
        self._server.server_close()  # closes the connections too
        self._thread.join(timeout=5)

    def __enter__(self) -> RunningEmulator:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"RunningEmulator(url={self.url!r})"


def start_in_thread(
    host: str = DEFAULT_HOST,
    port: int = 0,
    *,
    api_key: str | None = None,
    visibility_timeout: float = DEFAULT_VISIBILITY_TIMEOUT,
    publish_price_usd: str | Decimal = DEFAULT_PUBLISH_PRICE_USD,
    clock: EmulatorClock | None = None,
    verbose: bool = False,
) -> RunningEmulator:
    """Serve a fresh emulator from a daemon thread; port 0 picks a free port (see ``.url``)."""
    emulator = Emulator(
        api_key=api_key,
        visibility_timeout=visibility_timeout,
        publish_price_usd=publish_price_usd,
        clock=clock,
    )
    server = EmulatorHTTPServer((host, port), emulator, verbose=verbose)
    thread = threading.Thread(
        target=server.serve_forever,
        kwargs={"poll_interval": 0.05},
        name=f"infrai-emulator-{server.server_port}",
        daemon=True,
    )
    thread.start()
    return RunningEmulator(server, thread)


def serve(
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    api_key: str | None = None,
    visibility_timeout: float = DEFAULT_VISIBILITY_TIMEOUT,
    *,
    publish_price_usd: str | Decimal = DEFAULT_PUBLISH_PRICE_USD,
    verbose: bool = False,
    out: TextIO | None = None,
) -> None:
    """Serve in the foreground until SIGINT or SIGTERM.

    The URL is the first line written to ``out`` (stdout), flushed at once, because callers
    that start the emulator with port 0 read it to learn the port.
    """
    stop = threading.Event()
    running = start_in_thread(
        host,
        port,
        api_key=api_key,
        visibility_timeout=visibility_timeout,
        publish_price_usd=publish_price_usd,
        verbose=verbose,
    )
    with running, _stop_on_signals(stop):
        print(running.url, file=out or sys.stdout, flush=True)
        auth = "only the --api-key token" if api_key else "any bearer token"
        print(f"infrai emulator: serving {running.url}, accepting {auth}", file=sys.stderr)
        while not stop.wait(timeout=1.0):
            pass


@contextlib.contextmanager
def _stop_on_signals(stop: threading.Event) -> Iterator[None]:
    """Turn SIGINT/SIGTERM into a clean stop; only the main thread may install handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handle(_signum: int, _frame: FrameType | None) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError("must be a number of seconds above 0")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError("must be from 0 to 65535 (0 picks a free port)")
    return value


def build_parser(prog: str = "infrai-jobs emulator") -> argparse.ArgumentParser:
    """The command line of ``infrai-jobs emulator`` and ``python -m infrai_local.emulator``."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Serve a local Infrai queue (the INFRAI_API.md contract) until Ctrl-C. "
        "Prints the URL it serves on as its first line.",
    )
    parser.add_argument("--host", default=DEFAULT_HOST, help="default: %(default)s")
    parser.add_argument(
        "--port",
        type=_port,
        default=DEFAULT_PORT,
        help="0 picks a free port (default: %(default)s)",
    )
    parser.add_argument(
        "--api-key", default=None, help="accept only this bearer token (default: any non-empty)"
    )
    parser.add_argument(
        "--visibility-timeout",
        type=_positive_seconds,
        default=DEFAULT_VISIBILITY_TIMEOUT,
        metavar="SECONDS",
        help="visibility timeout of new queues (default: %(default)g)",
    )
    parser.add_argument(
        "--publish-price",
        default=DEFAULT_PUBLISH_PRICE_USD,
        metavar="USD",
        help="per-message publish price that discovery reports (default: %(default)s)",
    )
    parser.add_argument("--verbose", action="store_true", help="log every request to stderr")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parse ``argv`` (without the program name), serve, exit 0 on a signal."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        price = _price_text(args.publish_price)
    except ApiError as error:
        parser.error(f"--publish-price: {error.message}")
    try:
        serve(
            args.host,
            args.port,
            api_key=args.api_key,
            visibility_timeout=args.visibility_timeout,
            publish_price_usd=price,
            verbose=args.verbose,
        )
    except OSError as error:
        print(
            f"infrai emulator: cannot serve on {args.host}:{args.port}: {error.strerror or error}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
