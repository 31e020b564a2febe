"""Flow policies: the ``JOB_POLICIES`` document (docs/flow-control.md: per job, a ``retry``,
``rate`` or ``concurrency`` section replaces the code's whole, ``null`` turns one off, anything
malformed is a ``ConfigurationError`` naming the job and the field), which policy is in force,
back-off delays, and the value of a concurrency key."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Collection, Iterable, Mapping
from typing import Any

from infrai_jobs.errors import ConfigurationError, InvalidPayload
from infrai_jobs.jobs.keys import canonical_json
from infrai_jobs.jobs.payload_schema import json_kind
from infrai_jobs.jobs.policy import ConcurrencyLimit, JobPolicy, RateLimit, RetryPolicy
from infrai_jobs.jobs.registry import JobDefinition, Payload, did_you_mean

SETTING = "JOB_POLICIES"

# A section's fields are its dataclass's.
_SECTIONS: dict[str, type] = {
    "retry": RetryPolicy,
    "rate": RateLimit,
    "concurrency": ConcurrencyLimit,
}


def parse_job_policies(text: str | None, known_jobs: Iterable[str]) -> dict[str, JobPolicy]:
    """The ``JOB_POLICIES`` document as overrides by job name; empty text is no override."""
    if text is None or not text.strip():
        return {}
    try:
        document = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ConfigurationError(f"{SETTING} is not valid JSON: {exc}") from None
    if not isinstance(document, dict):
        raise ConfigurationError(
            f"{SETTING} must be a JSON object keyed by job name (got {json_kind(document)})"
        )
    known = sorted(set(known_jobs))
    return {name: _parse_job(name, value, known) for name, value in document.items()}


def _parse_job(name: str, value: object, known: list[str]) -> JobPolicy:
    where = f"{SETTING}: job {name!r}"
    if name not in known:
        raise ConfigurationError(
            f"{where} is not a registered job "
            f"({did_you_mean(name, known)}registered: {', '.join(known) or 'none'})"
        )
    must_be = f"{where} must be an object with retry, rate or concurrency"
    policy = _known_fields(value, _SECTIONS, must_be, where)
    sections = {s: _parse_section(where, s, body) for s, body in policy.items() if body is not None}
    cleared = frozenset(section for section, body in policy.items() if body is None)
    return JobPolicy(**sections, cleared=cleared)


def _parse_section(where: str, section: str, body: object) -> Any:
    kind = _SECTIONS[section]
    fields = {field.name: field for field in dataclasses.fields(kind)}
    must_be = f"{where}: {section} must be an object or null"
    arguments = dict(_known_fields(body, fields, must_be, where, f"{section}."))
    for listed in ("key", "final_errors"):
        if listed in arguments:
            if not isinstance(arguments[listed], list):
                raise ConfigurationError(
                    f"{where}: {section}.{listed} must be a list of strings "
                    f"(got {json_kind(arguments[listed])})"
                )
            if not all(isinstance(item, str) for item in arguments[listed]):
                raise ConfigurationError(f"{where}: {section}.{listed} must hold only strings")
            arguments[listed] = tuple(arguments[listed])
    missing = sorted(
        name
        for name, field in fields.items()
        if name not in arguments
        and field.default is dataclasses.MISSING
        and field.default_factory is dataclasses.MISSING
    )
    if missing:
        raise ConfigurationError(f"{where}: {section}.{missing[0]} is missing")
    try:
        return kind(**arguments)
    except ConfigurationError as exc:
        raise ConfigurationError(f"{where}: {exc}") from None


def _known_fields(
    value: object, known: Collection[str], must_be: str, where: str, prefix: str = ""
) -> dict[str, Any]:
    """``value`` as an object of ``known`` fields only: the job's policy and each of its sections
    are held to the same two rules, so a misspelt field is refused, never silently ignored."""
    if not isinstance(value, dict):
        raise ConfigurationError(f"{must_be} (got {json_kind(value)})")
    if unknown := sorted(set(value) - set(known)):
        raise ConfigurationError(
            f"{where}: unknown field {prefix + unknown[0]!r} (known: {', '.join(sorted(known))})"
        )
    return value


def declared_policy(definition: JobDefinition) -> JobPolicy:
    return JobPolicy(definition.retry, definition.rate, definition.concurrency)


def effective_policy(declared: JobPolicy, override: JobPolicy | None) -> JobPolicy:
    """Each section ``override`` gives (or clears) replaces the declared one."""
    if override is None:
        return declared
    sections = {s: getattr(declared, s) for s in _SECTIONS if s not in override.cleared}
    sections |= {s: mine for s in _SECTIONS if (mine := getattr(override, s)) is not None}
    return JobPolicy(**sections)


def next_delay(policy: RetryPolicy, attempt: int) -> float:
    """Seconds to wait after attempt ``attempt`` (1 is the first run) failed (``RetryPolicy``)."""
    if attempt < 1:
        raise ValueError(f"attempts count from 1 (got {attempt})")
    first, cap = float(policy.first_delay_seconds), float(policy.max_delay_seconds)
    if policy.factor == 1:
        return first
    # The exponent past which the cap holds anyway, so a large attempt never overflows a float.
    enough = math.ceil(math.log(cap / first, policy.factor)) + 1
    return min(cap, first * float(policy.factor) ** min(attempt - 1, enough))


def is_final_error(policy: RetryPolicy, error: BaseException) -> bool:
    """Whether ``error`` is one the policy never retries: its class or a base of it is named
    (by class, by name, or by ``module.Name``) in ``final_errors``."""
    mro = type(error).__mro__
    names = {cls.__name__ for cls in mro} | {f"{cls.__module__}.{cls.__qualname__}" for cls in mro}
    return any(
        isinstance(error, entry) if isinstance(entry, type) else entry in names
        for entry in policy.final_errors
    )


def concurrency_value(limit: ConcurrencyLimit, payload: Payload) -> str:
    """The concurrency key's value for ``payload``: its ``key`` fields' values, in order, as
    canonical JSON (so ``"42"`` and ``42`` stay apart). A missing field is ``InvalidPayload``."""
    if missing := [name for name in limit.key if name not in payload]:
        raise InvalidPayload(
            f"payload has no {', '.join(repr(name) for name in missing)} for its concurrency key"
        )
    values = [payload[name] for name in limit.key]
    return canonical_json(values).decode("utf-8")


def policies_in_force(
    definitions: Iterable[JobDefinition], overrides: Mapping[str, JobPolicy]
) -> dict[str, JobPolicy]:
    """Every job that has something to enforce, with its policy in force."""
    in_force = {}
    for definition in definitions:
        policy = effective_policy(declared_policy(definition), overrides.get(definition.name))
        if not policy.is_empty:
            check_against_job(definition, policy)
            in_force[definition.name] = policy
    return in_force


def check_against_job(definition: JobDefinition, policy: JobPolicy) -> None:
    """Refuse a concurrency key naming a field the job's payload does not declare (when it
    declares its fields, with ``fields=``): it would fail every run of the job."""
    declared = [field.name for field in definition.schema.fields if field.declared_types]
    if policy.concurrency is None or not declared:
        return
    for name in policy.concurrency.key:
        if name not in declared:
            raise ConfigurationError(
                f"job {definition.name!r}: concurrency.key names {name!r}, a field its payload "
                f"does not declare ({did_you_mean(name, declared)}declared: {', '.join(declared)})"
            )
