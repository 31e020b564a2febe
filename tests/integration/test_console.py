"""``infrai-jobs console`` over real HTTP, in a child process on the emulator and a real
PostgreSQL: its counts are the commands' counts, a POST without the token changes nothing, and
the redrive it performs publishes exactly what its dry run listed."""

from __future__ import annotations

import json
import re

from consolekit import RECEIPTS, Session, console, count_on, seed
from drainkit import OPERATOR, QUEUE, Harness, run_cli


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
