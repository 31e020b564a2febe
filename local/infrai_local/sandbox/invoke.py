"""``infrai-jobs invoke FUNCTION --event FILE [--env-vars FILE]``: a local Lambda invocation.

It reads ``template.yaml`` and ``samconfig.toml`` as ``sam local invoke`` does (see
``sam_template``: the ``--config-env`` environment's ``local_invoke`` and ``global`` sections,
never ``deploy``'s), then runs the handler in a child Python with only the function's code, its
layers and their dependencies on the path: ``python -S`` skips site-packages' ``.pth`` files, so
neither ``infrai_local`` nor anything else installed in the developer's virtualenv leaks in. The
child is this machine's Python with the virtualenv's packages, not the template's Runtime and
Architectures (python3.13 on arm64): ``make build`` and ``.ci/check_build.py`` cover those. The
child gets a Lambda context whose remaining time counts down from the function's Timeout, and is
killed when it runs out.

The jobs' settings and secrets' ARNs reach the function in one variable, ``JOB_SETTINGS`` (the
template's JobSettings, or the env-vars file's JSON string): an entry it leaves empty is filled in
there, from the shell or a stand-in, as any other variable would be. A job's secret is passed as
``sam local invoke`` passes it, by its ``NAME_SECRET_ARN`` (the function fetches it with the
shell's AWS credentials); with none named, the shell's plain ``NAME`` is passed, and in a sandbox
a stand-in value (``PARITY_GAPS`` says so).

Local stand-ins, all or nothing as everywhere in this project (``local_services``): a variable the
function's environment leaves empty is taken from the shell when set there, and an endpoint only
the template's parameter defaults name counts as empty (a default is the template author's
suggestion for AWS, not the user's choice: the hosted Infrai is reached only when the user set
its URL); when none of the
function's endpoints is configured, an embedded PostgreSQL (migrated: this command started it),
a fresh emulator and the provider sink stand in for the invocation; when any is configured, a
missing one is a configuration error. A database invoke did not start is never migrated.

As ``sam local invoke`` does, the shell's AWS credentials, profile, region and endpoints are
passed on (``aws_environment``), and ``AWS_SAM_LOCAL=true`` tells the function it runs locally.

A function that may invoke itself (DrainFunction's backlog fan-out, ``DRAIN_MAX_CONCURRENCY``
above 1) gets Lambda's Invoke API on loopback (``infrai_local.sandbox.fan_out.LocalLambda``): each
``Event`` invoke runs ``infrai-jobs invoke`` again with that event, on the same local services,
at most ``ReservedConcurrentExecutions`` at once, and this invocation ends once they all have.

Logs go to stderr, the handler's JSON result to stdout. Exit code 0 when the handler returned,
1 when it raised or timed out, 2 for bad usage.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from infrai_jobs.config.settings import JOB_SETTINGS_ENV, SECRET_ARN_SUFFIX
from infrai_jobs.errors import ConfigurationError
from infrai_jobs.ledger.postgres import describe
from infrai_local.sam_template import (
    FunctionSpec,
    load_template,
    parse_parameter_overrides,
    resolve_function,
    samconfig_environments,
    samconfig_overrides,
    samconfig_parameters,
)
from infrai_local.sandbox import (
    LEDGER_ENDPOINT,
    QUEUE_ENDPOINT,
    STAND_IN_SECRET,
    sandbox_notice,
    stand_ins,
)

# Runs inside the child. It is passed with -c so that no folder of this package is on the path.
_BOOTSTRAP = r"""
import importlib, json, os, sys, time, uuid

handler_name, event_file, result_file, deadline, function_name, memory = sys.argv[1:7]
deadline = float(deadline)


class LambdaContext:
    function_name = function_name
    function_version = "$LATEST"
    invoked_function_arn = (
        "arn:aws:lambda:" + os.environ.get("AWS_REGION", "us-east-1")
        + ":123456789012:function:" + function_name
    )
    memory_limit_in_mb = int(memory)
    aws_request_id = str(uuid.uuid4())
    log_group_name = "/aws/lambda/" + function_name
    log_stream_name = "local"

    def get_remaining_time_in_millis(self):
        return max(0, int((deadline - time.time()) * 1000))


module_name, _, attr = handler_name.rpartition(".")
try:
    with open(event_file) as stream:
        event = json.load(stream)
    handler = getattr(importlib.import_module(module_name), attr)
    result = {"ok": True, "payload": handler(event, LambdaContext())}
except Exception as exc:
    # The error's type and message, never a stack trace: it is printed to whoever invoked.
    result = {"ok": False, "payload": {"errorMessage": str(exc), "errorType": type(exc).__name__}}
with open(result_file, "w") as stream:
    json.dump(result, stream, default=str)
sys.stdout.flush()
sys.exit(0 if result["ok"] else 1)
"""

# What a Lambda environment has besides the function's own variables.
_PASS_THROUGH = ("PATH", "HOME", "LANG", "LC_ALL", "TZ", "TMPDIR", "XDG_RUNTIME_DIR")
# The shell's AWS credentials, profile, region and endpoints, forwarded as `sam local invoke`
# forwards them (with the files a profile lives in, and every AWS_ENDPOINT_URL_<SERVICE>).
AWS_FORWARDED = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_CONFIG_FILE",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_CA_BUNDLE",
    "AWS_DEFAULT_REGION",
    "AWS_REGION",
    "AWS_ENDPOINT_URL",
)
AWS_SERVICE_ENDPOINT_PREFIX = "AWS_ENDPOINT_URL_"
# Where a function runs when neither the shell nor its profile names a region, as in SAM.
DEFAULT_REGION = "us-east-1"


def aws_environment(shell: Mapping[str, str]) -> dict[str, str]:
    """The AWS variables a local invocation takes from ``shell``, and the region both
    ``AWS_REGION`` and ``AWS_DEFAULT_REGION`` name (Lambda sets the two alike): the shell's
    ``AWS_REGION``, else its ``AWS_DEFAULT_REGION``, else its profile's, else us-east-1."""
    forwarded = {
        name: value
        for name, value in shell.items()
        if value and (name in AWS_FORWARDED or name.startswith(AWS_SERVICE_ENDPOINT_PREFIX))
    }
    region = (
        shell.get("AWS_REGION")
        or shell.get("AWS_DEFAULT_REGION")
        or _profile_region(shell)
        or DEFAULT_REGION
    )
    forwarded["AWS_REGION"] = forwarded["AWS_DEFAULT_REGION"] = region
    return forwarded


def _profile_region(shell: Mapping[str, str]) -> str:
    """The region of the shell's AWS profile (its config file), or "" when it names none."""
    profile = shell.get("AWS_PROFILE") or shell.get("AWS_DEFAULT_PROFILE")
    if not profile:
        return ""
    import configparser  # noqa: PLC0415 - only a profile without a region in the shell needs it

    config = configparser.ConfigParser()
    path = shell.get("AWS_CONFIG_FILE") or str(Path(shell.get("HOME", "~")) / ".aws" / "config")
    try:
        config.read(Path(path).expanduser())
    except (OSError, configparser.Error):
        return ""
    section = "default" if profile == "default" else f"profile {profile}"
    return config.get(section, "region", fallback="").strip()


@dataclass(frozen=True, slots=True)
class InvocationResult:
    function: str
    ok: bool
    timed_out: bool
    payload: Any
    duration_ms: int

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1


def dependency_path() -> list[str]:
    """Where the layer's pinned requirements are installed locally: the folders this Python's
    own start-up put on its path (the virtualenv's site-packages and the folders its ``.pth``
    files name, or a base or user site), the standard library aside. The handler's Python
    starts without that start-up (``-S``), so it sees these folders and nothing a ``.pth``
    file would run."""
    stdlib = tuple(sysconfig.get_paths()[name] for name in ("stdlib", "platstdlib"))
    site = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    found = [p for p in sys.path if p and os.path.isdir(p) and not p.startswith(stdlib)]
    return sorted(site) + [p for p in dict.fromkeys(found) if p not in site]


def invoke(
    spec: FunctionSpec,
    event: Path,
    *,
    log_stream: TextIO | None = None,
    extra_env: Mapping[str, str] | None = None,
) -> InvocationResult:
    """Run one invocation of ``spec`` with the event in ``event``."""
    python_path = [str(spec.code_uri), *map(str, spec.layer_dirs), *dependency_path()]
    env = {name: os.environ[name] for name in _PASS_THROUGH if name in os.environ}
    env.update(aws_environment(os.environ))
    env.update(
        {
            "PYTHONPATH": os.pathsep.join(python_path),
            "PYTHONDONTWRITEBYTECODE": "1",
            "AWS_LAMBDA_FUNCTION_NAME": spec.logical_id,
            "AWS_LAMBDA_FUNCTION_MEMORY_SIZE": str(spec.memory_mb),
            "AWS_LAMBDA_FUNCTION_TIMEOUT": str(spec.timeout),
            "AWS_LAMBDA_FUNCTION_VERSION": "$LATEST",
            # As `sam local invoke` says so: the function knows it is not in AWS (the drain
            # then fans out only to a local Lambda endpoint, never to the real service).
            "AWS_SAM_LOCAL": "true",
            "_HANDLER": spec.handler,
        }
    )
    env.update(spec.environment)
    env.update(extra_env or {})
    with tempfile.TemporaryDirectory(prefix="infrai-invoke-") as scratch:
        result_file = Path(scratch) / "result.json"
        started = time.time()
        deadline = started + spec.timeout
        command = [
            sys.executable,
            "-S",
            "-c",
            _BOOTSTRAP,
            spec.handler,
            str(event.resolve()),
            str(result_file),
            repr(deadline),
            spec.logical_id,
            str(spec.memory_mb),
        ]
        out = log_stream if log_stream is not None else sys.stderr
        with subprocess.Popen(  # noqa: S603 - our own interpreter and arguments
            command,
            cwd=spec.code_uri,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        ) as process:
            timed_out = False
            try:
                for line in _lines_until(process, deadline + 1.0):
                    out.write(line)
            except TimeoutError:
                timed_out = True
                process.kill()
            process.wait()
        duration_ms = int((time.time() - started) * 1000)
        if timed_out:
            message = f"Task timed out after {spec.timeout:.2f} seconds"
            return InvocationResult(
                spec.logical_id, False, True, {"errorMessage": message}, duration_ms
            )
        if not result_file.exists():
            return InvocationResult(
                spec.logical_id,
                False,
                False,
                {"errorMessage": f"the handler process exited with {process.returncode}"},
                duration_ms,
            )
        document = json.loads(result_file.read_text())
        return InvocationResult(
            spec.logical_id, bool(document["ok"]), False, document["payload"], duration_ms
        )


def _lines_until(process: subprocess.Popen[str], deadline: float) -> Iterator[str]:
    """The child's output, line by line; TimeoutError once the deadline passes."""
    import selectors  # noqa: PLC0415 - only the invoke command needs it

    assert process.stdout is not None
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        while True:
            remaining = deadline - time.time()
            if remaining <= 0:
                raise TimeoutError
            if not selector.select(timeout=min(remaining, 0.5)):
                if process.poll() is not None:
                    return
                continue
            line = process.stdout.readline()
            if not line:
                return
            yield line


# What a function's environment may leave empty and the shell may fill in (and the settings
# its jobs declared).
_FROM_SHELL = (QUEUE_ENDPOINT, "INFRAI_API_KEY", LEDGER_ENDPOINT)
# The variables that point a function at something real.
_ENDPOINTS = (QUEUE_ENDPOINT, LEDGER_ENDPOINT, "DATABASE_SECRET_ARN")


def job_setting_owners(spec: FunctionSpec) -> dict[str, tuple[str, ...]]:
    """The settings the jobs in the function's code declared that its environment carries (the
    template gives the functions that run jobs ``JOB_SETTINGS``, which carries every one), with
    the jobs that declared each."""
    return _declared_in_environment(spec, secrets=False)


def job_secret_owners(spec: FunctionSpec) -> dict[str, tuple[str, ...]]:
    """The secrets the jobs in the function's code declared whose ``NAME_SECRET_ARN`` its
    environment carries (in ``JOB_SETTINGS``), with their jobs."""
    return _declared_in_environment(spec, secrets=True)


def _declared_in_environment(spec: FunctionSpec, *, secrets: bool) -> dict[str, tuple[str, ...]]:
    if not (spec.code_uri / "jobs" / "__init__.py").is_file():
        return {}
    from infrai_local.jobs_package import load_registry  # noqa: PLC0415

    registry = load_registry(str(spec.code_uri))
    declared = registry.declared_secrets() if secrets else registry.declared_settings()
    suffix = SECRET_ARN_SUFFIX if secrets else ""
    carried = JOB_SETTINGS_ENV in spec.environment
    return {
        name: jobs
        for name, jobs in declared.items()
        if carried or name + suffix in spec.environment
    }


def _job_settings_map(spec: FunctionSpec) -> dict[str, str] | None:
    """The function's ``JOB_SETTINGS`` (the template's JobSettings, or the env-vars file's), or
    None when its environment has none; refused here, as the function would refuse it, when it
    is not a JSON object of strings."""
    if JOB_SETTINGS_ENV not in spec.environment:
        return None
    try:
        mapped = json.loads(spec.environment[JOB_SETTINGS_ENV] or "{}")
    except ValueError:
        mapped = None
    if not isinstance(mapped, dict) or not all(isinstance(v, str) for v in mapped.values()):
        raise ConfigurationError(
            f"{spec.logical_id}'s {JOB_SETTINGS_ENV} is not a JSON object of strings "
            '(e.g. {"NAME": ""}): see the env-vars file, or the JobSettings parameter'
        )
    return mapped


def _unfolded(
    spec: FunctionSpec,
) -> tuple[FunctionSpec, dict[str, tuple[str, ...]], list[str]]:
    """``spec`` with each of the jobs' settings and secrets' ARNs that ``JOB_SETTINGS`` carries
    as a variable of its own, so that the shell and the stand-ins fill them in as any other
    (``_folded`` puts what they filled back into ``JOB_SETTINGS``); the settings' owners; and
    the names it carries."""
    owners = job_setting_owners(spec)
    names = [*owners, *(name + SECRET_ARN_SUFFIX for name in job_secret_owners(spec))]
    mapped = _job_settings_map(spec)
    if mapped is None:
        return spec, owners, names
    unfolded = {name: mapped.get(name, "") for name in names if not spec.environment.get(name)}
    template_only = set(spec.template_only)
    if JOB_SETTINGS_ENV in spec.template_only:
        template_only |= set(unfolded)
    unfolded_spec = dataclasses.replace(
        spec,
        environment={**spec.environment, **unfolded},
        template_only=frozenset(template_only),
    )
    return unfolded_spec, owners, names


def _folded(spec: FunctionSpec, names: Sequence[str], values: dict[str, str]) -> dict[str, str]:
    """``values`` with those of ``names`` moved into the function's ``JOB_SETTINGS``: SAM passes
    the function only the variables its template declares, and the template declares the map."""
    mapped = _job_settings_map(spec)
    moved = {name: values.pop(name) for name in names if name in values}
    if mapped is not None and moved:
        values[JOB_SETTINGS_ENV] = json.dumps({**mapped, **moved})
    elif moved:
        values.update(moved)
    return values


def _job_secrets(
    spec: FunctionSpec,
    env: Mapping[str, str],
    shell: Mapping[str, str],
    say: Callable[[str], object],
) -> tuple[dict[str, str], list[str]]:
    """Each job secret's ARN variable, as ``sam local invoke`` passes it: from the template
    and ``--env-vars``, else from the shell; and, where no ARN is named, the plain ``NAME`` from
    the shell (which SAM would not pass: its template declares no such variable). Returns the
    values to add and the secrets still unset."""
    values: dict[str, str] = {}
    unset: list[str] = []
    for name in job_secret_owners(spec):
        variable = name + SECRET_ARN_SUFFIX
        if not env.get(variable) and shell.get(variable):
            values[variable] = shell[variable]
            say(f"{variable}: from your shell ({values[variable]})")
        if env.get(variable) or values.get(variable):
            continue
        if shell.get(name):
            values[name] = shell[name]
            say(f"{name}: from your shell (not shown)")
        else:
            unset.append(name)
    return values, unset


@contextlib.contextmanager
def local_services(
    spec: FunctionSpec,
    *,
    shell: Mapping[str, str] | None = None,
    announce: Callable[[str], object] | None = None,
) -> Iterator[dict[str, str]]:
    """The values to add to the function's environment for one local invocation.

    A variable the template and ``--env-vars`` leave empty is taken from the shell when it is
    set there (the same variables the other commands read). Then all or nothing: when none of
    the function's endpoints (INFRAI_BASE_URL, DATABASE_URL or DATABASE_SECRET_ARN, the
    settings its jobs declared) is configured, each one it declares is stood in for the
    invocation (an emulator with the function's queue, an embedded PostgreSQL that this command
    starts and therefore migrates, the jobs' migrations included, one provider sink for every
    job setting), after one line saying so; when any is configured, a missing one is a
    ``ConfigurationError`` naming it (a job setting with its jobs) and nothing starts. A
    database this command did not start is never migrated: the handler reports
    ``SchemaNotMigrated`` with the command.
    """
    say = announce if announce is not None else _to_stderr
    from_shell = os.environ if shell is None else shell
    spec, owners, carried = _unfolded(spec)
    secret_values, unset_secrets = _job_secrets(spec, spec.environment, from_shell, say)
    # An endpoint only the template's defaults name (InfraiBaseUrl's hosted service) is not
    # one the user chose: it counts as unset, and is never passed on to the function.
    values: dict[str, str] = {
        name: ""
        for name in (*_ENDPOINTS, *owners)
        if name in spec.environment and name in spec.template_only
    }
    env = {**spec.environment, **values}
    for name in (*_FROM_SHELL, *owners):
        if name in env and not env[name] and from_shell.get(name):
            values[name] = from_shell[name]
            shown = describe(values[name]) if name == LEDGER_ENDPOINT else values[name]
            if name != "INFRAI_API_KEY":
                say(f"{name}: from your shell ({shown})")
    merged = {**env, **values}
    declared = [name for name in (QUEUE_ENDPOINT, LEDGER_ENDPOINT, *owners) if name in env]
    configured = {
        name: bool(
            merged.get(name) or (name == LEDGER_ENDPOINT and merged.get("DATABASE_SECRET_ARN"))
        )
        for name in declared
    }
    if merged.get(LEDGER_ENDPOINT):
        # A database this command did not start: looked at, never migrated.
        _require_migrated(merged[LEDGER_ENDPOINT])
    who = f"`infrai-jobs invoke {spec.logical_id}`"
    plan = stand_ins(configured, declared, who=who, job_setting_owners=owners)
    # A job's secret left unset: a stand-in in a sandbox; else the function says it is missing.
    values.update(secret_values)
    if plan:
        values.update(dict.fromkeys(unset_secrets, STAND_IN_SECRET))
    with contextlib.ExitStack() as stack:
        if plan:
            say(sandbox_notice(plan, who=who))
        if LEDGER_ENDPOINT in plan:
            values["DATABASE_URL"] = _embedded_migrated_ledger(spec.code_uri)
            values["DATABASE_SECRET_ARN"] = ""
        if QUEUE_ENDPOINT in plan:
            from infrai_jobs.queue.client import InfraiClient  # noqa: PLC0415
            from infrai_local.sandbox.emulator import start_in_thread  # noqa: PLC0415
            from infrai_local.sandbox.queues import ensure_queue  # noqa: PLC0415

            server = start_in_thread()
            stack.callback(server.stop)
            values["INFRAI_BASE_URL"] = server.url
            values["INFRAI_API_KEY"] = merged.get("INFRAI_API_KEY") or "local-emulator"
            values["INFRAI_API_KEY_PARAMETER"] = ""
            if merged.get("INFRAI_QUEUE"):
                # The function's queue exists, empty, as on a freshly deployed stack.
                client = InfraiClient(server.url, values["INFRAI_API_KEY"])
                try:
                    ensure_queue(
                        client, merged["INFRAI_QUEUE"], dlq=merged.get("INFRAI_DLQ") or None
                    )
                finally:
                    client.close()
        if any(name in owners for name in plan):
            from infrai_local.sandbox import provider_sink  # noqa: PLC0415

            sink = provider_sink.start_in_thread()
            stack.callback(sink.stop)
            values.update(dict.fromkeys((name for name in plan if name in owners), sink.url))
        yield _folded(spec, carried, values)


@contextlib.contextmanager
def _self_invocations(
    spec: FunctionSpec, args: argparse.Namespace, services: Mapping[str, str]
) -> Iterator[dict[str, str]]:
    """Lambda's Invoke API for this function on loopback, when it may fan out to itself."""
    concurrency = _int_or_zero(spec.environment.get("DRAIN_MAX_CONCURRENCY", ""))
    if concurrency <= 1:
        yield {}
        return
    from infrai_local.sandbox.fan_out import CLI, LocalLambda  # noqa: PLC0415

    with tempfile.TemporaryDirectory(prefix="infrai-fan-out-") as scratch:
        folder = Path(scratch)
        # The children run on this invocation's local services, never on new ones.
        env_vars = folder / "env.json"
        env_vars.write_text(json.dumps({spec.logical_id: {**spec.environment, **services}}))
        template = (args.template or Path.cwd() / "template.yaml").resolve()
        count = [0]

        def launch(payload: bytes) -> list[str]:
            count[0] += 1
            event = folder / f"event-{count[0]}.json"
            event.write_bytes(payload or b"{}")
            return [
                *CLI,
                "invoke",
                spec.logical_id,
                "--event",
                str(event),
                "--env-vars",
                str(env_vars),
                "--template",
                str(template),
                "--config-env",
                args.config_env,
            ]

        endpoint = LocalLambda(
            spec.logical_id,
            launch,
            env={**os.environ, **aws_environment(os.environ)},
            reserved_concurrency=spec.reserved_concurrency or concurrency,
            cwd=template.parent,
            log=sys.stderr,
        ).start()
        try:
            yield endpoint.client_env()
        finally:
            endpoint.stop(timeout=spec.timeout + 30)


def _int_or_zero(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        return 0


def _embedded_migrated_ledger(code_uri: Path) -> str:
    """This process's own embedded server, whatever the shell says: the one database invoke
    may migrate is one it started. The jobs' tables are those of the jobs package in the
    function's own code."""
    from infrai_jobs.ledger.postgres import connect_to_ledger  # noqa: PLC0415
    from infrai_local.migrations import (  # noqa: PLC0415
        apply_migrations,
        jobs_migrations_folder,
        read_migrations,
    )
    from infrai_local.sandbox.embedded_db import ensure_database_url  # noqa: PLC0415

    jobs = read_migrations(jobs_migrations_folder(code_uri))
    url = ensure_database_url({}, announce=lambda _line: None)
    with connect_to_ledger(url, application_name="infrai-jobs-invoke") as conn:
        apply_migrations(conn, jobs)
    return url


def _require_migrated(url: str) -> None:
    """``SchemaNotMigrated``, naming the command to run, for a database behind this code (or
    ``SchemaTooNew`` for one whose floor is above this code's version)."""
    from infrai_jobs.ledger.job_schema import check_schema  # noqa: PLC0415
    from infrai_jobs.ledger.postgres import connect_to_ledger  # noqa: PLC0415

    with connect_to_ledger(url, application_name="infrai-jobs-invoke") as conn:
        check_schema(conn)


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def resolve(
    function: str,
    *,
    root: Path,
    template: Path | None = None,
    env_vars: Path | None = None,
    config_env: str = "default",
    parameter_overrides: Mapping[str, str] | None = None,
) -> FunctionSpec:
    """The function as ``sam local invoke`` would run it: the template, samconfig.toml's
    ``local_invoke`` and ``global`` parameter overrides for ``config_env``, then
    ``parameter_overrides`` (the command line's), then the env-vars file."""
    document = load_template(template or root / "template.yaml")
    overrides = samconfig_overrides(root / "samconfig.toml", config_env)
    overrides.update(parameter_overrides or {})
    env_document: dict[str, Any] = {}
    if env_vars is not None:
        try:
            env_document = json.loads(env_vars.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigurationError(f"cannot read --env-vars {env_vars}: {exc}") from exc
        if not isinstance(env_document, dict):
            raise ConfigurationError(f"--env-vars {env_vars} must hold a JSON object")
    return resolve_function(
        document,
        function,
        root,
        parameter_overrides=overrides,
        env_vars=env_document,
    )


def _check_event(event: Path) -> None:
    """The event must be a readable JSON file: found out here, not as a traceback in the child."""
    if not event.is_file():
        raise ConfigurationError(f"no event file {event}")
    try:
        json.loads(event.read_text(), parse_constant=_reject_constant)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigurationError(f"the event file {event} is not valid JSON: {exc}") from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


# Shown by --help; docs/development.md ("Where it differs from sam local invoke") says the same.
PARITY_GAPS = """\
where it differs from sam local invoke:
  - AWS credentials: it forwards AWS_PROFILE and the config and credentials files, and the
    function's SDK resolves the profile; SAM resolves the profile itself and passes only
    AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and AWS_SESSION_TOKEN.
  - Lambda's own variables: it sets AWS_LAMBDA_FUNCTION_NAME (the logical id), _MEMORY_SIZE,
    _TIMEOUT, _VERSION, AWS_REGION and AWS_SAM_LOCAL; not AWS_LAMBDA_LOG_GROUP_NAME,
    AWS_LAMBDA_LOG_STREAM_NAME or AWS_ACCOUNT_ID, which SAM sets.
  - The env-vars file's "Parameters" section: SAM sets those environment variables in every
    function; here its entries also count as template parameter values, so a name that is
    a parameter (QueueName=...) changes every variable that refers to it.
  - A variable the template and --env-vars leave empty is taken from this shell; SAM never
    reads the shell into the function.
  - A job's setting or NAME_SECRET_ARN left empty in JOB_SETTINGS is taken from this shell
    too, and written into JOB_SETTINGS (the one variable the template declares for them).
  - A job's secret: NAME_SECRET_ARN is passed as SAM passes it, in JOB_SETTINGS (the function
    then fetches the secret from Secrets Manager with your AWS credentials); where none is
    named, the shell's plain NAME is passed too, and in a sandbox a stand-in value. SAM passes
    only variables the template declares, and the template declares JOB_SETTINGS only.
  - The handler runs on this machine's Python with the virtualenv's packages, not python3.13
    on arm64 in Lambda's image.
"""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="infrai-jobs invoke",
        description="Invoke a function of template.yaml locally, as `sam local invoke` would.",
        epilog=PARITY_GAPS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("function", help="the function's logical id, e.g. DrainFunction")
    parser.add_argument("--event", "-e", required=True, type=Path, help="event JSON file")
    parser.add_argument(
        "--env-vars",
        "-n",
        type=Path,
        help="SAM env-vars JSON file (default: env_vars of samconfig.toml's local_invoke section)",
    )
    parser.add_argument("--template", "-t", type=Path, help="default: ./template.yaml")
    parser.add_argument(
        "--config-env",
        default="default",
        help="samconfig.toml environment: its local_invoke and global sections apply, as in SAM",
    )
    parser.add_argument(
        "--parameter-overrides",
        help="template parameters, 'Name=Value Name2=Value2' (over samconfig.toml's)",
    )
    args = parser.parse_args(argv)
    root = (args.template.parent if args.template else Path.cwd()).resolve()
    try:
        samconfig = root / "samconfig.toml"
        if samconfig.is_file() and args.config_env not in samconfig_environments(samconfig):
            # SAM CLI goes on without a word; say it, since a typo would go unnoticed.
            print(
                f"note: {samconfig.name} has no [{args.config_env}] environment: "
                "only the template's defaults apply",
                file=sys.stderr,
            )
        env_vars = args.env_vars
        if env_vars is None:
            configured = samconfig_parameters(samconfig, args.config_env).get("env_vars")
            env_vars = root / str(configured) if configured else None
        spec = resolve(
            args.function,
            root=root,
            template=args.template,
            env_vars=env_vars,
            config_env=args.config_env,
            parameter_overrides=parse_parameter_overrides(args.parameter_overrides or ""),
        )
        _check_event(args.event)
        with local_services(spec) as extra, _self_invocations(spec, args, extra) as lambda_env:
            result = invoke(spec, args.event, extra_env={**extra, **lambda_env})
    except ConfigurationError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    status = "timed out" if result.timed_out else ("ok" if result.ok else "error")
    print(
        f"END {spec.logical_id}: {status} in {result.duration_ms} ms (timeout {spec.timeout} s)",
        file=sys.stderr,
    )
    print(json.dumps(result.payload, indent=2, default=str))
    return result.exit_code
