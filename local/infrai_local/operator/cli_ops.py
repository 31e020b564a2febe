"""The on-call commands of ``infrai-jobs``: dlq (and dlq discard), redrive, claims, cost.

Human output by default (aligned tables; colour only on a terminal), ``--json`` for scripts on
every read command. Exit codes: 0 success, 1 the operation failed, 2 bad usage or
configuration, 3 the claim is missing, changed since it was read, or in no state the command
acts on (fenced actions).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from decimal import Decimal
from typing import Any, TextIO

from infrai_jobs.errors import ClaimChanged, ClaimNotFound, ConfigurationError, InfraiJobsError
from infrai_jobs.jobs.probes import ANSWERS
from infrai_jobs.jobs.registry import JobRegistry
from infrai_jobs.operations.dead_letters import (
    Collected,
    DeadLetterRow,
    DeadLetterStore,
    RetryOf,
    collect,
)
from infrai_jobs.operations.reconcile import Reconciler, ReconcileReport
from infrai_jobs.operations.redrive import (
    JobsKnowledge,
    RedriveRequest,
    Selection,
    publish_price,
    redrive,
)
from infrai_jobs.queue.ports import QueuePort
from infrai_jobs.work.admin import RECONCILE
from infrai_jobs.work.states import ClaimRow
from infrai_local.operator.verbs import (
    OperatorLedger,
    default_actor,
    live_lease_ends,
    probe_only,
    reconcile_one,
    still_stuck,
    stuck_probed,
)

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_CONFLICT = 3

KeyOf = Callable[[Any], str]

_DURATION = re.compile(r"^(\d+)\s*([smhd]?)$")
_UNIT_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


class DeadLetterNotFound(InfraiJobsError):
    """No dead letter read matched what the operator named (``dlq discard``)."""


def parse_duration(text: str) -> int:
    """``30d``, ``12h``, ``15m``, ``90s`` or plain seconds."""
    match = _DURATION.match(text.strip().lower())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration like 30d, 12h, 15m or 90s")
    return int(match.group(1)) * _UNIT_SECONDS[match.group(2)]


def add_jobs_path(
    parser: argparse.ArgumentParser, what: str, *, default: Any = None, metavar: str | None = None
) -> None:
    """``--jobs-path``: the code root a command loads the `jobs` package from, ``what`` saying
    what for; when it is not given, every command looks in the same places."""
    parser.add_argument(
        "--jobs-path",
        default=default,
        metavar=metavar,
        help=f"{what} (default: $INFRAI_JOBS_PATH, else the jobs package on the path: "
        "functions/jobs, which `make venv` puts there)",
    )


def _add_jobs_path(parser: argparse.ArgumentParser) -> None:
    # SUPPRESS: a sub-command's own default must not overwrite `dlq --jobs-path X discard`.
    add_jobs_path(
        parser,
        "a code root holding the `jobs` package whose key rules name the claims",
        default=argparse.SUPPRESS,
        metavar="FOLDER",
    )


def _add_json_and_command(
    parser: argparse.ArgumentParser, ops_command: str, *, jobs_path: bool = False, **more: str
) -> None:
    """How every operator command ends: ``--json`` for scripts, then (``jobs_path``) where its
    key rules come from, and the command it runs."""
    parser.add_argument("--json", action="store_true")
    if jobs_path:
        _add_jobs_path(parser)
    parser.set_defaults(ops_command=ops_command, **more)


def add_ops_commands(sub: Any) -> None:
    """Register dlq, redrive, claims and cost on the top-level sub-parsers."""
    dlq = sub.add_parser(
        "dlq",
        help="show the ledger's dead letters with their keys and claims, after moving new ones "
        "out of Infrai's DLQ",
    )
    dlq.add_argument(
        "--queue", help="the main queue (default: INFRAI_QUEUE); its DLQ is moved into the ledger"
    )
    dlq.add_argument("--max", type=int, default=100, help="dead letters to show (default 100)")
    dlq.add_argument(
        "--all",
        action="store_true",
        help="show resolved ones too (redriven, discarded, or done: their work was done), "
        "newest last, with a RESOLUTION column",
    )
    _add_json_and_command(dlq, "dlq", dlq_action="list", jobs_path=True)
    dlq_sub = dlq.add_subparsers(metavar="ACTION")
    discard = dlq_sub.add_parser(
        "discard",
        help="resolve dead letters as discarded (by message id or key): the ledger keeps "
        "them, and claim_history records each",
    )
    which = discard.add_mutually_exclusive_group(required=True)
    which.add_argument("--message-id", help="the dead letter's message id (as `dlq` shows it)")
    which.add_argument("--key", help="every dead letter of this idempotency key")
    discard.add_argument(
        "--max", type=int, default=100, help="dead letters to discard at most (default 100)"
    )
    discard.add_argument("--note", default="", help="why, for claim_history")
    _add_json_and_command(discard, "dlq", dlq_action="discard", jobs_path=True)

    red = sub.add_parser(
        "redrive", help="publish the ledger's dead letters to the main queue again"
    )
    red.add_argument(
        "--max", type=int, default=100, help="dead letters to publish at most (default 100)"
    )
    red.add_argument(
        "--reopen-failed",
        action="store_true",
        help="re-open failed claims of the redriven work so it runs again",
    )
    red.add_argument(
        "--dry-run",
        action="store_true",
        help="look only: new dead letters are moved into the ledger, none is published",
    )
    red.add_argument(
        "--include-bouncing",
        action="store_true",
        help="publish the dead letters whose copies would be duplicates or bounce back too "
        "(a plain redrive holds them back and says why)",
    )
    red.add_argument("--key", help="move only the dead letters of this idempotency key")
    red.add_argument("--job", help="move only the dead letters of this job type")
    red.add_argument("--message-id", help="move only the dead letter with this message id")
    _add_json_and_command(red, "redrive", jobs_path=True)

    _add_claims_commands(sub.add_parser("claims", help="inspect and repair the claim ledger"))

    cost = sub.add_parser("cost", help="monthly publish cost at today's price")
    cost.add_argument("--messages-per-day", type=int, required=True)
    cost.add_argument("--days", type=int, default=30)
    _add_json_and_command(cost, "cost")


def _add_claims_commands(claims: argparse.ArgumentParser) -> None:
    csub = claims.add_subparsers(metavar="ACTION", required=True)
    ls = csub.add_parser(
        "list",
        help="claims, newest first; with --state deferred, the deferred work the ledger holds",
    )
    ls.add_argument(
        "--state",
        choices=["running", "done", "failed", "deferred"],
        help="deferred: jobs waiting for their next attempt (or running one now), the next "
        "due first, with their attempts, run-after time and last error",
    )
    ls.add_argument("--job")
    ls.add_argument("--older-than", type=parse_duration, help="e.g. 1h, 30d")
    ls.add_argument("--limit", type=int, default=50)
    _add_json_and_command(ls, "claims_list")
    show = csub.add_parser("show", help="one claim and its operator history")
    show.add_argument("key")
    _add_json_and_command(show, "claims_show")
    stuck = csub.add_parser(
        "stuck", help="running claims, and deferred runs left for a human, a human must look at"
    )
    stuck.add_argument("--older-than", type=parse_duration, default=900)
    _add_json_and_command(stuck, "claims_stuck")
    resolve = csub.add_parser("resolve", help="record a human's verdict on a running claim")
    resolve.add_argument("key")
    verdict = resolve.add_mutually_exclusive_group(required=True)
    verdict.add_argument("--done", action="store_true", help="the effect happened")
    verdict.add_argument("--failed", action="store_true", help="the effect did not happen")
    resolve.add_argument("--result", help="JSON to store with --done (e.g. the provider's id)")
    resolve.add_argument("--error", help="the reason, with --failed")
    resolve.add_argument("--token", type=uuid.UUID, help="the claim token you looked at")
    resolve.add_argument("--note", default="")
    _add_json_and_command(resolve, "claims_resolve")
    release = csub.add_parser("release", help="delete a running or failed claim to allow a retry")
    release.add_argument("key")
    release.add_argument("--token", type=uuid.UUID, help="the claim token you looked at")
    release.add_argument("--note", default="")
    _add_json_and_command(release, "claims_release")
    _add_deferred_commands(csub)
    reconcile = csub.add_parser(
        "reconcile",
        help="ask the provider about stuck claims (jobs with a probe): settle what it has done, "
        "release what it has not, leave the rest stuck",
    )
    which = reconcile.add_mutually_exclusive_group(required=True)
    which.add_argument("key", nargs="?", help="one claim, by its key")
    which.add_argument("--all", action="store_true", help="every stuck claim of a job with a probe")
    reconcile.add_argument(
        "--older-than",
        type=parse_duration,
        default=900,
        help="with --all: running claims older than this, or flagged (default 15m)",
    )
    reconcile.add_argument("--limit", type=int, default=100, help="with --all (default 100)")
    reconcile.add_argument(
        "--dry-run", action="store_true", help="ask the probes, change and record nothing"
    )
    _add_jobs_path(reconcile)
    _add_json_and_command(reconcile, "claims_reconcile")
    prune = csub.add_parser("prune", help="delete old done/failed claims in batches")
    prune.add_argument(
        "--older-than", type=parse_duration, default=30 * 86400, help="whole days, e.g. 30d"
    )
    prune.add_argument("--batch-size", type=int, default=1000)
    _add_json_and_command(prune, "claims_prune")


_DEFERRED_COMMANDS = (
    (
        "run-now",
        "claims_run_now",
        "make a waiting deferred job due at once: the next drain runs it (recorded in "
        "claim_history, with you as the actor)",
    ),
    (
        "cancel",
        "claims_cancel",
        "cancel a waiting deferred job: it never runs, and a new message for its key is new "
        "work (recorded in claim_history, with you as the actor); a running one is refused",
    ),
)


def _add_deferred_commands(csub: Any) -> None:
    """``claims run-now`` and ``claims cancel``: steering the deferred work the ledger holds.
    Both take the same arguments; they differ in what they do to the job."""
    for name, ops_command, help_text in _DEFERRED_COMMANDS:
        command = csub.add_parser(name, help=help_text, description=help_text)
        command.add_argument("key", help="the deferred job's key (`claims list --state deferred`)")
        command.add_argument("--note", default="", help="why, for claim_history")
        _add_json_and_command(command, ops_command)


# --- output ------------------------------------------------------------------------------------


def _colour(text: str, code: str, stream: TextIO) -> str:
    return f"\033[{code}m{text}\033[0m" if stream.isatty() else text


def print_table(
    rows: Sequence[Mapping[str, Any]],
    columns: Sequence[str],
    out: TextIO,
    *,
    whole: Sequence[str] = (),
) -> None:
    """An aligned table; values are cut to 60 characters except in the ``whole`` columns."""
    if not rows:
        print("(none)", file=out)
        return
    cells = [[_cell(row.get(c), whole=c in whole) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    print(
        _colour(
            "  ".join(c.upper().ljust(w) for c, w in zip(columns, widths, strict=True)), "1", out
        ),
        file=out,
    )
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip(), file=out)


def _cell(value: Any, *, whole: bool = False) -> str:
    if value is None:
        return "-"
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    text = " ".join(text.split())
    return text if whole or len(text) <= 60 else text[:57] + "..."


def _emit(document: Any, as_json: bool, human: Callable[[], None], out: TextIO) -> None:
    if as_json:
        print(json.dumps(document, default=str), file=out)
    else:
        human()


# --- commands ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class OpsContext:
    """Lazily built adapters and the configured names, handed in by the CLI."""

    queue: Callable[[], QueuePort]
    admin: Callable[[], OperatorLedger]
    queue_name: str
    dlq_name: str
    # The drain's own key derivation (its jobs package's registry), found when first needed:
    # only the commands that derive keys need the jobs package.
    key_of: Callable[[], KeyOf]
    out: TextIO = field(default_factory=lambda: sys.stdout)
    # Drops a key's second-layer record (IDEMPOTENCY_BACKEND on), so a release really retries.
    forget: Callable[[str], None] | None = None
    # The reconcile pass over the jobs package's probes, its settings bound (claims reconcile).
    reconciler: Callable[[], Reconciler] | None = None
    # Each job's retry policy in force (JOB_POLICIES applied): a dead letter with attempts left
    # is taken back as deferred work when it is collected.
    retry_of: Callable[[], RetryOf] | None = None
    # The jobs package's registry, for a command that names a job (redrive --job).
    registry: Callable[[], JobRegistry] | None = None


def run_ops(args: argparse.Namespace, ctx: OpsContext) -> int:
    """Run one ops command. Errors propagate: ``infrai-jobs``'s main reports each as one line
    (and a JSON object with ``--json``); ``ClaimNotFound`` and ``ClaimChanged`` exit 3."""
    command = args.ops_command
    if command == "dlq" and args.dlq_action == "discard":
        return _discard(args, ctx)
    if command == "dlq":
        return _dlq(args, ctx)
    if command == "redrive":
        return _redrive(args, ctx)
    if command == "cost":
        return _cost(args, ctx.queue(), ctx.out)
    if command == "claims_reconcile":
        if ctx.reconciler is None:  # pragma: no cover - the CLI always passes one
            raise ConfigurationError("claims reconcile needs the jobs package's probes")
        return _reconcile(args, ctx.reconciler(), ctx.out)
    if command == "claims_list" and args.state == "deferred":
        return _deferred_list(args, ctx.admin(), ctx.out)
    if command in ("claims_run_now", "claims_cancel"):
        return _steer_deferred(args, ctx.admin(), ctx.out)
    return _claims(args, ctx.admin(), ctx.out, ctx.forget)


def _queues(args: argparse.Namespace, ctx: OpsContext) -> tuple[str, str]:
    """The main queue and its DLQ: ``--queue`` names both, else the configured ones."""
    queue = getattr(args, "queue", None)
    return (queue, f"{queue}-dlq") if queue else (ctx.queue_name, ctx.dlq_name)


def _collect(
    args: argparse.Namespace, ctx: OpsContext, command: str
) -> tuple[DeadLetterStore, str, str, Collected]:
    """Check ``COMMAND --max``, then move what is new in Infrai's DLQ into the ledger (the
    ledger is checked first): the ledger's dead letters, the queue, its DLQ and what moved."""
    if args.max < 1:
        raise ConfigurationError(f"{command} --max must be at least 1")
    store = DeadLetterStore(ctx.admin())
    queue, dlq = _queues(args, ctx)
    collected = collect(
        ctx.queue(),
        store,
        dlq=dlq,
        main_queue=queue,
        key_of=ctx.key_of(),
        retry_of=ctx.retry_of() if ctx.retry_of is not None else None,
    )
    return store, queue, dlq, collected


_DLQ_COLUMNS = ["message_id", "deliveries", "idem_key", "state", "first_seen", "reason"]
# With --all: how each was resolved (redriven, discarded, done), empty while it is unresolved.
_DLQ_ALL_COLUMNS = [*_DLQ_COLUMNS[:-1], "resolution", "reason"]


def _listed(row: DeadLetterRow) -> dict[str, Any]:
    document = row.as_dict()
    document["deliveries"] = row.main_deliveries
    document["recorded"] = True
    # Deferred work that ran out of attempts: no DLQ had it, and a redrive reopens its claim.
    document["held_by_ledger"] = row.held_by_ledger
    return document


def _dlq(args: argparse.Namespace, ctx: OpsContext) -> int:
    store, queue, dlq, collected = _collect(args, ctx, "dlq")
    rows = [_listed(r) for r in store.rows(queue, unresolved=not args.all, limit=args.max)]
    # Unreadable answers that named no message could not be recorded: shown, never hidden.
    rows += [
        {
            **entry,
            "message_id": None,
            "state": "unreadable",
            "recorded": False,
            "held_by_ledger": False,
        }
        for entry in collected.unrecorded
    ]
    unresolved = store.unresolved_count(queue)
    out = ctx.out
    notes = [
        f"{unresolved} unresolved dead letter(s) of {queue} in the ledger; "
        f"{collected.recorded} new one(s) moved there from {dlq} just now"
    ]
    if collected.taken_back:
        notes.append(
            f"{collected.taken_back} dead letter(s) of jobs whose retry policy had attempts "
            "left were taken back as deferred work (`infrai-jobs claims list --state "
            "deferred`): their deliveries died before their runs ended"
        )
    done = sum(1 for row in rows if row.get("resolution") == "done")
    if done:
        notes.append(
            f"{done} shown resolved done: the ledger shows their work done (their key's claim "
            "is done), so nothing is left to redrive; the watcher resolved them before counting "
            "(`infrai-jobs claims show KEY` has the record)"
        )
    if collected.unrecorded:
        notes.append(
            f"{len(collected.unrecorded)} dead letter(s) in {dlq} could not be read and named "
            "no message id: they stay there, hidden for its visibility timeout, and the next "
            "`infrai-jobs dlq` tries again"
        )

    def human() -> None:
        shown = [
            {**row, "message_id": row["message_id"] or "(unknown)"}
            | {"resolution": row.get("resolution") or ""}
            for row in rows
        ]
        columns = _DLQ_ALL_COLUMNS if args.all else _DLQ_COLUMNS
        print_table(shown, columns, out, whole=("reason",))
        for note in notes:
            print(f"\nnote: {note}", file=out)

    _emit(
        {
            "queue": queue,
            "dlq": dlq,
            "messages": rows,
            "unresolved": unresolved,
            "unreadable": sum(1 for r in rows if r["unreadable"]),
            "collected": asdict(collected),
            "notice": "; ".join(notes),
        },
        args.json,
        human,
        out,
    )
    return EXIT_OK


def _discard(args: argparse.Namespace, ctx: OpsContext) -> int:
    """Resolve each matching dead letter as discarded, recorded in claim_history."""
    store, queue, dlq, _ = _collect(args, ctx, "dlq discard")
    rows = store.rows(queue, message_id=args.message_id, key=args.key, limit=args.max)
    what = f"--message-id {args.message_id}" if args.message_id else f"--key {args.key}"
    if not rows:
        raise DeadLetterNotFound(
            f"no unresolved dead letter of {queue} matched {what} in the ledger "
            f"({store.unresolved_count(queue)} unresolved; `infrai-jobs dlq --all` shows the "
            "discarded and redriven ones too)"
        )
    actor = default_actor()
    discarded = [
        {"message_id": row.message_id, "idem_key": row.idem_key, "unreadable": row.unreadable}
        for row in rows
        if store.discard(row.message_id, actor=actor, note=args.note)
    ]
    out = ctx.out
    document = {
        "queue": queue,
        "dlq": dlq,
        "discarded": discarded,
        "selection": {"message_id": args.message_id} if args.message_id else {"key": args.key},
    }

    def human() -> None:
        for entry in discarded:
            print(
                f"discarded {entry['message_id']} (key {entry['idem_key'] or '-'}): resolved "
                "in the ledger, recorded in claim_history with its payload",
                file=out,
            )
        if len(discarded) < len(rows):
            print(
                f"note: {len(rows) - len(discarded)} matching dead letter(s) were resolved by "
                "someone else meanwhile",
                file=out,
            )

    _emit(document, args.json, human, out)
    return EXIT_OK


def _redrive(args: argparse.Namespace, ctx: OpsContext) -> int:
    if args.max < 1:
        raise ConfigurationError("redrive --max must be at least 1")
    out = ctx.out
    queue_name, dlq_name = _queues(args, ctx)
    selection = Selection(key=args.key, job=args.job, message_id=args.message_id)
    progress = _progress_bar(args.max) if sys.stderr.isatty() and not args.json else None
    admin = ctx.admin()
    registry = ctx.registry() if ctx.registry is not None and args.job else None
    request = RedriveRequest(
        max_messages=args.max,
        reopen_failed=args.reopen_failed,
        dry_run=args.dry_run,
        include_bouncing=args.include_bouncing,
        selection=selection,
    ).to(source=dlq_name, target=queue_name, actor=default_actor())
    jobs = JobsKnowledge(
        key_of=ctx.key_of(),
        known_jobs=(lambda name: "" if registry.get(name) else registry.unknown_job(name))
        if registry is not None
        else None,
        retry_of=ctx.retry_of() if ctx.retry_of is not None else None,
    )
    store = DeadLetterStore(admin) if progress is None else _TickingStore(admin, progress)
    summary = redrive(ctx.queue(), store, request, admin=admin, jobs=jobs)
    if progress is not None:
        print(file=sys.stderr)
    document = summary.as_dict()

    def human() -> None:
        verb = "would publish" if args.dry_run else "published"
        count = len(summary.seen) if args.dry_run else summary.published
        chosen = f" ({describe_selection(selection)})" if selection.as_dict() else ""
        print(
            f"{verb} {count} dead letter(s) of the ledger -> {queue_name}{chosen} "
            f"({summary.recorded} new one(s) moved from {dlq_name} into the ledger first)",
            file=out,
        )
        causes = summary.held_back_by_cause()
        if causes:
            counted = ", ".join(f"{n} {cause}" for cause, n in causes.items())
            verb_held = "would hold back" if args.dry_run else "held back"
            print(
                f"{verb_held} {len(summary.held_back)}: {counted} (their copies would not run; "
                "--include-bouncing publishes them anyway)",
                file=out,
            )
        if args.dry_run:
            print_table(
                summary.seen + summary.held_back,
                ["message_id", "idem_key", "verdict", "why"],
                out,
                whole=("why",),
            )
            print("note: nothing was published or marked redriven", file=out)
        else:
            for entry in summary.held_back:
                print(f"HELD BACK: {entry['message_id']}: {entry['why']}", file=out)
        print(
            f"selected {summary.selected}, published {summary.published}, "
            f"reopened {len(summary.reopened)}, skipped {len(summary.skipped)}, "
            f"unreadable {len(summary.unreadable)}",
            file=out,
        )
        for entry in summary.unreadable:
            print(
                f"NOT MOVED: {entry['message_id'] or '(message id unknown)'}: {entry['reason']}; "
                "it stays in the DLQ",
                file=out,
            )
        for entry in summary.skipped:
            print(f"NOT MOVED: {entry['message_id']}: {entry['reason']}", file=out)
        if summary.not_selected:
            print(
                f"note: {summary.not_selected} other unresolved dead letter(s) were not "
                "selected; they stay in the ledger (`infrai-jobs dlq`)",
                file=out,
            )
        if summary.stopped:
            print("note: stopped early (time budget); run it again for the rest", file=out)
        print(
            f"publish cost: {summary.published} x ${summary.price_usd_per_message} = "
            f"${summary.cost_usd} (price from {summary.price_source})",
            file=out,
        )

    _emit(document, args.json, human, out)
    return EXIT_OK if summary.complete else EXIT_FAILED


class _TickingStore(DeadLetterStore):
    """The ledger's dead letters, ticking ``tick`` with the count of those a redrive has tried
    to publish so far (the progress bar on a terminal)."""

    def __init__(self, admin: OperatorLedger, tick: Callable[[int], None]) -> None:
        super().__init__(admin)
        self._tick, self._moved = tick, 0

    def redrive(
        self, message_id: str, publish: Callable[[Any], object], *, actor: str, note: str = ""
    ) -> bool:
        moved = super().redrive(message_id, publish, actor=actor, note=note)
        self._moved += 1
        self._tick(self._moved)
        return moved


def describe_selection(selection: Selection) -> str:
    """The command line's options that choose ``selection``."""
    return " ".join(f"--{n.replace('_', '-')} {v}" for n, v in selection.as_dict().items())


def _progress_bar(total: int) -> Callable[[int], None]:
    def show(done: int) -> None:
        width = 30
        filled = int(width * min(done, total) / max(total, 1))
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
        sys.stderr.flush()

    return show


def _cost(args: argparse.Namespace, queue: QueuePort, out: TextIO) -> int:
    if args.messages_per_day < 0 or args.days < 1:
        raise ConfigurationError("--messages-per-day must be >= 0 and --days >= 1")
    price, source = publish_price(queue)
    total = price * args.messages_per_day * args.days
    document = {
        "messages_per_day": args.messages_per_day,
        "days": args.days,
        "usd_per_message": str(price),
        "price_source": source,
        "usd_total": str(total),
    }

    def human() -> None:
        print(
            f"{args.messages_per_day} publishes/day x {args.days} days x ${price} = "
            f"${total.quantize(Decimal('0.01'))}",
            file=out,
        )
        if source == "fallback":
            print(
                "note: discovery could not be reached (or its answer read); this uses the "
                "field notes' price "
                "($0.00002, verified 2026-07-26)",
                file=out,
            )
        print("consume, ack, stats and redeliveries are free", file=out)

    _emit(document, args.json, human, out)
    return EXIT_OK


CLAIM_COLUMNS = ["idem_key", "state", "job", "effect", "attempts", "claimed_at", "error"]


def _claims(
    args: argparse.Namespace,
    admin: OperatorLedger,
    out: TextIO,
    forget: Callable[[str], None] | None = None,
) -> int:
    command = args.ops_command
    if command == "claims_list":
        rows = admin.list_claims(
            state=args.state, job=args.job, older_than_seconds=args.older_than, limit=args.limit
        )
        return _rows_out(rows, args.json, out)
    if command == "claims_stuck":
        return _stuck_out(admin, args.older_than, args.json, out)
    if command == "claims_show":
        return _show(args, admin, out)
    if command == "claims_resolve":
        if args.done and args.error:
            raise ConfigurationError(
                "claims resolve: --error goes with --failed; use --result with --done"
            )
        if args.failed and not (args.error or "").strip():
            raise ConfigurationError(
                "claims resolve --failed needs --error TEXT: why the effect did not happen "
                "(it is kept with the claim and shown by `infrai-jobs dlq`)"
            )
        if args.failed and args.result:
            raise ConfigurationError(
                "claims resolve: --result goes with --done; use --error with --failed"
            )
        result = _parse_result(args.result) if args.result else None
        action = "resolve_done" if args.done else "resolve_failed"
        _check_fence(admin, args.key, action, token=args.token)
        if args.failed and forget is not None:
            # "The effect did not happen": a stored "uncertain" in the second layer is wrong
            # now, and would park a reopened retry as stuck again.
            forget(args.key)
        changed = admin.resolve(
            args.key,
            done=args.done,
            result=result,
            error=args.error,
            expected_token=args.token,
            actor=default_actor(),
            note=args.note,
        )
        return _changed_out(changed, "resolved", args.json, out)
    if command == "claims_release":
        _check_fence(admin, args.key, "release", token=args.token)
        if forget is not None:
            # Without this, a stored "uncertain" in the second layer would park the retry again.
            forget(args.key)
        released = admin.release(
            args.key, expected_token=args.token, actor=default_actor(), note=args.note
        )
        return _changed_out(released, "released", args.json, out, then=_released_then)
    if command == "claims_prune":
        days, rest = divmod(args.older_than, 86400)
        if rest or days < 1:
            # Rounding would delete rows younger than asked: the done rows are what lets a
            # later redrive skip finished work.
            raise ConfigurationError(
                "claims prune --older-than takes whole days, at least 1d (e.g. 30d); "
                f"got {args.older_than} s"
            )
        result = admin.prune(older_than_days=days, batch_size=args.batch_size)
        _emit(
            {"deleted": result.deleted, "batches": result.batches, "older_than_days": days},
            args.json,
            lambda: print(
                f"pruned {result.deleted} done/failed claim(s) older than {days} "
                f"day(s) in {result.batches} batch(es)",
                file=out,
            ),
            out,
        )
        return EXIT_OK
    raise ConfigurationError(f"unknown claims action {command}")  # pragma: no cover


DEFERRED_COLUMNS = ["idem_key", "job", "state", "attempts", "run_after", "last_error"]


def _deferred_list(args: argparse.Namespace, admin: OperatorLedger, out: TextIO) -> int:
    deferred = admin.list_deferred(
        job=args.job, older_than_seconds=args.older_than, limit=args.limit
    )
    documents = [job.as_dict() for job in deferred]
    _emit(documents, args.json, lambda: print_table(documents, DEFERRED_COLUMNS, out), out)
    return EXIT_OK


def _steer_deferred(args: argparse.Namespace, admin: OperatorLedger, out: TextIO) -> int:
    """``claims run-now`` and ``claims cancel``: the ledger's change, recorded with the
    operator as actor. A missing key or work that is not waiting exits 3, in one line."""
    run_now = args.ops_command == "claims_run_now"
    change = admin.run_deferred_now if run_now else admin.cancel_deferred
    try:
        job = change(args.key, actor=default_actor(), note=args.note)
    except ClaimNotFound as exc:
        raise ClaimNotFound(
            f"{exc}; `infrai-jobs claims list --state deferred` lists the deferred jobs"
        ) from None
    verb = "due now" if run_now else "cancelled"
    detail = (
        "the next drain runs it" if run_now else "it will not run; a new message for it is new work"
    )
    _emit(
        {"action": "run_now" if run_now else "cancel", "deferred": job.as_dict()},
        args.json,
        lambda: print(f"{verb}: {job.idem_key}: {detail} (recorded in claim_history)", file=out),
        out,
    )
    return EXIT_OK


def _reconcile(args: argparse.Namespace, reconciler: Reconciler, out: TextIO) -> int:
    if args.all and args.dry_run:
        stuck = stuck_probed(reconciler, threshold_seconds=args.older_than, limit=args.limit)
        report = probe_only(reconciler, stuck)
    elif args.all:
        report = reconciler.run_all(threshold_seconds=args.older_than, limit=args.limit)
    else:
        report = reconcile_one(reconciler, args.key, dry_run=args.dry_run)
    live = live_lease_ends(reconciler.admin, still_stuck(report))
    document = report.as_dict()
    for claim in document["claims"]:
        claim["lease_until"] = live.get(claim["idem_key"])
    _emit(document, args.json, lambda: _reconcile_human(report, live, out), out)
    return EXIT_OK


def _reconcile_human(report: ReconcileReport, live: Mapping[str, str], out: TextIO) -> None:
    rows = [asdict(outcome) for outcome in report.outcomes]
    print_table(rows, ["idem_key", "job", "answer", "action", "detail"], out)
    by_answer = report.by_answer().items()
    counts = ", ".join(f"{n} {answer.replace('_', ' ')}" for answer, n in by_answer)
    lead = "dry run, nothing changed: " if report.dry_run else ""
    print(f"\n{lead}probed {len(report.outcomes)} stuck claim(s): {counts}", file=out)
    if report.skipped:
        print(f"{report.skipped} more left unprobed (time ran out); run it again", file=out)
    # Under a live lease only the run holding it may act (`claims resolve` is refused too):
    # the advice is when to ask again, the lease's end as the database reads it.
    for key, until in live.items():
        print(
            f"{key}: running under a live lease until {until}: its run may still settle it; "
            f"after then, run `infrai-jobs claims reconcile {key}` again",
            file=out,
        )
    if report.dry_run:
        return
    ended = [outcome for outcome in still_stuck(report) if outcome.idem_key not in live]
    if ended:
        print(
            f"{len(ended)} still stuck: check the provider, then `infrai-jobs claims resolve KEY`",
            file=out,
        )


def _check_fence(admin: OperatorLedger, key: str, action: str, *, token: uuid.UUID | None) -> None:
    """Refuse a fenced change (``ClaimChanged``) the ledger would refuse, naming the command
    to type instead; the change itself is fenced again in its own transaction.

    Checked before the second layer's record is forgotten, which happens before the ledger
    changes, not after: if the store cannot be reached, the command fails with nothing changed
    and can simply be run again. (After, a failed forget left the row deleted and a rerun found
    no claim to act on.) A claim the change is refused for keeps its record."""
    refused = admin.change_refused(key, action, token=token)
    if refused:
        raise ClaimChanged(refused)


def _parse_result(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        raise ConfigurationError(f"--result is not valid JSON: {text!r}") from None


def _rows_out(rows: Iterable[ClaimRow], as_json: bool, out: TextIO) -> int:
    documents = [r.as_dict() for r in rows]
    _emit(documents, as_json, lambda: print_table(documents, CLAIM_COLUMNS, out), out)
    return EXIT_OK


def _stuck_out(admin: OperatorLedger, older_than: int, as_json: bool, out: TextIO) -> int:
    """Everything running that a human must look at: stuck claims, then deferred runs left for
    a human (an irreversible run that began its call and whose lease ran out). Both are
    settled with the same commands (`claims resolve`, `claims release`, `claims reconcile`);
    ``kind`` tells them apart."""
    documents = [_stuck_document(r) for r in admin.stuck(threshold_seconds=older_than)]
    _emit(documents, as_json, lambda: print_table(documents, CLAIM_COLUMNS, out), out)
    return EXIT_OK


def _stuck_document(row: ClaimRow) -> dict[str, Any]:
    document = {**row.as_dict(), "kind": "deferred_run" if row.owned else "claim"}
    if row.owned and row.error is None:
        document["error"] = (
            "deferred run left for a human: it began its call and its lease ran out "
            f"(last error: {row.last_error or 'none'})"
        )
    return document


def answer_of(note: str | None) -> str | None:
    """The answer a ``reconcile`` history note records (``reconcile.history_note``'s first
    word)."""
    head = (note or "").split(":", 1)[0]
    return head if head in ANSWERS else None


def _show(args: argparse.Namespace, admin: OperatorLedger, out: TextIO) -> int:
    """One claim and its history; a key whose claim is gone (released, reopened) shows its
    history and the claim as it was before the last change."""
    found = admin.find(args.key)
    history = admin.history(args.key)
    if found is None and not history:
        raise ClaimNotFound(
            f"no claim with key {args.key!r}, and no operator history for it (a handler that "
            "raised released its claim: the drain's log lines with action retry and this "
            "idem_key say why)"
        )
    row = found.as_dict() if found is not None else None
    probes = [
        {"at": h["at"], "answer": answer_of(h["note"]), "note": h["note"], "actor": h["actor"]}
        for h in history
        if h["action"] == RECONCILE
    ]
    _emit(
        {"claim": row, "history": history, "probes": probes},
        args.json,
        lambda: _show_human(args.key, row, history, out, probes),
        out,
    )
    return EXIT_OK


def _show_human(
    key: str,
    row: Mapping[str, Any] | None,
    history: Sequence[Mapping[str, Any]],
    out: TextIO,
    probes: Sequence[Mapping[str, Any]] = (),
) -> None:
    if row is not None and row.get("run_after") is not None:
        print("deferred work, owned by the ledger (claims list --state deferred):", file=out)
    if row is None:
        last = history[-1]
        before = next((h["before"] for h in reversed(history) if _is_claim(h["before"])), None)
        then = "a new delivery claims it afresh"
        if last["action"] == "release" and before is not None:
            then = _released_then(before)
        print(
            f"no claim with key {key!r} now: {last['action']} by {last['actor']} at "
            f"{_cell(last['at'])}; {then}",
            file=out,
        )
        if before is not None:
            print("\nthe claim as it was before that:", file=out)
            row = before
    if row is not None:
        _print_fields(row, out)
    if probes:
        print("\nreconcile probes (what the provider answered):", file=out)
        print_table(probes, ["at", "answer", "note"], out, whole=["note"])
    if not history:
        print("\nhistory: none recorded", file=out)
        return
    print("\nhistory:", file=out)
    print_table(history, ["at", "action", "actor", "note"], out)


def _print_fields(row: Mapping[str, Any], out: TextIO) -> None:
    width = max(len(k) for k in row)
    for name, value in row.items():
        whole = name in {"error", "last_error"}
        print(f"{name.ljust(width)}  {value if whole else _cell(value)}", file=out)


def _is_claim(document: Any) -> bool:
    return isinstance(document, Mapping) and "state" in document and "idem_key" in document


def _changed_out(
    row: ClaimRow,
    verb: str,
    as_json: bool,
    out: TextIO,
    *,
    then: Callable[[Mapping[str, Any]], str] | None = None,
) -> int:
    """A resolve or a release: of a claim, or of a deferred run left for a human; ``then``
    says what comes next for the claim as the change left it (as it was, when deleted)."""
    document: dict[str, Any] = {"action": verb, "claim": row.as_dict()}
    line = f"{verb} {row.idem_key} (recorded in claim_history)"
    if then is not None:
        document["next"] = then(document["claim"])
        line += f": {document['next']}"
    _emit(document, as_json, lambda: print(line, file=out), out)
    return EXIT_OK


def _released_then(claim: Mapping[str, Any]) -> str:
    """What runs a released claim's work again, by the claim as the release left it, or as it
    was when the release deleted it (docs/operations.md's CLI table says the same)."""
    if claim.get("run_after") is None:
        return "the next delivery of its message runs the job (a redrive, if it reached the DLQ)"
    if claim["state"] == "deferred":
        return "it waits again, due now: the next drain runs it"
    return (
        "deferred work that failed has no next delivery (its message was acked when the ledger "
        "took it over); its dead letter is what runs it again: `infrai-jobs redrive --key "
        f"{claim['idem_key']}` (`infrai-jobs dlq` lists it, and it pages until redriven or "
        "discarded)"
    )
