"""``infrai-jobs console`` over real HTTP, in a child process on the emulator and a real
PostgreSQL: its counts are the commands' counts, a POST without the token changes nothing, the
redrive it performs publishes exactly what its dry run listed, no client holds up another, and
the URL it prints connects wherever it listens."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest
import urllib3
from consolekit import (
    RECEIPTS,
    HeldProvider,
    RunningConsole,
    Session,
    console,
    count_on,
    held_provider,
    raw_exchange,
    seed,
)
from drainkit import OPERATOR, QUEUE, Harness, run_cli, start_cli

from infrai_local.operator.console.server import ConsoleServer


def _cli_json(kit: Harness, *args: str) -> object:
    finished = run_cli(kit, *args, "--json")
    assert finished.returncode == 0, finished.stderr
    return json.loads(finished.stdout)


def test_the_overview_counts_what_the_commands_count(kit: Harness) -> None:
    # Given dead letters in Infrai's DLQ, a stuck claim and deferred work
    seed(kit)
    # When the console's overview is read (it moves the dead letters into the ledger, as dlq)
    with console(kit) as running:
        html = Session(running).get("/").data.decode()
    # Then each count equals its command's
    dlq = _cli_json(kit, "dlq")
    stuck = _cli_json(kit, "claims", "stuck")
    deferred = _cli_json(kit, "claims", "list", "--state", "deferred")
    assert isinstance(dlq, dict)
    assert isinstance(stuck, list)
    assert isinstance(deferred, list)
    assert count_on(html, "dead-letters") == dlq["unresolved"] == 2
    assert count_on(html, "stuck") == len(stuck) == 1
    assert count_on(html, "deferred") == len(deferred) == 1
    # And a read-only console offers no action
    assert '<form method="post"' not in html


def test_a_post_without_the_token_or_from_another_site_is_refused_and_changes_nothing(
    kit: Harness,
) -> None:
    # Given a stuck claim and a console that may act
    seeded = seed(kit)
    with console(kit, "--allow-actions") as running:
        session = Session(running)
        release = [("key", seeded.stuck_key), ("note", "should not happen")]
        # When a release is posted without the token, with a wrong one, from another origin,
        # marked cross-site by the browser, and without the console's cookie
        answers = [
            session.post("/claims/release", release),
            session.post("/claims/release", [*release, ("csrf_token", "guessed")]),
            session.post(
                "/claims/release",
                [*release, ("csrf_token", running.token)],
                Origin="https://evil.example",
            ),
            session.post(
                "/claims/release",
                [*release, ("csrf_token", running.token)],
                **{"Sec-Fetch-Site": "cross-site"},
            ),
            session.http.request(
                "POST",
                running.base + "/claims/release",
                fields=[*release, ("csrf_token", running.token)],
                encode_multipart=False,
            ),
        ]
        # And a page is asked for under a name that is not loopback
        rebound = session.http.request(
            "GET", running.base + "/", headers={"Cookie": session.cookie, "Host": "evil.example"}
        )
    # Then every one is refused, and the claim is as it was, with nothing recorded
    assert [answer.status for answer in answers] == [403] * 5
    assert rebound.status == 403
    row = kit.row(seeded.stuck_key)
    assert row is not None
    assert row.state == "running"
    assert kit.history(seeded.stuck_key) == []


def test_a_read_only_console_refuses_an_action_even_with_the_token(kit: Harness) -> None:
    seeded = seed(kit)
    with console(kit) as running:
        session = Session(running)
        answer = session.post(
            "/claims/release", [("key", seeded.stuck_key), ("csrf_token", running.token)]
        )
    assert answer.status == 403
    assert "--allow-actions" in answer.data.decode()
    assert kit.history(seeded.stuck_key) == []


def test_the_redrive_publishes_exactly_what_its_dry_run_listed(kit: Harness) -> None:
    # Given two dead letters, and the console's preview of redriving both
    seeded = seed(kit)
    with console(kit, "--allow-actions") as running:
        session = Session(running)
        preview = session.get(
            "/dead-letters/preview", [("m", m) for m in seeded.dead_letter_ids]
        ).data.decode()
        listed = re.findall(r'<tr class="would-run"><td><code>([^<]+)</code>', preview)
        # Then the preview lists what `redrive --dry-run` lists as would-run
        dry = _cli_json(kit, "redrive", "--dry-run")
        assert isinstance(dry, dict)
        assert sorted(listed) == sorted(s["message_id"] for s in dry["seen"])
        assert sorted(listed) == sorted(seeded.dead_letter_ids)
        # When the operator redrives what the preview listed
        fields = [("m", m) for m in listed] + [("csrf_token", running.token)]
        done = session.post("/dead-letters/redrive", fields, Origin=running.base)
    # Then exactly those payloads are on the main queue again, once each
    assert done.status == 200, done.data
    assert "infrai-jobs redrive" in done.data.decode()
    published = kit.client.consume(QUEUE, 10)
    assert sorted(json.dumps(m.payload, sort_keys=True) for m in published) == sorted(
        json.dumps(p, sort_keys=True) for p in RECEIPTS
    )
    # And the ledger resolved each as redriven by the operator (as `redrive` records it)
    rows = kit.sql(
        "SELECT message_id, resolution, resolved_by FROM dead_letters ORDER BY message_id"
    )
    assert sorted(rows) == sorted((m, "redriven", OPERATOR) for m in listed)


def test_the_console_refuses_to_start_without_a_queue_and_shows_no_password(
    kit: Harness,
) -> None:
    # Given a ledger URL with a password and no Infrai URL
    secret_url = "postgresql://ops:hunter2-secret@127.0.0.1:1/ledger"
    finished = run_cli(kit, "console", INFRAI_BASE_URL="", DATABASE_URL=secret_url)
    assert finished.returncode == 2
    assert "INFRAI_BASE_URL" in finished.stderr
    # And with an unreachable ledger: one line, no password, no traceback, no URL printed
    finished = run_cli(kit, "console", DATABASE_URL=secret_url)
    assert finished.returncode == 1
    assert "hunter2" not in finished.stderr + finished.stdout
    assert "Traceback" not in finished.stderr
    assert "token=" not in finished.stdout


def test_a_client_that_sends_half_a_request_and_waits_holds_up_no_other_page(
    kit: Harness,
) -> None:
    # Given a console, and a client that sent half a request line and then waits
    seed(kit)
    with console(kit) as running:
        session = Session(running, timeout=10)
        with socket.create_connection(running.address, timeout=30) as idle:
            idle.sendall(b"GET / HT")
            # When another client loads pages, 20 times, while that connection is open
            paths = ("/", "/dead-letters", "/stuck", "/deferred") * 5
            answers = [session.get(path) for path in paths]
    # Then every page answered (a console held by the idle client times each load out)
    assert [answer.status for answer in answers] == [200] * 20
    assert count_on(answers[0].data.decode(), "stuck") == 1


def test_a_probe_waiting_on_a_slow_provider_holds_up_no_other_page(kit: Harness) -> None:
    # Given a stuck claim whose provider answers its probe only when told, and a console
    seeded = seed(kit)
    with (
        held_provider() as provider,
        console(kit, "--allow-actions", MAIL_PROVIDER_URL=provider.url) as running,
        ThreadPoolExecutor(max_workers=1) as background,
    ):
        operator, other = Session(running, timeout=60), Session(running, timeout=30)
        # When the operator probes it, and the probe is waiting on the provider
        probe = [("key", seeded.stuck_key), ("csrf_token", running.token)]
        probing = background.submit(operator.post, "/claims/probe", probe, Origin=running.base)
        assert provider.arrived.wait(timeout=30)
        # And another client loads pages meanwhile
        pages = [other.get(path) for path in ("/stuck", "/deferred", "/stuck")]
        # Then they answered while the probe still waited: when the provider then answers,
        # the probe reads that answer and resolves the claim with it
        provider.release.set()
        probed = probing.result(timeout=60)
    assert [page.status for page in pages] == [200] * 3
    assert probed.status == 200, probed.data
    row = kit.row(seeded.stuck_key)
    assert row is not None
    assert row.state == "done"
    assert row.result is not None
    assert row.result["provider_message_id"] == HeldProvider.MESSAGE_ID


@pytest.mark.parametrize(
    "request_line",
    [
        b"GET / HTTP/9.9",
        b"GET / JUNK/1.1",
        b"GET /?token=%(token)s HTTP/x.y",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",
    ],
)
def test_a_malformed_request_line_gets_400_and_no_traceback(
    kit: Harness, request_line: bytes
) -> None:
    # Given a console
    with console(kit) as running:
        line = request_line.replace(b"%(token)s", running.token.encode())
        # When a client sends a request line it cannot read
        answer = raw_exchange(running, line + b"\r\n\r\n")
        # Then it answers 400, and goes on serving
        assert answer.split(b"\r\n", 1)[0].split()[1:2] == [b"400"], answer
        assert Session(running, timeout=30).get("/stuck").status == 200
        err = running.stop()
    # And its terminal has one line about it: no traceback, nor the token
    assert "Traceback" not in err
    assert "Error" not in err
    assert running.token not in err
    assert "console: refused a request it could not read" in err


def test_a_connection_that_stays_silent_is_closed_after_the_idle_timeout() -> None:
    # Given the console's server with a short idle timeout, serving a trivial page
    def app(environ: dict[str, object], start: object) -> Iterable[bytes]:
        start("200 OK", [("Content-Type", "text/plain")])  # type: ignore[operator]
        return [b"ok"]

    server = ConsoleServer("127.0.0.1", 0, app, idle_timeout=0.5)
    # When a client sends half a request line and waits
    with served(server) as address, socket.create_connection(address, timeout=30) as idle:
        idle.sendall(b"GET / HT")
        # Then the server closes that connection without an answer
        assert idle.recv(1024) == b""


def test_a_slow_answer_holds_up_no_other_request() -> None:
    # Given the console's server, with a page that answers only when the test says so
    arrived, release = threading.Event(), threading.Event()

    def app(environ: dict[str, object], start: object) -> Iterable[bytes]:
        if environ["PATH_INFO"] == "/slow":
            arrived.set()
            release.wait(timeout=60)
        start("200 OK", [("Content-Type", "text/plain")])  # type: ignore[operator]
        return [str(environ["PATH_INFO"]).encode()]

    http = urllib3.PoolManager(retries=False, timeout=30)
    with (
        served(ConsoleServer("127.0.0.1", 0, app)) as (host, port),
        ThreadPoolExecutor(max_workers=1) as background,
    ):
        slow = background.submit(http.request, "GET", f"http://{host}:{port}/slow")
        assert arrived.wait(timeout=30)
        # When another request arrives while the slow one waits
        fast = http.request("GET", f"http://{host}:{port}/fast")
        # Then it is answered, and the slow one still is once let go
        assert (fast.status, fast.data, slow.done()) == (200, b"/fast", False)
        release.set()
        assert slow.result(timeout=60).data == b"/slow"


def test_the_token_redirect_keeps_the_query_as_it_was(kit: Harness) -> None:
    # Given a console
    with console(kit) as running:
        # When the printed URL is opened with a query whose values hold &, # and repeats
        http = urllib3.PoolManager(retries=False, timeout=30)
        url = f"{running.base}/key?token={running.token}&k=a%26b%23c&k2=x+y&m=1&m=2"
        answer = http.request("GET", url, redirect=False)
    # Then the redirect drops only the token: every value is still encoded as it was
    assert answer.status == 303
    assert answer.headers["Location"] == "/key?k=a%26b%23c&k2=x+y&m=1&m=2"


def test_a_console_on_the_ipv6_loopback_prints_a_url_that_connects(kit: Harness) -> None:
    # Given a console listening on ::1
    seed(kit)
    with console(kit, "--bind", "::1") as running:
        # Then the URL it printed names ::1, and a page opened through it answers
        assert running.url.startswith("http://[::1]:"), running.url
        assert count_on(Session(running, timeout=30).get("/").data.decode(), "stuck") == 1


def test_a_console_on_every_address_needs_the_name_it_is_reached_by(kit: Harness) -> None:
    # When the console is asked to listen on every address without the name to print
    process = start_cli(kit, "console", "--port", "0", "--bind", "0.0.0.0")
    try:
        out, err = process.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        pytest.fail("the console started on 0.0.0.0 without --hostname")
    # Then it refuses to start, saying why and what to give; it printed no URL
    assert process.returncode == 2
    assert "--hostname" in err
    assert "every address" in err
    assert "Traceback" not in err
    assert out == ""


def test_a_console_off_loopback_answers_to_its_name_and_says_why_it_refuses(
    kit: Harness,
) -> None:
    # Given a stuck claim and a console on every address, reached as console.example
    seeded = seed(kit)
    name = "console.example"
    with console(kit, "--bind", "0.0.0.0", "--hostname", name, "--allow-actions") as running:
        port = running.address[1]
        # Then the URL it printed names it
        assert running.url.startswith(f"http://{name}:{port}/?token="), running.url
        site = f"http://{name}:{port}"
        with by_name(running, name) as browser:
            # When a page is asked for under another name, or an action comes from another site
            other_host = browser.request("GET", "/", {"Host": f"evil.example:{port}"})
            release = [("key", seeded.stuck_key), ("note", "n"), ("csrf_token", running.token)]
            other_site = browser.post("/claims/release", release, "http://evil.example")
            # Then each is refused, saying which name or site was met and which is the console's
            for answer, met in ((other_host, f"evil.example:{port}"), (other_site, "evil.example")):
                text = answer.data.decode()
                assert answer.status == 403
                assert met in text
                assert site in text
            assert kit.history(seeded.stuck_key) == []
            # And a page and an action from the console's own name are served and done
            assert browser.request("GET", "/stuck").status == 200
            assert browser.post("/claims/release", release, site).status == 200
    assert kit.row(seeded.stuck_key) is None


class _ByName:
    """A browser that reaches the console through 127.0.0.1 but names it as its URL does."""

    def __init__(self, running: RunningConsole, name: str) -> None:
        self.local = f"http://127.0.0.1:{running.address[1]}"
        self.host = f"{name}:{running.address[1]}"
        self.http = urllib3.PoolManager(retries=False, timeout=30)
        first = self.http.request(
            "GET",
            f"{self.local}/?token={running.token}",
            headers={"Host": self.host},
            redirect=False,
        )
        assert first.status == 303, first.data
        self.cookie = first.headers["Set-Cookie"].split(";", 1)[0]

    def request(
        self, method: str, path: str, headers: dict[str, str] | None = None
    ) -> urllib3.BaseHTTPResponse:
        sent = {"Host": self.host, "Cookie": self.cookie, **(headers or {})}
        return self.http.request(method, self.local + path, headers=sent)

    def post(
        self, path: str, fields: list[tuple[str, str]], origin: str
    ) -> urllib3.BaseHTTPResponse:
        headers = {"Host": self.host, "Cookie": self.cookie, "Origin": origin}
        return self.http.request(
            "POST", self.local + path, fields=fields, encode_multipart=False, headers=headers
        )


@contextmanager
def by_name(running: RunningConsole, name: str) -> Iterator[_ByName]:
    browser = _ByName(running, name)
    try:
        yield browser
    finally:
        browser.http.clear()


@contextmanager
def served(server: ConsoleServer) -> Iterator[tuple[str, int]]:
    """Serve ``server`` (the console's, in this process) until the block ends."""
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.host, server.port
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
