"""Dead letters whose consume answer cannot be read: ``dlq`` and ``redrive`` (in a child
process, against a real PostgreSQL and the emulator behind a proxy that spoils those answers)
show each as unreadable, still move every other into the ledger, and never report one as moved.
One whose message id could still be read is recorded in the ledger as unreadable (and acked by
that id); it can be discarded, never redriven."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import urllib3
from drainkit import DLQ, QUEUE, TEST_JOBS_CODE, Harness
from stub_servers import QuietJsonHandler, serving
from test_operator_cli import ROOT, run_cli


@dataclass
class CorruptingProxy:
    """Infrai behind a proxy that spoils the answer of any consume serving a marked payload:
    the consume is applied (the delivery spent), its answer cannot be read."""

    target: str
    marker: bytes = b"POISON-MARKER"
    # True: the answer is cut off after the marker (its message id still readable); False: it
    # is replaced by an HTML error page (nothing readable).
    cut_off: bool = False
    spoiled: list[int] = field(default_factory=list)
    url: str = ""
    pool: urllib3.PoolManager = field(default_factory=urllib3.PoolManager)


class _ProxyHandler(QuietJsonHandler):
    protocol_version = "HTTP/1.1"
    server: _ProxyServer

    def _forward(self) -> None:
        proxy = self.server.proxy
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        headers = {
            name: value
            for name, value in self.headers.items()
            if name.lower() in ("authorization", "content-type", "accept")
        }
        answer = proxy.pool.request(
            self.command, proxy.target + self.path, body=body or None, headers=headers
        )
        status, data = answer.status, answer.data
        if self.path == "/v1/queue/consume" and proxy.marker in data:
            if proxy.cut_off:
                data = data[: data.index(proxy.marker) + len(proxy.marker)]
            else:
                data = b"<html>502 Bad Gateway</html>" + b" " * 4000
            proxy.spoiled.append(len(data))
        self.send_json(status, data)

    do_GET = do_POST = _forward


class _ProxyServer(ThreadingHTTPServer):
    daemon_threads = True
    proxy: CorruptingProxy


@pytest.fixture
def proxy(kit: Harness) -> Iterator[CorruptingProxy]:
    server = _ProxyServer(("127.0.0.1", 0), _ProxyHandler)
    with serving(server) as url:
        server.proxy = CorruptingProxy(target=kit.server.url, url=url)
        yield server.proxy
    server.proxy.pool.clear()


def _poisoned_dlq(kit: Harness) -> dict[str, str]:
    """Three dead letters, the middle one unreadable through the proxy."""
    return {
        "first": kit.client.publish(DLQ, {"job": "test.db", "id": "first"}),
        "poison": kit.client.publish(DLQ, {"job": "test.db", "id": "POISON-MARKER"}),
        "last": kit.client.publish(DLQ, {"job": "test.db", "id": "last"}),
    }


def _json_through(
    proxy: CorruptingProxy, kit: Harness, command: str, *, exit_code: int
) -> dict[str, Any]:
    """``infrai-jobs COMMAND --json`` against Infrai behind ``proxy``: checks its exit code and
    returns the JSON document it printed."""
    # The test jobs' package: a redrive judges each letter by the drain's jobs.
    finished = run_cli(
        kit, command, "--json", INFRAI_BASE_URL=proxy.url, INFRAI_JOBS_PATH=str(TEST_JOBS_CODE)
    )
    assert finished.returncode == exit_code, finished.stderr
    document: dict[str, Any] = json.loads(finished.stdout)
    return document


def test_dlq_shows_an_unreadable_dead_letter_as_such_and_still_reads_the_others(
    kit: Harness, proxy: CorruptingProxy
) -> None:
    # Given three dead letters, the middle one's consume answer unreadable
    ids = _poisoned_dlq(kit)
    # When the operator lists the DLQ
    document = _json_through(proxy, kit, "dlq", exit_code=0)
    # Then both readable ones are recorded and listed with their keys, and the poison as
    # unreadable, with its size: never as "(none)", never hiding its neighbours
    rows = document["messages"]
    assert [r["message_id"] for r in rows if not r.get("unreadable")] == [ids["first"], ids["last"]]
    (poison,) = [r for r in rows if r.get("unreadable")]
    assert (poison["state"], poison["recorded"]) == ("unreadable", False)
    assert poison["size_bytes"] == proxy.spoiled[0]
    assert f"unreadable dead letter ({proxy.spoiled[0]} bytes)" in poison["reason"]
    assert document["unreadable"] == 1
    # And only the poison is left in Infrai's DLQ
    assert kit.client.stats(QUEUE).dlq_count == 1
    # And the table shows it too, once it can be read again, beside the two in the ledger
    kit.advance()
    table = run_cli(kit, "dlq", INFRAI_BASE_URL=proxy.url)
    assert "(none)" not in table.stdout
    assert "(unknown)" in table.stdout
    assert "could not be read" in table.stdout
    assert ids["first"] in table.stdout
    assert ids["last"] in table.stdout


def test_redrive_moves_the_readable_dead_letters_and_never_reports_the_unreadable_as_moved(
    kit: Harness, proxy: CorruptingProxy
) -> None:
    # Given three dead letters, the middle one's consume answer unreadable
    ids = _poisoned_dlq(kit)
    # When the operator redrives
    summary = _json_through(proxy, kit, "redrive", exit_code=1)
    # Then it fails (exit 1): the two readable ones moved, the unreadable one counted, not moved
    assert (summary["published"], summary["acked"]) == (2, 2)
    assert summary["complete"] is False
    (unreadable,) = summary["unreadable"]
    assert unreadable["size_bytes"] == proxy.spoiled[0]
    # And the poison is still in the DLQ; the others are back in the main queue
    stats = kit.client.stats(QUEUE)
    assert (stats.dlq_count, stats.available_count) == (1, 2)
    assert ids["poison"] not in json.dumps(summary) or unreadable["message_id"] == ids["poison"]
    # And the human form says NOT MOVED for it
    kit.advance()
    again = run_cli(kit, "redrive", INFRAI_BASE_URL=proxy.url, INFRAI_JOBS_PATH=str(TEST_JOBS_CODE))
    assert again.returncode == 1
    assert "published 0 dead letter(s)" in again.stdout
    assert "unreadable 1" in again.stdout
    assert "NOT MOVED" in again.stdout


def test_an_unreadable_dead_letter_whose_id_is_known_can_be_discarded(
    kit: Harness, proxy: CorruptingProxy
) -> None:
    # Given three dead letters, the middle one's answer cut off after its message id
    proxy.cut_off = True
    ids = _poisoned_dlq(kit)
    # When the operator lists the DLQ
    listed = _json_through(proxy, kit, "dlq", exit_code=0)
    # Then the unreadable one is recorded in the ledger under its message id, and acked
    (poison,) = [r for r in listed["messages"] if r.get("unreadable")]
    assert (poison["message_id"], poison["recorded"]) == (ids["poison"], True)
    assert poison["payload"] is None
    assert kit.client.stats(QUEUE).dlq_count == 0
    # When the operator redrives, Then the two readable ones go, the unreadable one is not
    # redriven blindly: NOT MOVED, exit 1
    redriven = run_cli(
        kit, "redrive", INFRAI_BASE_URL=proxy.url, INFRAI_JOBS_PATH=str(TEST_JOBS_CODE)
    )
    assert redriven.returncode == 1
    assert "published 2 dead letter(s)" in redriven.stdout
    assert f"NOT MOVED: {ids['poison']}: unreadable" in redriven.stdout
    # When the operator discards it by that id
    discarded = run_cli(
        kit, "dlq", "discard", "--message-id", ids["poison"], INFRAI_BASE_URL=proxy.url
    )
    # Then it is resolved, recorded (as unreadable, with its size) under its message id
    assert discarded.returncode == 0, discarded.stderr
    assert f"discarded {ids['poison']}" in discarded.stdout
    assert json.loads(run_cli(kit, "dlq", "--json").stdout)["messages"] == []
    shown = json.loads(run_cli(kit, "claims", "show", ids["poison"], "--json").stdout)
    ((entry,),) = [shown["history"]]
    record = entry["before"]["dead_letter"]
    assert (record["unreadable"], record["size_bytes"]) == (True, proxy.spoiled[-1])


def test_redrive_function_reports_an_unreadable_dead_letter_and_moves_the_rest(
    kit: Harness, proxy: CorruptingProxy, tmp_path: Path
) -> None:
    from infrai_local.sandbox.invoke import invoke, resolve  # noqa: PLC0415

    # Given three dead letters, the middle one's consume answer unreadable
    _poisoned_dlq(kit)
    # When RedriveFunction is invoked with events/redrive.json through that Infrai
    spec = resolve("RedriveFunction", root=ROOT, env_vars=ROOT / "events" / "env.json")
    services = {
        "INFRAI_BASE_URL": proxy.url,
        "INFRAI_API_KEY": "test-key",
        "DATABASE_URL": kit.database_url,
    }
    # (asked to include the letters that would bounce: the function's jobs package is the
    # team's, which lacks the harness's test jobs)
    event = json.loads((ROOT / "events" / "redrive.json").read_text())
    event_file = tmp_path / "redrive.json"
    event_file.write_text(json.dumps({**event, "include_bouncing": True}))
    result = invoke(spec, event_file, extra_env=services)
    # Then its answer moves the two, lists the unreadable one, and is not complete
    assert result.ok, result.payload
    assert (result.payload["published"], result.payload["complete"]) == (2, False)
    (unreadable,) = result.payload["unreadable"]
    assert unreadable["size_bytes"] == proxy.spoiled[0]
    assert kit.client.stats(QUEUE).dlq_count == 1
