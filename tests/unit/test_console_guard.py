"""The console's guard and pages without a socket: Flask's test client over an in-memory backend
that answers the read commands and records every command it is asked to run."""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import pytest
from flask.testing import FlaskClient
from werkzeug.datastructures import MultiDict

from infrai_local.operator.console import commands
from infrai_local.operator.console.commands import CommandResult, ops_parser
from infrai_local.operator.console.guard import Guard, is_loopback, is_wildcard
from infrai_local.operator.console.server import page_url, parse_args
from infrai_local.operator.console.views import create_app

TOKEN = "t" * 43
PORT = 8780
ORIGIN = f"http://127.0.0.1:{PORT}"


class RecordingBackend:
    queue_name = "billing-jobs"
    watched = ("billing-jobs",)
    actor = "on-call@example.com"

    def __init__(self, lock: threading.Lock | None = None) -> None:
        self.ran: list[tuple[str, ...]] = []
        self.lock = lock
        self.held: list[tuple[str, bool]] = []  # (command, whether the lock was held)

    def run(self, argv: Sequence[str]) -> CommandResult:
        self.ran.append(tuple(argv))
        if self.lock is not None:
            self.held.append(
                (" ".join(w for w in argv[:2] if not w.startswith("-")), self.lock.locked())
            )
        words = [w for w in argv if not w.startswith("-")]
        document: Any = {"ok": True}
        if words[:1] == ["dlq"] and len(words) == 1:
            document = {
                "messages": [
                    {
                        "message_id": "m-1",
                        "job": "receipt.send",
                        "idem_key": "receipt.send:inv_1",
                        "state": None,
                        "deliveries": 3,
                        "first_seen": datetime.now(UTC).isoformat(),
                        "reason": "<script>alert(1)</script>",
                        "recorded": True,
                    }
                ],
                "unresolved": 1,
                "notice": "",
            }
        elif words[:2] in (["claims", "stuck"], ["claims", "list"]):
            document = []
        elif words[:2] == ["claims", "show"]:
            document = {"claim": None, "deferred": None, "history": [], "probes": []}
        return CommandResult(tuple(argv), 0, document)

    def stats(self) -> list[dict[str, Any]]:
        return []

    def alerts(self) -> list[dict[str, Any]]:
        return []

    def settled_per_minute(self) -> tuple[Any, list[dict[str, Any]]]:
        return datetime(2026, 1, 1, 12, 0, tzinfo=UTC), []

    def dead_letters_of_key(self, key: str) -> list[dict[str, Any]]:
        return []


def client_for(backend: RecordingBackend, *, allow_actions: bool = True) -> FlaskClient:
    app = create_app(backend, Guard(token=TOKEN, port=PORT, allow_actions=allow_actions))
    client = app.test_client()
    client.set_cookie(f"infrai_console_{PORT}", TOKEN, domain="127.0.0.1")
    return client


def post(client: FlaskClient, path: str, data: dict[str, str], **headers: str) -> Any:
    return client.post(path, data=data, headers=headers, base_url=ORIGIN)


def actions_ran(backend: RecordingBackend) -> list[tuple[str, ...]]:
    return [argv for argv in backend.ran if argv[:2] != ("claims", "show")]


def test_the_token_in_the_url_becomes_a_cookie_and_leaves_the_address_bar() -> None:
    client = RecordingBackend()
    app = create_app(client, Guard(token=TOKEN, port=PORT)).test_client()
    answer = app.get(f"/dead-letters?token={TOKEN}&job=x", base_url=ORIGIN)
    assert answer.status_code == 303
    assert answer.headers["Location"] == "/dead-letters?job=x"
    cookie = answer.headers["Set-Cookie"]
    assert TOKEN in cookie
    assert "HttpOnly" in cookie
    assert "SameSite=Strict" in cookie


def test_a_page_without_the_token_is_refused() -> None:
    app = create_app(RecordingBackend(), Guard(token=TOKEN, port=PORT)).test_client()
    assert app.get("/", base_url=ORIGIN).status_code == 403
    assert app.get("/?token=wrong", base_url=ORIGIN).status_code == 403


@pytest.mark.parametrize(
    ("data", "headers"),
    [
        ({"key": "k"}, {}),
        ({"key": "k", "csrf_token": "nope"}, {}),
        ({"key": "k", "csrf_token": TOKEN}, {"Origin": "https://evil.example"}),
        ({"key": "k", "csrf_token": TOKEN}, {"Origin": "null"}),
        ({"key": "k", "csrf_token": TOKEN}, {"Sec-Fetch-Site": "cross-site"}),
        ({"key": "k", "csrf_token": TOKEN}, {"Sec-Fetch-Site": "same-site"}),
    ],
)
def test_a_post_without_the_token_or_from_another_site_runs_nothing(
    data: dict[str, str], headers: dict[str, str]
) -> None:
    backend = RecordingBackend()
    answer = post(client_for(backend), "/claims/release", data, **headers)
    assert answer.status_code == 403
    assert backend.ran == []


def test_a_read_only_console_runs_no_action_even_with_the_token() -> None:
    backend = RecordingBackend()
    client = client_for(backend, allow_actions=False)
    answer = post(client, "/claims/release", {"key": "k", "csrf_token": TOKEN}, Origin=ORIGIN)
    assert answer.status_code == 403
    assert backend.ran == []
    assert b'method="post"' not in client.get("/dead-letters", base_url=ORIGIN).data


def test_a_host_that_is_not_loopback_is_refused() -> None:
    answer = client_for(RecordingBackend()).get("/", base_url="http://evil.example:8780")
    assert answer.status_code == 403


def test_an_allowed_post_runs_the_command_with_its_values_kept_as_values() -> None:
    backend = RecordingBackend()
    data = {"key": "-odd:key", "claim_token": "", "note": "--all", "csrf_token": TOKEN}
    answer = post(client_for(backend), "/claims/release", data, Origin=ORIGIN)
    assert answer.status_code == 200
    assert actions_ran(backend) == [
        ("claims", "release", "--json", "--note=--all", "--", "-odd:key")
    ]
    # And the commands' own parser reads it as the release of that key with that note
    args = ops_parser().parse_args(list(backend.ran[0]))
    assert (args.ops_command, args.key, args.note) == ("claims_release", "-odd:key", "--all")


def test_a_bulk_discard_runs_one_discard_per_letter_with_the_note() -> None:
    backend = RecordingBackend()
    form = MultiDict([("m", "m-1"), ("m", "m-2"), ("note", "duplicate"), ("csrf_token", TOKEN)])
    client = client_for(backend)
    answer = client.post(
        "/dead-letters/discard", data=form, headers={"Origin": ORIGIN}, base_url=ORIGIN
    )
    assert answer.status_code == 200
    assert backend.ran == [
        tuple(commands.discard_one("m-1", "duplicate")),
        tuple(commands.discard_one("m-2", "duplicate")),
    ]


def test_pages_escape_what_the_ledger_holds() -> None:
    html = client_for(RecordingBackend()).get("/dead-letters", base_url=ORIGIN).data
    assert b"<script>alert(1)</script>" not in html
    assert b"&lt;script&gt;" in html


def test_the_console_listens_on_loopback_unless_told_otherwise() -> None:
    assert parse_args([]).bind == "127.0.0.1"
    assert is_loopback("127.0.0.1")
    assert is_loopback("::1")
    assert is_loopback("localhost")
    assert not is_loopback("0.0.0.0")
    assert parse_args(["--bind", "0.0.0.0", "--hostname", "ops.internal"]).bind == "0.0.0.0"


def test_the_token_redirect_encodes_the_query_it_keeps() -> None:
    app = create_app(RecordingBackend(), Guard(token=TOKEN, port=PORT)).test_client()
    query = f"k=a%26b%23c&token={TOKEN}&m=m-1&m=m%202&note=%C3%A9t%C3%A9"
    answer = app.get(f"/key?{query}", base_url=ORIGIN)
    assert answer.status_code == 303
    assert answer.headers["Location"] == "/key?k=a%26b%23c&m=m-1&m=m+2&note=%C3%A9t%C3%A9"


def test_the_token_redirect_stays_on_the_console() -> None:
    app = create_app(RecordingBackend(), Guard(token=TOKEN, port=PORT)).test_client()
    # (a request line `GET //evil.example/x?token=... HTTP/1.1`)
    answer = app.get(
        "/",
        query_string={"token": TOKEN},
        base_url=ORIGIN,
        environ_overrides={"PATH_INFO": "//evil.example/x"},
    )
    assert answer.status_code == 303
    assert answer.headers["Location"] == "/evil.example/x"


def test_every_render_carries_a_mark_of_its_own() -> None:
    client = client_for(RecordingBackend())
    marks = [
        re.search(r'<html lang="en" data-render="([0-9a-f]+)">', html).group(1)  # type: ignore[union-attr]
        for html in (client.get("/stuck", base_url=ORIGIN).data.decode() for _ in range(2))
    ]
    assert len(set(marks)) == 2


@pytest.mark.parametrize(
    ("bind", "hostname", "url"),
    [
        ("127.0.0.1", "", f"http://127.0.0.1:{PORT}/"),
        ("localhost", "", f"http://127.0.0.1:{PORT}/"),
        ("127.0.0.2", "", f"http://127.0.0.2:{PORT}/"),
        ("::1", "", f"http://[::1]:{PORT}/"),
        ("10.0.0.5", "", f"http://10.0.0.5:{PORT}/"),
        ("0.0.0.0", "ops.internal", f"http://ops.internal:{PORT}/"),
        ("::", "fd00::5", f"http://[fd00::5]:{PORT}/"),
    ],
)
def test_the_printed_url_names_where_the_console_listens(
    bind: str, hostname: str, url: str
) -> None:
    guard = Guard(token=TOKEN, port=PORT, bind=bind, hostname=hostname)
    assert page_url(guard) == f"{url}?token={TOKEN}"
    # And the console answers to the name its URL gives
    assert guard.host_refusal(url.split("/")[2]) == ""


@pytest.mark.parametrize(
    ("argv", "why"),
    [
        (["--bind", "0.0.0.0"], "--hostname"),
        (["--bind", "::"], "--hostname"),
        (["--bind", ""], "--hostname"),
        (["--bind", "0.0.0.0", "--hostname", "http://ops.internal"], "no scheme"),
        (["--bind", "0.0.0.0", "--hostname", "ops.internal:8780"], "no scheme, port"),
        (["--bind", "0.0.0.0", "--hostname", "0.0.0.0"], "not an address one can open"),
        (["--hostname", "ops.internal"], "beyond this machine"),
    ],
)
def test_a_bind_the_console_cannot_name_is_refused_with_the_reason(
    argv: list[str], why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stopped:
        parse_args(argv)
    assert stopped.value.code == 2
    assert why in capsys.readouterr().err
    assert is_wildcard("0.0.0.0")
    assert not is_wildcard("10.0.0.5")


def test_off_loopback_a_refusal_says_which_name_or_site_it_met_and_which_it_wanted() -> None:
    guard = Guard(
        token=TOKEN, port=PORT, bind="0.0.0.0", allow_actions=True, hostname="ops.internal"
    )
    own = f"http://ops.internal:{PORT}"
    # A page asked for under another name (the machine's address, say) is refused, saying both
    refusal = guard.host_refusal(f"10.0.0.5:{PORT}")
    assert f"10.0.0.5:{PORT}" in refusal
    assert own in refusal
    assert "--hostname" in refusal
    # As is an action from another origin
    refusal = guard.action_refusal(TOKEN, origin=f"http://10.0.0.5:{PORT}", fetch_site=None)
    assert f"http://10.0.0.5:{PORT}" in refusal
    assert own in refusal
    refusal = guard.action_refusal(TOKEN, origin=own, fetch_site="cross-site")
    assert "cross-site" in refusal
    # And the console's own name, and loopback (it listens there too), are served
    assert guard.host_refusal(f"OPS.internal:{PORT}") == ""
    assert guard.host_refusal(f"127.0.0.1:{PORT}") == ""
    assert guard.action_refusal(TOKEN, origin=own, fetch_site="same-origin") == ""
    # A console on one address answers to that address only
    one = Guard(token=TOKEN, port=PORT, bind="10.0.0.5")
    assert one.host_refusal(f"10.0.0.5:{PORT}") == ""
    assert one.host_refusal(f"127.0.0.1:{PORT}") != ""


def test_only_the_commands_that_touch_the_dead_letters_run_one_at_a_time() -> None:
    # Given a console whose dead-letter commands hold a lock the test can see
    lock = threading.Lock()
    backend = RecordingBackend(lock)
    app = create_app(
        backend, Guard(token=TOKEN, port=PORT, allow_actions=True), dead_letters_lock=lock
    )
    client = app.test_client()
    client.set_cookie(f"infrai_console_{PORT}", TOKEN, domain="127.0.0.1")
    # When the pages and the actions run
    client.get("/", base_url=ORIGIN)
    client.get("/dead-letters/preview?m=m-1", base_url=ORIGIN)
    for path, data in [
        ("/dead-letters/redrive", {"m": "m-1"}),
        ("/dead-letters/discard", {"m": "m-1", "note": "n"}),
        ("/claims/probe", {"key": "k"}),
        ("/claims/release", {"key": "k"}),
    ]:
        answer = post(client, path, {**data, "csrf_token": TOKEN}, Origin=ORIGIN)
        assert answer.status_code == 200, answer.data
    # Then the reads and changes of the dead letters held it, and nothing else did (a probe
    # waiting on its provider holds up no other page)
    held = dict(backend.held)
    assert {command for command, locked in backend.held if locked} == {
        "dlq",
        "redrive",
        "dlq discard",
    }
    assert held["claims reconcile"] is False
    assert held["claims release"] is False
    assert held["claims stuck"] is False
