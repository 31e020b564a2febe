"""The local Infrai emulator over real HTTP on loopback: every row of docs/infrai-api.md, the
control surface (clock, faults, reset, state) and the command line.

Only the standard library talks to it here (http.client), so these tests pin the wire
contract itself, independently of the project's own client.
"""

from __future__ import annotations

import contextlib
import email.utils
import http.client
import json
import os
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import IO, Any
from urllib.parse import urlsplit

import pytest
from notes_example import NOTES_PAYLOAD

from infrai_local.sandbox.emulator import (
    MAX_BODY_BYTES,
    Emulator,
    EmulatorHTTPServer,
    RunningEmulator,
    start_in_thread,
)
from infrai_local.sandbox.emulator import http as emulator_http

QUEUE = "billing-jobs"
DLQ = "billing-jobs-dlq"
VISIBILITY = 300
MESSAGE_ID = re.compile(r"^qmsg_[0-9A-Za-z]{24}$")
PUBLISHED_AT = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{6}Z$")
ITEM_KEYS = {
    "message_id",
    "queue",
    "payload",
    "status",
    "delivery_count",
    "published_at",
    "receipt_handle",
}
SECRET_KEY = "sk_emulator_test_secret_9f3e1a"
WRONG_KEY = "sk_wrong_token_do_not_echo_77c2"
_DEFAULT_TOKEN = "any-test-token"


# --- A tiny stdlib HTTP helper ----------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    """One HTTP answer, read whole."""

    status: int
    headers: dict[str, str]
    raw: bytes

    @property
    def document(self) -> Any:
        return json.loads(self.raw)

    @property
    def data(self) -> Any:
        """The ``data`` of a success envelope (asserting it is one)."""
        assert self.status == 200, self.raw
        document = self.document
        assert document["ok"] is True, document
        return document["data"]

    def error(self, status: int, code: str) -> str:
        """Assert an error envelope with this status and code; return its message."""
        assert self.status == status, self.raw
        document = self.document
        assert document["ok"] is False, document
        assert document["error"]["code"] == code, document
        message = document["error"]["message"]
        assert isinstance(message, str)
        assert message
        return message


class Api:
    """Plain HTTP calls against one emulator; a fresh connection per call unless given one."""

    def __init__(self, url: str, token: str | None = _DEFAULT_TOKEN) -> None:
        parts = urlsplit(url)
        assert parts.hostname is not None
        assert parts.port is not None
        self.host = parts.hostname
        self.port = parts.port
        self.token = token

    def connect(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=10)

    def auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token is not None else {}

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        raw: bytes | None = None,
        headers: dict[str, str] | None = None,
        connection: http.client.HTTPConnection | None = None,
    ) -> Answer:
        payload = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        all_headers = {**self.auth_headers(), **(headers or {})}
        if payload is not None:
            all_headers.setdefault("Content-Type", "application/json")
        conn = connection or self.connect()
        try:
            conn.request(method, path, body=payload, headers=all_headers)
            response = conn.getresponse()
            return Answer(
                response.status,
                {name.lower(): value for name, value in response.getheaders()},
                response.read(),
            )
        finally:
            if connection is None:
                conn.close()

    def post(self, path: str, body: Any = None, **kwargs: Any) -> Answer:
        return self.request("POST", path, body if body is not None else {}, **kwargs)

    def get(self, path: str, **kwargs: Any) -> Answer:
        return self.request("GET", path, **kwargs)

    # The queue calls, asserting success.

    def create(self, name: str, dlq: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"name": name, "type": "standard"}
        if dlq is not None:
            body["dlq"] = dlq
        created: dict[str, Any] = self.post("/v1/queue/create", body).data
        return created

    def publish(self, queue: str, body: dict[str, Any], **extra: Any) -> str:
        answer = self.post("/v1/queue/publish", {"queue": queue, "body": body, **extra})
        message_id: str = answer.data["message_id"]
        return message_id

    def consume(self, queue: str, max_messages: int = 10) -> list[dict[str, Any]]:
        answer = self.post("/v1/queue/consume", {"queue": queue, "max_messages": max_messages})
        data = answer.data
        assert data["next_cursor"] is None
        items: list[dict[str, Any]] = data["items"]
        return items

    def ack(self, queue: str, handle: str) -> Answer:
        return self.post("/v1/queue/ack", {"queue": queue, "receipt_handle": handle})

    def stats(self, queue: str) -> dict[str, Any]:
        stats: dict[str, Any] = self.get(f"/v1/queue/stats/{queue}").data
        return stats

    def advance(self, seconds: float) -> None:
        self.post("/_emulator/clock", {"advance_seconds": seconds}).data  # noqa: B018

    def set_faults(self, **faults: Any) -> None:
        self.post("/_emulator/faults", faults).data  # noqa: B018

    def state(self) -> dict[str, Any]:
        state: dict[str, Any] = self.get("/_emulator/state").data
        return state


def zero_stats(queue: str) -> dict[str, Any]:
    return {
        "queue": queue,
        "message_count": 0,
        "available_count": 0,
        "in_flight_count": 0,
        "delayed_count": 0,
        "dlq_count": 0,
        "oldest_message_age_seconds": 0,
    }


# --- Fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server() -> Iterator[RunningEmulator]:
    with start_in_thread() as running:
        yield running


@pytest.fixture
def api(server: RunningEmulator) -> Api:
    Api(server.url).post("/_emulator/reset").data  # noqa: B018
    return Api(server.url)


@pytest.fixture
def queue(api: Api) -> str:
    api.create(QUEUE, dlq=DLQ)
    return QUEUE


@pytest.fixture(scope="module")
def keyed_server() -> Iterator[RunningEmulator]:
    with start_in_thread(api_key=SECRET_KEY) as running:
        yield running


def walk_to_dlq(api: Api, queue: str) -> dict[str, Any]:
    """Consume a queue's only message three times without acking; return the first item."""
    first = api.consume(queue)
    assert len(first) == 1
    for delivery in (2, 3):
        api.advance(VISIBILITY + 1)
        assert [item["delivery_count"] for item in api.consume(queue)] == [delivery]
    api.advance(VISIBILITY + 1)
    return first[0]


# --- Publish and consume ----------------------------------------------------------------------


def test_two_identical_publishes_are_two_independent_messages(api: Api, queue: str) -> None:
    # Given the notes' producer retry: the same body published twice
    first_id = api.publish(queue, NOTES_PAYLOAD)
    second_id = api.publish(queue, NOTES_PAYLOAD)

    # When the queue is drained
    items = api.consume(queue, max_messages=10)

    # Then there are two ids and two independent deliveries of the same work
    assert first_id != second_id
    assert [item["message_id"] for item in items] == [first_id, second_id]
    assert all(item["payload"] == NOTES_PAYLOAD for item in items)
    assert all(item["delivery_count"] == 1 for item in items)
    assert api.ack(queue, items[0]["receipt_handle"]).status == 200
    assert api.stats(queue)["in_flight_count"] == 1


def test_a_consumed_item_has_exactly_the_notes_shape(api: Api, queue: str) -> None:
    # Given one published message
    message_id = api.publish(queue, NOTES_PAYLOAD)

    # When it is consumed
    (item,) = api.consume(queue)

    # Then the item has the notes' fields, the id and timestamp shapes, and handle == id
    assert set(item) == ITEM_KEYS
    assert MESSAGE_ID.fullmatch(message_id)
    assert PUBLISHED_AT.fullmatch(item["published_at"])
    assert item["message_id"] == item["receipt_handle"] == message_id
    assert item["queue"] == queue
    assert item["status"] == "in_flight"
    assert item["delivery_count"] == 1


def test_every_publish_gets_a_new_well_formed_id(api: Api, queue: str) -> None:
    # Given / When fifty publishes of one body
    ids = [api.publish(queue, {"n": 1}) for _ in range(50)]

    # Then every id is new and has the qmsg_ + 24 base62 shape
    assert len(set(ids)) == 50
    assert all(MESSAGE_ID.fullmatch(message_id) for message_id in ids)


def test_consume_defaults_to_one_message_oldest_first(api: Api, queue: str) -> None:
    # Given three messages published in order
    ids = [api.publish(queue, {"n": n}) for n in range(3)]

    # When consuming without max_messages, three times
    answer = api.post("/v1/queue/consume", {"queue": queue})
    first = answer.data["items"]
    rest = api.consume(queue, max_messages=5)

    # Then the default is one message, and delivery follows publish order
    assert [item["message_id"] for item in first] == ids[:1]
    assert [item["message_id"] for item in rest] == ids[1:]
    assert api.consume(queue) == []


def test_max_messages_is_served_capped_at_ten(api: Api, queue: str) -> None:
    # Given twelve messages
    for n in range(12):
        api.publish(queue, {"n": n})

    # When asking for fifty
    items = api.consume(queue, max_messages=50)

    # Then ten come back and two remain available
    assert len(items) == 10
    assert api.stats(queue)["available_count"] == 2
    assert api.stats(queue)["in_flight_count"] == 10


@pytest.mark.parametrize("max_messages", [0, -1, "3", True, 2.5, [1]])
def test_max_messages_must_be_an_integer_from_one(
    api: Api, queue: str, max_messages: object
) -> None:
    # Given a queue with a message
    api.publish(queue, NOTES_PAYLOAD)

    # When consuming with a bad max_messages
    answer = api.post("/v1/queue/consume", {"queue": queue, "max_messages": max_messages})

    # Then it is a validation error naming the field, and nothing was delivered
    assert "max_messages" in answer.error(400, "VALIDATION_ERROR")
    assert api.stats(queue)["available_count"] == 1


# --- Visibility, redelivery and the dead-letter queue -----------------------------------------


def test_an_unacked_message_comes_back_with_delivery_count_2(api: Api, queue: str) -> None:
    # Given a message consumed and not acked
    message_id = api.publish(queue, NOTES_PAYLOAD)
    assert [item["delivery_count"] for item in api.consume(queue)] == [1]

    # When the visibility timeout has not passed yet, it stays hidden
    api.advance(VISIBILITY - 1)
    assert api.consume(queue) == []

    # When it passes
    api.advance(2)
    items = api.consume(queue)

    # Then the same message is delivered again with delivery_count 2
    assert [(item["message_id"], item["delivery_count"]) for item in items] == [(message_id, 2)]


def test_a_third_unacked_delivery_moves_the_message_to_the_dlq(api: Api, queue: str) -> None:
    # Given a message delivered three times and never acked
    api.publish(queue, NOTES_PAYLOAD)
    first = walk_to_dlq(api, queue)

    # When the third visibility timeout lapses
    stats = api.stats(queue)

    # Then there is no fourth delivery: it sits in the DLQ and dlq_count says so
    assert api.consume(queue) == []
    assert stats == {**zero_stats(queue), "dlq_count": 1}
    assert api.stats(DLQ)["available_count"] == 1

    # And the DLQ delivers it by name, same id, payload and published_at, counting from 1
    (dead,) = api.consume(DLQ)
    assert dead["queue"] == DLQ
    assert dead["delivery_count"] == 1
    for key in ("message_id", "payload", "published_at"):
        assert dead[key] == first[key]

    # And dlq_count counts it while it is in flight in the DLQ, too
    assert api.stats(queue)["dlq_count"] == 1
    assert api.stats(DLQ)["dlq_count"] == 0


def test_the_main_queue_no_longer_holds_a_dead_lettered_handle(api: Api, queue: str) -> None:
    # Given a message walked to the DLQ
    api.publish(queue, NOTES_PAYLOAD)
    first = walk_to_dlq(api, queue)

    # When the worker finally acks it on the main queue
    answer = api.ack(queue, first["receipt_handle"])

    # Then the queue no longer holds it; the DLQ does, and an ack there removes it
    answer.error(404, "QUEUE_MESSAGE_NOT_FOUND")
    assert api.ack(DLQ, first["receipt_handle"]).status == 200
    assert api.stats(queue)["dlq_count"] == 0


def test_a_dlq_message_is_never_dropped(api: Api, queue: str) -> None:
    # Given a dead-lettered message consumed from the DLQ three times without acking
    api.publish(queue, NOTES_PAYLOAD)
    walk_to_dlq(api, queue)
    for delivery in (1, 2, 3):
        assert [item["delivery_count"] for item in api.consume(DLQ)] == [delivery]
        api.advance(VISIBILITY + 1)

    # When it lapses a third time in the DLQ (which has no DLQ of its own)
    items = api.consume(DLQ)

    # Then it is simply delivered again and keeps counting
    assert [item["delivery_count"] for item in items] == [4]
    assert api.stats(queue)["dlq_count"] == 1


def test_acking_twice_answers_queue_message_not_found(api: Api, queue: str) -> None:
    # Given a consumed message acked once
    api.publish(queue, NOTES_PAYLOAD)
    (item,) = api.consume(queue)
    first = api.ack(queue, item["receipt_handle"])

    # When it is acked again
    second = api.ack(queue, item["receipt_handle"])

    # Then the first ack succeeded and the second is QUEUE_MESSAGE_NOT_FOUND
    assert first.data["acked"] is True
    assert first.data["message_id"] == item["message_id"]
    second.error(404, "QUEUE_MESSAGE_NOT_FOUND")
    assert api.stats(queue) == zero_stats(queue)


def test_a_lapsed_message_still_held_can_be_acked(api: Api, queue: str) -> None:
    # Given a message whose visibility expired before the worker acked it
    api.publish(queue, NOTES_PAYLOAD)
    (item,) = api.consume(queue)
    api.advance(VISIBILITY + 5)

    # When the slow worker acks it
    answer = api.ack(queue, item["receipt_handle"])

    # Then the ack succeeds and the message is not redelivered
    assert answer.status == 200
    assert api.consume(queue) == []


def test_a_new_queue_uses_the_configured_visibility_timeout(api: Api) -> None:
    # Given / When a queue is created with a DLQ
    created = api.create(QUEUE, dlq=DLQ)

    # Then create answers the queue, and the DLQ exists with no DLQ of its own
    assert created == {
        "name": QUEUE,
        "type": "standard",
        "dlq": DLQ,
        "visibility_timeout_default": 300,
        "max_receive_count": 3,
    }
    assert api.stats(DLQ) == zero_stats(DLQ)
    assert api.state()["queues"][DLQ]["dlq"] is None


def test_creating_an_existing_queue_answers_409(api: Api, queue: str) -> None:
    # Given the queue exists with a message
    api.publish(queue, NOTES_PAYLOAD)

    # When it is created again
    answer = api.post("/v1/queue/create", {"name": queue, "type": "standard", "dlq": DLQ})

    # Then it is QUEUE_ALREADY_EXISTS, and the existing queue is untouched
    answer.error(409, "QUEUE_ALREADY_EXISTS")
    assert api.stats(queue)["message_count"] == 1


# --- Stats and delays -------------------------------------------------------------------------


def test_stats_on_a_drained_queue_are_all_zero(api: Api, queue: str) -> None:
    # Given messages that were published, consumed and acked
    for n in range(3):
        api.publish(queue, {"n": n})
    for item in api.consume(queue):
        assert api.ack(queue, item["receipt_handle"]).status == 200

    # When reading its stats
    stats = api.stats(queue)

    # Then they are exactly the notes' drained-queue answer
    assert stats == zero_stats(queue)


def test_message_count_adds_available_in_flight_and_delayed(api: Api, queue: str) -> None:
    # Given two immediate messages (one consumed) and one delayed message
    api.publish(queue, {"n": 1})
    api.publish(queue, {"n": 2})
    api.publish(queue, {"n": 3}, delay_seconds=60)
    api.consume(queue, max_messages=1)
    api.advance(7.5)

    # When reading stats
    stats = api.stats(queue)

    # Then each state is counted once and the age is whole seconds since the oldest publish
    assert stats["available_count"] == 1
    assert stats["in_flight_count"] == 1
    assert stats["delayed_count"] == 1
    assert stats["message_count"] == 3
    assert stats["oldest_message_age_seconds"] == 7


def test_a_delayed_message_is_invisible_until_the_clock_passes(api: Api, queue: str) -> None:
    # Given a message published with a 30 s delay
    message_id = api.publish(queue, NOTES_PAYLOAD, delay_seconds=30)

    # When consuming before the delay ends, nothing is served
    assert api.consume(queue) == []
    api.advance(29)
    assert api.consume(queue) == []

    # When the delay has passed
    api.advance(1.5)
    items = api.consume(queue)

    # Then it is delivered for the first time
    assert [(item["message_id"], item["delivery_count"]) for item in items] == [(message_id, 1)]


def test_discovery_reports_the_publish_price(api: Api, server: RunningEmulator) -> None:
    # Given the default price
    capabilities = api.get("/v1/discovery").data["capabilities"]
    by_id = {capability["id"]: capability for capability in capabilities}

    # Then publishing is metered at $0.00002 per message, everything else is free
    assert by_id["queue.publish"]["billing"]["price_usd"] == "0.00002"
    assert by_id["queue.publish"]["billing"]["unit"] == "message"
    for capability_id in ("queue.create", "queue.consume", "queue.ack", "queue.stats"):
        assert by_id[capability_id]["billing"]["price_usd"] == "0"

    # When the price changes (on the object, then through the control surface)
    server.emulator.publish_price_usd = "0.000015"
    first = api.get("/v1/discovery").data
    api.post("/_emulator/price", {"publish_price_usd": "0.00001"}).data  # noqa: B018
    second = api.get("/v1/discovery").data

    # Then discovery reports today's price
    assert first["capabilities"][1]["billing"]["price_usd"] == "0.000015"
    assert second["capabilities"][1]["billing"]["price_usd"] == "0.00001"


# --- Auth -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "authorization", [None, "", "Bearer", "Bearer    ", "Basic dXNlcjpwYXNz", "token-only"]
)
def test_every_v1_route_needs_a_bearer_token(api: Api, authorization: str | None) -> None:
    # Given a request without a usable bearer token
    bare = Api(f"http://{api.host}:{api.port}", token=None)
    headers = {} if authorization is None else {"Authorization": authorization}

    # When calling a route
    answers = [
        bare.get("/v1/discovery", headers=headers),
        bare.post("/v1/queue/create", {"name": QUEUE}, headers=headers),
    ]

    # Then it is UNAUTHORIZED and nothing was created
    for answer in answers:
        answer.error(401, "UNAUTHORIZED")
    assert api.get(f"/v1/queue/stats/{QUEUE}").status == 404


def test_with_an_api_key_only_that_token_is_accepted(keyed_server: RunningEmulator) -> None:
    # Given an emulator started with an API key
    right = Api(keyed_server.url, token=SECRET_KEY)
    wrong = Api(keyed_server.url, token=WRONG_KEY)

    # When calling with the wrong token and then the right one
    refused = wrong.post("/v1/queue/create", {"name": QUEUE})
    accepted = right.post("/v1/queue/create", {"name": QUEUE})

    # Then only the right one works, and no answer echoes either token
    refused.error(401, "UNAUTHORIZED")
    assert accepted.status == 200
    for answer in (refused, accepted):
        seen = answer.raw + json.dumps(answer.headers).encode()
        assert WRONG_KEY.encode() not in seen
        assert SECRET_KEY.encode() not in seen
    assert SECRET_KEY not in repr(keyed_server.emulator)
    assert SECRET_KEY not in json.dumps(right.state())


# --- Bad input --------------------------------------------------------------------------------

PUBLISH, CONSUME, ACK, CREATE = (
    f"/v1/queue/{call}" for call in ("publish", "consume", "ack", "create")
)


@dataclass(frozen=True)
class BadRequest:
    """A request the emulator must refuse, and what its error message must mention."""

    path: str
    body: Any
    mentions: str
    status: int = 400
    code: str = "VALIDATION_ERROR"


BAD_REQUESTS = [
    BadRequest(PUBLISH, b"not json", "not valid JSON"),
    BadRequest(PUBLISH, b"", "empty"),
    BadRequest(PUBLISH, b"[1, 2]", "JSON object"),
    BadRequest(PUBLISH, b'"text"', "JSON object"),
    BadRequest(PUBLISH, b'{"queue": "billing-jobs", "body": {"x": NaN}}', "JSON"),
    BadRequest(PUBLISH, b"\xff\xfe{}", "JSON"),
    BadRequest(PUBLISH, {"body": {"a": 1}}, "'queue'"),
    BadRequest(PUBLISH, {"queue": QUEUE}, "'body'"),
    BadRequest(PUBLISH, {"queue": 7, "body": {}}, "queue"),
    BadRequest(PUBLISH, {"queue": "", "body": {}}, "queue"),
    BadRequest(PUBLISH, {"queue": QUEUE, "body": "x"}, "body"),
    BadRequest(PUBLISH, {"queue": QUEUE, "body": [1]}, "body"),
    BadRequest(PUBLISH, {"queue": QUEUE, "body": None}, "body"),
    BadRequest(PUBLISH, {"queue": QUEUE, "body": {}, "delay_seconds": -1}, "delay_seconds"),
    BadRequest(PUBLISH, {"queue": QUEUE, "body": {}, "delay_seconds": "5"}, "delay_seconds"),
    BadRequest(PUBLISH, {"queue": QUEUE, "body": {}, "delay_seconds": True}, "delay_seconds"),
    BadRequest(PUBLISH, {"queue": "nope", "body": {}}, "nope", 404, "QUEUE_NOT_FOUND"),
    BadRequest(CONSUME, {}, "'queue'"),
    BadRequest(CONSUME, {"queue": [QUEUE]}, "queue"),
    BadRequest(CONSUME, {"queue": "nope"}, "nope", 404, "QUEUE_NOT_FOUND"),
    BadRequest(ACK, {"queue": QUEUE}, "'receipt_handle'"),
    BadRequest(ACK, {"queue": QUEUE, "receipt_handle": 5}, "receipt_handle"),
    BadRequest(ACK, {"queue": "nope", "receipt_handle": "qmsg_x"}, "nope", 404, "QUEUE_NOT_FOUND"),
    BadRequest(
        ACK,
        {"queue": QUEUE, "receipt_handle": "qmsg_unknown"},
        "receipt handle",
        404,
        "QUEUE_MESSAGE_NOT_FOUND",
    ),
    BadRequest(CREATE, {}, "'name'"),
    BadRequest(CREATE, {"name": ""}, "name"),
    BadRequest(CREATE, {"name": "bad name!"}, "name"),
    BadRequest(CREATE, {"name": "other", "type": "fifo"}, "type"),
    BadRequest(CREATE, {"name": "other", "dlq": 3}, "dlq"),
    BadRequest(CREATE, {"name": "other", "dlq": "other"}, "dlq"),
]


@pytest.mark.parametrize("bad", BAD_REQUESTS, ids=lambda bad: f"{bad.path[10:]}-{bad.body!r}")
def test_bad_input_answers_a_clear_error_and_changes_nothing(
    api: Api, queue: str, bad: BadRequest
) -> None:
    # Given a queue with one available and one in-flight message
    api.publish(queue, {"n": 1})
    api.publish(queue, {"n": 2})
    api.consume(queue, max_messages=1)
    before = api.state()["queues"]

    # When sending a bad request
    raw = bad.body if isinstance(bad.body, bytes) else json.dumps(bad.body).encode()
    answer = api.post(bad.path, raw=raw)

    # Then the error envelope says what is wrong, and no queue changed
    assert bad.mentions in answer.error(bad.status, bad.code)
    assert api.state()["queues"] == before


def test_stats_of_an_unknown_queue_is_queue_not_found(api: Api) -> None:
    # Given no queues / When asking for stats of one
    answer = api.get("/v1/queue/stats/no-such-queue")

    # Then it is QUEUE_NOT_FOUND
    assert "no-such-queue" in answer.error(404, "QUEUE_NOT_FOUND")


def test_unknown_routes_and_wrong_methods(api: Api, queue: str) -> None:
    # Given / When calling routes that do not exist, or with the wrong method
    unknown = [api.get("/v1/queue/dlq"), api.post("/v2/queue/publish"), api.get("/_emulator/x")]
    wrong_method = api.get("/v1/queue/publish")
    wrong_stats = api.post(f"/v1/queue/stats/{queue}")

    # Then 404 NOT_FOUND and 405 METHOD_NOT_ALLOWED with an Allow header
    for answer in unknown:
        answer.error(404, "NOT_FOUND")
    wrong_method.error(405, "METHOD_NOT_ALLOWED")
    assert wrong_method.headers["allow"] == "POST"
    wrong_stats.error(405, "METHOD_NOT_ALLOWED")
    assert wrong_stats.headers["allow"] == "GET"


def test_an_oversized_body_is_refused_unread(api: Api, queue: str) -> None:
    # Given a request announcing a body over the limit
    conn = api.connect()
    try:
        conn.putrequest("POST", "/v1/queue/publish")
        for name, value in api.auth_headers().items():
            conn.putheader(name, value)
        conn.putheader("Content-Length", str(MAX_BODY_BYTES + 1))
        conn.endheaders()

        # When the emulator answers before the body is sent
        response = conn.getresponse()
        document = json.loads(response.read())
    finally:
        conn.close()

    # Then it is 413 PAYLOAD_TOO_LARGE and the connection is closed
    assert response.status == 413
    assert document["error"]["code"] == "PAYLOAD_TOO_LARGE"
    assert response.getheader("Connection") == "close"
    assert api.stats(queue)["message_count"] == 0


# --- Control surface --------------------------------------------------------------------------


def test_reset_forgets_queues_faults_and_the_clock(api: Api, queue: str) -> None:
    # Given a queue with a message, a clock jump and faults on stats
    api.publish(queue, NOTES_PAYLOAD)
    api.advance(1000)
    api.set_faults(error_rate=1.0, routes=["stats"])

    # When resetting
    api.post("/_emulator/reset").data  # noqa: B018
    state = api.state()

    # Then everything is back to a fresh start
    assert state["queues"] == {}
    assert state["clock"]["offset_seconds"] == 0
    assert state["faults"]["error_rate"] == 0
    assert state["requests"] == {}
    api.get(f"/v1/queue/stats/{queue}").error(404, "QUEUE_NOT_FOUND")


@pytest.mark.parametrize(
    "body", [{"advance_seconds": -1}, {"advance_seconds": "5"}, {"advance_seconds": True}, {}]
)
def test_the_clock_only_moves_forward_by_a_number(api: Api, body: dict[str, Any]) -> None:
    # Given / When advancing the clock with a bad value
    answer = api.post("/_emulator/clock", body)

    # Then it is refused and the clock did not move
    assert "advance_seconds" in answer.error(400, "VALIDATION_ERROR")
    assert api.state()["clock"]["offset_seconds"] == 0


def test_advancing_the_clock_answers_the_new_offset(api: Api) -> None:
    # Given / When advancing twice
    api.post("/_emulator/clock", {"advance_seconds": 10})
    answer = api.post("/_emulator/clock", {"advance_seconds": 2.5}).data

    # Then the offset accumulates and "now" is a timestamp in the notes' shape
    assert answer["offset_seconds"] == 12.5
    assert PUBLISHED_AT.fullmatch(answer["now"])


@pytest.mark.parametrize(
    "body",
    [
        {"error_rate": 1.5},
        {"rate_limit_rate": -0.1},
        {"latency_ms": "10"},
        {"routes": ["publish", "teleport"]},
        {"routes": "publish"},
        {"retry_after_seconds": 0.5},
        {"seed": "seven"},
        {"eror_rate": 1.0},
    ],
)
def test_bad_fault_settings_are_refused(api: Api, body: dict[str, Any]) -> None:
    # Given / When setting a malformed fault
    answer = api.post("/_emulator/faults", body)

    # Then it is refused and no fault is in effect
    answer.error(400, "VALIDATION_ERROR")
    assert api.get("/_emulator/faults").data["error_rate"] == 0
    assert api.get("/v1/discovery").status == 200


def test_the_state_dump_counts_requests_and_messages(api: Api, queue: str) -> None:
    # Given some traffic
    api.publish(queue, {"n": 1})
    api.publish(queue, {"n": 2}, delay_seconds=10)
    api.consume(queue)
    api.stats(queue)

    # When reading the state
    state = api.state()

    # Then it shows per-state counts per queue and requests per route
    assert state["queues"][queue] == {
        "type": "standard",
        "dlq": DLQ,
        "visibility_timeout_default": 300,
        "message_count": 2,
        "available": 0,
        "in_flight": 1,
        "delayed": 1,
    }
    assert state["requests"] == {"create": 1, "publish": 2, "consume": 1, "stats": 1}
    assert state["faults_injected"] == {}


# --- Faults -----------------------------------------------------------------------------------


def test_error_rate_answers_500_without_applying_the_call(api: Api, queue: str) -> None:
    # Given every call fails
    api.set_faults(error_rate=1.0)

    # When publishing and creating
    published = api.post("/v1/queue/publish", {"queue": queue, "body": NOTES_PAYLOAD})
    created = api.post("/v1/queue/create", {"name": "other"})

    # Then both answer 500 INTERNAL and neither happened
    published.error(500, "INTERNAL")
    created.error(500, "INTERNAL")
    api.set_faults()
    assert api.stats(queue)["message_count"] == 0
    api.get("/v1/queue/stats/other").error(404, "QUEUE_NOT_FOUND")
    assert api.state()["faults_injected"] == {"error": 2}


def test_rate_limit_answers_429_with_retry_after(api: Api, queue: str) -> None:
    # Given every publish is rate limited
    api.set_faults(rate_limit_rate=1.0, routes=["publish"])

    # When publishing, then again with a zero Retry-After
    first = api.post("/v1/queue/publish", {"queue": queue, "body": NOTES_PAYLOAD})
    api.set_faults(rate_limit_rate=1.0, retry_after_seconds=0)
    second = api.post("/v1/queue/publish", {"queue": queue, "body": NOTES_PAYLOAD})

    # Then both are 429 RATE_LIMITED with the header, and nothing was published
    first.error(429, "RATE_LIMITED")
    assert first.headers["retry-after"] == "1"
    second.error(429, "RATE_LIMITED")
    assert second.headers["retry-after"] == "0"
    api.set_faults()
    assert api.stats(queue)["message_count"] == 0


def test_a_dropped_response_still_applies_the_publish(api: Api, queue: str) -> None:
    # Given responses to publish are dropped
    api.set_faults(drop_response_rate=1.0, routes=["publish"])

    # When publishing, the connection closes without an answer
    with pytest.raises(ConnectionError):
        api.post("/v1/queue/publish", {"queue": queue, "body": NOTES_PAYLOAD})

    # Then the message is in the queue all the same (other routes are unaffected)
    stats = api.stats(queue)
    assert stats["message_count"] == 1
    assert [item["payload"] for item in api.consume(queue)] == [NOTES_PAYLOAD]
    assert api.state()["faults_injected"] == {"drop_response": 1}


def test_only_a_successful_call_loses_its_response(api: Api, queue: str) -> None:
    # Given a consumed message, and every ack's answer dropped
    api.publish(queue, NOTES_PAYLOAD)
    (item,) = api.consume(queue)
    api.set_faults(drop_response_rate=1.0, routes=["ack"])

    # When the ack lands but its answer is lost, and the client retries
    with pytest.raises(ConnectionError):
        api.ack(queue, item["receipt_handle"])
    retried = api.ack(queue, item["receipt_handle"])

    # Then the retry applied nothing, so its error is delivered: the first ack did land
    retried.error(404, "QUEUE_MESSAGE_NOT_FOUND")
    assert api.stats(queue) == zero_stats(queue)
    assert api.state()["faults_injected"] == {"drop_response": 1}


def test_latency_delays_only_the_chosen_routes(api: Api, queue: str) -> None:
    # Given 200 ms of latency on stats only
    api.set_faults(latency_ms=200, routes=["stats"])

    # When calling stats and discovery
    started = time.monotonic()
    api.stats(queue)
    elapsed = time.monotonic() - started
    api.get("/v1/discovery").data  # noqa: B018

    # Then stats took at least the latency, and only it was delayed
    assert elapsed >= 0.2
    assert api.state()["faults_injected"] == {"latency": 1}


def test_a_seed_makes_faults_reproducible(api: Api) -> None:
    # Given half the discovery calls fail, with a seed
    def run() -> list[int]:
        api.set_faults(error_rate=0.5, seed=42, routes=["discovery"])
        return [api.get("/v1/discovery").status for _ in range(20)]

    # When running the same calls twice with the same seed
    first, second = run(), run()

    # Then the same calls fail, and some do while some do not
    assert first == second
    assert set(first) == {200, 500}


def test_faults_never_touch_the_control_surface(api: Api, queue: str) -> None:
    # Given every /v1 call fails
    api.set_faults(error_rate=1.0)

    # When using the control surface
    state = api.get("/_emulator/state")
    cleared = api.post("/_emulator/faults", {})

    # Then it still works, and an empty object clears the faults
    assert state.status == 200
    assert cleared.data["error_rate"] == 0
    assert api.stats(queue)["message_count"] == 0


# --- Transport --------------------------------------------------------------------------------


def test_keep_alive_serves_several_requests_on_one_connection(api: Api, queue: str) -> None:
    # Given one HTTP/1.1 connection
    conn = api.connect()
    try:
        # When sending three requests over it, one of them an error
        first = api.get("/v1/discovery", connection=conn)
        sock = conn.sock
        missing = api.get("/v1/queue/stats/no-such-queue", connection=conn)
        last = api.request("GET", f"/v1/queue/stats/{queue}", connection=conn)

        # Then all are answered over the same socket
        assert sock is not None
        assert conn.sock is sock
    finally:
        conn.close()
    assert first.status == 200
    missing.error(404, "QUEUE_NOT_FOUND")
    assert last.data == zero_stats(queue)
    assert first.headers.get("connection") != "close"


def test_concurrent_publishers_and_consumers(api: Api, queue: str) -> None:
    # Given 8 publishers publishing 50 messages each, concurrently
    ids: list[str] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def publisher(worker: int) -> None:
        conn = api.connect()
        try:
            for n in range(50):
                body = {"queue": queue, "body": {"worker": worker, "n": n}}
                answer = api.post("/v1/queue/publish", body, connection=conn)
                with lock:
                    ids.append(answer.data["message_id"])
        except BaseException as error:
            errors.append(error)
        finally:
            conn.close()

    run_threads(publisher, 8)

    # Then there are exactly 400 distinct ids and 400 messages
    assert errors == []
    assert len(ids) == len(set(ids)) == 400
    assert api.stats(queue)["message_count"] == 400

    # When 4 consumers drain the queue concurrently
    delivered: list[str] = []

    def consumer(_worker: int) -> None:
        try:
            while items := api.consume(queue, max_messages=10):
                with lock:
                    delivered.extend(item["message_id"] for item in items)
        except BaseException as error:
            errors.append(error)

    run_threads(consumer, 4)

    # Then every message was delivered exactly once
    assert errors == []
    assert sorted(delivered) == sorted(ids)


def run_threads(target: Any, count: int) -> None:
    threads = [threading.Thread(target=target, args=(n,)) for n in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads)


# --- Raw HTTP: the request parser and the answer framing -------------------------------------
# The stdlib reads request lines and headers; bodies, faults and answers are the emulator's.
# These pin the bytes on the wire, as they were when the emulator had a server of its own.

AUTH_LINE = f"Authorization: Bearer {_DEFAULT_TOKEN}\r\n".encode()


@dataclass(frozen=True)
class RawAnswer(Answer):
    """An ``Answer`` read off a raw socket (its header names lower-cased), with the status line
    exactly as it was sent."""

    status_line: bytes


class RawConnection:
    """A plain socket to the emulator: send bytes as they are, read answers one by one."""

    def __init__(self, server: RunningEmulator) -> None:
        self.sock = socket.create_connection((server.host, server.port), timeout=10)
        self.rfile: IO[bytes] = self.sock.makefile("rb")

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def answer(self) -> RawAnswer:
        status_line = self.rfile.readline()
        assert status_line.startswith(b"HTTP/1.1 "), status_line
        headers: dict[str, str] = {}
        while (line := self.rfile.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.lower()] = value.strip()
        body = self.rfile.read(int(headers.get("content-length", "0")))
        return RawAnswer(int(status_line.split()[1]), headers, body, status_line)

    def rest(self) -> bytes:
        """Everything until the server closes (a reset counts as closed)."""
        with contextlib.suppress(ConnectionResetError):
            return self.rfile.read()
        return b""

    def close(self) -> None:
        self.rfile.close()
        self.sock.close()


@pytest.fixture
def raw(api: Api, server: RunningEmulator) -> Iterator[RawConnection]:
    connection = RawConnection(server)
    yield connection
    connection.close()


def request_bytes(request_line: str, headers: bytes = AUTH_LINE, body: bytes = b"") -> bytes:
    return request_line.encode("latin-1") + b"\r\n" + headers + b"\r\n" + body


def post_bytes(path: str, document: Any, extra_headers: bytes = b"") -> bytes:
    body = json.dumps(document).encode()
    headers = AUTH_LINE + b"Content-Length: %d\r\n" % len(body) + extra_headers
    return request_bytes(f"POST {path} HTTP/1.1", headers, body)


def stats_bytes(queue: str, extra_headers: bytes = b"") -> bytes:
    return request_bytes(f"GET /v1/queue/stats/{queue} HTTP/1.1", AUTH_LINE + extra_headers)


def test_an_answer_is_framed_as_before(raw: RawConnection, queue: str) -> None:
    # Given / When one ordinary request
    before = datetime.now(UTC).replace(microsecond=0)
    raw.send(stats_bytes(queue))
    answer = raw.answer()
    after = datetime.now(UTC)

    # Then the status line, the headers and their order are the stdlib's, the body is exact
    assert answer.status_line == b"HTTP/1.1 200 OK\r\n"
    assert list(answer.headers) == ["server", "date", "content-type", "content-length"]
    assert answer.headers["server"] == "infrai-emulator/0.1"
    assert answer.headers["content-type"] == "application/json"
    assert int(answer.headers["content-length"]) == len(answer.raw)
    # The Date header has whole seconds: it falls between the request's second and the answer
    sent = email.utils.parsedate_to_datetime(answer.headers["date"])
    assert before <= sent <= after
    assert answer.document == {"ok": True, "data": zero_stats(queue)}


def test_pipelined_requests_on_one_socket_are_answered_in_order(
    raw: RawConnection, queue: str
) -> None:
    # Given four requests written at once on one keep-alive connection
    publish = post_bytes(PUBLISH, {"queue": queue, "body": {"n": 1}})
    consume = post_bytes(CONSUME, {"queue": queue, "max_messages": 10})
    raw.send(publish + publish + stats_bytes(queue) + consume)

    # When reading the answers
    answers = [raw.answer() for _ in range(4)]

    # Then each was answered in order, and the connection is still open for a fifth
    assert [answer.status for answer in answers] == [200, 200, 200, 200]
    assert answers[2].document["data"]["message_count"] == 2
    assert len(answers[3].document["data"]["items"]) == 2
    assert all("connection" not in answer.headers for answer in answers)
    raw.send(stats_bytes(queue))
    assert raw.answer().document["data"]["in_flight_count"] == 2


def test_a_request_arriving_a_byte_at_a_time_is_served_once_whole(
    raw: RawConnection, api: Api, queue: str
) -> None:
    # Given a publish written one byte per packet
    raw.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    request = post_bytes(PUBLISH, {"queue": queue, "body": {"n": 1}})
    for n in range(len(request)):
        raw.send(request[n : n + 1])
    # When its answer is read
    answer = raw.answer()
    # Then it was applied exactly once, when the last byte arrived
    assert answer.status == 200
    assert api.stats(queue)["message_count"] == 1
    assert api.state()["requests"]["publish"] == 1


def test_injected_latency_holds_each_connection_in_order_and_no_other(
    server: RunningEmulator, api: Api, queue: str
) -> None:
    # Given 0.5 s of latency on every call, and twenty connections
    api.set_faults(latency_ms=500)
    connections = [RawConnection(server) for _ in range(20)]
    try:
        # When each sends two pipelined requests at the same moment
        started = time.monotonic()
        for connection in connections:
            connection.send(stats_bytes(queue) + stats_bytes(queue))
        first = [connection.answer().status for connection in connections]
        after_first = time.monotonic() - started
        second = [connection.answer().status for connection in connections]
        after_second = time.monotonic() - started
    finally:
        for connection in connections:
            connection.close()
    # Then a connection's second request waited for its first (HTTP/1.1 order), while the
    # twenty connections waited together: twenty in a row would take 10 s for the first answers
    # alone, so half of that leaves a busy machine room without blurring the two
    assert first == second == [200] * 20
    assert 0.5 <= after_first < 5.0
    assert after_second >= 1.0


def test_a_request_whose_client_resets_during_the_latency_is_still_applied(
    server: RunningEmulator, api: Api, queue: str
) -> None:
    # Given 1 s of latency, and a publish the emulator has received
    api.set_faults(latency_ms=1000)
    sock = socket.create_connection((server.host, server.port), timeout=5)
    sock.sendall(post_bytes(PUBLISH, {"queue": queue, "body": {"n": 1}}))
    deadline = time.monotonic() + 5
    while api.state()["requests"].get("publish", 0) < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    # When its client aborts (RST) before the answer
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()
    # Then the publish is applied once its latency has passed, as a server that had received
    # it would
    while api.state()["queues"][queue]["message_count"] < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    api.set_faults()
    assert api.stats(queue)["message_count"] == 1


def test_idle_time_runs_from_the_answer_not_from_the_request(
    server: RunningEmulator, api: Api, queue: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given idle connections closed after 4 s, and 3.5 s of latency
    monkeypatch.setattr(emulator_http, "_IDLE_CONNECTION_SECONDS", 4.0)
    api.set_faults(latency_ms=3500)
    connection = RawConnection(server)
    try:
        # When a request is answered, and the next one follows 0.6 s later
        connection.send(stats_bytes(queue))
        first = connection.answer().status
        api.set_faults()
        time.sleep(0.6)
        connection.send(stats_bytes(queue))
        # Then the connection was still open: 0.6 s idle (3.4 s short of the limit, room for a
        # busy machine), not 4.1 s since the request
        assert (first, connection.answer().status) == (200, 200)
    finally:
        connection.close()


def test_the_server_survives_a_failure_handling_one_connection(
    server: RunningEmulator, api: Api, queue: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a bug that makes serving the next connection raise
    http_server = server._server
    real_finish = http_server.finish_request
    failures: list[Any] = []

    def finish_broken_once(request: Any, client_address: Any) -> None:
        if not failures:
            failures.append(client_address)
            raise RuntimeError("injected bug")
        real_finish(request, client_address)

    monkeypatch.setattr(http_server, "finish_request", finish_broken_once)
    victim = RawConnection(server)
    try:
        victim.send(stats_bytes(queue))
        # Then that connection is closed unanswered, and other clients are still served
        assert victim.rest() == b""
        assert failures == [victim.sock.getsockname()]
    finally:
        victim.close()
    assert api.stats(queue)["message_count"] == 0


def test_a_burst_of_connections_is_queued_not_dropped_while_the_server_is_busy() -> None:
    # Given an emulator whose serving thread is not accepting (as when it is busy)
    server = EmulatorHTTPServer(("127.0.0.1", 0), Emulator())
    sockets: list[socket.socket] = []
    try:
        # When a drain's lanes open 60 connections at once
        for _ in range(60):
            sock = socket.socket()
            sock.setblocking(False)
            sock.connect_ex(("127.0.0.1", server.server_port))
            sockets.append(sock)
        _, writable, _ = select.select([], sockets, [], 0.5)

        # Then the kernel completes every handshake and queues it for accept(); with
        # socketserver's backlog of 5 most SYNs were dropped, each retried only after 1 s
        connected = [s for s in writable if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0]
        assert len(connected) == 60
    finally:
        for sock in sockets:
            sock.close()
        server.server_close()


@pytest.mark.parametrize(
    "header", [b"Connection: close", b"CONNECTION: Close", b"connection:close"]
)
def test_connection_close_ends_the_connection_after_its_answer(
    raw: RawConnection, queue: str, header: bytes
) -> None:
    # Given a request asking to close, pipelined with one more
    raw.send(stats_bytes(queue, header + b"\r\n") + stats_bytes(queue))

    # When reading
    answer = raw.answer()

    # Then it is answered with Connection: close, and the second is never answered
    assert answer.status == 200
    assert answer.headers["connection"] == "close"
    assert raw.rest() == b""


@pytest.mark.parametrize(("extra", "closes"), [(b"", True), (b"Connection: keep-alive\r\n", False)])
def test_http_1_0_closes_unless_asked_to_keep_alive(
    raw: RawConnection, queue: str, extra: bytes, closes: bool
) -> None:
    # Given an HTTP/1.0 request, with or without Connection: keep-alive
    request = request_bytes(f"GET /v1/queue/stats/{queue} HTTP/1.0", AUTH_LINE + extra)
    raw.send(request + stats_bytes(queue))

    # When reading / Then the connection closes after the answer unless kept alive
    first = raw.answer()
    assert first.status == 200
    assert (first.headers.get("connection") == "close") is closes
    if closes:
        assert raw.rest() == b""
    else:
        assert raw.answer().status == 200


@pytest.mark.parametrize(
    ("authorization", "content_length"),
    [
        (b"authorization: bearer", b"content-length"),
        (b"AUTHORIZATION: BEARER", b"CONTENT-LENGTH"),
        (b"aUtHoRiZaTiOn: BeArEr", b"cOnTeNt-LeNgTh"),
        (b"Authorization:\tBearer", b"Content-Length:"),
    ],
)
def test_header_names_are_case_insensitive(
    raw: RawConnection, queue: str, authorization: bytes, content_length: bytes
) -> None:
    # Given a publish whose header names (and bearer scheme) are in another case
    body = json.dumps({"queue": queue, "body": {"n": 1}}).encode()
    name = content_length.rstrip(b":")
    headers = authorization + b" t\r\n" + name + b": %d\r\n" % len(body)
    raw.send(request_bytes(f"POST {PUBLISH} HTTP/1.1", headers, body))

    # When reading the answer / Then both headers were found: published
    assert raw.answer().status == 200
    assert Api(raw_url(raw)).stats(queue)["message_count"] == 1


def raw_url(raw: RawConnection) -> str:
    host, port = raw.sock.getpeername()[:2]
    return f"http://{host}:{port}"


def test_of_repeated_headers_the_first_counts(raw: RawConnection, queue: str) -> None:
    # Given a publish with two Content-Length headers (the first right) and an empty first
    # Authorization
    body = json.dumps({"queue": queue, "body": {"n": 1}}).encode()
    headers = AUTH_LINE + b"Content-Length: %d\r\ncontent-length: 3\r\n" % len(body)
    raw.send(request_bytes(f"POST {PUBLISH} HTTP/1.1", headers, body) + stats_bytes(queue))
    published = raw.answer()
    stats = raw.answer()
    raw.send(stats_bytes(queue, b"").replace(AUTH_LINE, b"Authorization:\r\n" + AUTH_LINE))
    refused = raw.answer()

    # Then the first of each counted
    assert published.status == 200
    assert stats.document["data"]["message_count"] == 1
    assert refused.status == 401


@pytest.mark.parametrize(
    "request_line",
    [
        "GET /v1/discovery HTTP/1.x",
        "GET /v1/discovery HTTP/1.1.1",
        "GET /v1/discovery HTTP/1.\u00b2",
        "GET /v1/discovery HTTP/1.12345678901",
        "GET /v1/discovery FOO/1.1",
        "GET /v1/discovery HTTP/1.1 extra",
        "GET",
        "POST /v1/queue/publish",
    ],
)
def test_a_malformed_request_line_answers_400_and_closes(
    raw: RawConnection, request_line: str
) -> None:
    # Given a request line the stdlib refuses (its version unknown, so HTTP/0.9 style: no
    # status line), followed by a good request
    raw.send(request_bytes(request_line) + request_bytes("GET /v1/discovery HTTP/1.1"))

    # When reading everything
    rest = raw.rest()

    # Then it is the stdlib's 400 page, and nothing else is answered
    assert not rest.startswith(b"HTTP/")
    assert b"Error code: 400" in rest
    assert rest.count(b"<!DOCTYPE HTML>") == 1
    assert b'"ok"' not in rest


def test_http_2_is_refused_with_505(raw: RawConnection) -> None:
    # Given / When a request claiming HTTP/2.0
    raw.send(request_bytes("GET /v1/discovery HTTP/2.0"))

    # Then the stdlib's 505 page, and the connection closes
    rest = raw.rest()
    assert b"Error code: 505" in rest


def test_an_unknown_method_is_501_with_a_status_line(raw: RawConnection) -> None:
    # Given / When a HEAD (no do_HEAD)
    raw.send(request_bytes("HEAD /v1/discovery HTTP/1.1"))

    # Then 501 from the stdlib, and the connection closes
    rest = raw.rest()
    assert rest.startswith(b"HTTP/1.1 501 Unsupported method ('HEAD')\r\n")


def test_a_blank_request_line_closes_without_an_answer(raw: RawConnection) -> None:
    # Given / When a blank line where a request line belongs, then a good request
    raw.send(b"\r\n" + request_bytes("GET /v1/discovery HTTP/1.1"))

    # Then the connection closes unanswered
    assert raw.rest() == b""


def test_an_http_0_9_get_is_answered_with_the_body_alone(raw: RawConnection) -> None:
    # Given / When a request line without a version (HTTP/0.9)
    raw.send(b"GET /v1/discovery\r\n" + AUTH_LINE + b"\r\n")

    # Then the answer is the JSON body with no status line or headers, then the end
    rest = raw.rest()
    assert json.loads(rest)["ok"] is True


def test_a_request_line_over_64_kib_is_414(raw: RawConnection) -> None:
    # Given a request line of 65,537 bytes (exactly what the server reads before refusing)
    line = b"GET /" + b"a" * (65_537 - 5)

    # When it is sent
    raw.send(line)

    # Then 414, and the connection closes
    assert raw.rest().startswith(b"HTTP/1.1 414 Request-URI Too Long\r\n")


def test_a_header_line_over_64_kib_is_431(raw: RawConnection) -> None:
    # Given a header line of 65,537 bytes
    header = b"X-Big: " + b"a" * (65_537 - 7)

    # When it is sent
    raw.send(b"GET /v1/discovery HTTP/1.1\r\n" + header)

    # Then 431 "Line too long", and the connection closes
    assert raw.rest().startswith(b"HTTP/1.1 431 Line too long\r\n")


def test_a_header_line_of_exactly_64_kib_is_read(raw: RawConnection) -> None:
    # Given a header line of 65,536 bytes, CRLF included
    header = b"X-Big: " + b"a" * (65_536 - 9) + b"\r\n"

    # When it is sent / Then the request is served
    raw.send(request_bytes("GET /v1/discovery HTTP/1.1", AUTH_LINE + header))
    assert raw.answer().status == 200


@pytest.mark.parametrize(("extra_headers", "status"), [(98, 200), (99, 431)])
def test_more_than_100_header_lines_is_431(
    raw: RawConnection, extra_headers: int, status: int
) -> None:
    # Given Authorization plus N more headers (the blank line counts towards the 100)
    headers = AUTH_LINE + b"".join(b"X-%d: v\r\n" % n for n in range(extra_headers))

    # When it is sent
    raw.send(request_bytes("GET /v1/discovery HTTP/1.1", headers))

    # Then 99 header lines are served, 100 are "Too many headers"
    answer = raw.answer()
    assert answer.status == status
    if status == 431:
        assert answer.status_line == b"HTTP/1.1 431 Too many headers\r\n"
        assert raw.rest() == b""


def test_a_missing_content_length_means_an_empty_body(raw: RawConnection, queue: str) -> None:
    # Given a publish without Content-Length, and a stats request after it
    raw.send(request_bytes(f"POST {PUBLISH} HTTP/1.1") + stats_bytes(queue))

    # When reading both answers
    refused = raw.answer()
    stats = raw.answer()

    # Then the body was read as empty (400), and the connection stayed usable
    assert "empty" in refused.document["error"]["message"]
    assert refused.status == 400
    assert stats.document["data"]["message_count"] == 0


@pytest.mark.parametrize("value", [b"abc", b"-1", b"+1", b"1.5", b"0x10", "\u0661".encode()])
def test_an_invalid_content_length_is_400_and_closes(
    raw: RawConnection, queue: str, value: bytes
) -> None:
    # Given a publish whose Content-Length is not a plain decimal count
    headers = AUTH_LINE + b"Content-Length: " + value + b"\r\n"
    raw.send(request_bytes(f"POST {PUBLISH} HTTP/1.1", headers, b"{}"))

    # When reading / Then 400 about Content-Length, and the connection closes
    answer = raw.answer()
    assert answer.status == 400
    assert "Content-Length" in answer.document["error"]["message"]
    assert answer.headers["connection"] == "close"
    assert raw.rest() == b""


def test_a_padded_content_length_is_read(raw: RawConnection, queue: str) -> None:
    # Given a Content-Length with spaces around the number
    body = json.dumps({"queue": queue, "body": {}}).encode()
    headers = AUTH_LINE + b"Content-Length:   %d  \r\n" % len(body)

    # When it is sent / Then the publish is served
    raw.send(request_bytes(f"POST {PUBLISH} HTTP/1.1", headers, body))
    assert raw.answer().status == 200


def test_expect_100_continue_is_answered_before_the_body(raw: RawConnection, queue: str) -> None:
    # Given the headers of a publish that waits for 100 Continue
    body = json.dumps({"queue": queue, "body": {}}).encode()
    headers = AUTH_LINE + b"Content-Length: %d\r\nExpect: 100-continue\r\n" % len(body)
    raw.send(request_bytes(f"POST {PUBLISH} HTTP/1.1", headers))

    # When the interim answer arrives and the body follows
    assert raw.rfile.readline() == b"HTTP/1.1 100 Continue\r\n"
    assert raw.rfile.readline() == b"\r\n"
    raw.send(body)

    # Then the publish is served
    assert raw.answer().status == 200


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        # A line that is no header ends the headers for the email parser: the rest is ignored.
        (b"Host: x\r\nbogus\r\n" + AUTH_LINE, 401),
        (b"Authorization : Bearer t\r\n", 401),
        # A folded header keeps its line break, which is no bearer token.
        (b"Authorization: Bearer\r\n t\r\n", 401),
        # A lone CR splits a line in two for the email parser.
        (b"X-A: 1\rAuthorization: Bearer t\r\n", 200),
        (b"From x\r\n" + AUTH_LINE, 200),
        (b": nameless\r\n" + AUTH_LINE, 200),
        (b"X-Caf\xe9: 1\r\n" + AUTH_LINE, 401),
        (b"Authorization: Bearer caf\xe9\r\n", 200),
    ],
)
def test_odd_header_lines_are_read_as_the_stdlib_reads_them(
    raw: RawConnection, headers: bytes, status: int
) -> None:
    # Given / When a request with an unusual header block
    raw.send(request_bytes("GET /v1/discovery HTTP/1.1", headers))

    # Then the answer is the one the stdlib's email parser leads to
    assert raw.answer().status == status


def test_bare_lf_line_endings_are_accepted(raw: RawConnection) -> None:
    # Given / When a request with LF-only line ends
    raw.send(b"GET /v1/discovery HTTP/1.1\n" + AUTH_LINE.replace(b"\r\n", b"\n") + b"\n")

    # Then it is served
    assert raw.answer().status == 200


# --- Command line -----------------------------------------------------------------------------


def test_the_command_line_serves_until_terminated() -> None:
    # Given the emulator started as a process on a free port, with an API key
    command = [sys.executable, "-m", "infrai_local.sandbox.emulator", "--port", "0"]
    command += ["--api-key", SECRET_KEY, "--visibility-timeout", "30"]
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as process:
        try:
            assert process.stdout is not None
            ready, _, _ = select.select([process.stdout], [], [], 20)
            assert ready, "the emulator printed no URL within 20 s"
            url = process.stdout.readline().strip()

            # When calling it with the key, and without
            api = Api(url, token=SECRET_KEY)
            created = api.create(QUEUE, dlq=DLQ)
            stats = api.stats(QUEUE)
            refused = Api(url, token=WRONG_KEY).get(f"/v1/queue/stats/{QUEUE}")
        finally:
            # Then it stops cleanly on SIGTERM
            os.kill(process.pid, signal.SIGTERM)
            out, err = process.communicate(timeout=20)

    assert re.fullmatch(r"http://127\.0\.0\.1:\d+", url)
    assert not url.endswith(":0")
    assert created["visibility_timeout_default"] == 30
    assert stats == zero_stats(QUEUE)
    refused.error(401, "UNAUTHORIZED")
    assert process.returncode == 0
    assert SECRET_KEY not in out + err
    assert WRONG_KEY not in out + err
