"""The local commands' sandbox rule: stand-ins for the real endpoints, all or nothing.

``infrai-jobs drain`` and ``infrai-jobs invoke`` stand in an emulator, an embedded PostgreSQL
and a provider sink only when nothing real is configured (docs/configuration.md, "Local
stand-ins are all or nothing"). The functions in AWS never stand anything in. A job's secret
is no endpoint: in a sandbox, one left unset holds ``STAND_IN_SECRET``; beside a real
endpoint, it must be set.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from infrai_jobs.config.settings import CommonSettings, JobSettings
from infrai_jobs.errors import ConfigurationError

# The real endpoints a command may need, by the variable that configures each (the database
# also by DATABASE_SECRET_ARN), and what stands in for each in a local sandbox. Every setting a
# job declares is an endpoint too, stood in by the provider sink.
QUEUE_ENDPOINT = "INFRAI_BASE_URL"
LEDGER_ENDPOINT = "DATABASE_URL"
STAND_INS: dict[str, str] = {
    QUEUE_ENDPOINT: "a fresh local emulator",
    LEDGER_ENDPOINT: "an embedded PostgreSQL",
}
JOB_SETTING_STAND_IN = "a local provider sink"
# What a job's declared secret holds in a sandbox when nothing sets it: the provider sink
# checks no credential. Never used beside a real endpoint.
STAND_IN_SECRET = "local-sandbox-secret"  # noqa: S105 - a stand-in, not a credential
_HOW_TO_SET = {
    QUEUE_ENDPOINT: "INFRAI_BASE_URL (Infrai, or a running `infrai-jobs emulator`)",
    LEDGER_ENDPOINT: "DATABASE_URL (a PostgreSQL migrated with `infrai-jobs migrate`) or "
    "DATABASE_SECRET_ARN",
}


def _how_to_set(name: str, owners: Mapping[str, Sequence[str]]) -> str:
    if name in _HOW_TO_SET:
        return _HOW_TO_SET[name]
    jobs = ", ".join(owners.get(name, ())) or "a job"
    return f"{name} (the downstream {jobs} calls, or a running `infrai-jobs provider-sink`)"


def stand_ins(
    configured: Mapping[str, bool],
    needed: Sequence[str],
    *,
    who: str,
    job_setting_owners: Mapping[str, Sequence[str]] | None = None,
) -> tuple[str, ...]:
    """Which of the ``needed`` endpoints to stand in locally, all or nothing.

    When no endpoint at all is configured (a sandbox), every needed one is stood in. When any
    is, nothing is, and each needed one that is missing is a ``ConfigurationError`` naming its
    variable (and, for a job's setting, the jobs that declared it): a real queue is never
    drained into a throwaway ledger or downstream, and a throwaway queue never feeds a real
    ledger. ``who`` names the command in the message.
    """
    owners = job_setting_owners or {}
    real = [name for name, on in configured.items() if on]
    if not real:
        return tuple(needed)
    missing = [name for name in needed if not configured.get(name)]
    if missing:
        verb = "is" if len(missing) == 1 else "are"
        raise ConfigurationError(
            f"{_and(missing)} {verb} not set, but {_and(real)} {'is' if len(real) == 1 else 'are'}"
            f": local stand-ins are used only when nothing real is configured, so {who} did "
            f"nothing. Set {'; set '.join(_how_to_set(name, owners) for name in missing)}; or "
            f"unset {_and(real)} for a local sandbox"
        )
    return ()


def sandbox_notice(stood_in: Sequence[str], *, who: str) -> str:
    """The one line a command prints first when it runs on stand-ins only."""
    unset = ", ".join(stood_in)
    uses = _and(list(dict.fromkeys(STAND_INS.get(name, JOB_SETTING_STAND_IN) for name in stood_in)))
    return (
        f"sandbox: nothing real is configured ({unset} unset), so {who} uses {uses}, all "
        "thrown away when it ends"
    )


def _and(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def configured_endpoints(settings: CommonSettings) -> dict[str, bool]:
    """Which real endpoints ``settings`` configure, by the variable that names each: the
    queue, the ledger, and every setting the jobs declared."""
    declared = settings.job_settings if isinstance(settings, JobSettings) else {}
    return {
        QUEUE_ENDPOINT: bool(settings.infrai_base_url),
        LEDGER_ENDPOINT: bool(settings.database_url or settings.database_secret_arn),
        **{name: bool(value) for name, value in declared.items()},
    }
