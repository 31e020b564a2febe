"""Before ``sam build``: every setting and secret the jobs declare has a real value in the deploy.

The framework's template carries the jobs' settings in one parameter, ``JobSettings`` (a JSON
object the functions read as ``JOB_SETTINGS``), and the ARNs of their secrets, which the
functions may read, in ``JobSecretArns``. CloudFormation cannot look inside the JSON, so a
missing setting or a placeholder would deploy functions that refuse every cold start. ``make
build`` checks them instead, read as ``sam deploy --config-env ENV`` would take them
(samconfig.toml's deploy and global sections over the template's defaults), against the jobs the
functions' code registers (``functions/jobs``):

* ``JobSettings`` is a JSON object of strings;
* each declared setting is in it, is not ``SET-ME``, and is an ``https://`` URL with a host and
  no credentials (a deployed function calls nothing on loopback);
* each declared secret ``NAME`` has ``NAME_SECRET_ARN`` in it, the full ARN of a Secrets Manager
  secret, listed in ``JobSecretArns`` too (else the functions may not read it), and its plain
  ``NAME`` is not in it (a credential in the functions' environment);
* ``JobSecretArns`` holds no placeholder.

Each problem is one line naming the environment, the entry and the jobs that declare it.
``make build JOB_SETTINGS_CHECK=off`` skips the check, for a build that is never deployed (CI's).
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from urllib.parse import urlsplit

from infrai_jobs.config.settings import SECRET_ARN_SUFFIX
from infrai_local.authoring.scaffold_settings import (
    JOB_SECRET_ARNS_PARAMETER,
    JOB_SETTINGS_PARAMETER,
    PLACEHOLDER,
)
from infrai_local.checks.ca_bundle_check import CODE_URI, PREFIX, run_check
from infrai_local.sam_template import deploy_values

# JobSecretArns' own AllowedPattern, for one ARN.
_SECRET_ARN = re.compile(
    r"arn:aws[a-z-]*:secretsmanager:[a-z0-9-]+:[0-9]{12}:secret:[A-Za-z0-9/_+=.@-]+-[A-Za-z0-9]{6}"
)
_WHERE = "samconfig.toml's deploy parameter_overrides"
_DOCS = '`infrai-jobs docs configuration`, "Jobs\' settings and secrets"'


def declared_by_the_jobs(
    root: Path,
) -> tuple[dict[str, tuple[str, ...]], dict[str, tuple[str, ...]]]:
    """The settings and the secrets the jobs in the functions' code declare, with their jobs;
    none when the project has no jobs package."""
    code = root / CODE_URI
    if not (code / "jobs" / "__init__.py").is_file():
        return {}, {}
    from infrai_local.jobs_package import load_registry  # noqa: PLC0415

    registry = load_registry(str(code))
    return registry.declared_settings(), registry.declared_secrets()


def job_settings_problems(
    values: Mapping[str, str],
    settings: Mapping[str, Sequence[str]],
    secrets: Mapping[str, Sequence[str]],
    config_env: str,
) -> list[str]:
    """One line per thing wrong with the jobs' settings and secrets in a deploy's parameter
    ``values``; none when they are all there."""
    where = f"{PREFIX} [{config_env}] {JOB_SETTINGS_PARAMETER}"
    try:
        given = json.loads(values.get(JOB_SETTINGS_PARAMETER) or "{}")
    except ValueError as exc:
        return [f"{where} is not valid JSON ({exc}): give it as a JSON object in {_WHERE}"]
    if not isinstance(given, dict) or not all(isinstance(v, str) for v in given.values()):
        return [f"{where} must be a JSON object of strings (setting name to value) ({_DOCS})"]
    listed = [arn.strip() for arn in values.get(JOB_SECRET_ARNS_PARAMETER, "").split(",")]
    problems = []
    for name, jobs in settings.items():
        problem = _url_problem(given.get(name))
        if problem:
            problems.append(f"{where}: {name} (for {', '.join(jobs)}) {problem} ({_DOCS})")
    for secret, jobs in secrets.items():
        name, owners = secret + SECRET_ARN_SUFFIX, ", ".join(jobs)
        arn = given.get(name)
        if given.get(secret):
            problems.append(
                f"{where} holds {secret} itself (for {owners}), a credential the functions' "
                f"environment would show: store it in Secrets Manager and give {name} instead"
            )
        problem = _arn_problem(arn)
        if problem:
            problems.append(f"{where}: {name} (for {owners}) {problem} ({_DOCS})")
        elif arn not in listed:
            problems.append(
                f"{PREFIX} [{config_env}] {JOB_SECRET_ARNS_PARAMETER} lacks {name}'s ARN (for "
                f"{owners}), so the functions may not read the secret: add {arn} to it in {_WHERE}"
            )
    placeholders = [arn for arn in listed if arn.startswith(PLACEHOLDER)]
    if placeholders:
        problems.append(
            f"{PREFIX} [{config_env}] {JOB_SECRET_ARNS_PARAMETER} still holds "
            f"{', '.join(placeholders)}: replace each with its secret's ARN in {_WHERE}"
        )
    return problems


def _url_problem(value: str | None) -> str:
    if value is None or not value.strip():
        return f"is missing: give its URL in {_WHERE}"
    if value.strip() == PLACEHOLDER:
        return f"still holds {PLACEHOLDER}: replace it with its URL in {_WHERE}"
    try:
        parts = urlsplit(value.strip())
        host = parts.hostname
    except ValueError:
        return "is not a valid URL: give an https:// URL"
    if parts.scheme != "https" or not host:
        return "is not an https:// URL with a host (a deploy takes HTTPS only)"
    if parts.username is not None or parts.password is not None:
        return (
            "carries credentials in the URL: give it without them, and the credential as a "
            'secret of the job (`infrai-jobs docs jobs`, "Secrets")'
        )
    return ""


def _arn_problem(value: str | None) -> str:
    if value is None or not value.strip():
        return f"is missing: give the ARN of the Secrets Manager secret in {_WHERE}"
    if value.strip().startswith(PLACEHOLDER):
        return f"still holds {PLACEHOLDER}: replace it with the secret's ARN in {_WHERE}"
    if not _SECRET_ARN.fullmatch(value.strip()):
        return "is not the full ARN of a Secrets Manager secret (with its -XXXXXX suffix)"
    return ""


def _judged(root: Path, config_env: str) -> tuple[str, str]:
    _, values = deploy_values(root, config_env)
    settings, secrets = declared_by_the_jobs(root)
    problems = job_settings_problems(values, settings, secrets, config_env)
    passed = (
        f"jobs' settings: {len(settings)} setting(s) and {len(secrets)} secret(s) declared, each "
        f"given in {JOB_SETTINGS_PARAMETER}"
    )
    return "\n".join(problems), passed


def main(argv: list[str] | None = None) -> int:
    return run_check(argv, _judged, (__doc__ or "").split("\n", 1)[0])


if __name__ == "__main__":
    sys.exit(main())
