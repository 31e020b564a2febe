"""The settings table: each setting declared once (in config/settings.py), as a dataclass field
``setting(variable, default, parse)``: its environment variable, its value when unset, and how
its text becomes the value (or a ``ConfigurationError`` naming the variable)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

from infrai_jobs.errors import ConfigurationError

_T = TypeVar("_T")
TRUE_WORDS = ("1", "true", "yes", "on")


@dataclass(frozen=True, slots=True)
class Setting:
    """One row, as ``settings_table`` reads it back from a field."""

    variable: str
    field_name: str
    default: Any
    parse: Parse


class Reading:
    """One ``from_env`` call. A row's parse may need another field's value (the DLQ's default
    follows the queue; a URL's check depends on ``INFRAI_ALLOW_PLAIN_HTTP``), so each field is
    read when first asked for, once, whatever the table's order."""

    def __init__(self, env: Mapping[str, str], table: Sequence[Setting]) -> None:
        self.env = env
        self._rows = {row.field_name: row for row in table}
        self._values: dict[str, Any] = {}

    def value(self, field_name: str) -> Any:
        if field_name not in self._values:
            row = self._rows[field_name]
            self._values[field_name] = row.parse(row, self.env.get(row.variable), self)
        return self._values[field_name]


# How a row's text (None when its variable is unset) becomes its field's value.
Parse = Callable[[Setting, "str | None", Reading], Any]

_VARIABLE = "infrai_jobs.variable"
_PARSE = "infrai_jobs.parse"


def setting(variable: str, default: _T, parse: Parse, *, secret: bool = False) -> _T:
    """A settings field read from ``variable``; ``secret`` keeps its value out of ``repr``."""
    return field(default=default, repr=not secret, metadata={_VARIABLE: variable, _PARSE: parse})


def settings_table(kind: type[Any]) -> tuple[Setting, ...]:
    """``kind``'s rows, one per field declared with ``setting``, in field order."""
    return tuple(
        Setting(f.metadata[_VARIABLE], f.name, f.default, f.metadata[_PARSE])
        for f in fields(kind)
        if _VARIABLE in f.metadata
    )


def parse_text(row: Setting, raw: str | None, reading: Reading) -> str:
    return row.default if raw is None else raw.strip()


def parse_verbatim(row: Setting, raw: str | None, reading: Reading) -> str:
    """A secret, used exactly as given (a key or a password may end in a space)."""
    return row.default if raw is None else raw


def parse_bool(row: Setting, raw: str | None, reading: Reading) -> bool:
    if raw is None or raw.strip() == "":
        return bool(row.default)
    lowered = raw.strip().lower()
    if lowered in TRUE_WORDS:
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ConfigurationError(f"{row.variable}={raw!r} is not a boolean (use true or false)")


def parse_int(
    *,
    minimum: int,
    maximum: int | None = None,
    why_maximum: str = "",
    check: Callable[[str, int], None] | None = None,
) -> Parse:
    """An integer of at least ``minimum`` and at most ``maximum`` (``why_maximum`` ends that
    refusal); ``check`` refuses what else a row rules out."""

    def parse(row: Setting, raw: str | None, reading: Reading) -> int:
        if raw is None or raw.strip() == "":
            return int(row.default)
        try:
            value = int(raw)
        except ValueError:
            raise ConfigurationError(f"{row.variable}={raw!r} is not an integer") from None
        if value < minimum:
            raise ConfigurationError(f"{row.variable}={value} is below the minimum of {minimum}")
        if maximum is not None and value > maximum:
            raise ConfigurationError(f"{row.variable}={value} is above {maximum}{why_maximum}")
        if check is not None:
            check(row.variable, value)
        return value

    return parse


def parse_choice(choices: Sequence[str], *, lower: bool = False, why: str = "") -> Parse:
    """One of ``choices`` (``lower``: compared lower-cased); ``why`` ends the refusal."""

    def parse(row: Setting, raw: str | None, reading: Reading) -> str:
        text = (raw or "").strip()
        choice = (text.lower() if lower else text) or row.default
        if choice not in choices:
            raise ConfigurationError(
                f"{row.variable}={choice!r} is not one of {', '.join(choices)}{why}"
            )
        return str(choice)

    return parse
