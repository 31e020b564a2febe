"""``infrai-jobs outbox relay|status|list|retry|discard``: the producers' outbox from a laptop or
a bastion.

``relay`` runs one pass, as OutboxRelayFunction does, against the configured Infrai and outbox
database (never a throwaway emulator: a publish there would vanish). ``--follow`` keeps relaying
until Ctrl-C: it listens on the ``infrai_outbox`` channel, which ``enqueue(..., notify=True)``
signals at commit, and polls every ``--poll-seconds`` in any case, so a row enqueued without
notify still goes out within that interval. ``LISTEN`` needs a session of its own, which a
transaction pooler does not keep: ``OUTBOX_LISTEN_URL`` names the outbox's database directly,
for listening only (docs/configuration.md, "Behind a connection pooler"). ``status`` reads the
outbox's figures.

``list`` shows the rows that wait (pending, or dead: refused for good, or for their own queue),
``retry`` makes one (or every dead one) due now, ``discard`` deletes one with a reason; both are
``infrai_jobs.outbox.admin``'s, recorded in claim_history with the operator's name.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from infrai_jobs.config.settings import OutboxRelaySettings
from infrai_jobs.errors import ConfigurationError, OutboxError
from infrai_jobs.ledger.postgres import LedgerConnector, ledger_errors, malformed_reason
from infrai_jobs.outbox.admin import WAITING, OutboxAdmin, OutboxChange
from infrai_jobs.outbox.relay import OutboxRelay, RelayReport
from infrai_jobs.outbox.rows import OutboxRow
from infrai_jobs.outbox.status import OutboxStatus, read_status
from infrai_jobs.outbox.writer import NOTIFY_CHANNEL
from infrai_jobs.runtime.factory import (
    ledger_connector,
    make_outbox_relay,
    make_queue_client,
    outbox_connector,
    with_secrets,
)
from infrai_local.operator.verbs import default_actor

EXIT_OK = 0

# A pass from the command line has no invocation deadline; this stands in for one.
PASS_BUDGET_MS = 240_000
# What `outbox list` shows at most unless --limit says otherwise.
DEFAULT_LIST_LIMIT = 100
# The outbox's database without a pooler in between, for --follow's LISTEN (CLI only).
LISTEN_URL_ENV = "OUTBOX_LISTEN_URL"


def add_outbox_commands(sub: Any, command: Callable[[argparse.Namespace], int]) -> None:
    """Register ``outbox relay|status|list|retry|discard``; ``command`` is what the CLI's
    dispatcher calls for each (``run_outbox``, wired by the CLI)."""
    outbox = sub.add_parser(
        "outbox",
        help="the producers' transactional outbox: relay it to Infrai, show it, retry or "
        "discard a row",
    )
    actions = outbox.add_subparsers(metavar="ACTION", dest="outbox_action", required=True)
    relay = actions.add_parser(
        "relay", help="publish what producers committed, oldest first, as OutboxRelayFunction"
    )
    relay.add_argument("--max-batches", type=int, default=None, help="stop after N batches")
    relay.add_argument(
        "--follow",
        action="store_true",
        help="keep relaying until Ctrl-C: woken by enqueue(..., notify=True), else every "
        "--poll-seconds",
    )
    relay.add_argument(
        "--poll-seconds",
        type=float,
        default=5.0,
        help="with --follow, the longest wait between passes (default 5)",
    )
    _add_json_and_command(relay, command)
    status = actions.add_parser(
        "status", help="pending rows, the oldest one's age, published in the last hour, dead"
    )
    _add_json_and_command(status, command)
    _add_row_commands(actions, command)


def _add_json_and_command(
    parser: argparse.ArgumentParser, command: Callable[[argparse.Namespace], int]
) -> None:
    """How every ``outbox`` action ends: ``--json`` for scripts, and the command it runs."""
    parser.add_argument("--json", action="store_true", help="print JSON for scripts")
    parser.set_defaults(command=command)


def _add_row_commands(actions: Any, command: Callable[[argparse.Namespace], int]) -> None:
    listing = actions.add_parser(
        "list", help="the rows that wait, oldest first: pending, and dead (refused for good)"
    )
    listing.add_argument(
        "--state", choices=WAITING, default=None, help="only pending, or only dead, rows"
    )
    listing.add_argument("--job", default=None, help="only rows of this job")
    listing.add_argument("--queue", default=None, help="only rows for this queue (their own)")
    listing.add_argument(
        "--failing", action="store_true", help="only rows that met an error (attempts > 0)"
    )
    listing.add_argument(
        "--limit", type=int, default=DEFAULT_LIST_LIMIT, help="at most N rows (default 100)"
    )
    _add_json_and_command(listing, command)
    retry = actions.add_parser(
        "retry",
        help="make a pending or dead row due now, its attempts at 0 (after fixing the cause); "
        "recorded in claim_history",
    )
    retry.add_argument("seq", nargs="?", type=int, default=None, help="the row's seq")
    retry.add_argument("--all-dead", action="store_true", help="every dead row")
    retry.add_argument("--note", default="", help="why, for claim_history")
    _add_json_and_command(retry, command)
    discard = actions.add_parser(
        "discard",
        help="delete a pending or dead row for good; recorded in claim_history with its body",
    )
    discard.add_argument("seq", type=int, help="the row's seq")
    discard.add_argument("--reason", required=True, help="why, for claim_history")
    _add_json_and_command(discard, command)


def run_outbox(args: argparse.Namespace) -> int:
    settings = OutboxRelaySettings.from_env()
    if not (settings.database_url or settings.database_secret_arn):
        raise ConfigurationError(
            "`infrai-jobs outbox` needs DATABASE_URL (or DATABASE_SECRET_ARN): the outbox lives "
            "in the ledger's database unless OUTBOX_DATABASE_URL names another"
        )
    if args.outbox_action == "status":
        return _status(settings, as_json=args.json)
    if args.outbox_action in ("list", "retry", "discard"):
        return _row_command(settings, args)
    if not settings.infrai_base_url:
        raise ConfigurationError(
            "`infrai-jobs outbox relay` needs INFRAI_BASE_URL: a row published to a throwaway "
            "emulator would be marked published and lost. Point it at Infrai or at a running "
            "`infrai-jobs emulator`"
        )
    if args.max_batches is not None and args.max_batches < 1:
        raise ConfigurationError("--max-batches must be at least 1")
    if args.poll_seconds <= 0:
        raise ConfigurationError("--poll-seconds must be above 0")
    listen_url = os.environ.get(LISTEN_URL_ENV, "").strip()
    if args.follow and malformed_reason(listen_url):
        # Names the variable, never the value: it may hold a password.
        raise ConfigurationError(f"{LISTEN_URL_ENV} is malformed: {malformed_reason(listen_url)}")
    edge, refresh = with_secrets(settings)
    client = make_queue_client(edge, refresh_api_key=refresh.api_key)
    try:
        relay = make_outbox_relay(edge, client, refresh=refresh)
        if args.follow:
            listener = (
                LedgerConnector(listen_url, application_name="infrai-jobs-outbox-listen")
                if listen_url
                else outbox_connector(edge)
            )
            return _follow(relay, listener, args.poll_seconds, as_json=args.json)
        report = _one_pass(relay, args.max_batches)
        _print_report(report, relay.status(), as_json=args.json)
    finally:
        client.close()
    return EXIT_OK


def _one_pass(relay: OutboxRelay, max_batches: int | None) -> RelayReport:
    deadline = time.monotonic() + PASS_BUDGET_MS / 1000
    return relay.run(lambda: int((deadline - time.monotonic()) * 1000), max_batches=max_batches)


def _follow(
    relay: OutboxRelay, connector: LedgerConnector, poll_seconds: float, *, as_json: bool
) -> int:
    """Relay until Ctrl-C, woken by ``connector``'s LISTEN (the outbox's own connector, or
    ``OUTBOX_LISTEN_URL``'s) or every ``poll_seconds``."""
    with connector.session("cannot listen on the outbox") as conn:
        conn.execute("LISTEN infrai_outbox")
        print(
            f"relaying; listening on {NOTIFY_CHANNEL}, polling every {poll_seconds:g} s "
            "(Ctrl-C stops)",
            file=sys.stderr,
            flush=True,
        )
        while True:
            report = _one_pass(relay, None)
            if report.published or report.retried or report.dead or report.refused:
                _print_report(report, None, as_json=as_json)
            with ledger_errors("cannot listen on the outbox", connector.url):
                for _ in conn.notifies(timeout=poll_seconds, stop_after=1):
                    pass


def _status(settings: OutboxRelaySettings, *, as_json: bool) -> int:
    edge = with_secrets(settings, api_key=False).settings
    with outbox_connector(edge).session("cannot read the outbox") as conn:
        status = read_status(conn)
    if as_json:
        print(json.dumps(status.as_dict()))
    else:
        _print_fields(status.as_dict())
    return EXIT_OK


def _row_command(settings: OutboxRelaySettings, args: argparse.Namespace) -> int:
    """``list``, ``retry`` or ``discard``: each checks its arguments before it connects."""
    if args.outbox_action == "list" and args.limit < 1:
        raise ConfigurationError("--limit must be at least 1")
    if args.outbox_action == "retry" and (args.seq is None) == (not args.all_dead):
        raise ConfigurationError("`outbox retry` takes a row's SEQ or --all-dead (one of them)")
    if args.outbox_action == "discard" and not args.reason.strip():
        raise ConfigurationError("`outbox discard` needs a --reason that says why")
    edge = with_secrets(settings, api_key=False).settings
    admin = OutboxAdmin(outbox_connector(edge), ledger_connector(edge, _APPLICATION, None))
    if args.outbox_action == "list":
        return _list(admin, args)
    actor = default_actor()
    if args.outbox_action == "discard":
        changes = [admin.discard(args.seq, actor=actor, reason=args.reason)]
    elif args.all_dead:
        changes = _retry_every_dead(admin, actor, args.note)
    else:
        changes = [admin.retry(args.seq, actor=actor, note=args.note)]
    _print_changes(args.outbox_action, changes, as_json=args.json)
    return EXIT_OK


def _retry_every_dead(admin: OutboxAdmin, actor: str, note: str) -> list[OutboxChange]:
    """Every dead row made due; one another operator (or a relay) changed meanwhile is left
    as it is now, said on stderr, and the others are retried all the same."""
    changes = []
    for seq in admin.dead_seqs():
        try:
            changes.append(admin.retry(seq, actor=actor, note=note))
        except OutboxError as exc:
            print(f"note: outbox row {seq} left as it is: {exc}", file=sys.stderr, flush=True)
    return changes


_APPLICATION = "infrai-jobs-outbox-cli"


def _list(admin: OutboxAdmin, args: argparse.Namespace) -> int:
    rows = admin.rows(
        states=(args.state,) if args.state else WAITING,
        job=args.job,
        queue=args.queue,
        failing=args.failing,
        limit=args.limit,
    )
    if args.json:
        print(json.dumps({"rows": [row.as_dict() for row in rows], "count": len(rows)}))
        return EXIT_OK
    if not rows:
        print("no outbox row waits (pending or dead) that matches", flush=True)
        return EXIT_OK
    for row in rows:
        print(_row_line(row), flush=True)
    return EXIT_OK


def _row_line(row: OutboxRow) -> str:
    queue = row.queue or "(the relay's queue)"
    due = "" if row.state != "pending" else f", due {row.next_attempt_at.isoformat()}"
    error = f"\n    last error: {row.last_error}" if row.last_error else ""
    return (
        f"{row.seq}  {row.state}  {row.job or '-'}  key {row.idem_key}  queue {queue}  "
        f"attempts {row.attempts}{due}{error}"
    )


def _print_changes(action: str, changes: list[OutboxChange], *, as_json: bool) -> None:
    if as_json:
        print(json.dumps({action: [change.as_dict() for change in changes]}), flush=True)
        return
    if not changes:
        print("no dead outbox row: nothing to retry", flush=True)
    done = "due now, attempts 0" if action == "retry" else "deleted"
    for change in changes:
        letter = " (its dead letter resolved)" if change.letter_resolved else ""
        print(
            f"{action} outbox row {change.before.seq} (key {change.before.idem_key}): {done}"
            f"{letter}; recorded in claim_history",
            flush=True,
        )


def _print_report(report: RelayReport, status: OutboxStatus | None, *, as_json: bool) -> None:
    document: dict[str, Any] = report.as_dict()
    if status is not None:
        document["outbox"] = status.as_dict()
    if as_json:
        print(json.dumps(document), flush=True)
        return
    print(
        f"published {report.published}, retried later {report.retried}, dead-lettered "
        f"{report.dead} in {report.batches} batch(es)",
        flush=True,
    )
    if report.refused:
        print(
            f"{report.refused} row(s) refused for their own queue (`infrai-jobs outbox list "
            "--failing` shows them)",
            flush=True,
        )
    if status is not None:
        _print_fields(status.as_dict())


def _print_fields(fields: dict[str, Any]) -> None:
    width = max(len(name) for name in fields)
    for name, value in fields.items():
        shown = f"{value:.1f}" if isinstance(value, float) else value
        print(f"{name.ljust(width)}  {shown}", flush=True)
