"""The routes: each /v1 call and each /_emulator control, from request bytes to answer data."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final
from urllib.parse import unquote

from infrai_local.sandbox.emulator.parsing import (
    optional_int,
    optional_number,
    optional_str,
    parse_json_object,
    reject_unknown_fields,
    required_str,
)
from infrai_local.sandbox.emulator.state import Emulator, FaultConfig
from infrai_local.sandbox.queue_model import JsonObject, invalid

# A route handler gets the emulator, the raw body and the path parameter (stats' queue name).
RouteHandler = Callable[[Emulator, bytes, str], JsonObject]


def _api_create(emulator: Emulator, raw: bytes, _param: str) -> JsonObject:
    document = parse_json_object(raw)
    return emulator.create_queue(
        required_str(document, "name"),
        queue_type=optional_str(document, "type") or "standard",
        dlq=optional_str(document, "dlq"),
    )


def _api_publish(emulator: Emulator, raw: bytes, _param: str) -> JsonObject:
    document = parse_json_object(raw)
    queue = required_str(document, "queue")
    if "body" not in document:
        raise invalid("missing field 'body'")
    if not isinstance(document["body"], dict):
        raise invalid("body must be a JSON object")
    delay = optional_int(document, "delay_seconds", 0)
    return {"message_id": emulator.publish(queue, document["body"], delay_seconds=delay)}


def _api_consume(emulator: Emulator, raw: bytes, _param: str) -> JsonObject:
    document = parse_json_object(raw)
    queue = required_str(document, "queue")
    max_messages = optional_int(document, "max_messages", 1)
    return {"items": emulator.consume(queue, max_messages), "next_cursor": None}


def _api_ack(emulator: Emulator, raw: bytes, _param: str) -> JsonObject:
    document = parse_json_object(raw)
    queue = required_str(document, "queue")
    return emulator.ack(queue, required_str(document, "receipt_handle"))


def _api_stats(emulator: Emulator, _raw: bytes, queue: str) -> JsonObject:
    return emulator.stats(queue)


def _api_discovery(emulator: Emulator, _raw: bytes, _param: str) -> JsonObject:
    return emulator.discovery()


def _control_clock(emulator: Emulator, raw: bytes, _param: str) -> JsonObject:
    document = parse_json_object(raw)
    reject_unknown_fields(document, frozenset({"advance_seconds"}))
    if "advance_seconds" not in document:
        raise invalid("missing field 'advance_seconds'")
    return emulator.advance_clock(optional_number(document, "advance_seconds", 0.0))


def _control_clock_read(emulator: Emulator, _raw: bytes, _param: str) -> JsonObject:
    return emulator.advance_clock(0.0)


def _control_faults(emulator: Emulator, raw: bytes, _param: str) -> JsonObject:
    emulator.set_faults(FaultConfig.from_json(parse_json_object(raw)))
    return emulator.faults.as_json()


def _control_faults_read(emulator: Emulator, _raw: bytes, _param: str) -> JsonObject:
    return emulator.faults.as_json()


def _control_price(emulator: Emulator, raw: bytes, _param: str) -> JsonObject:
    document = parse_json_object(raw)
    reject_unknown_fields(document, frozenset({"publish_price_usd"}))
    emulator.publish_price_usd = required_str(document, "publish_price_usd")
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
CONTROL_ENDPOINTS: Final[Mapping[str, Endpoint]] = {
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
