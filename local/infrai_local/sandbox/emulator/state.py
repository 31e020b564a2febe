"""The emulator's state: Infrai's queue (``infrai_local.sandbox.queue_model``) plus what only the
emulator has: a clock that jumps forward, injected faults, request counters, an API key and the
price discovery reports. All behind locks; the HTTP layer only parses and formats.
"""

from __future__ import annotations

import math
import random
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any, Final

from infrai_jobs.queue_contract import DEFAULT_VISIBILITY_TIMEOUT_SECONDS
from infrai_local.sandbox.emulator.parsing import (
    optional_int,
    optional_integer,
    optional_number,
    reject_unknown_fields,
)
from infrai_local.sandbox.queue_model import (
    DEFAULT_PUBLISH_PRICE_USD,
    JsonObject,
    QueueModel,
    format_timestamp,
    invalid,
    json_number,
)

DEFAULT_VISIBILITY_TIMEOUT: Final = float(DEFAULT_VISIBILITY_TIMEOUT_SECONDS)
MAX_LATENCY_MS: Final = 60_000.0
# The /v1 route names, as used in fault "routes" lists and the request counters.
API_ROUTES: Final = ("create", "publish", "consume", "ack", "stats", "discovery")


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
            raise invalid("advance_seconds must be a finite number >= 0")
        with self._lock:
            self._offset += seconds
            return self._offset

    def reset(self) -> None:
        """Back to real time."""
        with self._lock:
            self._offset = 0.0


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
            raise invalid(f"latency_ms must be a number from 0 to {MAX_LATENCY_MS:g}")
        for name in ("error_rate", "rate_limit_rate", "drop_response_rate"):
            if not 0 <= getattr(self, name) <= 1:
                raise invalid(f"{name} must be a probability from 0 to 1")
        if self.retry_after_seconds < 0:
            raise invalid("retry_after_seconds must be an integer >= 0")
        unknown = sorted((self.routes or frozenset()) - set(API_ROUTES))
        if unknown:
            raise invalid(f"unknown routes {unknown}; known: {list(API_ROUTES)}")

    def applies_to(self, route: str) -> bool:
        """Whether requests to this /v1 route are eligible for faults."""
        return self.routes is None or route in self.routes

    def as_json(self) -> JsonObject:
        """The configuration as the faults endpoint echoes it."""
        return {
            "latency_ms": json_number(self.latency_ms),
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
        reject_unknown_fields(document, _FAULT_FIELDS)
        routes = document.get("routes")
        if routes is not None and not (
            isinstance(routes, list) and all(isinstance(r, str) for r in routes)
        ):
            raise invalid("routes must be a list of route names")
        return cls(
            latency_ms=optional_number(document, "latency_ms", 0.0),
            error_rate=optional_number(document, "error_rate", 0.0),
            rate_limit_rate=optional_number(document, "rate_limit_rate", 0.0),
            drop_response_rate=optional_number(document, "drop_response_rate", 0.0),
            retry_after_seconds=optional_int(document, "retry_after_seconds", 1),
            seed=optional_integer(document, "seed"),
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
    """The queue model plus the emulator's own state; the HTTP layer only parses and formats.

    The public methods mirror the /v1 calls and the control surface, so tests can also drive
    the emulator in-process.
    """

    def __init__(
        self,
        *,
        api_key: str | None = None,
        visibility_timeout: float = DEFAULT_VISIBILITY_TIMEOUT,
        publish_price_usd: str | Decimal = DEFAULT_PUBLISH_PRICE_USD,
        clock: EmulatorClock | None = None,
    ) -> None:
        self._lock = threading.Lock()
        self._api_key = api_key or None
        self._default_price = price_text(publish_price_usd)
        self._price = self._default_price
        self._clock = clock or EmulatorClock()
        self._model = QueueModel(
            visibility_timeout=visibility_timeout,
            monotonic=self._clock.monotonic,
            wall=self._clock.wall,
        )
        self._faults = FaultConfig()
        self._rng = random.Random()
        self._requests: Counter[str] = Counter()
        self._connections_accepted = 0
        self._faults_injected: Counter[str] = Counter()

    def __repr__(self) -> str:
        # Never the API key: reprs end up in logs and assertion messages.
        auth = "required" if self._api_key else "any bearer token"
        return f"Emulator(queues={len(self._model.names())}, api_key={auth})"

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
        return self._model.create(name, queue_type, dlq)

    def publish(self, queue: str, body: JsonObject, delay_seconds: int = 0) -> str:
        """Add a new message (always a new id: no producer-side deduplication)."""
        if not isinstance(body, dict):
            raise invalid("body must be a JSON object")
        return self._model.publish(queue, body, delay_seconds)

    def consume(self, queue: str, max_messages: int = 1) -> list[JsonObject]:
        """Deliver up to ``min(max_messages, 10)`` available messages, oldest first."""
        return self._model.consume(queue, max_messages)

    def ack(self, queue: str, receipt_handle: str) -> JsonObject:
        """Delete a held message; 404 ``QUEUE_MESSAGE_NOT_FOUND`` once it is gone."""
        return self._model.ack(queue, receipt_handle)

    def stats(self, queue: str) -> JsonObject:
        """The counters of one queue, in the notes' field order."""
        return self._model.stats(queue)

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
        text = price_text(price)
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
        self._model.clear()
        with self._lock:
            self._faults = FaultConfig()
            self._rng = random.Random()
            self._requests.clear()
            self._connections_accepted = 0
            self._faults_injected.clear()
            self._price = self._default_price
            self._clock.reset()

    def snapshot(self) -> JsonObject:
        """Everything a test or a chaos report may want to look at, in one JSON object."""
        queues = self._model.summaries()
        with self._lock:
            return {
                "clock": {
                    "offset_seconds": self._clock.offset,
                    "now": format_timestamp(self._clock.wall()),
                },
                "queues": queues,
                "requests": dict(self._requests),
                "connections_accepted": self._connections_accepted,
                "faults": self._faults.as_json(),
                "faults_injected": dict(self._faults_injected),
                "publish_price_usd": self._price,
                "auth": "api_key" if self._api_key else "any_bearer_token",
            }

    def _count_faults(self, decision: FaultDecision) -> None:
        if decision.latency_seconds > 0:
            self._faults_injected["latency"] += 1
        for name in ("error", "rate_limited"):
            if getattr(decision, name):
                self._faults_injected[name] += 1


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


def price_text(price: str | Decimal) -> str:
    """A price as a plain decimal string (never ``2E-5``), validated."""
    try:
        value = Decimal(price)
    except (InvalidOperation, TypeError, ValueError):
        raise invalid("publish_price_usd must be a decimal string like '0.00002'") from None
    if not value.is_finite() or value < 0:
        raise invalid("publish_price_usd must be a finite decimal >= 0")
    return format(value, "f")
