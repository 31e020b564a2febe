"""``infrai-jobs init`` and ``infrai-jobs upgrade``: a team's own project on a pinned version.

A project holds the team's files and two the framework owns, which only these commands write:

* ``framework.yaml``: the framework's SAM resources, the template this version ships (this
  repository's ``template.yaml``, as package data), under generated first lines that record the
  version and the ledger migrations it carries. The team's ``template.yaml`` nests it as one
  ``AWS::Serverless::Application`` with a local ``Location``, so its relative ``CodeUri``
  (``functions``) and ``ContentUri`` (``layers/common``) resolve from the project's root.
* ``layers/common/requirements.txt``: the pin ``infrai-jobs==VERSION``, which ``sam build``
  installs into the functions' layer. No module of the framework is copied into a project.

``upgrade`` rewrites those two and nothing else, and says what changed in between: the
changelog's sections, the ledger migrations added, the template parameters added or removed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import textwrap
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Final

import yaml

from infrai_jobs import __version__
from infrai_jobs.errors import ConfigurationError
from infrai_local.authoring.scaffold import _IMPORTS_TEST
from infrai_local.migrations import LEDGER_MIGRATIONS
from infrai_local.sam_template import decode_template, deploy_values, samconfig_environments

FRAMEWORK: Final = "framework.yaml"
PIN: Final = Path("layers/common/requirements.txt")
NESTED: Final = "Framework"
PLACEHOLDER: Final = "SET-ME"
_HEADER: Final = (
    "# infrai-jobs {version}: the framework's resources. Written by init/upgrade; do not edit.\n"
    "# ledger migrations: {migrations}\n"
)
_HEADER_VERSION: Final = re.compile(r"^# infrai-jobs (\S+):")
_HEADER_MIGRATIONS: Final = re.compile(r"^# ledger migrations: ([0-9 ]*)$", re.M)
_PIN_LINE: Final = re.compile(r"^infrai-jobs==(\S+)\s*$", re.M)
_SECTION: Final = re.compile(r"^## (\d+\.\d+\.\d+)\b.*$", re.M)
# CloudFormation's rule for a stack name.
_STACK_NAME: Final = re.compile(r"^[A-Za-z][A-Za-z0-9-]{0,127}$")
# The framework parameters a team's template declares besides those without a default.
_TEAM_PARAMETERS: Final = (
    "InfraiBaseUrl",
    "QueueName",
    "DlqName",
    "ApiKeyParameterName",
    "DatabaseSecretArn",
    "JobSettings",
    "JobSecretArns",
    "AlertEmail",
    "LogLevel",
    "LogRetentionDays",
    "EnableTracing",
    "DrainScheduleRate",
)


def _shipped(name: str) -> str:
    return (resources.files("infrai_local") / name).read_text(encoding="utf-8")


def framework_text() -> str:
    """``framework.yaml`` as this version writes it: the shipped template under its header."""
    migrations = " ".join(str(m.version) for m in LEDGER_MIGRATIONS)
    return _HEADER.format(version=__version__, migrations=migrations) + _shipped(FRAMEWORK)


def read_deploy(root: Path, config_env: str) -> None:
    """Refuse, in one line, a project whose deploy of ``config_env`` cannot be read: a broken
    template or samconfig.toml, or an environment samconfig.toml lacks (SAM CLI would go on with
    the template's defaults alone, and a typo would pass every check)."""
    deploy_values(root, config_env)
    samconfig = root / "samconfig.toml"
    if samconfig.is_file() and config_env not in (known := samconfig_environments(samconfig)):
        raise ConfigurationError(
            f"samconfig.toml has no [{config_env}] environment (it has {', '.join(known)}): "
            "its deploy would take only the template's defaults"
        )


# The changelog ships one folder above the pages, which link to it: a page of its own too.
CHANGELOG_PAGE: Final = "changelog"


def _shipped_page(page: str) -> str:
    return "CHANGELOG.md" if page == CHANGELOG_PAGE else f"docs/{page}.md"


def docs_pages() -> dict[str, str]:
    """The framework's documentation as this version ships it: each page's name (what
    a page a message names in ``docs/`` is called by) and its title; the changelog among them."""
    folder = resources.files("infrai_local") / "docs"
    pages = sorted(
        {CHANGELOG_PAGE}
        | {
            entry.name.removesuffix(".md")
            for entry in folder.iterdir()
            if entry.name.endswith(".md")
        }
    )
    return {page: _shipped(_shipped_page(page)).split("\n", 1)[0].lstrip("# ") for page in pages}


def docs_page(name: str) -> str:
    """One page's Markdown; ``name`` may be written ``configuration``, ``configuration.md`` or
    ``docs/configuration.md``, and the changelog ``changelog`` or ``CHANGELOG.md``."""
    page = name.removeprefix("docs/").removesuffix(".md")
    page = CHANGELOG_PAGE if page.lower() == CHANGELOG_PAGE else page
    if page not in docs_pages():
        raise ConfigurationError(
            f"no documentation page {name!r}: the pages are {', '.join(docs_pages())}"
        )
    return _shipped(_shipped_page(page))


def version_key(version: str) -> tuple[int, ...]:
    """``MAJOR.MINOR.PATCH`` as numbers, to order versions."""
    if not re.fullmatch(r"\d+\.\d+\.\d+", version):
        raise ConfigurationError(f"{version!r} is not a MAJOR.MINOR.PATCH version")
    return tuple(int(part) for part in version.split("."))


# --- init ----------------------------------------------------------------------------------------


def init(directory: Path, stack: str) -> list[Path]:
    """Write a team's project into ``directory`` (absent or empty), for stack ``stack``."""
    if not _STACK_NAME.match(stack):
        raise ConfigurationError(
            f"stack name {stack!r}: CloudFormation takes letters, digits and hyphens, starting "
            "with a letter, at most 128 characters (e.g. payments-jobs)"
        )
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise ConfigurationError(f"{directory} exists and is not an empty folder: nothing written")
    framework = framework_text()
    template = _team_template(decode_template(framework, FRAMEWORK), stack)
    files = {
        FRAMEWORK: framework,
        str(PIN): _pin_text(),
        "template.yaml": template.text,
        "samconfig.toml": _samconfig(stack, template.overrides),
        "functions/jobs/__init__.py": _REGISTRY,
        "functions/jobs/migrations/README.txt": _MIGRATIONS_README,
        "tests/conftest.py": _CONFTEST,
        "tests/unit/test_jobs_import_public_api.py": _IMPORTS_TEST,
        "pytest.ini": _PYTEST_INI,
        "events/drain-schedule.json": json.dumps(_SCHEDULE_EVENT, indent=2) + "\n",
        "events/redrive-dry-run.json": json.dumps(_REDRIVE_DRY_RUN, indent=2) + "\n",
        "events/redrive.json": json.dumps(_REDRIVE_EVENT, indent=2) + "\n",
        "events/env.json": json.dumps(_ENV_VARS, indent=2) + "\n",
        "Makefile": _MAKEFILE.replace("@PYTEST@", _pytest_pin()),
        "README.md": _README.format(stack=stack, version=__version__),
        ".gitignore": _GITIGNORE,
    }
    # Written in a hidden folder beside it, then renamed into place: a run stopped half-way
    # (Ctrl-C, a full disk) leaves no half project that the next init would refuse.
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.init-", dir=directory.parent))
    try:
        for name, text in files.items():
            path = staging / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
        staging.chmod(0o777 & ~_umask())
        try:
            staging.replace(directory)
        except OSError:
            raise ConfigurationError(
                f"{directory} was filled by something else meanwhile: nothing written there"
            ) from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return [directory / name for name in files]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@dataclass(frozen=True, slots=True)
class _TeamTemplate:
    text: str
    # samconfig.toml's parameter_overrides: the placeholder where a value is required.
    overrides: dict[str, str]


def _team_template(framework: dict[str, Any], stack: str) -> _TeamTemplate:
    parameters: dict[str, Any] = framework.get("Parameters", {})
    names = [
        name
        for name, spec in parameters.items()
        if name in _TEAM_PARAMETERS or "Default" not in spec
    ]
    declared = {name: _passable(parameters[name]) for name in names}
    # The team's own names for what the framework names after its examples.
    for name, default in (("QueueName", stack), ("DlqName", f"{stack}-dlq")):
        if name in declared:
            declared[name] = {**declared[name], "Default": default}
    passed = "".join(f"        {name}: !Ref {name}\n" for name in names)
    # Re-exported: an output the framework declares under a condition may not exist.
    outputs = "".join(
        f"  {name}:\n    Description: {json.dumps(_text(spec.get('Description'), name))}\n"
        f"    Value: !GetAtt {NESTED}.Outputs.{name}\n"
        for name, spec in framework.get("Outputs", {}).items()
        if "Condition" not in spec
    )
    text = _TEMPLATE.format(
        stack=stack,
        nested=NESTED,
        framework=FRAMEWORK,
        parameters=textwrap.indent(yaml.safe_dump(declared, sort_keys=False, width=96), "  "),
        passed=passed,
        outputs=outputs and "\nOutputs:\n" + outputs,
    )
    overrides = {
        name: str(spec.get("Default", PLACEHOLDER))
        for name, spec in declared.items()
        if "Default" not in spec or name in ("QueueName", "DlqName")
    }
    return _TeamTemplate(text, overrides)


def _passable(spec: dict[str, Any]) -> dict[str, Any]:
    """A nested application's parameters are strings: a list parameter is declared here as the
    comma-separated text the framework's own parameter splits (and checks item by item)."""
    if spec.get("Type") != "CommaDelimitedList":
        return spec
    kept = {k: v for k, v in spec.items() if k not in ("AllowedPattern", "ConstraintDescription")}
    return {**kept, "Type": "String"}


def _text(value: Any, otherwise: str) -> str:
    return value if isinstance(value, str) else otherwise


def _samconfig(stack: str, overrides: dict[str, str]) -> str:
    pairs = " ".join(f"{name}={value}" for name, value in overrides.items())
    return _SAMCONFIG.format(stack=stack, overrides=json.dumps(pairs))


def _pin_text() -> str:
    return _PIN_HEADER + f"infrai-jobs=={__version__}\n"


def _pytest_pin() -> str:
    """The pytest the framework's own tests run on, from this distribution's metadata."""
    from importlib.metadata import PackageNotFoundError, requires  # noqa: PLC0415

    try:
        pins = [r.split(";")[0].strip() for r in requires("infrai-jobs") or []]
    except PackageNotFoundError:
        pins = []
    return next((pin for pin in pins if pin.startswith("pytest==")), "pytest")


# --- upgrade -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Upgrade:
    """What ``upgrade`` did: from which version to which, and what changed in between."""

    project: Path
    old: str
    new: str
    changelog: list[str]
    migrations: list[str]
    parameters_added: list[str]
    parameters_removed: list[str]

    def as_dict(self) -> dict[str, Any]:
        return {
            "project": str(self.project),
            "from": self.old,
            "to": self.new,
            "upgraded": self.old != self.new,
            "rewritten": [FRAMEWORK, str(PIN)] if self.old != self.new else [],
            "changelog": self.changelog,
            "ledger_migrations_added": self.migrations,
            "parameters_added": self.parameters_added,
            "parameters_removed": self.parameters_removed,
        }

    def lines(self) -> list[str]:
        if self.old == self.new:
            return [f"already at infrai-jobs {self.new}: nothing to do"]
        lines = [
            f"upgraded {self.project} from infrai-jobs {self.old} to {self.new}:",
            f"  rewrote {FRAMEWORK} and {PIN} (no file of yours was touched)",
        ]
        if self.migrations:
            lines += ["ledger migrations this version adds (run `infrai-jobs migrate` first):"]
            lines += [f"  {m}" for m in self.migrations]
        for what, names in (("added", self.parameters_added), ("removed", self.parameters_removed)):
            if names:
                lines.append(f"template parameters {what}: {', '.join(names)}")
        if self.parameters_removed:
            lines.append("  (remove them from template.yaml's Framework and samconfig.toml)")
        lines += ["", *self.changelog] if self.changelog else []
        return lines


def upgrade(project: Path) -> Upgrade:
    """Bring ``project``'s framework-owned files to the installed version."""
    old = pinned_version(project)
    new = __version__
    if version_key(new) < version_key(old):
        raise ConfigurationError(
            f"the installed infrai-jobs {new} is older than the project's {old}: a downgrade is "
            f"not an upgrade; install infrai-jobs=={old} or newer (nothing was changed)"
        )
    if new == old:
        return Upgrade(project, old, new, [], [], [], [])
    framework_file = project / FRAMEWORK
    old_text = framework_file.read_text(encoding="utf-8")
    recorded = _HEADER_MIGRATIONS.search(old_text)
    known = {int(v) for v in recorded[1].split()} if recorded else set()
    # An upgrade stopped between the two files left framework.yaml newer than the pin: what it
    # records is not the old version's, so every migration is named (migrate skips the applied).
    header = _HEADER_VERSION.search(old_text)
    if header is None or header[1] != old:
        known = set()
    new_text = framework_text()
    old_parameters = set(decode_template(old_text, framework_file).get("Parameters", {}))
    new_parameters = set(decode_template(new_text, FRAMEWORK).get("Parameters", {}))
    # Each file replaced whole (never half written), the pin last: a stop in between leaves the
    # old pin, so the next upgrade runs again.
    for path, text in ((framework_file, new_text), (project / PIN, _pin_text())):
        partial = path.with_name(path.name + ".upgrading")
        partial.write_text(text, encoding="utf-8")
        partial.replace(path)
    return Upgrade(
        project,
        old,
        new,
        changelog_between(old, new),
        [f"ledger {m.version:04d}: {m.name}" for m in LEDGER_MIGRATIONS if m.version not in known],
        sorted(new_parameters - old_parameters),
        sorted(old_parameters - new_parameters),
    )


def pinned_version(project: Path) -> str:
    """The version a project is on: its pin's."""
    pin, framework = project / PIN, project / FRAMEWORK
    found = _PIN_LINE.search(pin.read_text(encoding="utf-8")) if pin.is_file() else None
    if found is None or not framework.is_file():
        raise ConfigurationError(
            f"{project} is not an infrai-jobs project: it needs {FRAMEWORK} and an "
            f"`infrai-jobs==VERSION` line in {PIN} (what `infrai-jobs init` writes); run "
            "upgrade in one, or pass --project DIR"
        )
    version_key(found[1])
    return found[1]


def changelog_between(old: str, new: str) -> list[str]:
    """The shipped changelog's sections for the versions after ``old``, up to ``new``, as
    lines, newest first."""
    text = _shipped("CHANGELOG.md")
    starts = list(_SECTION.finditer(text))
    lines: list[str] = []
    for index, start in enumerate(starts):
        version = version_key(start[1])
        if version_key(old) < version <= version_key(new):
            end = starts[index + 1].start() if index + 1 < len(starts) else len(text)
            lines += [*text[start.start() : end].rstrip().splitlines(), ""]
    return lines[:-1]


# --- the project's files ------------------------------------------------------------------------

_TEMPLATE: Final = """\
# {stack}: the team's stack.
# The framework's resources (functions, schedules, alarms, dashboard, optional second layer,
# outbox relay) are one nested application, {framework}, which
# `infrai-jobs init` and `infrai-jobs upgrade` write from the installed version: never edit it.
# This file is yours: its parameters, and resources of your own beside {nested}. A framework
# parameter not passed below keeps its default; pass it as `Name: !Ref Name` with a parameter
# of the same name here.
AWSTemplateFormatVersion: "2010-09-09"
Transform: AWS::Serverless-2016-10-31
Description: {stack}, jobs processed exactly once by infrai-jobs.

Parameters:
{parameters}
Resources:
  {nested}:
    Type: AWS::Serverless::Application
    Properties:
      Location: {framework}
      Parameters:
{passed}{outputs}"""

_SAMCONFIG: Final = """\
# SAM CLI settings: `sam build`, `sam validate`, `sam deploy`. A SET-ME must be replaced
# before a deploy (CloudFormation refuses it, naming the parameter).
version = 0.1

[default.global.parameters]
stack_name = "{stack}"

[default.build.parameters]
cached = true
parallel = true

[default.validate.parameters]
lint = true

[default.deploy.parameters]
capabilities = "CAPABILITY_IAM CAPABILITY_AUTO_EXPAND"
confirm_changeset = true
resolve_s3 = true
s3_prefix = "{stack}"
tags = "project={stack}"
parameter_overrides = {overrides}

# `sam local invoke` and `infrai-jobs invoke` take this env-vars file unless given --env-vars.
[default.local_invoke.parameters]
env_vars = "events/env.json"
"""

_PIN_HEADER: Final = """\
# The framework's version, which `sam build` installs into the functions' layer. Written by
# `infrai-jobs init` and `infrai-jobs upgrade` (which reads it): do not edit.
"""

_REGISTRY: Final = '''\
"""Our jobs: one module each, registered in ``build_registry``. ``infrai-jobs new-job`` writes
a job's module, migration, test and sample payload, and registers it here."""

from __future__ import annotations

from infrai_jobs.jobs.registry import JobRegistry


def build_registry() -> JobRegistry:
    """Every job the functions know. Their settings are bound by the drain at start-up."""
    registry = JobRegistry()
    return registry
'''

_MIGRATIONS_README: Final = """\
Our jobs' own tables: `NNNN_name.sql` files applied in order by `infrai-jobs migrate`, after
the ledger's. `infrai-jobs new-job` writes the next one.
"""

_CONFTEST: Final = '''\
"""Our jobs' tests run through the framework's test kit: a fresh database on a real PostgreSQL
(DATABASE_URL when set, else an embedded one), the Infrai emulator and a stand-in provider."""

pytest_plugins = ["infrai_local.testkit"]
'''

_PYTEST_INI: Final = """\
[pytest]
testpaths = tests
# The functions' code root, as Lambda puts it on the path: `import jobs` finds our jobs.
pythonpath = functions
addopts = -ra --strict-markers
filterwarnings = error
"""

_SCHEDULE_EVENT: Final = {
    "version": "0",
    "id": "5f0c9d2a7b3e4c18",
    "detail-type": "Scheduled Event",
    "source": "aws.scheduler",
    "time": "2026-11-29T09:00:00Z",
    "resources": ["arn:aws:scheduler:us-east-1:123456789012:schedule/jobs/DrainSchedule"],
    "detail": {},
}

# RedriveFunction's event, as the runbook's dead-letter steps invoke it: a dry run, then this.
_REDRIVE_EVENT: Final = {"max_messages": 100, "reopen_failed": False, "dry_run": False}
_REDRIVE_DRY_RUN: Final = {**_REDRIVE_EVENT, "dry_run": True}

# Empty values: `infrai-jobs invoke` takes them from the shell, else stands in a sandbox.
_ENV_VARS: Final = {
    "Parameters": dict.fromkeys(
        (
            "INFRAI_BASE_URL",
            "INFRAI_API_KEY",
            "INFRAI_API_KEY_PARAMETER",
            "DATABASE_URL",
            "DATABASE_SECRET_ARN",
        ),
        "",
    )
}

_MAKEFILE: Final = """\
# `make demo` runs our jobs end to end on the local stand-ins; `make test` runs our tests.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The framework's version: the pin that `infrai-jobs upgrade` moves.
VERSION := $(shell sed -n 's/^infrai-jobs==//p' layers/common/requirements.txt)
STAMP := $(VENV)/.installed-$(VERSION)
SAM ?= sam

.PHONY: venv test demo build validate

# pip takes the version from the configured index, or from PIP_FIND_LINKS (a folder of wheels,
# named by its absolute path: pip runs here).
# The .pth line puts functions/ on the path, as Lambda puts the CodeUri: `import jobs` works.
$(STAMP): layers/common/requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet "infrai-jobs[local]==$(VERSION)" "@PYTEST@"
	echo "$(CURDIR)/functions" > "$$($(BIN)/python -c 'import sysconfig; \\
		print(sysconfig.get_path("purelib"))')/team_jobs.pth"
	touch $@

venv: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest

# The names of the settings (or secrets) our jobs declare.
NAMES := import sys, jobs; print(*getattr(jobs.build_registry(), sys.argv[1])())
DECLARED := $(BIN)/python -c '$(NAMES)'

# The stand-ins run as long as the demo: an embedded PostgreSQL, the emulator and the provider
# sink (every setting a job declares points at it), then migrate, publish each sample payload in
# events/jobs/ and drain. With no sample payload there is nothing to publish: it says so, and
# starts nothing.
demo: $(STAMP)
	@set -euo pipefail; \\
	if ! compgen -G 'events/jobs/*.json' >/dev/null; then \\
		echo "no jobs yet (events/jobs/ holds no sample payload to publish):" \\
			"$(BIN)/infrai-jobs new-job NAME --effect ... --identity ... adds one" \\
			"with its sample, then make demo"; \\
		exit 0; \\
	fi; \\
	run=$$(mktemp -d); pids=(); \\
	trap 'kill "$${pids[@]}" 2>/dev/null; wait; rm -rf "$$run"' EXIT; \\
	$(BIN)/infrai-jobs postgres --url-file "$$run/database" >/dev/null & pids+=($$!); \\
	$(BIN)/infrai-jobs emulator --port 0 >"$$run/queue" 2>/dev/null & pids+=($$!); \\
	$(BIN)/infrai-jobs provider-sink >"$$run/sink" 2>/dev/null & pids+=($$!); \\
	for f in database queue sink; do \\
		for _ in $$(seq 600); do [[ -s "$$run/$$f" ]] && break; sleep 0.1; done; \\
	done; \\
	export DATABASE_URL=$$(head -1 "$$run/database") INFRAI_BASE_URL=$$(head -1 "$$run/queue"); \\
	export INFRAI_API_KEY=demo INFRAI_QUEUE=demo-jobs INFRAI_DLQ=demo-jobs-dlq; \\
	sink=$$(head -1 "$$run/sink"); \\
	for name in $$($(DECLARED) declared_settings); do export "$$name=$$sink"; done; \\
	for name in $$($(DECLARED) declared_secrets); do export "$$name=demo-secret"; done; \\
	$(BIN)/infrai-jobs migrate; \\
	for event in events/jobs/*.json; do \\
		$(BIN)/infrai-jobs publish --create --body-file "$$event"; \\
	done; \\
	$(BIN)/infrai-jobs drain

# sam build installs the pinned framework into the layer (python3.13 on PATH for it), after
# the checks a deploy of CONFIG_ENV would need to pass: the ledger's CA bundle, the connection
# budget, our jobs' settings and secrets. CHECK_SKIP="--skip job-settings" for a build never
# deployed (infrai-jobs build-check --help).
CONFIG_ENV ?= default
CHECK_SKIP ?=
build: $(STAMP)
	$(BIN)/infrai-jobs build-check --config-env $(CONFIG_ENV) $(CHECK_SKIP)
	$(SAM) build

validate: $(STAMP)
	$(SAM) validate --lint
	$(BIN)/cfn-lint template.yaml framework.yaml
"""

_README: Final = """\
# {stack}

Our jobs, processed exactly once by infrai-jobs {version}: each message from Infrai's queue is
claimed in a PostgreSQL ledger before it runs and acked only when its outcome is settled.

    make demo    # our jobs end to end on local stand-ins (emulator, embedded PostgreSQL)
    make test    # our tests, on the framework's test kit

`make` installs the pinned infrai-jobs with pip from your package index (or from a folder of
wheels that PIP_FIND_LINKS names by its absolute path, e.g. `export PIP_FIND_LINKS="$PWD/dist"`
where `make dist` left them) into `.venv`. `.venv/bin/infrai-jobs new-job NAME --effect ...
--identity ...` adds a job; `make build` (`sam build`) and `make validate` need the SAM CLI.

The framework's documentation ships with it: `.venv/bin/infrai-jobs docs` lists the pages and
the changelog, and `.venv/bin/infrai-jobs docs jobs` prints one (writing jobs); a message that
names `docs/configuration.md` means `infrai-jobs docs configuration`.

## Whose files are whose

The framework's, rewritten by `infrai-jobs upgrade` and never edited by hand:

- `framework.yaml`: the framework's SAM resources, nested by `template.yaml`;
- `layers/common/requirements.txt`: the pinned version, installed into the functions' layer.

Everything else is ours: `template.yaml` (our parameters and resources), `samconfig.toml`,
`functions/jobs/` (our jobs and their migrations), `tests/`, `events/`, this README, the
Makefile. To move to a newer version: `pip install -U infrai-jobs`, `infrai-jobs upgrade`
(it prints the changelog in between, the ledger migrations to apply and the parameters added
or removed), `infrai-jobs migrate`, then `make test` and deploy.
"""

_GITIGNORE: Final = """\
.venv/
.aws-sam/
__pycache__/
.pytest_cache/
.ruff_cache/
"""
