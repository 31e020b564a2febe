"""``infrai-jobs outbox relay`` and ``infrai-jobs outbox status``: the producers' outbox from
a laptop or a bastion.

``relay`` runs one pass, as OutboxRelayFunction does, against the configured Infrai and outbox
database (never a throwaway emulator: a publish there would vanish). ``--follow`` keeps relaying
until Ctrl-C: it listens on the ``infrai_outbox`` channel, which ``enqueue(..., notify=True)``
signals at commit, and polls every ``--poll-seconds`` in any case, so a row enqueued without
notify still goes out within that interval. ``LISTEN`` needs a session of its own, which a
transaction pooler does not keep: ``OUTBOX_LISTEN_URL`` names the outbox's database directly,
for listening only (docs/configuration.md, "Behind a connection pooler"). ``status`` reads the
outbox's figures.
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
from infrai_jobs.errors import ConfigurationError
from infrai_jobs.ledger.postgres import LedgerConnector, ledger_errors, malformed_reason
from infrai_jobs.outbox.relay import OutboxRelay, RelayReport
from infrai_jobs.outbox.status import OutboxStatus, read_status
from infrai_jobs.outbox.writer import NOTIFY_CHANNEL
from infrai_jobs.runtime.factory import (
    make_outbox_relay,
    make_queue_client,
    outbox_connector,
    with_secrets,
)

EXIT_OK = 0

# A pass from the command line has no invocation deadline; this stands in for one.
PASS_BUDGET_MS = 240_000
# The outbox's database without a pooler in between, for --follow's LISTEN (CLI only).
LISTEN_URL_ENV = "OUTBOX_LISTEN_URL"


def add_outbox_commands(sub: Any, command: Callable[[argparse.Namespace], int]) -> None:
    """Register ``outbox relay`` and ``outbox status``; ``command`` is what the CLI's
    dispatcher calls for either (``run_outbox``, wired by the CLI)."""
    outbox = sub.add_parser(
        "outbox", help="the producers' transactional outbox: relay it to Infrai, or show it"
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
    relay.add_argument("--json", action="store_true", help="print JSON for scripts")
    relay.set_defaults(command=command)
    status = actions.add_parser(
        "status", help="pending rows, the oldest one's age, published in the last hour, dead"
    )
    status.add_argument("--json", action="store_true", help="print JSON for scripts")
    status.set_defaults(command=command)


def run_outbox(args: argparse.Namespace) -> int:
    settings = OutboxRelaySettings.from_env()
    if not (settings.database_url or settings.database_secret_arn):
        raise ConfigurationError(
            "`infrai-jobs outbox` needs DATABASE_URL (or DATABASE_SECRET_ARN): the outbox lives "
            "in the ledger's database unless OUTBOX_DATABASE_URL names another"
        )
    if args.outbox_action == "status":
        return _status(settings, as_json=args.json)
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
    edge, refresh = with_secrets(settings).unpacked()
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
            if report.published or report.retried or report.dead:
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
    if status is not None:
        _print_fields(status.as_dict())


def _print_fields(fields: dict[str, Any]) -> None:
    width = max(len(name) for name in fields)
    for name, value in fields.items():
        shown = f"{value:.1f}" if isinstance(value, float) else value
        print(f"{name.ljust(width)}  {shown}", flush=True)
