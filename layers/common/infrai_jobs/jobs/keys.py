"""Idempotency keys and payload fingerprints: pure functions of the work, no I/O, by the scheme
(version ``KEY_SCHEME_VERSION``) of docs/design.md's "Idempotency keys" (``derive_key``); a
natural key is byte for byte the notes' Node worker's, so both can share one ledger. A change that
gives an existing payload another key is a new scheme version: rows under the old keys would stop
matching, and their redeliveries would run twice."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Final, TypeAlias, cast

import rfc8785

from infrai_jobs.errors import ConfigurationError, KeyDerivationError

KEY_SCHEME_VERSION: Final = 1

PRODUCER_KEY_FIELD: Final = "_idempotency_key"
ENVELOPE_PREFIX: Final = "_"
CONTENT_KEY_PREFIX: Final = "sha256:"
# A key is a text primary key and in every log line about its message: 512 is far above any
# natural key and far below the btree entry limit.
MAX_KEY_LENGTH: Final = 512

# Job name -> the payload fields that identify one unit of that job's work, in key order.
KeyRules: TypeAlias = Mapping[str, Sequence[str]]
NO_KEY_RULES: Final[KeyRules] = MappingProxyType({})

# JSON numbers are doubles: beyond this an integer names no one value (Node has rounded it).
_SAFE_INTEGER_MAX: Final = 2**53 - 1


def derive_key(payload: object, key_rules: KeyRules) -> str:
    """The idempotency key of one message body under ``key_rules``, or ``KeyDerivationError``
    saying why none can be derived."""
    body = _require_object(payload)
    if PRODUCER_KEY_FIELD in body:
        key = body[PRODUCER_KEY_FIELD]
        if not isinstance(key, str) or not key.strip():
            raise KeyDerivationError(
                f"{PRODUCER_KEY_FIELD} must be a non-empty string (got {_describe(key)})"
            )
        return _checked_key(key, PRODUCER_KEY_FIELD)
    job = body.get("job")
    if isinstance(job, str) and job in key_rules:
        return natural_key(job, key_rules[job], body)
    return CONTENT_KEY_PREFIX + payload_fingerprint(body)


def natural_key(job: str, identity_fields: Sequence[str], payload: Mapping[str, object]) -> str:
    """``{job}:{value}[:{value}...]`` from the payload's identity fields, in rule order.
    Only the last may contain ``:``: with one field that keeps the Node worker's plain
    concatenation, and with several it keeps ``a:b`` + ``c`` apart from ``a`` + ``b:c``."""
    check_key_rule(job, identity_fields)
    parts = [job]
    for position, field in enumerate(identity_fields, start=1):
        if field not in payload:
            raise KeyDerivationError(f"job {job!r} needs field {field!r} to derive its key")
        part = _identity_part(job, field, payload[field])
        if ":" in part and position < len(identity_fields):
            raise KeyDerivationError(
                f"job {job!r}: field {field!r} must not contain ':' (it is not the last part "
                "of the key, so the key would be ambiguous)"
            )
        parts.append(part)
    return _checked_key(":".join(parts), f"the key of job {job!r}")


def identity_from_key(job: str, identity_fields: Sequence[str], key: str) -> dict[str, str] | None:
    """The identity fields (as strings) a natural key of ``job`` spells, else None: the inverse
    of ``natural_key`` up to type (split from the left: only the last field may hold ``:``)."""
    prefix = job + ":"
    if not identity_fields or not key.startswith(prefix):
        return None
    parts = key[len(prefix) :].split(":", len(identity_fields) - 1)
    if len(parts) != len(identity_fields) or not all(parts):
        return None
    return dict(zip(identity_fields, parts, strict=True))


def payload_fingerprint(payload: object) -> str:
    return hashlib.sha256(canonical_json(work_fields(payload))).hexdigest()


def work_fields(payload: object) -> dict[str, object]:
    body = _require_object(payload)
    return {
        name: value
        for name, value in body.items()
        if not (isinstance(name, str) and name.startswith(ENVELOPE_PREFIX))
    }


def canonical_json(value: object) -> bytes:
    """RFC 8785 (JCS) canonical JSON of ``value``; ``KeyDerivationError`` for anything JSON
    cannot carry exactly, so that two payloads never meet in one lossy serialisation."""
    if (plain := _plain_canonical_json(value)) is not None:
        return plain
    try:
        return rfc8785.dumps(value)  # type: ignore[arg-type]  # it refuses what JSON cannot carry
    except rfc8785.IntegerDomainError as exc:
        raise KeyDerivationError(
            "payload holds an integer outside +/-(2**53 - 1), which a JSON number cannot "
            "represent exactly; send it as a string"
        ) from exc
    except rfc8785.FloatDomainError as exc:
        raise KeyDerivationError(
            "payload holds NaN or Infinity, which JSON cannot represent"
        ) from exc
    except UnicodeError as exc:
        # rfc8785 lets a lone surrogate in an object key escape as a bare UnicodeEncodeError.
        raise KeyDerivationError(
            "payload holds text that is not valid Unicode (a lone surrogate)"
        ) from exc
    except ValueError as exc:
        # CanonicalizationError (non-string keys, bytes, sets...) and int-to-text's refusal.
        raise KeyDerivationError(f"payload is not representable as canonical JSON: {exc}") from exc
    except RecursionError as exc:
        raise KeyDerivationError("payload is nested too deeply to canonicalise") from exc


_PLAIN_ENCODER: Final = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _plain_canonical_json(value: object) -> bytes | None:
    """The canonical JSON of plain work, written by the stdlib's C encoder; else None. Plain:
    objects with ASCII names, arrays, strings, integers within +/-(2**53 - 1), booleans and nulls,
    at most 32 levels deep. For these, sorted ``json`` without spaces writes the very bytes RFC 8785
    prescribes (ASCII names sort alike by code point and by UTF-16 unit; strings escape alike) in
    half ``rfc8785``'s time, for every message. A test compares the two."""
    if not _is_plain(value, 32):
        return None
    text = _PLAIN_ENCODER.encode(value)
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        return None  # a lone surrogate: rfc8785 refuses it by name


def _is_plain(value: object, depth: int) -> bool:
    # Exact types: an int subclass (an IntEnum, say) takes the slow path, not a bet on encoders.
    kind = type(value)
    if kind is str or kind is bool or value is None:
        return True
    if kind is int:
        return -_SAFE_INTEGER_MAX <= cast(int, value) <= _SAFE_INTEGER_MAX
    if depth == 0:
        return False
    if kind is dict:
        return all(
            type(name) is str and name.isascii() and _is_plain(item, depth - 1)
            for name, item in cast(dict[object, object], value).items()
        )
    if kind is list:
        return all(_is_plain(item, depth - 1) for item in cast(list[object], value))
    return False


def _require_object(payload: object) -> dict[str, object]:
    if not isinstance(payload, Mapping):
        raise KeyDerivationError(f"payload is not a JSON object (got {type(payload).__name__})")
    # A copy as a plain dict: rfc8785 serialises dicts only, and callers may hold other Mappings.
    return dict(payload)


def _identity_part(job: str, field: str, value: object) -> str:
    # bool is an int to Python, but JavaScript would render it "true": refuse rather than differ.
    if isinstance(value, int) and not isinstance(value, bool):
        if abs(value) > _SAFE_INTEGER_MAX:
            raise KeyDerivationError(
                f"job {job!r}: field {field!r} is an integer outside +/-(2**53 - 1); "
                "send it as a string"
            )
        return str(value)
    if isinstance(value, str) and value:
        return value
    raise KeyDerivationError(
        f"job {job!r}: field {field!r} must be a non-empty string or an integer "
        f"(got {_describe(value)})"
    )


def check_key_rule(job: str, identity_fields: Sequence[str]) -> None:
    # A bare string is a Sequence[str] too, and would key by its characters.
    if isinstance(identity_fields, str) or not identity_fields:
        raise ConfigurationError(
            f"the key rule for job {job!r} must list one or more field names, "
            f"e.g. ('invoice_id',) (got {identity_fields!r})"
        )
    if not job or ":" in job:
        raise ConfigurationError(
            f"job name {job!r} cannot carry a key rule: it must be non-empty and free of ':'"
        )


# What terminals, pages or PostgreSQL would act on (a zero-width joiner stays: emoji need it).
_UNFIT_CHARACTERS: Final = re.compile(
    "[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff]"
)


def _checked_key(key: str, source: str) -> str:
    if len(key) > MAX_KEY_LENGTH:
        raise KeyDerivationError(f"{source} is longer than {MAX_KEY_LENGTH} characters")
    if unfit := _UNFIT_CHARACTERS.search(key):
        raise KeyDerivationError(
            f"{source} contains U+{ord(unfit.group()):04X}: a key takes no control character, "
            "bidi mark, override or isolate, or lone surrogate"
        )
    return key


def _describe(value: object) -> str:
    if isinstance(value, str):
        return "an empty string" if not value else "a blank string"
    return "null" if value is None else type(value).__name__
