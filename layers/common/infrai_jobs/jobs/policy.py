"""What a job may declare about its flow: a retry policy, a rate limit, a concurrency key; plain
values that check themselves when built (a ``ConfigurationError`` naming the field, so a policy in
code fails at start-up). What they mean is ``infrai_jobs.flow``'s."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

from infrai_jobs.errors import ConfigurationError

# Every value within these bounds fits the back-off's floats and the ledger's int columns and
# timestamps, and no delay is short enough to turn a retry into a busy loop.
MAX_ATTEMPTS: Final = 1_000
MIN_DELAY_SECONDS: Final = 0.01
MAX_DELAY_SECONDS: Final = 30 * 86_400.0  # the ledger's default retention
MAX_FACTOR: Final = 100.0
# Starts are spaced 1/N s apart, and a microsecond is the database clock's grain.
MAX_STARTS_PER_SECOND: Final = 1_000_000
MAX_RUNNING: Final = 10_000


def _positive(field: str, value: object, most: float, whole: bool = True, low: float = 0) -> None:
    # bool is an int to Python, but true is no count in a policy.
    if isinstance(value, bool) or not isinstance(value, int if whole else int | float):
        kind = "a whole number" if whole else "a number"
        raise ConfigurationError(f"{field} must be {kind} (got {value!r})")
    if not math.isfinite(value) or value <= 0:
        raise ConfigurationError(f"{field} must be positive (got {value!r})")
    if value < low or value > most:
        least = f"at least {low:g} and " if low else ""
        raise ConfigurationError(f"{field} must be {least}at most {most:g} (got {value!r})")


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Up to ``attempts`` runs in all; the delay before attempt n+1 is
    ``first_delay_seconds * factor ** (n - 1)``, never more than ``max_delay_seconds``. An error
    whose class (or a base of it) is named in ``final_errors`` is not retried."""

    attempts: int
    first_delay_seconds: float = 1.0
    factor: float = 2.0
    max_delay_seconds: float = 300.0
    # Exception classes, or their names as ``JOB_POLICIES`` spells them ("module.ClassName").
    final_errors: tuple[type[BaseException] | str, ...] = ()

    def __post_init__(self) -> None:
        _positive("retry.attempts", self.attempts, MAX_ATTEMPTS)
        for name in ("first_delay_seconds", "max_delay_seconds"):
            value = getattr(self, name)
            _positive(f"retry.{name}", value, MAX_DELAY_SECONDS, whole=False, low=MIN_DELAY_SECONDS)
        _positive("retry.factor", self.factor, MAX_FACTOR, whole=False, low=1)  # else delays shrink
        if self.max_delay_seconds < self.first_delay_seconds:
            raise ConfigurationError(
                f"retry.max_delay_seconds ({self.max_delay_seconds!r}) is below "
                f"retry.first_delay_seconds ({self.first_delay_seconds!r})"
            )
        if not isinstance(self.final_errors, tuple):
            raise ConfigurationError("retry.final_errors must list exception classes or names")
        for entry in self.final_errors:
            is_class = isinstance(entry, type) and issubclass(entry, BaseException)
            if not is_class and not (isinstance(entry, str) and entry.strip()):
                raise ConfigurationError(
                    f"retry.final_errors must list exception classes or names (got {entry!r})"
                )


@dataclass(frozen=True, slots=True)
class RateLimit:
    """At most ``per_second`` starts in any one-second window, or ``per_minute`` in any
    minute: exactly one of the two."""

    per_second: int | None = None
    per_minute: int | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("per_second", "per_minute") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ConfigurationError("rate needs exactly one of per_second or per_minute")
        most = MAX_STARTS_PER_SECOND * (1 if given[0] == "per_second" else 60)
        _positive(f"rate.{given[0]}", getattr(self, given[0]), most)

    @property
    def limit(self) -> int:
        return self.per_second if self.per_second is not None else int(self.per_minute or 0)

    @property
    def window_seconds(self) -> float:
        return 1.0 if self.per_second is not None else 60.0

    @property
    def spacing_seconds(self) -> float:
        """How far apart two starts are at least: the window over the limit."""
        return self.window_seconds / self.limit


@dataclass(frozen=True, slots=True)
class ConcurrencyLimit:
    """At most ``max_running`` runs at once for each value of the payload fields ``key``."""

    key: tuple[str, ...]
    max_running: int

    def __post_init__(self) -> None:
        key = self.key
        if not (isinstance(key, tuple) and key and all(isinstance(n, str) and n for n in key)):
            raise ConfigurationError(
                f"concurrency.key must list one or more payload field names (got {self.key!r})"
            )
        _positive("concurrency.max_running", self.max_running, MAX_RUNNING)


@dataclass(frozen=True, slots=True)
class JobPolicy:
    """A job's flow declarations; None is "not declared". In an override, a section named in
    ``cleared`` removes what the code declares (``"rate": null`` in ``JOB_POLICIES``)."""

    retry: RetryPolicy | None = None
    rate: RateLimit | None = None
    concurrency: ConcurrencyLimit | None = None
    cleared: frozenset[str] = frozenset()

    @property
    def is_empty(self) -> bool:
        """Nothing to enforce: the job takes the path it takes without a policy."""
        return self.retry is None and self.rate is None and self.concurrency is None
