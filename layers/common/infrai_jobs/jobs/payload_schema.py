"""Payload schemas: which fields a job's payload carries, their JSON types (named by the Python
types ``json.loads`` gives; ``bool`` is never an ``int``) and which are required; the rules are in
docs/payload-schemas.md. Undeclared fields pass unchecked: a rolling deploy must not turn payloads
with a new field into dead letters."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Self, TypeAlias

from infrai_jobs.errors import ConfigurationError, InvalidPayload
from infrai_jobs.jobs.keys import ENVELOPE_PREFIX

# A JSON type by its Python type (``str``, ``int``, ...), or a tuple of them for any one.
FieldType: TypeAlias = type[object] | tuple[type[object], ...]


@dataclass(frozen=True, slots=True)
class Field:
    """A declared field other than "required, of this type": ``Field(str, required=False)``."""

    type: FieldType
    required: bool = True


# What ``fields=`` maps a field name to: a type (required), a tuple of types, or a ``Field``.
FieldSpec: TypeAlias = FieldType | Field

# Declared Python type -> (what the messages call it, the Python values that are one), in the
# order ``json_type_of`` tries them.
_JSON_TYPES: Final[dict[type[object], tuple[str, tuple[type[object], ...]]]] = {
    bool: ("a boolean", (bool,)),
    int: ("an integer", (int,)),
    float: ("a number", (int, float)),
    str: ("a string", (str,)),
    dict: ("an object", (Mapping,)),
    list: ("an array", (list, tuple)),
}
# What a key can be built from (keys.natural_key): an identity field may be declared only so.
_KEYABLE: Final = frozenset({str, int})


@dataclass(frozen=True, slots=True)
class DeclaredField:
    name: str
    required: bool
    # The Python types that are values of this field; None when any value is (untyped).
    accepted: tuple[type[object], ...] | None
    # "an integer", "a string or an integer": for messages.
    expected: str
    declared_types: frozenset[type[object]] = frozenset()


@dataclass(frozen=True, slots=True)
class PayloadSchema:
    """A job's declared payload fields. The empty schema checks nothing."""

    fields: tuple[DeclaredField, ...] = ()

    @classmethod
    def declare(cls, job: str, fields: Mapping[str, FieldSpec]) -> PayloadSchema:
        """The schema ``fields`` describes, or a ``ConfigurationError`` at registration."""
        if not isinstance(fields, Mapping):
            raise ConfigurationError(
                f"job {job!r}: fields must map field names to types, e.g. "
                f"{{'refund_id': str}} (got {type(fields).__name__})"
            )
        return cls(tuple(_declared(job, name, spec) for name, spec in fields.items()))

    @property
    def required(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields if f.required)

    def requiring(self, job: str, identity: Sequence[str], required: Sequence[str]) -> Self:
        """This schema with ``identity`` and ``required`` required too (untyped where undeclared).
        A ``ConfigurationError`` refuses one declared optional, or an identity field declared of
        a type no key can be built from."""
        declared = {f.name: f for f in self.fields}
        added: list[DeclaredField] = []
        for name in dict.fromkeys((*identity, *required)):
            if (found := declared.get(name)) is None:
                added.append(DeclaredField(name, required=True, accepted=None, expected="any"))
            elif not found.required:
                raise ConfigurationError(
                    f"job {job!r}: field {name!r} is declared optional but is an identity or "
                    "required field"
                )
            elif name in identity and not found.declared_types <= _KEYABLE:
                raise ConfigurationError(
                    f"job {job!r}: identity field {name!r} is declared {found.expected}, but a key "
                    "is built only from strings and integers: declare it str, int or (str, int)"
                )
        return type(self)((*self.fields, *added)) if added else self

    def check(self, job: str, payload: Mapping[str, object]) -> None:
        """``InvalidPayload`` naming every missing required field, or else every mistyped one."""
        missing: list[str] = []
        wrong: list[str] = []
        for f in self.fields:
            value = payload.get(f.name)
            if value is None or (f.required and isinstance(value, str) and not value):
                if f.required:
                    missing.append(f.name)
                continue
            if f.accepted is not None and not _is_one_of(value, f.accepted):
                wrong.append(f"field {f.name!r} must be {f.expected}, got {json_type_of(value)}")
        if missing:
            raise InvalidPayload(f"job {job!r} is missing field(s): {', '.join(missing)}")
        if wrong:
            raise InvalidPayload(f"job {job!r}: {'; '.join(wrong)}")


def json_type_of(value: object) -> str:
    """The JSON type a value would be sent as, for messages ("integer", "null", ...)."""
    return json_kind(value).split()[-1]


def json_kind(value: object) -> str:
    """``json_type_of`` with its article: "an integer", "null"."""
    if value is None:
        return "null"
    for expected, accepted in _JSON_TYPES.values():
        if _is_one_of(value, accepted):
            return expected
    return type(value).__name__


def _is_one_of(value: object, accepted: tuple[type[object], ...]) -> bool:
    # bool subclasses int: True is an integer only to Python, never to JSON.
    if isinstance(value, bool):
        return bool in accepted
    return isinstance(value, accepted)


def _declared(job: str, name: object, spec: object) -> DeclaredField:
    if not isinstance(name, str) or not name:
        raise ConfigurationError(f"job {job!r}: field names must be non-empty strings ({name!r})")
    if name.startswith(ENVELOPE_PREFIX) or name == "job":
        raise ConfigurationError(
            f"job {job!r}: field {name!r} cannot be declared: 'job' and names starting with "
            f"{ENVELOPE_PREFIX!r} (the envelope) are never part of a job's payload schema"
        )
    required = True
    if isinstance(spec, Field):
        if not isinstance(spec.required, bool):
            raise ConfigurationError(f"job {job!r}: field {name!r}: required must be True or False")
        required, spec = spec.required, spec.type
    types = spec if isinstance(spec, tuple) else (spec,)
    if not types or not all(isinstance(t, type) and t in _JSON_TYPES for t in types):
        raise ConfigurationError(
            f"job {job!r}: field {name!r} has type {spec!r}; declare one of str, int, float, "
            "bool, dict, list, a tuple of them, or Field(type, required=False)"
        )
    unique = tuple(dict.fromkeys(types))
    accepted = tuple(dict.fromkeys(a for t in unique for a in _JSON_TYPES[t][1]))
    expected = " or ".join(_JSON_TYPES[t][0] for t in unique)
    return DeclaredField(name, required, accepted, expected, frozenset(unique))
