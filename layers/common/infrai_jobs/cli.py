"""``infrai-jobs``: the operator's command line.

Each sub-command reads settings once, builds the adapters it needs and calls into the package.
Local conveniences (the emulator, embedded PostgreSQL) come from ``infrai_local``, which is
imported only by the commands that need it and is never part of the Lambda layer.

Exit codes: 0 success, 1 the operation failed, 2 bad usage or configuration.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import psycopg

from infrai_jobs.claims_admin import ClaimsAdmin
from infrai_jobs.cli_ops import OpsContext, add_ops_commands, run_ops
from infrai_jobs.drain_report import DrainReport, summary_lines
from infrai_jobs.drain_service import DrainService
from infrai_jobs.errors import (
    ConfigurationError,
    InfraiError,
    InfraiJobsError,
    LedgerUnavailable,
)
from infrai_jobs.factory import make_effect_guard, make_queue_client
from infrai_jobs.keys import derive_key
from infrai_jobs.ledger import connect_to_ledger
from infrai_jobs.migrations import LATEST_VERSION, Migration, apply_migrations
from infrai_jobs.queue_client import InfraiClient
from infrai_jobs.secrets import resolve_secrets
from infrai_jobs.settings import Settings

if TYPE_CHECKING:
    from infrai_jobs.jobs import JobRegistry
    from infrai_local.fan_out import ProcessDrainStarter

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

Command = Callable[[argparse.Namespace], int]

_LOCAL_COMMANDS = {"emulator": "emulator", "invoke": "invoke", "demo": "demo"}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in _LOCAL_COMMANDS:
        # Local-only tools own their flags; they are never part of the Lambda layer.
        module = importlib.import_module(f"infrai_local.{_LOCAL_COMMANDS[args[0]]}")
        code: int = module.main(args[1:])
        return code
    parser = _build_parser()
    namespace = parser.parse_args(args)
    command: Command | None = getattr(namespace, "command", None)
    if command is None and getattr(namespace, "ops_command", None):
        command = _cmd_ops
    if command is None:
        parser.print_help()
        return EXIT_USAGE
    try:
        return command(namespace)
    except ConfigurationError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except InfraiError as exc:
        print(f"error: Infrai {exc}{_hint(exc)}", file=sys.stderr)
        return EXIT_FAILED
    except InfraiJobsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED


def _hint(exc: InfraiError) -> str:
    if exc.code == "UNAUTHORIZED":
        return "\n  hint: check INFRAI_API_KEY (the key is never printed)"
    if exc.code == "QUEUE_NOT_FOUND":
        return "\n  hint: check INFRAI_QUEUE, or create it with `infrai-jobs publish --create`"
    if exc.code == "CONNECTION_ERROR":
        return "\n  hint: check INFRAI_BASE_URL and that the service is reachable"
    return ""


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="infrai-jobs",
        description="Process Infrai queue jobs exactly once: claim in Postgres, then work.",
    )
    sub = parser.add_subparsers(metavar="COMMAND")

    sub.add_parser(
        "emulator",
        help="serve the Infrai queue API on loopback (see `infrai-jobs emulator --help`)",
        add_help=False,
    )
    sub.add_parser(
        "invoke",
        help="invoke a template function locally, like `sam local invoke` (see --help)",
        add_help=False,
    )
    sub.add_parser("demo", help="tell the field notes' story end to end, locally", add_help=False)

    publish = sub.add_parser("publish", help="publish one JSON job to the queue")
    publish.add_argument("body", help='the job as JSON, e.g. \'{"job": "invoice.finalize", ...}\'')
    publish.add_argument("--queue", help="queue name (default: INFRAI_QUEUE)")
    publish.add_argument("--delay-seconds", type=int, default=None)
    publish.add_argument("--count", type=int, default=1, help="publish the same body N times")
    publish.add_argument("--create", action="store_true", help="create the queue and DLQ first")
    publish.set_defaults(command=_cmd_publish)

    migrate = sub.add_parser("migrate", help="create or upgrade the claim ledger's tables")
    migrate.set_defaults(command=_cmd_migrate)

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
    drain.add_argument(
        "--jobs-path",
        default="functions/drain",
        help="folder holding the `jobs` package (default: functions/drain)",
    )
    drain.add_argument(
        "--fan-out-slot",
        default=None,
        metavar="DRAIN_ID",
        help="the drain slot a backlog fan-out reserved for this run (set by the fan-out)",
    )
    drain.set_defaults(command=_cmd_drain)

    add_ops_commands(sub)

    stats = sub.add_parser("stats", help="show a queue's counters")
    stats.add_argument("--queue", help="queue name (default: INFRAI_QUEUE)")
    stats.add_argument("--json", action="store_true", help="print JSON for scripts")
    stats.set_defaults(command=_cmd_stats)

    return parser


def _with_local_fallbacks(
    settings: Settings, stack: contextlib.ExitStack, *, database: bool = False
) -> Settings:
    """Locally, what is not configured is started here and stopped on exit.

    No INFRAI_BASE_URL: a fresh emulator. No DATABASE_URL (when ``database``): an embedded,
    migrated PostgreSQL. No PROVIDER_URL: the provider sink the example jobs call.
    """
    if not settings.infrai_base_url:
        from infrai_local.emulator import start_in_thread  # noqa: PLC0415 - local only

        server = start_in_thread()
        stack.callback(server.stop)
        settings = replace(
            settings,
            infrai_base_url=server.url,
            infrai_api_key=settings.infrai_api_key or "local-emulator",
        )
        print(f"note: no INFRAI_BASE_URL; using a fresh local emulator at {server.url}")
    if database and not settings.database_url and not settings.database_secret_arn:
        from infrai_local.embedded_db import ensure_database_url  # noqa: PLC0415

        url = ensure_database_url()
        _migrate(url)
        settings = replace(settings, database_url=url)
    if database and not settings.provider_url:
        from infrai_local import provider_sink  # noqa: PLC0415

        sink = provider_sink.start_in_thread()
        stack.callback(sink.stop)
        settings = replace(settings, provider_url=sink.url)
    return settings


@contextlib.contextmanager
def _queue_client(settings: Settings) -> Iterator[InfraiClient]:
    with contextlib.ExitStack() as stack:
        client = make_queue_client(resolve_secrets(_with_local_fallbacks(settings, stack)))
        stack.callback(client.close)
        yield client


def _migrate(url: str) -> list[Migration]:
    try:
        with connect_to_ledger(
            url, connect_timeout=10, application_name="infrai-jobs-migrate"
        ) as conn:
            return apply_migrations(conn)
    except psycopg.Error as exc:
        raise LedgerUnavailable(f"cannot migrate: {exc}") from exc


def _cmd_migrate(args: argparse.Namespace) -> int:
    settings = resolve_secrets(Settings.from_env())
    if settings.database_url:
        applied = _migrate(settings.database_url)
    else:
        from infrai_local.embedded_db import ensure_database_url  # noqa: PLC0415 - local only

        applied = _migrate(ensure_database_url())
    for migration in applied:
        print(f"applied {migration.version}: {migration.name}")
    if not applied:
        print(f"schema already at version {LATEST_VERSION}; nothing to do")
    return EXIT_OK


def _load_registry(jobs_path: str, provider_url: str) -> JobRegistry:
    folder = Path(jobs_path).resolve()
    if not (folder / "jobs" / "__init__.py").is_file():
        raise ConfigurationError(
            f"no jobs package in {folder}; run from the project root or pass --jobs-path"
        )
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    jobs = importlib.import_module("jobs")
    registry: JobRegistry = jobs.build_registry(provider_url)
    return registry


def _cmd_drain(args: argparse.Namespace) -> int:
    settings = Settings.from_env()
    if args.queue:
        settings = replace(settings, queue=args.queue)
    fanned_out: list[dict[str, object]] = []
    with contextlib.ExitStack() as stack:
        settings = _with_local_fallbacks(settings, stack, database=True)
        starter = _drain_processes(settings, args)
        service = DrainService.from_settings(
            settings,
            lambda provider_url: _load_registry(args.jobs_path, provider_url),
            starter=starter,
        )
        stack.callback(service.close)
        deadline = time.monotonic() + args.time_budget_seconds
        # Problem messages and retried calls, one line each on stderr as they happen.
        with DrainReport(sys.stderr).attached():
            summary = service.run(
                lambda: int((deadline - time.monotonic()) * 1000),
                max_batches=args.max_batches,
                fan_out_slot=args.fan_out_slot,
            )
        if starter is not None:
            # Before the local emulator and database stop: the children use them.
            fanned_out = starter.wait()
    for line in summary_lines(summary):
        print(line, file=sys.stderr)
    result: dict[str, object] = summary.as_dict()
    if fanned_out:
        result["fanned_out_drains"] = fanned_out
    print(json.dumps(result))
    return EXIT_OK


def _drain_processes(settings: Settings, args: argparse.Namespace) -> ProcessDrainStarter | None:
    """Locally, a fan-out starts `infrai-jobs drain` processes on this queue and ledger."""
    if settings.drain_max_concurrency <= 1:
        return None
    from infrai_local.fan_out import ProcessDrainStarter  # noqa: PLC0415 - local only

    env = dict(os.environ)
    # The children use this run's endpoints, local stand-ins included, never their own.
    env.update(
        {
            "INFRAI_BASE_URL": settings.infrai_base_url,
            "INFRAI_API_KEY": settings.infrai_api_key,
            "INFRAI_QUEUE": settings.queue,
            "INFRAI_DLQ": settings.dlq,
            "DATABASE_URL": settings.database_url,
            "PROVIDER_URL": settings.provider_url,
        }
    )
    return ProcessDrainStarter(
        env, time_budget_seconds=args.time_budget_seconds, jobs_path=args.jobs_path
    )


def _cmd_ops(args: argparse.Namespace) -> int:
    settings = resolve_secrets(Settings.from_env())
    if args.ops_command in ("dlq", "redrive", "cost") and not settings.infrai_base_url:
        raise ConfigurationError(
            "INFRAI_BASE_URL is not set; point it at Infrai (or a running `infrai-jobs emulator`)"
        )
    with contextlib.ExitStack() as stack:

        def queue() -> InfraiClient:
            client = make_queue_client(settings)
            stack.callback(client.close)
            return client

        def admin() -> ClaimsAdmin:
            return ClaimsAdmin(settings.require_database_url())

        return run_ops(
            args,
            OpsContext(
                queue=queue,
                admin=admin,
                database_url=settings.require_database_url,
                queue_name=settings.queue,
                dlq_name=settings.dlq,
                key_of=_key_function(),
                forget=_second_layer_forget(settings),
            ),
        )


def _second_layer_forget(settings: Settings) -> Callable[[str], None] | None:
    guard = make_effect_guard(settings)
    return guard.forget if guard is not None else None


def _key_function() -> Callable[[object], str]:
    """Keys as the drain derives them: from the jobs package when it is here, else defaults."""
    folder = Path("functions/drain")
    if not (folder / "jobs" / "__init__.py").is_file():
        return derive_key
    registry = _load_registry(str(folder), "")
    return lambda payload: registry.derive(payload).idem_key


def _cmd_publish(args: argparse.Namespace) -> int:
    settings = Settings.from_env()
    try:
        body = json.loads(args.body)
    except ValueError as exc:
        raise ConfigurationError(f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ConfigurationError("the body must be a JSON object")
    if args.count < 1:
        raise ConfigurationError("--count must be at least 1")
    queue = args.queue or settings.queue
    with _queue_client(settings) as client:
        if args.create:
            client.ensure_queue(queue, dlq=settings.dlq if queue == settings.queue else None)
        for _ in range(args.count):
            print(client.publish(queue, body, delay_seconds=args.delay_seconds))
    return EXIT_OK


def _cmd_stats(args: argparse.Namespace) -> int:
    settings = Settings.from_env()
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
