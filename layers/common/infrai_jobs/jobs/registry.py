"""Declaring jobs: a name, how its key is derived, its handler, and its effect class, which decides
how the claim protects the work (docs/design.md, "Effect classes"). Settings (URLs) and secrets
(credentials) are declared by name, read at the function's edge and bound (``bind_settings``)
before consuming."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from infrai_jobs.errors import ConfigurationError, KeyDerivationError, UnknownJob, unset_for_jobs
from infrai_jobs.jobs.keys import check_key_rule, derive_key, payload_fingerprint
from infrai_jobs.jobs.payload_schema import FieldSpec, PayloadSchema, json_type_of
from infrai_jobs.jobs.policy import ConcurrencyLimit, RateLimit, RetryPolicy
from infrai_jobs.jobs.probes import ProbeAnswer

if TYPE_CHECKING:
    import psycopg

Payload = Mapping[str, Any]
JsonValue = Any


class SecretValues(Mapping[str, str]):
    """A job's secrets by name. Its repr names them and shows no value, so a context or a
    derived job that ends up in a log line or an error leaks nothing."""

    def __init__(self, values: Mapping[str, str] | None = None) -> None:
        self._values = dict(values or {})

    def __getitem__(self, name: str) -> str:
        return self._values[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"SecretValues({', '.join(self._values)})"


class Effect(StrEnum):
    DATABASE = "database"
    EXTERNAL = "external"
    EXTERNAL_IDEMPOTENT = "external_idempotent"


@dataclass(frozen=True, slots=True)
class JobContext:
    """What a handler knows about the delivery it is running for."""

    idem_key: str
    job: str
    message_id: str
    delivery_count: int
    # Epoch seconds by which the invocation must have finished (the lease's basis).
    deadline: float
    # Only for DATABASE jobs: the connection whose transaction also holds the claim.
    db: psycopg.Connection[Any] | None = None
    settings: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    secrets: Mapping[str, str] = field(default_factory=SecretValues, repr=False)
    # The producer's correlation id and W3C traceparent (``correlation``), to pass downstream.
    correlation_id: str | None = None
    traceparent: str | None = None


Handler = Callable[[Payload, JobContext], JsonValue]
Probe = Callable[[Payload, JobContext], ProbeAnswer]


@dataclass(frozen=True, slots=True)
class JobDefinition:
    name: str
    effect: Effect
    handler: Handler
    # Payload fields that identify the work (``keys``); empty: the key is a content hash.
    identity: tuple[str, ...] = ()
    # Fields the handler cannot work without: ``register`` adds them, untyped, to the schema.
    required: tuple[str, ...] = ()
    schema: PayloadSchema = field(default_factory=PayloadSchema)
    settings: tuple[str, ...] = ()
    secrets: tuple[str, ...] = ()
    # Asks the provider about a stuck claim (``probes``); only for the external effect classes.
    probe: Probe | None = None
    # Flow control, as declared in code (``JOB_POLICIES`` may override each).
    retry: RetryPolicy | None = None
    rate: RateLimit | None = None
    concurrency: ConcurrencyLimit | None = None
    # Called once per process before the job's first rate-limited start (to build its client):
    # nothing slow may stand between a reserved start and the call.
    prepare: Callable[[], object] | None = None


@dataclass(frozen=True, slots=True)
class DerivedJob:
    """A payload matched to its job, with its claim's key and fingerprint, and bound values."""

    definition: JobDefinition
    payload: Payload
    idem_key: str
    fingerprint: str
    settings: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    secrets: Mapping[str, str] = field(default_factory=SecretValues, repr=False)


@dataclass
class JobRegistry:
    _jobs: dict[str, JobDefinition] = field(default_factory=dict)
    _settings: dict[str, Mapping[str, str]] = field(default_factory=dict)
    _secrets: dict[str, Mapping[str, str]] = field(default_factory=dict, repr=False)

    def register(self, definition: JobDefinition) -> JobDefinition:
        """Add a job; one that could never key a message fails here, not once per message."""
        name = definition.name
        if not name:
            raise ConfigurationError("a job needs a non-empty name")
        if name in self._jobs:
            raise ConfigurationError(f"job {name!r} is registered twice")
        if definition.identity:
            check_key_rule(name, definition.identity)
        if definition.probe is not None and definition.effect is Effect.DATABASE:
            raise ConfigurationError(
                f"job {name!r}: a reconcile probe needs an external effect "
                "(Effect.EXTERNAL or Effect.EXTERNAL_IDEMPOTENT); a database job's claim "
                "commits with its effect, so it is never stuck"
            )
        if definition.prepare is not None and not callable(definition.prepare):
            raise ConfigurationError(f"job {name!r}: prepare must be a function of no arguments")
        if definition.probe is not None and not callable(definition.probe):
            raise ConfigurationError(f"job {name!r}: probe must be a function of (payload, ctx)")
        if both := sorted(set(definition.secrets) & set(definition.settings)):
            raise ConfigurationError(
                f"job {name!r}: {', '.join(both)} is declared both as a setting "
                "and as a secret; a credential is a secret only"
            )
        for label, value, kind in (
            ("retry", definition.retry, RetryPolicy),
            ("rate", definition.rate, RateLimit),
            ("concurrency", definition.concurrency, ConcurrencyLimit),
        ):
            if value is not None and not isinstance(value, kind):
                raise ConfigurationError(
                    f"job {name!r}: {label} must be a {kind.__name__} (got {value!r})"
                )
        schema = definition.schema.requiring(name, definition.identity, definition.required)
        if schema is not definition.schema:
            definition = replace(definition, schema=schema)
        self._jobs[name] = definition
        return definition

    def job(
        self,
        name: str,
        *,
        effect: Effect,
        identity: Sequence[str] = (),
        required: Sequence[str] = (),
        fields: Mapping[str, FieldSpec] | None = None,
        settings: Sequence[str] = (),
        secrets: Sequence[str] = (),
        probe: Probe | None = None,
        retry: RetryPolicy | None = None,
        rate: RateLimit | None = None,
        concurrency: ConcurrencyLimit | None = None,
        prepare: Callable[[], object] | None = None,
    ) -> Callable[[Handler], Handler]:
        """Decorator form of ``register``; ``fields`` declares the ``payload_schema``."""
        for label, names in (
            ("identity", identity),
            ("required", required),
            ("settings", settings),
            ("secrets", secrets),
        ):
            if isinstance(names, str):
                # A bare string is a Sequence[str] too: it would name one field per character.
                raise ConfigurationError(
                    f"job {name!r}: {label} must list field names, e.g. ({names!r},)"
                )
        schema = PayloadSchema.declare(name, fields or {})

        def decorate(handler: Handler) -> Handler:
            self.register(
                JobDefinition(
                    name=name,
                    effect=effect,
                    handler=handler,
                    identity=tuple(identity),
                    required=tuple(dict.fromkeys((*identity, *required, *schema.required))),
                    schema=schema,
                    settings=tuple(dict.fromkeys(settings)),
                    secrets=tuple(dict.fromkeys(secrets)),
                    probe=probe,
                    retry=retry,
                    rate=rate,
                    concurrency=concurrency,
                    prepare=prepare,
                )
            )
            return handler

        return decorate

    def __iter__(self) -> Iterator[JobDefinition]:
        return iter(self._jobs.values())

    def __len__(self) -> int:
        return len(self._jobs)

    def get(self, name: str) -> JobDefinition | None:
        return self._jobs.get(name)

    def declared_settings(self, *, probes_only: bool = False) -> dict[str, tuple[str, ...]]:
        """Every setting a registered job (``probes_only``: one with a reconcile probe, all the
        watcher reads) declared, with the jobs that declared it."""
        return self._owners(lambda job: job.settings, probes_only=probes_only)

    def declared_secrets(self, *, probes_only: bool = False) -> dict[str, tuple[str, ...]]:
        return self._owners(lambda job: job.secrets, probes_only=probes_only)

    def bind_settings(
        self, values: Mapping[str, str], *, secrets: Mapping[str, str] | None = None
    ) -> None:
        """Give every job the values of the settings and secrets it declared, at start-up; a
        missing or empty one is a ``ConfigurationError`` naming it and its jobs, never a value."""
        secret_values = secrets or {}
        unset = unset_for_jobs(self.declared_settings(), values)
        unset_secrets = unset_for_jobs(self.declared_secrets(), secret_values)
        if unset or unset_secrets:
            raise ConfigurationError("; ".join(filter(None, (unset, unset_secrets))))
        self._bind(list(self._jobs.values()), values, secret_values)

    def bind_probe_settings(
        self, values: Mapping[str, str], *, secrets: Mapping[str, str] | None = None
    ) -> dict[str, tuple[str, ...]]:
        """For the watcher: bind the settings and secrets of the jobs with a probe. A job missing
        one loses its probe instead of failing the process (which must page whatever else is
        wrong); those jobs are returned with the names they miss."""
        secret_values = secrets or {}
        unprobed: dict[str, tuple[str, ...]] = {}
        for job in [job for job in self._jobs.values() if job.probe is not None]:
            missing = tuple(name for name in job.settings if not values.get(name))
            missing += tuple(name for name in job.secrets if not secret_values.get(name))
            if missing:
                unprobed[job.name] = missing
                self._jobs[job.name] = replace(job, probe=None)
        probed = [job for job in self._jobs.values() if job.probe is not None]
        self._bind(probed, values, secret_values)
        return unprobed

    def _bind(
        self, jobs: list[JobDefinition], values: Mapping[str, str], secrets: Mapping[str, str]
    ) -> None:
        self._settings = {
            job.name: MappingProxyType({name: values[name] for name in job.settings})
            for job in jobs
        }
        self._secrets = {
            job.name: SecretValues({name: secrets[name] for name in job.secrets}) for job in jobs
        }

    def settings_of(self, name: str) -> Mapping[str, str]:
        return self._settings.get(name, MappingProxyType({}))

    def secrets_of(self, name: str) -> Mapping[str, str]:
        return self._secrets.get(name, SecretValues())

    def _owners(
        self, names: Callable[[JobDefinition], tuple[str, ...]], *, probes_only: bool = False
    ) -> dict[str, tuple[str, ...]]:
        owners: dict[str, list[str]] = {}
        for job in self._jobs.values():
            if job.probe is not None or not probes_only:
                for name in names(job):
                    owners.setdefault(name, []).append(job.name)
        return {name: tuple(jobs) for name, jobs in owners.items()}

    def unknown_job(self, name: str) -> str:
        """What to tell someone who named a job this registry lacks: the closest name it has."""
        known = ", ".join(sorted(self._jobs)) or "none"
        return f"unknown job {name!r} ({did_you_mean(name, self._jobs)}registered: {known})"

    def derive(self, payload: object) -> DerivedJob:
        """Match a payload to its job, check it against the job's schema and derive its key;
        ``KeyDerivationError`` (``InvalidPayload`` when the fields do not match) says why not."""
        if not isinstance(payload, Mapping):
            raise KeyDerivationError(f"payload is not a JSON object (got {json_type_of(payload)})")
        name = payload.get("job")
        if not isinstance(name, str) or not name:
            raise KeyDerivationError("payload has no 'job' string naming the job type")
        if (definition := self._jobs.get(name)) is None:
            raise UnknownJob(self.unknown_job(name))
        definition.schema.check(name, payload)
        idem_key = derive_key(payload, {name: definition.identity} if definition.identity else {})
        return DerivedJob(
            definition,
            payload,
            idem_key,
            payload_fingerprint(payload),
            self.settings_of(name),
            self.secrets_of(name),
        )


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """ "did you mean 'x'? " for the closest of ``known`` to ``name``, or ""."""
    close = difflib.get_close_matches(name, list(known), n=1)
    return f"did you mean {close[0]!r}? " if close else ""
