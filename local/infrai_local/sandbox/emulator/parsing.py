"""Reading /v1 and /_emulator request bodies: a JSON object and its fields, or a 400 that says
what is wrong."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from infrai_local.sandbox.queue_model import JsonObject, invalid


def _reject_constant(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


def parse_json_object(raw: bytes) -> JsonObject:
    """A request body as a JSON object, or a 400 that says what is wrong with it."""
    if not raw.strip():
        raise invalid("request body is empty; expected a JSON object")
    try:
        document = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise invalid("request body is not valid JSON") from None
    if not isinstance(document, dict):
        raise invalid("request body must be a JSON object")
    return document


def required_str(document: Mapping[str, Any], key: str) -> str:
    if key not in document:
        raise invalid(f"missing field {key!r}")
    value = document[key]
    if not isinstance(value, str) or not value:
        raise invalid(f"{key} must be a non-empty string")
    return value


def optional_str(document: Mapping[str, Any], key: str) -> str | None:
    if document.get(key) is None:
        return None
    return required_str(document, key)


def optional_int(document: Mapping[str, Any], key: str, default: int) -> int:
    value = optional_integer(document, key)
    return default if value is None else value


def optional_integer(document: Mapping[str, Any], key: str) -> int | None:
    value = document.get(key)
    if value is None:
        return None
    # bool is an int subclass, but ``true`` is not a count.
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(f"{key} must be an integer")
    return value


def optional_number(document: Mapping[str, Any], key: str, default: float) -> float:
    value = document.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise invalid(f"{key} must be a number")
    if not math.isfinite(value):
        raise invalid(f"{key} must be finite")
    return float(value)


def reject_unknown_fields(document: Mapping[str, Any], known: frozenset[str]) -> None:
    unknown = sorted(set(document) - known)
    if unknown:
        raise invalid(f"unknown fields {unknown}; known: {sorted(known)}")
