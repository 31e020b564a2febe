"""What the console reads and does, as the on-call commands do it.

Every read and every action is an ``infrai-jobs`` command line (``dlq --json``, ``claims
resolve KEY --done``, ``redrive --message-id M``), parsed by the commands' own parser and run by
their own ``run_ops`` on the same ``OpsContext`` the command line builds. So the console can
only do what a command does, with the command's checks, fences and ``claim_history`` record
(the operator's name from ``default_actor``), and each page can show the command it ran.

The builders below turn a form's fields into those command lines; each value travels as
``--option=value`` or after ``--``, so a key or a note that starts with a dash stays a value.
"""

from __future__ import annotations

import argparse
import io
import json
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Final, LiteralString, NoReturn

from psycopg.rows import dict_row

from infrai_jobs.errors import ConfigurationError
from infrai_jobs.operations.dead_letters import DeadLetterStore
from infrai_jobs.queue.ports import QueuePort
from infrai_local.operator.cli_ops import OpsContext, add_ops_commands, run_ops
from infrai_local.operator.verbs import OperatorLedger, default_actor

# The most dead letters or deferred jobs one page lists (and one bulk action takes).
PAGE_LIMIT: Final = 500
# A bulk action on more dead letters than this is refused: a preview of each comes first.
BULK_LIMIT: Final = 100


@dataclass(frozen=True, slots=True)
class CommandResult:
    """One command the console ran: its words, its exit code and its ``--json`` document."""

    argv: tuple[str, ...]
    exit_code: int
    document: Any

    @property
    def command_line(self) -> str:
        return shlex.join(("infrai-jobs", *self.argv))


class _Parser(argparse.ArgumentParser):
    """The commands' parser; a command line it refuses is a ``ConfigurationError``."""

    def error(self, message: str) -> NoReturn:
        raise ConfigurationError(f"{self.prog}: {message}")


def ops_parser() -> argparse.ArgumentParser:
    """``dlq``, ``redrive`` and ``claims ...`` exactly as ``infrai-jobs`` registers them."""
    parser = _Parser(prog="infrai-jobs", add_help=False)
    add_ops_commands(parser.add_subparsers(metavar="COMMAND"))
    return parser


# --- command lines -----------------------------------------------------------------------------


def dlq_list() -> list[str]:
    return ["dlq", "--json", f"--max={PAGE_LIMIT}"]


def claims_stuck() -> list[str]:
    return ["claims", "stuck", "--json"]


def deferred_list() -> list[str]:
    return ["claims", "list", "--state=deferred", f"--limit={PAGE_LIMIT}", "--json"]


def claims_show(key: str) -> list[str]:
    return ["claims", "show", "--json", "--", key]


def redrive_one(message_id: str, *, dry_run: bool, reopen_failed: bool) -> list[str]:
    argv = ["redrive", "--json", "--max=1", f"--message-id={message_id}"]
    if dry_run:
        argv.append("--dry-run")
    if reopen_failed:
        argv.append("--reopen-failed")
    return argv


def discard_one(message_id: str, note: str) -> list[str]:
    return ["dlq", "discard", "--json", "--max=1", f"--message-id={message_id}", f"--note={note}"]


def reconcile_one(key: str) -> list[str]:
    return ["claims", "reconcile", "--json", "--", key]


def resolve(
    key: str, *, done: bool, claim_token: str, note: str, result: str = "", error: str = ""
) -> list[str]:
    argv = ["claims", "resolve", "--json", "--done" if done else "--failed"]
    if claim_token:
        argv.append(f"--token={claim_token}")
    if done and result.strip():
        argv.append(f"--result={result}")
    if not done:
        argv.append(f"--error={error}")
    return [*argv, f"--note={note}", "--", key]


def release(key: str, *, claim_token: str, note: str) -> list[str]:
    argv = ["claims", "release", "--json"]
    if claim_token:
        argv.append(f"--token={claim_token}")
    return [*argv, f"--note={note}", "--", key]


def steer_deferred(key: str, *, run_now: bool, note: str) -> list[str]:
    return ["claims", "run-now" if run_now else "cancel", "--json", f"--note={note}", "--", key]


def touches_dead_letters(argv: Sequence[str]) -> bool:
    """Whether the command reads or changes the dead letters (and so consumes Infrai's DLQ)."""
    return bool(argv) and argv[0] in ("dlq", "redrive")


# --- the ledger's own reads (no command prints them) ---------------------------------------------

# Claims settled (done or failed) and dead letters first seen, per minute of the last hour.
_SETTLED_PER_MINUTE: LiteralString = """
SELECT minute, outcome, count(*) AS n FROM (
    SELECT date_trunc('minute', coalesce(updated_at, claimed_at)) AS minute, state AS outcome
    FROM job_claims
    WHERE state IN ('done', 'failed')
      AND coalesce(updated_at, claimed_at) >= date_trunc('minute', now()) - interval '59 minutes'
    UNION ALL
    SELECT date_trunc('minute', first_seen), 'dead_letter'
    FROM dead_letters
    WHERE first_seen >= date_trunc('minute', now()) - interval '59 minutes'
) AS settled
GROUP BY minute, outcome
ORDER BY minute, outcome
"""

_NOW_MINUTE: LiteralString = "SELECT date_trunc('minute', now()) AS minute"

# What the watcher last decided per signal (alert_state): its last alerts, newest first.
_ALERTS: LiteralString = """
SELECT scope, signal, value, alerted_at, updated_at
FROM alert_state
ORDER BY alerted_at DESC NULLS LAST, scope, signal
LIMIT 20
"""


class ConsoleLedger(OperatorLedger):
    """The operator's ledger, plus the two reads only the console shows: the outcomes per
    minute for its chart and the watcher's alert state."""

    def settled_per_minute(self) -> tuple[Any, list[dict[str, Any]]]:
        """The current minute (the database's clock) and (minute, outcome, n) of the hour."""
        with (
            self._connector.session("cannot read the outcomes of the last hour") as conn,
            conn.cursor(row_factory=dict_row) as cur,
        ):
            now = cur.execute(_NOW_MINUTE).fetchone()
            rows = list(cur.execute(_SETTLED_PER_MINUTE).fetchall())
        return (now or {}).get("minute"), rows

    def alerts(self) -> list[dict[str, Any]]:
        with (
            self._connector.session("cannot read the watcher's alert state") as conn,
            conn.cursor(row_factory=dict_row) as cur,
        ):
            return list(cur.execute(_ALERTS).fetchall())


class CommandBackend:
    """The console's reads and actions on the real queue and ledger, through the commands."""

    def __init__(
        self,
        ops: OpsContext,
        ledger: ConsoleLedger,
        queue: QueuePort,
        *,
        watched: Sequence[str],
    ) -> None:
        self._ops = ops
        self._ledger = ledger
        self._queue = queue
        self._parser = ops_parser()
        self.queue_name = ops.queue_name
        self.watched = tuple(watched)
        self.actor = default_actor()

    def run(self, argv: Sequence[str]) -> CommandResult:
        """``infrai-jobs ARGV`` as the command line runs it; its errors propagate."""
        args = self._parser.parse_args(list(argv))
        out = io.StringIO()
        code = run_ops(args, replace(self._ops, out=out))
        text = out.getvalue()
        return CommandResult(tuple(argv), code, json.loads(text) if text.strip() else None)

    def stats(self) -> list[dict[str, Any]]:
        """``infrai-jobs stats`` of each watched queue."""
        rows = []
        for name in self.watched:
            stats = self._queue.stats(name)
            rows.append(
                {
                    "queue": stats.queue,
                    "available_count": stats.available_count,
                    "in_flight_count": stats.in_flight_count,
                    "delayed_count": stats.delayed_count,
                    "dlq_count": stats.dlq_count,
                    "oldest_message_age_seconds": stats.oldest_message_age_seconds,
                }
            )
        return rows

    def alerts(self) -> list[dict[str, Any]]:
        return self._ledger.alerts()

    def settled_per_minute(self) -> tuple[Any, list[dict[str, Any]]]:
        return self._ledger.settled_per_minute()

    def dead_letters_of_key(self, key: str) -> list[dict[str, Any]]:
        """Every dead letter of ``key`` the ledger holds, resolved ones too (``dlq --all``)."""
        store = DeadLetterStore(self._ledger)
        rows = store.rows(self.queue_name, unresolved=False, key=key, limit=PAGE_LIMIT)
        return [row.as_dict() for row in rows]
