"""A stand-in for the downstream providers of the jobs, on loopback.

Every setting a job declares (``MAIL_PROVIDER_URL`` ...) may point at it: ``sink_settings``
gives them all its URL, which is what a local sandbox does.

It counts effects so tests and the demo can prove "at most once":

* ``POST /v1/mail/send``: a mail-like, non-idempotent provider; every call is one more e-mail.
* ``POST /v1/digests``: honours ``Idempotency-Key``: a repeated key replays the first answer and
  performs no new effect.
* ``POST /v1/effects/<job>``: any other job's downstream (what ``infrai-jobs new-job`` calls):
  with an ``Idempotency-Key``, a repeated key replays the first answer; without one, every call
  is one more effect.
* ``GET /v1/mail?invoice_id=<id>``: the mails sent for an invoice (id, recipient, invoice id and
  template), as a mail provider's message search offers; an empty list when none was.
* ``GET /v1/digests/<idempotency key>``: the digest built under that key, or 404: the lookup by
  idempotency key an idempotent provider offers.
* ``GET /_sink/state``: calls and effects per route and per key.
* ``POST /_sink/faults`` ``{"fail_rate": p, "hang_rate": p, "hang_seconds": s, "seed": n,
  "lookup_status": code}``: answer 503 without an effect, or perform the effect and then hang
  past the client's read timeout; ``lookup_status`` makes every lookup answer that status.
* ``POST /_sink/reset``.

A job of your own gets routes of its own (``Route``, passed to ``start_in_thread(routes=...)``;
the test kit's ``job_kit_provider_routes`` fixture): any method and path, ``{name}`` matching
one path segment (``POST /hooks/{subscriber}``), answered with the status and body it gives
(200 and a fresh ``{"id": ...}`` unless told). A call answered 2xx is one effect, recorded under
its key: the ``Idempotency-Key`` header, else ``X-Request-Key`` (what ``new-job``'s handlers
send), else where ``key`` says (``header:NAME``, ``body:FIELD``, ``path:NAME``, ``query:NAME``).
A route with ``lookup=True`` is what a reconcile probe calls (``GET /deliveries/{id}``): it
answers 200 with what was received under the key its request names (its path's last
``{parameter}`` unless told) and 404 when nothing was. ``fail_rate``, ``hang_rate`` and
``lookup_status`` apply to these routes as to the built-in ones. A request no route serves
answers 404 and is listed in the state's ``unrouted``, so a test that calls a path the
stand-in lacks says which.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
import secrets
import sys
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Final
from urllib.parse import parse_qs, unquote, urlsplit

_KEY_SOURCES: Final = ("header", "body", "path", "query")
_PATH_PARAMETER: Final = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


@dataclass(frozen=True, slots=True)
class Route:
    """One route of a job's own stand-in provider (see the module's docstring).

    ``path``: ``{name}`` matches one path segment. ``status``/``body``: the answer (``body``
    None: a fresh ``{"id": ...}``); a 2xx answer records an effect. ``lookup``: answer from the
    calls received instead, 200 with the first call under the key the request names, else 404.
    ``key``: where a call's key is (``header:NAME``, ``body:FIELD``, ``path:NAME``,
    ``query:NAME``); empty: ``Idempotency-Key``, else ``X-Request-Key`` for an effect, and
    the path's last ``{parameter}`` for a lookup."""

    method: str
    path: str
    status: int = 200
    body: Mapping[str, Any] | None = None
    lookup: bool = False
    key: str = ""

    def __post_init__(self) -> None:
        if not self.path.startswith("/") or not self.method.isalpha():
            raise ValueError(f"route {self.method} {self.path}: a method and a path from /")
        source, _, name = self.key_source.partition(":")
        if source not in _KEY_SOURCES or not name:
            raise ValueError(
                f"route {self.method} {self.path}: key {self.key!r} is not one of "
                "header:NAME, body:FIELD, path:NAME, query:NAME"
            )
        if source == "path" and name not in _PATH_PARAMETER.findall(self.path):
            raise ValueError(
                f"route {self.method} {self.path}: key {self.key!r} names no {{{name}}} in the path"
            )

    @property
    def key_source(self) -> str:
        """Where the key is; a lookup's default is its path's last ``{parameter}``."""
        if self.key or not self.lookup:
            return self.key or "header:Idempotency-Key"
        names = _PATH_PARAMETER.findall(self.path)
        return f"path:{names[-1] if names else 'key'}"

    def match(self, method: str, path: str) -> dict[str, str] | None:
        """The path's parameters when this route serves the request, else None."""
        if method != self.method.upper():
            return None
        parts = _PATH_PARAMETER.split(self.path)  # literal, name, literal, ...
        pattern = "".join(
            f"(?P<{part}>[^/]+)" if index % 2 else re.escape(part)
            for index, part in enumerate(parts)
        )
        found = re.fullmatch(pattern, path)
        return {k: unquote(v) for k, v in found.groupdict().items()} if found else None


@dataclass
class SinkState:
    lock: threading.Lock = field(default_factory=threading.Lock)
    calls: Counter[str] = field(default_factory=Counter)
    mails: Counter[str] = field(default_factory=Counter)  # invoice id -> e-mails sent
    digests: Counter[str] = field(default_factory=Counter)  # idempotency key -> digests built
    effects: Counter[str] = field(default_factory=Counter)  # "<path> <key>" -> effects
    # path -> SHA-256 of the last Authorization header a /v1/effects/ call sent: a test checks
    # a job's credential arrived, and the sink keeps no credential itself.
    authorized: dict[str, str] = field(default_factory=dict)
    replies: dict[str, dict[str, Any]] = field(default_factory=dict)
    sent: dict[str, list[dict[str, str]]] = field(default_factory=dict)  # invoice id -> mails
    lookup_status: int = 0  # 0: lookups answer; else every lookup answers this status
    fail_rate: float = 0.0
    hang_rate: float = 0.0
    hang_seconds: float = 6.0
    rng: random.Random = field(default_factory=random.Random)
    # A job's own routes (``Route``), served before the built-in ones; what they received, by
    # key; and the requests no route served ("METHOD /path").
    routes: tuple[Route, ...] = ()
    received: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    unrouted: list[str] = field(default_factory=list)

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return {
                "calls": dict(self.calls),
                "mails": dict(self.mails),
                "digests": dict(self.digests),
                "effects": dict(self.effects),
                "authorized": dict(self.authorized),
                "mail_effects": sum(self.mails.values()),
                "digest_effects": sum(self.digests.values()),
                "received": {
                    key: [{"path": c["path"], "id": c["id"]} for c in calls]
                    for key, calls in self.received.items()
                },
                "unrouted": list(self.unrouted),
            }


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Small answers on a kept-alive connection would otherwise wait ~40 ms for a delayed ACK.
    disable_nagle_algorithm = True
    server: _SinkServer

    def log_message(self, format: str, *args: Any) -> None:
        return

    def _reply(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> dict[str, Any]:
        length = int(self.headers.get("Content-Length") or 0)
        try:
            parsed = json.loads(self.rfile.read(length) or b"{}")
        except ValueError:
            return {}
        return parsed if isinstance(parsed, dict) else {}

    def do_GET(self) -> None:
        state = self.server.state
        if self.path == "/_sink/state":
            self._reply(200, state.snapshot())
            return
        if self._routed({}):
            return
        url = urlsplit(self.path)
        if url.path != "/v1/mail" and not url.path.startswith("/v1/digests/"):
            self._not_found()
            return
        with state.lock:
            state.calls[f"GET {url.path.split('/')[2]}"] += 1
            status = state.lookup_status
            if url.path == "/v1/mail":
                invoice = (parse_qs(url.query).get("invoice_id") or [""])[0]
                found: dict[str, Any] | None = {
                    "invoice_id": invoice,
                    "messages": list(state.sent.get(invoice, [])),
                }
            else:
                key = unquote(url.path[len("/v1/digests/") :])
                reply = state.replies.get(key) if key in state.digests else None
                found = {"id": reply["id"], "idempotency_key": key} if reply else None
        if status:
            self._reply(status, {"error": f"lookup answers {status} (a fault)"})
        elif found is None:
            self._reply(404, {"error": "no digest under that key"})
        else:
            self._reply(200, found)

    def do_POST(self) -> None:
        state = self.server.state
        body = self._body()
        if self.path == "/_sink/reset":
            with state.lock:
                self.server.state = SinkState(routes=state.routes)
            self._reply(200, {"ok": True})
            return
        if self.path == "/_sink/faults":
            with state.lock:
                state.fail_rate = float(body.get("fail_rate", 0.0))
                state.hang_rate = float(body.get("hang_rate", 0.0))
                state.hang_seconds = float(body.get("hang_seconds", 6.0))
                state.rng = random.Random(body.get("seed"))
                state.lookup_status = int(body.get("lookup_status", 0))
            self._reply(200, {"ok": True})
            return
        if self._routed(body):
            return
        generic = self.path.startswith("/v1/effects/") and len(self.path) > len("/v1/effects/")
        if self.path not in ("/v1/mail/send", "/v1/digests") and not generic:
            self._not_found()
            return
        with state.lock:
            state.calls[self.path] += 1
            fail = state.rng.random() < state.fail_rate
            hang = not fail and state.rng.random() < state.hang_rate
        if fail:
            self._reply(503, {"error": "provider unavailable, nothing done"})
            return
        reply = self._effect(state, body)
        if hang:
            # The effect happened; the caller will time out and cannot know it.
            time.sleep(state.hang_seconds)
        self._reply(200, reply)

    def do_PUT(self) -> None:
        self._only_routed()

    def do_PATCH(self) -> None:
        self._only_routed()

    def do_DELETE(self) -> None:
        self._only_routed()

    def _only_routed(self) -> None:
        if not self._routed(self._body()):
            self._not_found()

    def _not_found(self) -> None:
        request = f"{self.command} {urlsplit(self.path).path}"
        with self.server.state.lock:
            self.server.state.unrouted.append(request)
        self._reply(404, {"error": f"the stand-in provider has no route {request}"})

    def _routed(self, body: dict[str, Any]) -> bool:
        """Serve the request with a job's own route, if one matches; whether one did."""
        state = self.server.state
        url = urlsplit(self.path)
        for route in state.routes:
            params = route.match(self.command, url.path)
            if params is None:
                continue
            key = self._route_key(route, params, parse_qs(url.query), body)
            with state.lock:
                state.calls[f"{route.method.upper()} {route.path}"] += 1
                if route.lookup:
                    status = state.lookup_status
                    calls = list(state.received.get(key, ()))
                    fail = hang = False
                else:
                    status = 0
                    fail = state.rng.random() < state.fail_rate
                    hang = not fail and state.rng.random() < state.hang_rate
            if route.lookup:
                self._reply(*_lookup_answer(status, key, calls))
            elif fail:
                self._reply(503, {"error": "provider unavailable, nothing done"})
            else:
                self._reply(route.status, self._route_effect(route, url.path, key, body, hang))
            return True
        return False

    def _route_key(
        self,
        route: Route,
        params: Mapping[str, str],
        query: Mapping[str, Sequence[str]],
        body: Mapping[str, Any],
    ) -> str:
        if not route.key and not route.lookup:
            return self.headers.get("Idempotency-Key") or self.headers.get("X-Request-Key") or ""
        source, _, name = route.key_source.partition(":")
        if source == "header":
            return self.headers.get(name) or ""
        if source == "path":
            return params.get(name, "")
        if source == "query":
            return (query.get(name) or [""])[0]
        return str(body.get(name, ""))

    def _route_effect(
        self, route: Route, path: str, key: str, body: dict[str, Any], hang: bool
    ) -> dict[str, Any]:
        """A job's own route's answer; a 2xx one is an effect, recorded under its key."""
        reply = dict(route.body) if route.body is not None else {"id": "fx_" + secrets.token_hex(6)}
        if 200 <= route.status < 300:
            state = self.server.state
            with state.lock:
                state.effects[f"{path} {key}"] += 1
                call = {"path": path, "id": reply.get("id"), "body": body}
                state.received.setdefault(key, []).append(call)
                if authorization := self.headers.get("Authorization"):
                    state.authorized[path] = hashlib.sha256(authorization.encode()).hexdigest()
        if hang:
            # The effect happened; the caller will time out and cannot know it.
            time.sleep(self.server.state.hang_seconds)
        return reply

    def _effect(self, state: SinkState, body: dict[str, Any]) -> dict[str, Any]:
        with state.lock:
            if self.path == "/v1/mail/send":
                invoice = str(body.get("invoice_id"))
                state.mails[invoice] += 1
                mail = {
                    "id": "mail_" + secrets.token_hex(6),
                    "to": str(body.get("to", "")),
                    "invoice_id": invoice,
                    "template": str(body.get("template", "")),
                }
                state.sent.setdefault(invoice, []).append(mail)
                return {"id": mail["id"]}
            key = self.headers.get("Idempotency-Key") or ""
            if self.path.startswith("/v1/effects/"):
                if authorization := self.headers.get("Authorization"):
                    digest = hashlib.sha256(authorization.encode()).hexdigest()
                    state.authorized[self.path] = digest
                if key and key in state.replies:
                    return {**state.replies[key], "replayed": True}
                state.effects[f"{self.path} {key or self.headers.get('X-Request-Key', '')}"] += 1
                reply = {"id": "fx_" + secrets.token_hex(6)}
                if key:
                    state.replies[key] = reply
                return reply
            if key and key in state.replies:
                return {**state.replies[key], "replayed": True}
            state.digests[key] += 1
            reply = {"id": "dg_" + secrets.token_hex(6)}
            if key:
                state.replies[key] = reply
            return reply


def _lookup_answer(fault: int, key: str, calls: list[dict[str, Any]]) -> tuple[int, dict[str, Any]]:
    """A lookup route's answer: the first call received under ``key`` (its id, path and body,
    and how many there were), 404 when none was, or the ``lookup_status`` fault."""
    if fault:
        return fault, {"error": f"lookup answers {fault} (a fault)"}
    if not key or not calls:
        return 404, {"error": f"nothing received under key {key!r}"}
    first = calls[0]
    return 200, {
        "key": key,
        "id": first["id"],
        "path": first["path"],
        "body": first["body"],
        "calls": len(calls),
    }


class _SinkServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], routes: Sequence[Route] = ()) -> None:
        super().__init__(address, _Handler)
        self.state = SinkState(routes=tuple(routes))

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A caller that hung up (a drain whose read timed out while a hang fault held the
        # answer) is what the fault is for: nothing to report, and no traceback for it.
        if isinstance(sys.exc_info()[1], BrokenPipeError | ConnectionResetError):
            return
        super().handle_error(request, client_address)


@dataclass
class RunningSink:
    server: _SinkServer
    thread: threading.Thread

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host!s}:{port}"

    @property
    def state(self) -> SinkState:
        return self.server.state

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def sink_settings(url: str, jobs_path: str | None = None) -> dict[str, str]:
    """Every setting the jobs package declares (the installed one unless ``jobs_path``),
    pointed at the sink at ``url``."""
    from infrai_local.jobs_package import load_registry  # noqa: PLC0415

    return dict.fromkeys(load_registry(jobs_path).declared_settings(), url)


def start_in_thread(
    host: str = "127.0.0.1", port: int = 0, routes: Sequence[Route] = ()
) -> RunningSink:
    """The sink on ``host:port`` (0: a free port), serving ``routes`` before its own."""
    server = _SinkServer((host, port), routes)
    thread = threading.Thread(target=server.serve_forever, name="provider-sink", daemon=True)
    thread.start()
    return RunningSink(server, thread)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="infrai-jobs provider-sink",
        description="Serve a local stand-in for the jobs' downstreams (the settings they "
        "declare, e.g. MAIL_PROVIDER_URL) "
        "until Ctrl-C. Prints its URL first; GET /_sink/state shows the effects it counted.",
    )
    parser.add_argument("--host", default="127.0.0.1", help="default: %(default)s")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port (default)")
    args = parser.parse_args(argv)
    sink = start_in_thread(args.host, args.port)
    print(sink.url, flush=True)
    try:
        sink.thread.join()
    except KeyboardInterrupt:
        sink.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
