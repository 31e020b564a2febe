"""Claims and payloads as JSON: what ``claim_history``'s and ``dead_letters``' jsonb columns
hold, and what ``--json`` prints.

Its own module so that the claims admin and the dead letters, which both write history, share
it without importing each other.
"""

from __future__ import annotations

import json
from typing import Any


def storable_json(value: Any) -> Any:
    """``value`` if PostgreSQL's jsonb can hold it, else a description of it that it can.

    jsonb refuses NUL characters and lone surrogates, both of which a JSON body may carry.
    """
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False)
        text.encode("utf-8")
    except (TypeError, ValueError, RecursionError):
        text = ""
    if text and "\\u0000" not in text:
        return value
    try:
        described = json.dumps(value, ensure_ascii=True, default=repr)
    except (TypeError, ValueError, RecursionError):
        described = f"<{type(value).__name__} that JSON cannot describe>"
    # ASCII text with every NUL and surrogate written as an escape: jsonb keeps it as text.
    return {"not_storable_as_jsonb": described}
