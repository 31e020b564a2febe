"""The jobs' secrets as the environment names them, for ``config.settings``.

A job declares a secret by name (``MAIL_API_TOKEN``). In AWS the function's environment holds
only the ARN of the Secrets Manager secret that stores it (``MAIL_API_TOKEN_SECRET_ARN``),
fetched by ``aws.secrets``. Locally the plain ``MAIL_API_TOKEN`` may stand in; a deployed
function refuses it: its environment is readable by whoever may read its configuration.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

from infrai_jobs.errors import ConfigurationError

SECRET_ARN_SUFFIX = "_SECRET_ARN"  # noqa: S105 - a variable name's suffix, not a secret


def secret_parameter_name(secret: str) -> str:
    """``MAIL_API_TOKEN`` -> ``MailApiTokenSecretArn``: the template parameter of its ARN."""
    return "".join(part.capitalize() for part in (secret + SECRET_ARN_SUFFIX).split("_") if part)


def job_secret_fields(
    env: Mapping[str, str], declared: Mapping[str, Sequence[str]]
) -> dict[str, Any]:
    """``JobSettings``' secret fields. A plain value is refused in a deployed function, and
    beside its ARN (which of the two would be meant?)."""
    owners = {name: tuple(jobs) for name, jobs in declared.items()}
    arns = {name: env.get(name + SECRET_ARN_SUFFIX, "").strip() for name in owners}
    plain = {name: env.get(name, "") for name in owners}
    deployed = bool(owners) and _in_deployed_lambda(env)
    for name, jobs in owners.items():
        if plain[name] and arns[name]:
            raise ConfigurationError(
                f"{name} and {name}{SECRET_ARN_SUFFIX} are both set: keep the value in the "
                f"secret only (unset {name})"
            )
        if plain[name] and deployed:
            raise ConfigurationError(
                f"{name} (for {', '.join(jobs)}) is set in the function's plain environment, "
                "readable by whoever may read its configuration: store it in Secrets Manager, "
                f"name it with {name}{SECRET_ARN_SUFFIX} (template parameter "
                f"{secret_parameter_name(name)}), and remove {name}"
            )
    return {
        "job_secret_arns": MappingProxyType(arns),
        "job_secrets": MappingProxyType(plain),
        "job_secret_owners": MappingProxyType(owners),
    }


def missing_secrets(missing: Sequence[str], owners: Mapping[str, Sequence[str]]) -> str:
    return "; ".join(
        f"{name} is not set, and job(s) {', '.join(owners.get(name, ()))} need it: in AWS, "
        f"name its Secrets Manager secret with {name}{SECRET_ARN_SUFFIX} (template parameter "
        f"{secret_parameter_name(name)}); locally, export {name}"
        for name in missing
    )


def _in_deployed_lambda(env: Mapping[str, str]) -> bool:
    """Lambda names the function, and no local invocation said AWS_SAM_LOCAL=true."""
    local = env.get("AWS_SAM_LOCAL", "").strip().lower() in ("1", "true", "yes", "on")
    return bool(env.get("AWS_LAMBDA_FUNCTION_NAME")) and not local
