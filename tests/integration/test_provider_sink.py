"""The provider sink, a stand-in on loopback: a caller that hung up (a drain whose read timed
out while the sink hung on purpose) is no error of the sink's, and prints no traceback; a job's
own routes (any path, its answers, the lookups its probe calls) are served beside the built-in
ones, with the same faults."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
import urllib3

from infrai_local.sandbox import provider_sink


@pytest.mark.parametrize("error", [BrokenPipeError, ConnectionResetError])
def test_a_caller_that_hung_up_prints_no_traceback(
    error: type[OSError], capsys: pytest.CaptureFixture[str]
) -> None:
    sink = provider_sink.start_in_thread()
    try:
        # Given the sink's answer met a connection its caller had closed
        try:
            raise error(32, "the caller closed the connection")
        except OSError:
            # When the server handles that request's error
            sink.server.handle_error(None, ("127.0.0.1", 40000))  # type: ignore[arg-type]
    finally:
        sink.stop()
    # Then nothing is printed
    assert capsys.readouterr().err == ""


def test_any_other_error_is_still_reported(capsys: pytest.CaptureFixture[str]) -> None:
    sink = provider_sink.start_in_thread()
    try:
        try:
            raise ValueError("a bug in the sink")
        except ValueError:
            sink.server.handle_error(None, ("127.0.0.1", 40000))  # type: ignore[arg-type]
    finally:
        sink.stop()
    assert "a bug in the sink" in capsys.readouterr().err


# A webhook provider of a team's own: deliveries POSTed per subscriber, looked up by id.
WEBHOOK_ROUTES = [
    provider_sink.Route("POST", "/hooks/{subscriber}"),
    provider_sink.Route("GET", "/deliveries/{id}", lookup=True),
    provider_sink.Route("POST", "/hooks-refusing/{subscriber}", status=422, body={"error": "no"}),
]


@pytest.fixture
def webhook_sink() -> Iterator[provider_sink.RunningSink]:
    sink = provider_sink.start_in_thread(routes=WEBHOOK_ROUTES)
    try:
        yield sink
    finally:
        sink.stop()


def _call(
    sink: provider_sink.RunningSink, method: str, path: str, **kwargs: Any
) -> tuple[int, dict[str, Any]]:
    response = urllib3.request(method, sink.url + path, **kwargs)
    return response.status, json.loads(response.data)


def test_a_jobs_own_routes_are_served_and_its_probes_lookup_answers_from_what_was_received(
    webhook_sink: provider_sink.RunningSink,
) -> None:
    # Given a stand-in with a webhook's own routes
    # When a delivery is POSTed to a subscriber's path with the job's key
    status, answer = _call(
        webhook_sink, "POST", "/hooks/sub-7", json={"n": 1}, headers={"X-Request-Key": "hook:d1"}
    )
    # Then it is answered 200 with an id, and recorded under its key
    assert status == 200
    assert answer["id"].startswith("fx_")
    # And the probe's lookup of that key finds it (id, path, body), of another key nothing
    found_status, found = _call(webhook_sink, "GET", "/deliveries/hook%3Ad1")
    assert (found_status, found["id"], found["path"]) == (200, answer["id"], "/hooks/sub-7")
    assert (found["body"], found["calls"]) == ({"n": 1}, 1)
    assert _call(webhook_sink, "GET", "/deliveries/hook%3Ad2")[0] == 404
    state = webhook_sink.state.snapshot()
    assert state["effects"] == {"/hooks/sub-7 hook:d1": 1}
    assert state["calls"] == {"POST /hooks/{subscriber}": 1, "GET /deliveries/{id}": 2}


def test_a_routes_answer_and_the_sinks_faults_apply_to_a_jobs_own_routes(
    webhook_sink: provider_sink.RunningSink,
) -> None:
    # Given a route that answers 422: an answer the test chose, with no effect recorded
    assert _call(webhook_sink, "POST", "/hooks-refusing/s", json={}) == (422, {"error": "no"})
    # When the sink is told to fail every call and every lookup
    _call(webhook_sink, "POST", "/_sink/faults", json={"fail_rate": 1.0, "lookup_status": 500})
    # Then a delivery answers 503 and is not recorded, and a lookup answers 500
    headers = {"X-Request-Key": "k1"}
    assert _call(webhook_sink, "POST", "/hooks/s", json={}, headers=headers)[0] == 503
    assert _call(webhook_sink, "GET", "/deliveries/k1")[0] == 500
    _call(webhook_sink, "POST", "/_sink/faults", json={})
    assert _call(webhook_sink, "GET", "/deliveries/k1")[0] == 404
    assert webhook_sink.state.snapshot()["effects"] == {}


def test_a_request_no_route_serves_is_404_and_listed_as_unrouted(
    webhook_sink: provider_sink.RunningSink,
) -> None:
    # When a job calls a path its stand-in does not serve
    status, answer = _call(webhook_sink, "PUT", "/webhooks/s1?x=1", json={})
    # Then it is refused, saying which request, and the state lists it
    assert status == 404
    assert "PUT /webhooks/s1" in answer["error"]
    assert webhook_sink.state.snapshot()["unrouted"] == ["PUT /webhooks/s1"]
    # And a reset forgets what was received, never the routes
    _call(webhook_sink, "POST", "/_sink/reset")
    assert webhook_sink.state.snapshot()["unrouted"] == []
    assert _call(webhook_sink, "POST", "/hooks/s", json={})[0] == 200


@pytest.mark.parametrize(
    ("route", "says"),
    [
        ({"method": "POST", "path": "hooks"}, "a path from /"),
        ({"method": "GET", "path": "/deliveries", "lookup": True, "key": "path:id"}, "no {id}"),
        ({"method": "GET", "path": "/deliveries", "key": "cookie:id"}, "header:NAME"),
    ],
)
def test_a_route_that_cannot_be_served_is_refused_when_written(
    route: dict[str, Any], says: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(says)):
        provider_sink.Route(**route)
