"""The console's pages: a Flask app over a backend that runs the on-call commands.

Pages are HTML rendered on the server (Jinja2, escaped by default) and read without JavaScript;
the stylesheet ships in the package. Reads run the read commands (``dlq``, ``claims stuck``,
``claims list --state deferred``, ``claims show``); each action runs the command that does it,
and the result page shows the command line, so the operator can type it next time.
"""

from __future__ import annotations

import secrets
import shlex
import sys
import threading
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import quote, urlencode

from flask import Flask, Response, redirect, render_template, request
from werkzeug.exceptions import HTTPException

from infrai_jobs.errors import (
    ClaimChanged,
    ClaimNotFound,
    ConfigurationError,
    InfraiError,
    InfraiJobsError,
)
from infrai_jobs.ledger.postgres import redact
from infrai_local.cli import raw_database_url
from infrai_local.operator.cli_ops import DeadLetterNotFound
from infrai_local.operator.console import chart, commands
from infrai_local.operator.console.commands import BULK_LIMIT, CommandResult
from infrai_local.operator.console.guard import TOKEN_FIELD, Guard

HERE = Path(__file__).resolve().parent
_MAX_FIELD = 2000


class Backend(Protocol):
    """What the pages need: the commands, and the reads no command prints."""

    queue_name: str
    watched: tuple[str, ...]
    actor: str

    def run(self, argv: Sequence[str]) -> CommandResult: ...

    def stats(self) -> list[dict[str, Any]]: ...

    def alerts(self) -> list[dict[str, Any]]: ...

    def settled_per_minute(self) -> tuple[Any, list[dict[str, Any]]]: ...

    def dead_letters_of_key(self, key: str) -> list[dict[str, Any]]: ...


class BadRequest(ConfigurationError):
    """A form or query the console cannot act on: shown as it is, nothing done."""


def public_message(exc: BaseException) -> str:
    """What a page may say about ``exc``: the commands' own one-line wording, with the
    database URL's secrets removed; never a traceback."""
    text = " ".join(str(exc).split())
    if isinstance(exc, InfraiError):
        text = f"Infrai {text}"
    elif not isinstance(exc, InfraiJobsError):
        text = f"unexpected {type(exc).__name__}; the console's terminal has one line about it"
    return redact(text, raw_database_url())


def _status_of(exc: InfraiJobsError) -> int:
    if isinstance(exc, ClaimNotFound | DeadLetterNotFound):
        return 404
    if isinstance(exc, ClaimChanged):
        return 409
    if isinstance(exc, ConfigurationError):
        return 400
    return 502


def parse_time(value: Any) -> datetime | None:
    if isinstance(value, datetime):
        return value
    if not isinstance(value, str) or not value:
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def age(value: Any, now: datetime | None = None) -> str:
    """``3h 12m``, ``45s``: how long ago ``value`` (an ISO time) was; "-" when unknown."""
    moment = parse_time(value)
    if moment is None:
        return "-"
    seconds = max(int(((now or datetime.now(UTC)) - moment).total_seconds()), 0)
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    mins, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours}h"
    if hours:
        return f"{hours}h {mins}m"
    if mins:
        return f"{mins}m {secs}s"
    return f"{secs}s"


def oldest(values: Sequence[Any]) -> Any:
    times = [t for t in (parse_time(v) for v in values) if t is not None]
    return min(times).isoformat() if times else None


def _field(name: str, *, required: bool = False) -> str:
    value = request.form.get(name, "")
    if len(value) > _MAX_FIELD:
        raise BadRequest(f"the field {name} is longer than {_MAX_FIELD} characters")
    if required and not value.strip():
        raise BadRequest(f"the field {name} is required")
    return value


def _message_ids(values: list[str]) -> list[str]:
    chosen = list(dict.fromkeys(v for v in values if v.strip()))
    if not chosen:
        raise BadRequest("select at least one dead letter")
    if len(chosen) > BULK_LIMIT:
        raise BadRequest(f"select at most {BULK_LIMIT} dead letters at a time")
    if any(len(v) > _MAX_FIELD for v in chosen):
        raise BadRequest("a message id is too long")
    return chosen


class _DeadLettersOneAtATime:
    """The backend, its commands that touch the dead letters run one at a time.

    The server serves each request on a thread of its own. Reading the dead letters consumes
    Infrai's DLQ before recording what it read: two reads at once would each hide from the other
    the letters it had taken and not yet recorded (a page would list too few), and a redrive or
    discard submitted twice would race itself to the same letters. Other commands (a probe that
    waits on a slow provider, the stuck claims, one key) run beside them: the ledger fences each
    change."""

    def __init__(self, backend: Backend, lock: threading.Lock) -> None:
        self._backend = backend
        self._lock = lock
        self.queue_name = backend.queue_name
        self.watched = backend.watched
        self.actor = backend.actor

    def run(self, argv: Sequence[str]) -> CommandResult:
        if not commands.touches_dead_letters(argv):
            return self._backend.run(argv)
        with self._lock:
            return self._backend.run(argv)

    def stats(self) -> list[dict[str, Any]]:
        return self._backend.stats()

    def alerts(self) -> list[dict[str, Any]]:
        return self._backend.alerts()

    def settled_per_minute(self) -> tuple[Any, list[dict[str, Any]]]:
        return self._backend.settled_per_minute()

    def dead_letters_of_key(self, key: str) -> list[dict[str, Any]]:
        return self._backend.dead_letters_of_key(key)


def create_app(
    backend: Backend, guard: Guard, *, dead_letters_lock: threading.Lock | None = None
) -> Flask:
    """The console's WSGI app, for one start (one token). Its commands that touch the dead
    letters hold ``dead_letters_lock`` (a new one unless given) while they run."""
    backend = _DeadLettersOneAtATime(backend, dead_letters_lock or threading.Lock())
    app = Flask(
        __name__,
        template_folder=str(HERE / "templates"),
        static_folder=str(HERE / "static"),
        static_url_path="/static",
    )
    app.config.update(MAX_CONTENT_LENGTH=256 * 1024, TRAP_HTTP_EXCEPTIONS=False)
    app.jinja_env.filters["age"] = age
    app.jinja_env.globals.update(
        guard=guard, token_field=TOKEN_FIELD, backend=backend, label=chart.label
    )

    _guard_requests(app, guard)
    _read_pages(app, backend)
    _action_pages(app, backend)
    return app


def page(template: str, status: int = 200, **context: Any) -> Response:
    # Each render carries a mark of its own (``data-render``): what follows a click is told
    # from the page clicked on without holding a node of the page being replaced.
    html = render_template(template, render_mark=secrets.token_hex(8), **context)
    return Response(html, status=status, mimetype="text/html")


def refused(message: str, status: int = 403) -> Response:
    return page("message.html", status, title="Refused", message=message)


def _guard_requests(app: Flask, guard: Guard) -> None:
    """The token, host and cross-site checks before every request; the headers after."""

    @app.before_request
    def check_access() -> Response | None:
        refusal = guard.host_refusal(request.host)
        if refusal:
            return refused(refusal)
        if request.endpoint == "static":
            return None
        query_token = request.args.get("token")
        refusal = guard.read_refusal(request.cookies.get(guard.cookie_name), query_token)
        if refusal:
            return refused(refusal)
        if query_token is not None:
            # Into a cookie, and out of the address bar (and the browser's history); the rest of
            # the query is encoded again, so a value holding & or # stays one value, and the
            # path keeps one leading slash (`//host/` would send the browser to another site).
            kept = [(k, v) for k, v in request.args.items(multi=True) if k != "token"]
            target = "/" + quote(request.path.lstrip("/")) + ("?" + urlencode(kept) if kept else "")
            response = redirect(target, code=303)
            response.set_cookie(
                guard.cookie_name, guard.token, httponly=True, samesite="Strict", path="/"
            )
            return response  # type: ignore[return-value]
        if request.method == "POST":
            refusal = guard.action_refusal(
                request.form.get(TOKEN_FIELD),
                origin=request.headers.get("Origin"),
                fetch_site=request.headers.get("Sec-Fetch-Site"),
            )
            if refusal:
                return refused(refusal)
        return None

    @app.after_request
    def harden(response: Response) -> Response:
        response.headers["Content-Security-Policy"] = (
            "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; "
            "frame-ancestors 'none'; base-uri 'none'"
        )
        response.headers["X-Content-Type-Options"] = "nosniff"
        # "no-referrer" would make the browser send `Origin: null` with the console's own forms.
        response.headers["Referrer-Policy"] = "same-origin"
        response.headers["Cache-Control"] = "no-store"
        return response

    @app.errorhandler(InfraiJobsError)
    def known_error(exc: InfraiJobsError) -> Response:
        return page("message.html", _status_of(exc), title="Not done", message=public_message(exc))

    @app.errorhandler(Exception)
    def unexpected(exc: Exception) -> Response:
        if isinstance(exc, HTTPException):
            return page(
                "message.html", exc.code or 500, title=exc.name, message=exc.description or ""
            )
        # One line for the terminal, secrets removed; the page says less.
        detail = redact(" ".join(str(exc).split()), raw_database_url())
        print(f"console: unexpected {type(exc).__name__}: {detail}", file=sys.stderr, flush=True)
        return page("message.html", 500, title="Error", message=public_message(exc))


def _read_pages(app: Flask, backend: Backend) -> None:
    """Overview, dead letters (and the redrive's preview), stuck claims, deferred work, a key."""

    def dlq() -> dict[str, Any]:
        document: dict[str, Any] = backend.run(commands.dlq_list()).document
        return document

    def stuck() -> list[dict[str, Any]]:
        claims: list[dict[str, Any]] = backend.run(commands.claims_stuck()).document
        rows = []
        for claim in claims:
            shown = backend.run(commands.claims_show(claim["idem_key"])).document
            probes = shown.get("probes") or []
            rows.append({"claim": claim, "probe": probes[-1] if probes else None})
        return rows

    def deferred() -> list[dict[str, Any]]:
        jobs: list[dict[str, Any]] = backend.run(commands.deferred_list()).document
        return jobs

    @app.get("/")
    def overview() -> Response:
        letters, claims, work = dlq(), stuck(), deferred()
        now = datetime.now(UTC)
        due = [
            j
            for j in work
            if j["state"] == "deferred" and (parse_time(j["run_after"]) or now) <= now
        ]
        now_minute, rows = backend.settled_per_minute()
        series = chart.minutes(now_minute, rows) if now_minute is not None else []
        recorded = [m for m in letters["messages"] if m.get("recorded")]
        return page(
            "overview.html",
            counts={
                "dead_letters": letters["unresolved"],
                "dead_letters_oldest": oldest([m["first_seen"] for m in recorded]),
                "stuck": len(claims),
                "stuck_oldest": oldest([r["claim"]["claimed_at"] for r in claims]),
                "deferred": len(work),
                "deferred_due": len(due),
                "deferred_running": sum(1 for j in work if j["state"] == "running"),
                "deferred_oldest": oldest([j["deferred_at"] for j in work]),
            },
            notice=letters.get("notice", ""),
            stats=backend.stats(),
            alerts=backend.alerts(),
            chart_svg=chart.svg(series),
            chart_totals=chart.totals(series),
        )

    @app.get("/dead-letters")
    def dead_letters() -> Response:
        letters = dlq()
        job = request.args.get("job", "").strip()
        reason = request.args.get("reason", "").strip()
        rows = [
            m
            for m in letters["messages"]
            if (not job or m.get("job") == job)
            and (not reason or reason.lower() in (m.get("reason") or "").lower())
        ]
        jobs = sorted({m["job"] for m in letters["messages"] if m.get("job")})
        return page(
            "dead_letters.html",
            rows=rows,
            jobs=jobs,
            job=job,
            reason=reason,
            unresolved=letters["unresolved"],
            notice=letters.get("notice", ""),
            command=shlex.join(["infrai-jobs", *commands.dlq_list()]),
        )

    @app.get("/dead-letters/preview")
    def redrive_preview() -> Response:
        chosen = _message_ids(request.args.getlist("m"))
        reopen = request.args.get("reopen") == "1"
        results = [
            backend.run(commands.redrive_one(m, dry_run=True, reopen_failed=reopen)) for m in chosen
        ]
        would_run = [seen for r in results for seen in r.document["seen"]]
        skipped = [s for r in results for s in r.document["skipped"]]
        found = {s["message_id"] for s in would_run} | {s["message_id"] for s in skipped}
        return page(
            "preview.html",
            would_run=would_run,
            skipped=skipped,
            missing=[m for m in chosen if m not in found],
            reopen=reopen,
            results=results,
            price=results[0].document["price_usd_per_message"] if results else "",
        )

    @app.get("/stuck")
    def stuck_claims() -> Response:
        return page("stuck.html", rows=stuck())

    @app.get("/deferred")
    def deferred_work() -> Response:
        return page("deferred.html", rows=deferred(), now=datetime.now(UTC))

    @app.get("/key")
    def one_key() -> Response:
        key = request.args.get("k", "").strip()
        if not key:
            return page("key.html", key="", shown=None, letters=[])
        try:
            shown = backend.run(commands.claims_show(key)).document
        except ClaimNotFound:
            shown = None
        letters = backend.dead_letters_of_key(key)
        if shown is None and not letters:
            raise ClaimNotFound(f"no claim, history, deferred work or dead letter with key {key!r}")
        return page("key.html", key=key, shown=shown, letters=letters)


def _action_pages(app: Flask, backend: Backend) -> None:
    """The POSTs: each runs the command that does it (the guard has checked the request)."""

    def act(title: str, argvs: list[list[str]]) -> Response:
        """Run each command; one that is refused is reported beside those that ran."""
        done: list[CommandResult] = []
        failed: list[tuple[str, str]] = []
        status = 200
        for argv in argvs:
            try:
                done.append(backend.run(argv))
            except InfraiJobsError as exc:
                failed.append((shlex.join(["infrai-jobs", *argv]), public_message(exc)))
                status = 409 if done else _status_of(exc)
        return page("result.html", status, title=title, done=done, failed=failed)

    @app.post("/dead-letters/redrive")
    def redrive() -> Response:
        chosen = _message_ids(request.form.getlist("m"))
        reopen = request.form.get("reopen") == "1"
        return act(
            "Redrive",
            [commands.redrive_one(m, dry_run=False, reopen_failed=reopen) for m in chosen],
        )

    @app.post("/dead-letters/discard")
    def discard() -> Response:
        chosen = _message_ids(request.form.getlist("m"))
        note = _field("note")
        return act("Discard", [commands.discard_one(m, note) for m in chosen])

    claim_actions: dict[str, Callable[[str, str, str], list[str]]] = {
        "probe": lambda key, _token, _note: commands.reconcile_one(key),
        "resolve-done": lambda key, token, note: commands.resolve(
            key, done=True, claim_token=token, note=note, result=_field("result")
        ),
        "resolve-failed": lambda key, token, note: commands.resolve(
            key, done=False, claim_token=token, note=note, error=_field("error")
        ),
        "release": lambda key, token, note: commands.release(key, claim_token=token, note=note),
        "run-now": lambda key, _token, note: commands.steer_deferred(key, run_now=True, note=note),
        "cancel": lambda key, _token, note: commands.steer_deferred(key, run_now=False, note=note),
    }

    @app.post("/claims/<action>")
    def claim_action(action: str) -> Response:
        build = claim_actions.get(action)
        if build is None:
            raise BadRequest(f"no such action: {action}")
        key = _field("key", required=True)
        argv = build(key, _field("claim_token"), _field("note"))
        return act(action.replace("-", " "), [argv])
