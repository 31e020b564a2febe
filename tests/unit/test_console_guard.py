"""The console's guard and pages without a socket: Flask's test client over an in-memory backend
that answers the read commands and records every command it is asked to run."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import pytest
from flask.testing import FlaskClient
from werkzeug.datastructures import MultiDict

from infrai_local.console import commands
from infrai_local.console.commands import CommandResult, ops_parser
from infrai_local.console.guard import Guard, is_loopback
from infrai_local.console.server import parse_args
from infrai_local.console.views import create_app

TOKEN = "t" * 43
PORT = 8780
ORIGIN = f"http://127.0.0.1:{PORT}"


class RecordingBackend:
    queue_name = "billing-jobs"
    watched = ("billing-jobs",)
    actor = "on-call@example.com"

    def __init__(self) -> None:
        self.ran: list[tuple[str, ...]] = []

    def run(self, argv: Sequence[str]) -> CommandResult:
        self.ran.append(tuple(argv))
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
    assert parse_args(["--bind", "0.0.0.0"]).bind == "0.0.0.0"
