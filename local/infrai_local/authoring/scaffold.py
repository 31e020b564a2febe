"""``infrai-jobs new-job``: write a job that runs out of the box.

For ``new-job refund.issue --effect database --identity refund_id`` it writes, in the project
the installed jobs package belongs to:

* ``functions/jobs/refund_issue.py``: the job's declaration (name, effect class, identity,
  payload schema, settings, flow policies) and a working handler. A ``database`` job writes one
  row to its own table; an ``external`` job calls the URL its declared setting names
  (``REFUND_ISSUE_URL``), with a reconcile probe that looks the call up there; an
  ``external_idempotent`` one sends its key as ``Idempotency-Key``;
* its registration in ``functions/jobs/__init__.py`` (``build_registry``);
* ``functions/jobs/migrations/NNNN_refund_issue.sql``, the next version: the table of a
  ``database`` job, a placeholder for the others;
* ``tests/integration/test_job_refund_issue.py``, written with the test kit (an external job's
  stand-in provider serves the routes its handler and probe call);
* ``events/jobs/refund.issue.json``, a sample payload for ``infrai-jobs publish``;
* for each setting it declares (``--setting NAME``, repeatable; an ``external`` job's default is
  ``REFUND_ISSUE_URL``) and each secret (``--secret NAME``) that no job declared before: an entry
  in the ``JobSettings`` (and for a secret ``JobSecretArns``) of ``samconfig.toml``'s deploy
  sections, a placeholder that ``make build`` refuses until it is replaced, and one in the
  ``JOB_SETTINGS`` of ``events/env.json`` (``scaffold_settings``). No template is edited.

Every path is the project's that holds the jobs package: the nearest folder above its code
root with a ``template.yaml`` (the SAM project whose functions import it), wherever the command
runs from; a jobs package outside any project is refused. ``--dry-run`` lists the files and
writes none.

Nothing is written unless everything can be: a name that exists, a bad field, or a
``build_registry`` it cannot find is refused first.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import keyword
import re
import subprocess
import sys
import textwrap
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from infrai_jobs.config.settings import SECRET_ARN_SUFFIX
from infrai_jobs.errors import ConfigurationError
from infrai_jobs.jobs.policy import ConcurrencyLimit, RateLimit, RetryPolicy
from infrai_jobs.jobs.registry import Effect, JobRegistry
from infrai_jobs.queue_contract import MAX_RECEIVE_COUNT
from infrai_local.authoring.scaffold_settings import (
    JOB_SECRET_ARNS_PARAMETER,
    JOB_SETTINGS_PARAMETER,
    PLACEHOLDER,
    plan_setting_edits,
    secret_arn_placeholder,
)
from infrai_local.public_imports import PUBLIC_API

_JOB_NAME: Final = re.compile(r"^[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)*$")
_FIELD_NAME: Final = re.compile(r"^[a-z][a-z0-9_]*$")
_SETTING_NAME: Final = re.compile(r"^[A-Z][A-Z0-9_]*$")
# Variables the framework reads itself: a job's setting may not take one of their names.
_FRAMEWORK_PREFIXES: Final = (
    "INFRAI_",
    "DATABASE_",
    "DRAIN_",
    "IDEMPOTENCY_",
    "POWERTOOLS_",
    "AWS_",
    "JOB_POLICIES",
)
_JOBS_IMPORT: Final = re.compile(r"^from jobs import (\([^)]*\)|[^\n(]+)$", re.M)
_RETURN_REGISTRY: Final = "    return registry\n"
_DEF_REGISTRY: Final = "\n\ndef build_registry("
_LINE_LENGTH: Final = 100
# Where the code new-job writes imports each name from: a job module's from the public job API
# (``public_imports``), its test's from the test kit. The one place to change when they move.
_IMPORTED_FROM: Final = {name: module for module, names in PUBLIC_API.items() for name in names}
# Written once per project, beside the first job's tests: the team's own check that its jobs
# import only the public API (infrai_local.public_imports).
_IMPORTS_TEST: Final = (
    '"""Our jobs import only the framework\'s public job API, so an upgrade cannot break them."""\n'
    "\n"
    "from infrai_local.testkit import assert_public_imports\n"
    "\n"
    "\n"
    "def test_the_jobs_import_only_the_public_api() -> None:\n"
    "    assert_public_imports()\n"
)
# A retry policy's back-off when new-job is given none.
_FIRST_DELAY_SECONDS: Final = 1.0
_MAX_DELAY_SECONDS: Final = 60.0


@dataclass(frozen=True, slots=True)
class Flow:
    """The flow policies ``new-job`` was asked for (external jobs): none by default."""

    # --retry-attempts and the back-off (--first-delay-seconds, --max-delay-seconds).
    retry_attempts: int | None = None
    first_delay_seconds: float = _FIRST_DELAY_SECONDS
    max_delay_seconds: float = _MAX_DELAY_SECONDS
    # --rate-per-second: a rate limit, None for none.
    rate_per_second: int | None = None
    # --concurrency-key and --max-running: a concurrency key, () for none.
    concurrency_key: tuple[str, ...] = ()
    max_running: int = 1


@dataclass(frozen=True, slots=True)
class NewJob:
    """What ``new-job`` was asked for, checked."""

    name: str
    effect: Effect
    identity: tuple[str, ...]
    # The settings asked for with --setting; none: an external job's default (``setting``).
    asked_settings: tuple[str, ...] = ()
    # The secrets asked for with --secret (credentials, read from ctx.secrets).
    secrets: tuple[str, ...] = ()
    flow: Flow = Flow()

    @property
    def module(self) -> str:
        return self.name.replace(".", "_")

    @property
    def fields(self) -> tuple[str, ...]:
        """The payload fields the job declares: its identity, then its concurrency key's
        other fields."""
        return (*self.identity, *(f for f in self.flow.concurrency_key if f not in self.identity))

    @property
    def probed(self) -> bool:
        """Whether it gets a reconcile probe: an irreversible call's outcome can be lost."""
        return self.effect is Effect.EXTERNAL

    @property
    def settings(self) -> tuple[str, ...]:
        """The settings the job declares: those asked for, else an external job's URL."""
        if self.asked_settings:
            return self.asked_settings
        default = f"{self.module.upper()}_URL"
        return () if self.effect is Effect.DATABASE else (default,)

    @property
    def setting(self) -> str:
        """The setting whose URL an external job's handler calls (its first)."""
        return self.settings[0] if self.settings else f"{self.module.upper()}_URL"

    @property
    def table(self) -> str:
        return self.module


@dataclass(frozen=True, slots=True)
class Scaffold:
    """The files ``new-job`` writes (path -> text), and the one it edits."""

    files: dict[Path, str]
    registry_file: Path
    registry_text: str
    project: Path
    # Files that name the jobs' settings, with the new one added (scaffold_settings).
    edits: dict[Path, str] = dataclasses.field(default_factory=dict)
    # What the settings' edits left to the user, one sentence each.
    left_alone: list[str] = dataclasses.field(default_factory=list)

    @property
    def paths(self) -> list[Path]:
        """What ``write`` writes, then the files it edits."""
        return [*self.files, self.registry_file, *self.edits]

    def write(self) -> list[Path]:
        for path, text in self.files.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
        self.registry_file.write_text(self.registry_text, encoding="utf-8")
        for path, text in self.edits.items():
            path.write_text(text, encoding="utf-8")
        written = self.paths
        _format([p for p in written if p.suffix == ".py"], self.project)
        return written


def project_of(code_root: Path) -> Path:
    """The project that holds a code root: the nearest folder above it with a template.yaml."""
    for folder in code_root.resolve().parents:
        if (folder / "template.yaml").is_file():
            return folder
    raise ConfigurationError(
        f"the jobs package in {code_root} is in no project (no template.yaml in a folder above "
        "it): new-job writes the job's test and sample event beside the template whose "
        "functions import the package; pass --jobs-path with a project's code root "
        "(e.g. functions/)"
    )


def parse_request(args: argparse.Namespace) -> NewJob:
    """Check ``new-job``'s arguments; a ``ConfigurationError`` says what is wrong."""
    name, effect, identity = args.name, args.effect, args.identity
    settings: Sequence[str] = args.setting or ()
    secrets: Sequence[str] = args.secret or ()
    rate_per_second: int | None = args.rate_per_second
    concurrency_key: str | None = args.concurrency_key
    max_running: int = args.max_running
    if not _JOB_NAME.match(name):
        raise ConfigurationError(
            f"job name {name!r}: use lower-case words separated by dots, e.g. refund.issue"
        )
    module = name.replace(".", "_")
    if keyword.iskeyword(module) or module.startswith("_"):
        raise ConfigurationError(f"job name {name!r} cannot be a Python module name")
    try:
        effect_class = Effect(effect)
    except ValueError:
        choices = ", ".join(e.value for e in Effect)
        raise ConfigurationError(f"--effect {effect!r}: choose one of {choices}") from None
    fields = tuple(f.strip() for f in identity.split(",") if f.strip())
    if not fields:
        raise ConfigurationError("--identity names at least one payload field, e.g. refund_id")
    _check_field_names("--identity", fields)
    if len(set(fields)) != len(fields):
        raise ConfigurationError(f"--identity {identity!r} names a field twice")
    _check_settings(settings)
    _check_secrets(secrets, settings)
    retry = _check_retry(effect_class, args)
    key = _check_limits(effect_class, rate_per_second, concurrency_key, max_running)
    flow = dataclasses.replace(
        retry, rate_per_second=rate_per_second, concurrency_key=key, max_running=max_running
    )
    return NewJob(name, effect_class, fields, tuple(settings), tuple(secrets), flow)


def _check_field_names(option: str, fields: Iterable[str]) -> None:
    for field in fields:
        if not _FIELD_NAME.match(field) or keyword.iskeyword(field) or field == "job":
            raise ConfigurationError(
                f"{option} field {field!r}: use a lower-case name (letters, digits, "
                "underscores), not 'job' and not starting with '_'"
            )


def _check_settings(settings: Sequence[str]) -> None:
    for setting in settings:
        if not _SETTING_NAME.match(setting) or setting.startswith(_FRAMEWORK_PREFIXES):
            raise ConfigurationError(
                f"--setting {setting!r}: use an upper-case environment variable name "
                "(letters, digits, underscores), e.g. REFUND_PROVIDER_URL, not one of the "
                "framework's own (INFRAI_, DATABASE_, DRAIN_, ...)"
            )
    if len(set(settings)) != len(settings):
        raise ConfigurationError("--setting names a setting twice")


def _check_secrets(secrets: Sequence[str], settings: Sequence[str]) -> None:
    for secret in secrets:
        if (
            not _SETTING_NAME.match(secret)
            or secret.startswith((*_FRAMEWORK_PREFIXES, "REDIS"))
            or secret.endswith(SECRET_ARN_SUFFIX)
        ):
            raise ConfigurationError(
                f"--secret {secret!r}: use an upper-case environment variable name (letters, "
                "digits, underscores), e.g. REFUND_PROVIDER_TOKEN, not one of the framework's "
                f"own and not ending in {SECRET_ARN_SUFFIX} (that suffix names its ARN)"
            )
    if len(set(secrets)) != len(secrets):
        raise ConfigurationError("--secret names a secret twice")
    if set(secrets) & set(settings):
        raise ConfigurationError("a name is given both as --setting and as --secret")


def _check_retry(effect: Effect, args: argparse.Namespace) -> Flow:
    """The retry policy asked for, checked as the policy checks itself (its back-off's bounds)
    and as the drain would take it (more attempts than Infrai's deliveries)."""
    attempts: int | None = args.retry_attempts
    first: float | None = args.first_delay_seconds
    most: float | None = args.max_delay_seconds
    if attempts is None:
        if first is not None or most is not None:
            raise ConfigurationError(
                "--first-delay-seconds and --max-delay-seconds shape a retry policy's back-off: "
                "give --retry-attempts too"
            )
        return Flow()
    if effect is Effect.DATABASE:
        raise ConfigurationError(
            "--retry-attempts: flow control applies to external jobs only; a database job "
            "rolls back with its batch and keeps Infrai's three deliveries"
        )
    if attempts <= MAX_RECEIVE_COUNT:
        raise ConfigurationError(
            f"--retry-attempts {attempts}: give more than {MAX_RECEIVE_COUNT}; Infrai's own "
            f"{MAX_RECEIVE_COUNT} deliveries retry that many already"
        )
    first = _FIRST_DELAY_SECONDS if first is None else first
    # The default ceiling never sits below a first delay that was given.
    most = max(_MAX_DELAY_SECONDS, first) if most is None else most
    try:
        RetryPolicy(attempts=attempts, first_delay_seconds=first, max_delay_seconds=most)
    except ConfigurationError as exc:
        raise ConfigurationError(f"new-job's retry policy: {exc}") from None
    return Flow(attempts, first, most)


def _check_limits(
    effect: Effect, rate_per_second: int | None, concurrency_key: str | None, max_running: int
) -> tuple[str, ...]:
    """The concurrency key's fields, once the limits are checked as the drain checks them at
    cold start (bounds). A key field that is not an identity field is declared beside them, so
    the key always names the job's own fields."""
    key = tuple(f.strip() for f in (concurrency_key or "").split(",") if f.strip())
    if concurrency_key is not None and not key:
        raise ConfigurationError(
            f"--concurrency-key {concurrency_key!r}: name one or more payload fields, e.g. "
            "subscriber_id"
        )
    _check_field_names("--concurrency-key", key)
    if concurrency_key is None and max_running != 1:
        raise ConfigurationError("--max-running needs --concurrency-key (what it counts by)")
    if rate_per_second is None and not key:
        return key
    if effect is Effect.DATABASE:
        raise ConfigurationError(
            "--rate-per-second and --concurrency-key: flow control applies to external jobs "
            "only; a database job rolls back with its batch's transaction"
        )
    try:
        if rate_per_second is not None:
            RateLimit(per_second=rate_per_second)
        if concurrency_key is not None:
            ConcurrencyLimit(key=key, max_running=max_running)
    except ConfigurationError as exc:
        raise ConfigurationError(f"new-job's flow control: {exc}") from None
    return key


def plan(job: NewJob, project: Path, jobs_folder: Path, registry: JobRegistry) -> Scaffold:
    """Everything ``new-job`` would write, refused before anything is written."""
    if registry.get(job.name) is not None:
        raise ConfigurationError(f"job {job.name!r} already exists in {jobs_folder}")
    module_file = jobs_folder / f"{job.module}.py"
    migrations = jobs_folder / "migrations"
    version = _next_version(migrations)
    files = {
        module_file: _module_text(job, version),
        migrations / f"{version:04d}_{job.module}.sql": _migration_text(job),
        project / "tests" / "integration" / f"test_job_{job.module}.py": _test_text(job),
        project / "events" / "jobs" / f"{job.name}.json": _sample_text(job),
    }
    for path in files:
        if path.exists():
            raise ConfigurationError(f"{path} already exists: nothing was written")
    imports_test = project / "tests" / "unit" / "test_jobs_import_public_api.py"
    if not imports_test.exists():
        files[imports_test] = _IMPORTS_TEST
    registry_file = jobs_folder / "__init__.py"
    declared = list(registry.declared_settings())
    declared_secrets = list(registry.declared_secrets())
    if set(job.settings) & set(declared_secrets) or set(job.secrets) & set(declared):
        raise ConfigurationError(
            "a job already declares one of these names as a setting where it is a secret, or "
            "the other way round: nothing was written"
        )
    edits = plan_setting_edits(
        project,
        [s for s in job.settings if s not in declared],
        [s for s in job.secrets if s not in declared_secrets],
    )
    return Scaffold(
        files,
        registry_file,
        _registered(registry_file, job.module),
        project,
        edits.texts,
        edits.left_alone,
    )


def dry_run_listing(job: NewJob, scaffold: Scaffold) -> str:
    lines = [f"new-job {job.name} ({job.effect.value}) would write, in {scaffold.project}:"]
    lines += [f"  {_relative(path, scaffold.project)}" for path in scaffold.files]
    lines += ["and edit:"]
    edited = [scaffold.registry_file, *scaffold.edits]
    lines += [f"  {_relative(path, scaffold.project)}" for path in edited]
    lines += [f"note: {note}." for note in scaffold.left_alone]
    lines += ["(dry run: nothing was written)"]
    return "\n".join(lines)


def next_steps(
    job: NewJob, written: list[Path], project: Path, left_alone: Sequence[str] = ()
) -> str:
    sample = project / "events" / "jobs" / f"{job.name}.json"
    lines = [f"created job {job.name} ({job.effect.value}):"]
    lines += [f"  {_relative(path, project)}" for path in written]
    lines += ["next:"]
    for setting in job.settings:
        lines += [
            f"  Set {setting} to the URL the job calls. Locally, export it or put it in",
            "  events/env.json's JOB_SETTINGS for `infrai-jobs invoke` (the provider sink stands",
            f"  in until then). In AWS, replace its {PLACEHOLDER} in {JOB_SETTINGS_PARAMETER} "
            "in samconfig.toml's",
            "  parameter_overrides: `make build` refuses a deploy while it is there.",
        ]
    for secret in job.secrets:
        arn = f"{secret}{SECRET_ARN_SUFFIX}"
        lines += [
            f"  Store {secret} in Secrets Manager, and in samconfig.toml give its ARN as {arn}",
            f"  in {JOB_SETTINGS_PARAMETER} and in {JOB_SECRET_ARNS_PARAMETER} (instead of "
            f"{secret_arn_placeholder(secret)}): the functions",
            f"  may read only the secrets listed there. Locally, export {secret} (a sandbox "
            "stands in).",
        ]
    if job.probed:
        lines += [
            f"  Make find_call in functions/jobs/{job.module}.py ask your provider's lookup; its",
            "  tests' stand-in serves the routes in their job_kit_provider_routes fixture.",
        ]
    lines += [f"  note: {note}." for note in left_alone]
    if job.effect is Effect.DATABASE:
        lines.append(f"  infrai-jobs migrate     # creates its table, {job.table}")
    else:
        lines.append(
            "  infrai-jobs migrate     # records its migration (a placeholder for its tables)"
        )
    lines += [
        f'  infrai-jobs publish "$(cat {_relative(sample, project)})"',
        "  infrai-jobs drain",
        f"  make test               # includes tests/integration/test_job_{job.module}.py",
    ]
    return "\n".join(lines)


# --- what is written ---------------------------------------------------------------------------


def _module_text(job: NewJob, version: int) -> str:
    """The job's module; with secrets, their declaration too (an external job sends its first
    as a bearer token)."""
    text = _module_body(job, version)
    if not job.secrets:
        return text
    constants = "\n".join(
        f"# A credential this job declares: in AWS from the secret {s}{SECRET_ARN_SUFFIX} names.\n"
        f'{s} = "{s}"'
        for s in job.secrets
    )
    listed = "".join(f"{s}, " for s in job.secrets).rstrip()
    text = text.replace("\n\ndef handle(", "\n" + constants + "\n\n\ndef handle(", 1)
    return text.replace("    )(handle)\n", f"        secrets=({listed}),\n    )(handle)\n")


def _module_body(job: NewJob, version: int) -> str:
    fields = ", ".join(f'"{f}": str' for f in job.fields)
    quoted = [f'"{f}"' for f in job.identity]
    identity = f"({quoted[0]},)" if len(quoted) == 1 else f"({', '.join(quoted)})"
    key = ":".join(f"<{f}>" for f in job.identity)
    common = {
        "name": job.name,
        "effect": job.effect.name,
        "identity": identity,
        "fields": fields,
        "key": f"{job.name}:{key}",
        "version": f"{version:04d}",
        "module": job.module,
    }
    article = "an" if job.effect.value[0] in "aeiou" else "a"
    title = f"``{job.name}``: {article} ``{job.effect.value}`` job "
    title += "(written by ``infrai-jobs new-job``; make it yours)."
    if job.effect is Effect.DATABASE:
        about = (
            f"Its effect is a row in its own table, ``{job.table}`` (``migrations/"
            f"{version:04d}_{job.module}.sql``), written on ``ctx.db``: the connection whose "
            "transaction also holds the job's claim, so the row and the claim's ``done`` commit "
            f"together or not at all. Its key is ``{common['key']}``."
        )
        text = _DATABASE_MODULE.format(
            **common,
            docstring=_docstring(title, about),
            imports=_framework_imports(
                ("Effect", "JobContext", "JobRegistry", "JsonValue", "Payload")
            ),
            table=job.table,
            columns=", ".join(job.identity),
            values=", ".join(f"%({f})s" for f in job.identity),
            returned=", ".join(f'"{f}": row[{i}]' for i, f in enumerate(job.identity)),
        )
        if not job.settings:
            return text
        # Declared for the handler to read (ctx.settings[...]); the drain refuses without them.
        text = text.replace("\n\ndef handle(", "\n" + _setting_constants(job) + "\n\ndef handle(")
        return text.replace(
            "    )(handle)\n", f"        settings=({_settings_tuple(job)}),\n    )(handle)\n"
        )
    idempotent = job.effect is Effect.EXTERNAL_IDEMPOTENT
    kind = (
        "the provider takes our key as Idempotency-Key, so a repeated call is harmless"
        if idempotent
        else "an irreversible call: a crash after it leaves the job for a human"
    )
    about = (
        f"It calls the URL its setting ``{job.setting}`` names: {kind}. Its key is "
        f"``{common['key']}``; its migration is ``migrations/{version:04d}_{job.module}.sql``."
    )
    if job.probed:
        about += (
            " When its outcome is lost, its reconcile probe ``find_call`` asks the provider "
            "whether the call arrived."
        )
    text = _EXTERNAL_MODULE.format(
        **common,
        docstring=_docstring(title, about),
        imports=_framework_imports(_external_names(job)),
        setting=job.setting,
        setting_constants=_setting_constants(job),
        settings_tuple=_settings_tuple(job),
        retry=_policy_arguments(job),
        key_header=(
            (f'"Authorization": "Bearer " + ctx.secrets[{job.secrets[0]}], ' if job.secrets else "")
            + (
                '"Idempotency-Key": ctx.idem_key, '
                if idempotent
                else '"X-Request-Key": ctx.idem_key, '
            )
        ),
    )
    if not job.probed:
        return text
    probe = _PROBE.format(name=job.name, setting=job.setting)
    text = text.replace("\n\ndef register(", probe + "\n\ndef register(", 1)
    text = text.replace("import json\n", "import json\nfrom urllib.parse import quote\n", 1)
    return text.replace("    )(handle)\n", "        probe=find_call,\n    )(handle)\n")


def _external_names(job: NewJob) -> list[str]:
    """The framework's names an external job's module imports."""
    names = ["Effect", "JobContext", "JobRegistry", "JsonValue", "LazyPool", "Payload"]
    flow = job.flow
    names += [
        name
        for name, wanted in (
            ("ConcurrencyLimit", flow.concurrency_key),
            ("RateLimit", flow.rate_per_second),
            ("RetryPolicy", flow.retry_attempts),
        )
        if wanted
    ]
    return names + (["Done", "NotDone", "ProbeAnswer", "Unknown"] if job.probed else [])


def _framework_imports(names: Iterable[str]) -> str:
    """The ``from MODULE import ...`` lines of ``names`` (``_IMPORTED_FROM``), one a module."""
    by_module: defaultdict[str, list[str]] = defaultdict(list)
    for name in sorted(set(names)):
        by_module[_IMPORTED_FROM[name]].append(name)
    return "\n".join(f"from {m} import {', '.join(n)}" for m, n in sorted(by_module.items()))


def _policy_arguments(job: NewJob) -> str:
    """The registration's policy arguments, one line each (a rate-limited job warms its pool
    before its first start is reserved, so the import never sits between a start and its
    call)."""
    lines = []
    flow = job.flow
    if flow.retry_attempts:
        lines.append(
            f"retry=RetryPolicy(attempts={flow.retry_attempts}, "
            f"first_delay_seconds={flow.first_delay_seconds!r}, "
            f"max_delay_seconds={flow.max_delay_seconds!r}),"
        )
    if flow.rate_per_second:
        lines.append(f"rate=RateLimit(per_second={flow.rate_per_second}),")
        lines.append("prepare=_http.warm,")
    if flow.concurrency_key:
        fields = ", ".join(f'"{f}"' for f in flow.concurrency_key)
        key = f"({fields},)" if len(flow.concurrency_key) == 1 else f"({fields})"
        lines.append(f"concurrency=ConcurrencyLimit(key={key}, max_running={flow.max_running}),")
    return "".join(f"\n        {line}" for line in lines)


def _setting_constants(job: NewJob) -> str:
    lines = []
    for index, setting in enumerate(job.settings):
        calls = job.effect is not Effect.DATABASE and index == 0
        lines.append(
            "# The base URL this job calls (HTTPS; HTTP on loopback only)."
            if calls
            else "# A setting this job declares (HTTPS; HTTP on loopback only)."
        )
        lines.append(f'{setting} = "{setting}"')
    return "\n".join(lines)


def _settings_tuple(job: NewJob) -> str:
    return "".join(f"{setting}, " for setting in job.settings).rstrip()


def _docstring(title: str, about: str) -> str:
    width = _LINE_LENGTH - 4
    paragraphs = [textwrap.fill(title, width), textwrap.fill(about, width)]
    return '"""' + "\n\n".join(paragraphs) + '\n"""'


def _migration_text(job: NewJob) -> str:
    if job.effect is not Effect.DATABASE:
        return (
            f"-- {job.name} keeps no table of its own yet. Add its DDL here, or in a later\n"
            "-- migration (NNNN_name.sql, the next number): an applied migration is never\n"
            "-- edited.\n"
        )
    columns = "".join(f"    {f} text NOT NULL,\n" for f in job.identity)
    return (
        f"-- {job.name}: one row per unit of work, written in the claim's own transaction.\n"
        f"CREATE TABLE IF NOT EXISTS {job.table} (\n"
        f"{columns}"
        "    payload jsonb NOT NULL,\n"
        "    done_at timestamptz NOT NULL DEFAULT now(),\n"
        f"    PRIMARY KEY ({', '.join(job.identity)})\n"
        ");\n"
    )


def _test_text(job: NewJob) -> str:
    payload = json.dumps(_sample(job, 1))
    other = ", ".join(f'"{f}": "{f}_2"' for f in job.identity)
    third = ", ".join(f'"{f}": "{f}_3"' for f in job.identity)
    external = job.effect is not Effect.DATABASE
    names = ["JobKit", "Route"] if external else ["JobKit"]
    body = _TEST_HEADER.format(name=job.name, payload=payload, imports=_framework_imports(names))
    if external:
        body = body.replace(
            "from __future__ import annotations\n",
            "from __future__ import annotations\n\nimport pytest\n",
            1,
        )
        routes = [f'Route("POST", "/v1/effects/{job.name}"),']
        if job.probed:
            routes.append(f'Route("GET", "/v1/effects/{job.name}/{{key}}", lookup=True),')
        about = f"The stand-in for the provider {job.setting} names: the route the handler calls"
        about += (
            ", and the lookup its probe makes, answered from what the stand-in received."
            if job.probed
            else "."
        )
        about += " Change them with the job's URLs (docs/jobs.md, \"A provider of the job's own\")."
        docstring = textwrap.fill(about, _LINE_LENGTH - 8, subsequent_indent="    ")
        body += _TEST_ROUTES.format(
            docstring=docstring, routes="".join(f"\n        {route}" for route in routes)
        )
    body += _TEST_RUNS_ONCE.format(module=job.module)
    if job.effect is Effect.DATABASE:
        body += _TEST_ONE_ROW.format(table=job.table)
    failing = _TEST_DEFERRED if job.flow.retry_attempts else _TEST_RETRIED
    body += failing.format(module=job.module, other=other)
    if job.flow.rate_per_second:
        body += _TEST_RATE.format(module=job.module, samples=_samples_text(job, 3))
    if job.flow.concurrency_key:
        body += _TEST_CONCURRENCY.format(module=job.module, fourth=_fields_text(job, 4))
    body += _TEST_CONFLICT.format(module=job.module)
    if external:
        body += _TEST_STUCK.format(module=job.module, third=third)
    if job.probed:
        body += _TEST_RECONCILED.format(
            module=job.module, fifth=_fields_text(job, 5), sixth=_fields_text(job, 6)
        )
    return body


def _sample(job: NewJob, n: int) -> dict[str, str]:
    return {"job": job.name, **{f: f"{f}_{n}" for f in job.fields}}


def _fields_text(job: NewJob, n: int) -> str:
    return ", ".join(f'"{f}": "{f}_{n}"' for f in job.identity)


def _samples_text(job: NewJob, count: int) -> str:
    return ", ".join(f"{{**PAYLOAD, {_fields_text(job, 10 + n)}}}" for n in range(count))


def _sample_text(job: NewJob) -> str:
    return json.dumps(_sample(job, 1)) + "\n"


def _format(paths: list[Path], project: Path) -> None:
    """Let the project's formatter have the last word on what was written, when it is installed
    beside this interpreter (``make venv`` installs it), so ``make lint`` passes as written."""
    ruff = Path(sys.executable).parent / "ruff"
    if not ruff.is_file() or not paths:
        return
    names = [str(p) for p in paths]
    for command in (["check", "--fix-only", "--quiet", "--select", "I"], ["format", "--quiet"]):
        # From the project: ruff keeps its cache where it runs, never in the caller's folder.
        subprocess.run(  # noqa: S603
            [str(ruff), *command, *names], check=False, capture_output=True, cwd=project
        )


def _next_version(migrations: Path) -> int:
    versions = [
        int(path.name[:4])
        for path in migrations.glob("*.sql")
        if path.name[:4].isdigit() and path.name[4:5] == "_"
    ]
    return max(versions, default=0) + 1


def _registered(registry_file: Path, module: str) -> str:
    """``functions/jobs/__init__.py`` with the module imported and registered."""
    if not registry_file.is_file():
        raise ConfigurationError(f"{registry_file} does not exist: where is build_registry?")
    text = registry_file.read_text(encoding="utf-8")
    imports = _JOBS_IMPORT.search(text)
    if imports is None and text.count(_DEF_REGISTRY) == 1:
        # The first job of a registry `infrai-jobs init` wrote: its import goes above it.
        text = text.replace(_DEF_REGISTRY, f"from jobs import {module}\n{_DEF_REGISTRY}")
        imports = _JOBS_IMPORT.search(text)
    if imports is None or text.count(_RETURN_REGISTRY) != 1:
        raise ConfigurationError(
            f"{registry_file}: cannot find one `from jobs import ...` line and one "
            f"`return registry` in build_registry; add `from jobs import {module}` and "
            f"`{module}.register(registry)` yourself (nothing was written)"
        )
    names = {n.strip() for n in imports.group(1).strip("()").replace("\n", " ").split(",")}
    names = {n for n in names if n} | {module}
    text = text[: imports.start()] + _import_line(sorted(names)) + text[imports.end() :]
    return text.replace(_RETURN_REGISTRY, f"    {module}.register(registry)\n{_RETURN_REGISTRY}")


def _import_line(names: list[str]) -> str:
    one_line = f"from jobs import {', '.join(names)}"
    if len(one_line) <= _LINE_LENGTH:
        return one_line
    return "from jobs import (\n" + "".join(f"    {n},\n" for n in names) + ")"


def _relative(path: Path, project: Path) -> str:
    try:
        return str(path.relative_to(project))
    except ValueError:
        return str(path)


def _registration(*more_arguments: str) -> str:
    """The end of a scaffolded module's template: its ``register``, the job's name, effect,
    identity and fields declared, then ``more_arguments`` (each a template line of its own)."""
    lines = [
        "",
        "",
        "def register(registry: JobRegistry) -> None:",
        "    registry.job(",
        '        "{name}",',
        "        effect=Effect.{effect},",
        "        identity={identity},",
        "        fields={{{fields}}},",
        *(f"        {argument}" for argument in more_arguments),
        "    )(handle)",
    ]
    return "\n".join(lines) + "\n"


_DATABASE_MODULE = (
    textwrap.dedent(
        '''\
    {docstring}

    from __future__ import annotations

    from typing import LiteralString

    from psycopg.types.json import Jsonb

    {imports}

    _INSERT: LiteralString = """
    INSERT INTO {table} ({columns}, payload)
    VALUES ({values}, %(payload)s)
    RETURNING {columns}
    """


    def handle(payload: Payload, ctx: JobContext) -> JsonValue:
        if ctx.db is None:  # pragma: no cover - the drain always passes it for database jobs
            raise RuntimeError("{name} needs the batch transaction's connection")
        params = {{**payload, "payload": Jsonb(dict(payload))}}
        row = ctx.db.execute(_INSERT, params).fetchone()
        assert row is not None  # INSERT ... RETURNING answers its row
        return {{{returned}}}
    '''
    )
    + _registration()
)

_EXTERNAL_MODULE = textwrap.dedent(
    """\
    {docstring}

    from __future__ import annotations

    import json

    {imports}

    _http = LazyPool(connect_s=2.0, read_s=10.0)

    {setting_constants}


    def handle(payload: Payload, ctx: JobContext) -> JsonValue:
        response = _http.call(
            "POST",
            f"{{ctx.settings[{setting}]}}/v1/effects/{name}",
            provider="the provider",
            body=json.dumps(dict(payload)),
            headers={{{key_header}"Content-Type": "application/json"}},
        )
        try:
            answer = json.loads(response.data)
        except ValueError:
            answer = {{}}
        return {{"provider_id": answer.get("id") if isinstance(answer, dict) else None}}
    """
) + _registration("settings=({settings_tuple}),{retry}")

_TEST_HEADER = textwrap.dedent(
    '''\
    """{name}'s guarantees, one line each, with the test kit (written by ``infrai-jobs
    new-job``)."""

    from __future__ import annotations

    {imports}

    PAYLOAD = {payload}
    '''
)

# An external job's stand-in provider: the routes its handler and its probe call.
_TEST_ROUTES = textwrap.dedent(
    '''

    @pytest.fixture
    def job_kit_provider_routes() -> list[Route]:
        """{docstring}"""
        return [{routes}
        ]
    '''
)

# The reconcile probe's two answers: the call arrived (settled done) or not (run once more).
_TEST_RECONCILED = textwrap.dedent(
    """

    def test_{module}_lost_answer_is_settled_done_by_its_probe(job_kit: JobKit) -> None:
        job_kit.assert_reconciled({{**PAYLOAD, {fifth}}}, effect_happened=True)


    def test_{module}_call_that_never_arrived_runs_once_after_its_probe(job_kit: JobKit) -> None:
        job_kit.assert_reconciled({{**PAYLOAD, {sixth}}}, effect_happened=False)
    """
)

# An irreversible job's reconcile probe: was the call received? Looked up by the key it sent.
_PROBE = textwrap.dedent(
    '''

    def find_call(payload: Payload, ctx: JobContext) -> ProbeAnswer:
        """The reconcile probe, asked about a stuck claim once its lease is over: did the
        provider receive this work's call? It looks the call up by the key the handler sent;
        make it ask what your provider offers. Answer NotDone only if the lookup sees a call as
        soon as it was answered. A lookup that fails raises: the reconcile pass counts it
        unknown."""
        key = quote(ctx.idem_key, safe="")
        response = _http.request("GET", f"{{ctx.settings[{setting}]}}/v1/effects/{name}/{{key}}")
        if response.status == 404:
            return NotDone()
        if response.status != 200:
            return Unknown(f"the provider's lookup answered HTTP {{response.status}}")
        try:
            answer = json.loads(response.data)
        except ValueError:
            answer = None
        if not isinstance(answer, dict) or answer.get("id") is None:
            return Unknown("the provider's lookup answered without the call's id")
        return Done({{"provider_id": answer["id"], "reconciled": True}})
    '''
)

_TEST_RUNS_ONCE = textwrap.dedent(
    """

    def test_{module}_published_twice_runs_once(job_kit: JobKit) -> None:
        job_kit.assert_runs_once(PAYLOAD)
    """
)

_TEST_ONE_ROW = '    assert job_kit.sql("SELECT count(*) FROM {table}") == [(1,)]\n'

_TEST_RETRIED = textwrap.dedent(
    """

    def test_{module}_failing_is_retried_then_dead_lettered(job_kit: JobKit) -> None:
        job_kit.assert_retried_then_dead_lettered(
            {{**PAYLOAD, {other}}},
            raising=RuntimeError("downstream is down"),
        )
    """
)

# A job with a retry policy past Infrai's deliveries: flow control defers it instead.
_TEST_DEFERRED = textwrap.dedent(
    """

    def test_{module}_failing_is_deferred_then_done(job_kit: JobKit) -> None:
        job_kit.assert_deferred_then_done(
            {{**PAYLOAD, {other}}},
            raising=RuntimeError("downstream is down"),
        )
    """
)

# A rate limit: the starts the ledger reserved are the limit's spacing apart, each job once.
_TEST_RATE = textwrap.dedent(
    """

    def test_{module}_starts_keep_the_rate_limit(job_kit: JobKit) -> None:
        job_kit.assert_rate_limited([{samples}])
    """
)

# A concurrency key: with every slot of its value held, the job waits (deferred), then runs.
_TEST_CONCURRENCY = textwrap.dedent(
    """

    def test_{module}_waits_for_a_free_concurrency_slot(job_kit: JobKit) -> None:
        job_kit.assert_held_back_by_concurrency({{**PAYLOAD, {fourth}}})
    """
)

_TEST_CONFLICT = textwrap.dedent(
    """

    def test_{module}_same_key_different_work_is_a_conflict(job_kit: JobKit) -> None:
        job_kit.assert_conflict(PAYLOAD, {{**PAYLOAD, "note": "different work"}})
    """
)

_TEST_STUCK = textwrap.dedent(
    """

    def test_{module}_unknown_outcome_is_left_for_a_human(job_kit: JobKit) -> None:
        job_kit.assert_stuck_when_uncertain(
            {{**PAYLOAD, {third}}},
        )
    """
)
