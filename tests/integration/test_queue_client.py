"""The Infrai client against the emulator over loopback: every call, every error row, retries."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from decimal import Decimal
from http.server import ThreadingHTTPServer
from typing import Any

import pytest
import urllib3
from notes_example import DLQ, NOTES_PAYLOAD, QUEUE
from stub_servers import QuietJsonHandler, serving

from infrai_jobs import errors
from infrai_jobs.queue.client import HttpRetryPolicy, InfraiClient
from infrai_local.sandbox.emulator import start_in_thread
from infrai_local.sandbox.queues import ensure_queue

API_KEY = "sk_live_do_not_print_4f9a2c"


class SleepRecorder:
    """Records the client's backoff sleeps instead of sleeping, so retry tests stay fast."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)


@pytest.fixture(scope="module")
def emulator() -> Iterator[Any]:
    server = start_in_thread(api_key=API_KEY)
    yield server
    server.stop()


@pytest.fixture
def control(emulator: Any) -> Iterator[urllib3.PoolManager]:
    pool = urllib3.PoolManager()
    pool.request("POST", f"{emulator.url}/_emulator/reset")
    yield pool
    pool.request("POST", f"{emulator.url}/_emulator/reset")
    pool.clear()


def set_faults(control: urllib3.PoolManager, url: str, **faults: Any) -> None:
    response = control.request("POST", f"{url}/_emulator/faults", json=faults)
    assert response.status == 200, response.data


@pytest.fixture
def sleeps() -> SleepRecorder:
    return SleepRecorder()


@pytest.fixture
def client(emulator: Any, control: urllib3.PoolManager, sleeps: SleepRecorder) -> Iterator[Any]:
    infrai = InfraiClient(emulator.url, API_KEY, sleep=sleeps)
    ensure_queue(infrai, QUEUE, dlq=DLQ)
    yield infrai
    infrai.close()


def test_ensure_queue_treats_an_existing_queue_as_success(client: InfraiClient) -> None:
    # Given the fixture created the queue already
    # When it is ensured again
    created = ensure_queue(client, QUEUE, dlq=DLQ)
    # Then that is not an error, and the answer says it existed
    assert created is False
    assert ensure_queue(client, "fresh-queue") is True


def test_publish_consume_ack_round_trip(client: InfraiClient) -> None:
    # Given the notes' payload published twice (a producer retry)
    first = client.publish(QUEUE, NOTES_PAYLOAD)
    second = client.publish(QUEUE, NOTES_PAYLOAD)
    # When the queue is consumed
    messages = client.consume(QUEUE, 10)
    # Then both arrive as independent, typed work
    assert first != second
    assert [m.message_id for m in messages] == [first, second]
    assert all(m.payload == NOTES_PAYLOAD and m.delivery_count == 1 for m in messages)
    assert messages[0].receipt_handle == first
    assert messages[0].published_at is not None
    assert messages[0].published_at.tzinfo is not None
    # And acking both leaves the queue empty
    for message in messages:
        client.ack(QUEUE, message.receipt_handle)
    stats = client.stats(QUEUE)
    assert (stats.message_count, stats.in_flight_count, stats.dlq_count) == (0, 0, 0)


def test_ack_of_a_handle_the_queue_no_longer_holds_is_its_own_error(client: InfraiClient) -> None:
    # Given a message consumed and acked once
    client.publish(QUEUE, NOTES_PAYLOAD)
    (message,) = client.consume(QUEUE)
    client.ack(QUEUE, message.receipt_handle)
    # When it is acked again
    with pytest.raises(errors.QueueMessageNotFound) as caught:
        client.ack(QUEUE, message.receipt_handle)
    # Then the drain can tell it apart from real failures
    assert caught.value.code == "QUEUE_MESSAGE_NOT_FOUND"
    assert caught.value.status == 404


def test_consume_caps_max_messages_at_ten(client: InfraiClient) -> None:
    for n in range(15):
        client.publish(QUEUE, {"job": "noop", "n": n})
    assert len(client.consume(QUEUE, 50)) == 10
    assert len(client.consume(QUEUE, 50)) == 5
    with pytest.raises(ValueError, match="max_messages"):
        client.consume(QUEUE, 0)


def test_stats_are_typed_and_count_delayed_messages(client: InfraiClient) -> None:
    client.publish(QUEUE, {"job": "later"}, delay_seconds=60)
    client.publish(QUEUE, {"job": "now"})
    stats = client.stats(QUEUE)
    assert stats.queue == QUEUE
    assert (stats.available_count, stats.delayed_count, stats.message_count) == (1, 1, 2)
    assert isinstance(stats.oldest_message_age_seconds, float)


def test_publish_price_comes_from_discovery(client: InfraiClient) -> None:
    price = client.publish_price()
    assert price.usd_per_message == Decimal("0.00002")


def test_unknown_queue_and_bad_key_map_to_clear_errors(emulator: Any, control: Any) -> None:
    good = InfraiClient(emulator.url, API_KEY)
    with pytest.raises(errors.InfraiError) as missing:
        good.stats("no-such-queue")
    assert (missing.value.code, missing.value.status) == ("QUEUE_NOT_FOUND", 404)

    wrong = InfraiClient(emulator.url, "sk_wrong_key_123")
    with pytest.raises(errors.InfraiError) as denied:
        wrong.stats(QUEUE)
    assert (denied.value.code, denied.value.status) == ("UNAUTHORIZED", 401)
    assert "sk_wrong_key_123" not in str(denied.value)


def test_the_api_key_never_appears_in_repr_logs_or_errors(
    emulator: Any, control: urllib3.PoolManager, caplog: pytest.LogCaptureFixture
) -> None:
    # Given every logger at DEBUG (urllib3 included) and a service that keeps failing
    caplog.set_level(logging.DEBUG)
    client = InfraiClient(emulator.url, API_KEY, retry=HttpRetryPolicy(base_delay=0.001))
    ensure_queue(client, QUEUE, dlq=DLQ)
    set_faults(control, emulator.url, error_rate=1.0)
    # When calls fail, are retried and give up
    with pytest.raises(errors.InfraiUnavailable) as caught:
        client.stats(QUEUE)
    unreachable = InfraiClient("http://127.0.0.1:9", API_KEY, retry=HttpRetryPolicy(max_attempts=1))
    with pytest.raises(errors.InfraiUnavailable) as refused:
        unreachable.consume(QUEUE)
    # Then the key is nowhere a human or a log shipper could see it
    assert caplog.records, "expected retry logging to have been captured"
    visible = [
        repr(client),
        str(caught.value),
        repr(caught.value),
        str(refused.value),
        caplog.text,
        json.dumps([r.__dict__ for r in caplog.records], default=str),
    ]
    assert all(API_KEY not in text for text in visible)
    assert "redacted" in repr(client)


def test_retryable_calls_back_off_on_5xx_then_give_up(
    client: InfraiClient, emulator: Any, control: urllib3.PoolManager, sleeps: SleepRecorder
) -> None:
    # Given every Infrai call answers 500
    set_faults(control, emulator.url, error_rate=1.0)
    # When stats is asked for
    with pytest.raises(errors.InfraiUnavailable) as caught:
        client.stats(QUEUE)
    # Then it was tried max_attempts times with bounded, jittered sleeps in between
    assert caught.value.code == "INTERNAL"
    assert caught.value.status == 500
    assert len(sleeps.delays) == HttpRetryPolicy().max_attempts - 1
    assert all(0 <= d <= HttpRetryPolicy().max_delay for d in sleeps.delays)


def test_sent_acks_and_consumes_keep_the_retry_rules_of_the_plain_calls(
    client: InfraiClient, emulator: Any, control: urllib3.PoolManager, sleeps: SleepRecorder
) -> None:
    # Given two consumed messages, and a service whose acks and consumes answer 500
    client.publish(QUEUE, NOTES_PAYLOAD)
    client.publish(QUEUE, NOTES_PAYLOAD)
    first, second = client.consume(QUEUE, 2)
    set_faults(control, emulator.url, error_rate=1.0, routes=["ack", "consume"])
    # When an ack and a consume are sent together, then their answers read
    ack = client.send_ack(QUEUE, first.receipt_handle)
    consume = client.send_consume(QUEUE)
    with pytest.raises(errors.InfraiUnavailable) as ack_error:
        ack.wait()
    with pytest.raises(errors.ConsumeAnswerLost) as consume_error:
        consume.wait()
    # Then the ack was tried max_attempts times in all, the sent request being the first, and
    # the consume once: a 5xx may have come after it served messages, and a repeat would spend
    # a delivery of the next ones too
    attempts = HttpRetryPolicy().max_attempts
    assert (ack_error.value.call, consume_error.value.call) == ("ack", "consume")
    assert (consume_error.value.status, consume_error.value.max_messages) == (500, 10)
    assert len(sleeps.delays) == attempts - 1
    requests = emulator.emulator.snapshot()["requests"]
    assert (requests["ack"], requests["consume"]) == (attempts, 2)
    # And once the service recovers, a sent ack lands and a sent consume gets nothing more
    set_faults(control, emulator.url)
    ack = client.send_ack(QUEUE, second.receipt_handle)
    assert ack.wait() is None
    with pytest.raises(RuntimeError, match="already read"):
        ack.wait()
    assert client.send_consume(QUEUE).wait() == []
    assert client.stats(QUEUE).message_count == 1


def test_acks_sent_together_before_a_key_rotation_all_land_with_one_refresh() -> None:
    # Given Infrai accepting only the new key, three deliveries, and a client holding the old
    server = start_in_thread(api_key="sk_new_key")
    try:
        fresh = InfraiClient(server.url, "sk_new_key")
        ensure_queue(fresh, QUEUE)
        for n in range(3):
            fresh.publish(QUEUE, {"n": n})
        handles = [m.receipt_handle for m in fresh.consume(QUEUE, 3)]
        fetches: list[str] = []

        def refresh() -> str:
            fetches.append("sk_new_key")
            return "sk_new_key"

        client = InfraiClient(server.url, "sk_old_key", refresh_api_key=refresh)
        # When three acks travel together with the old key, then their answers are read
        sent = [client.send_ack(QUEUE, handle) for handle in handles]
        outcomes = [pending.wait() for pending in sent]
        # Then every ack landed: the first 401 fetched the key, the others used it
        assert outcomes == [None, None, None]
        assert fetches == ["sk_new_key"]
        assert fresh.stats(QUEUE).message_count == 0
    finally:
        server.stop()


def test_rate_limits_honour_retry_after(
    client: InfraiClient, emulator: Any, control: urllib3.PoolManager, sleeps: SleepRecorder
) -> None:
    # Given the service answers 429 with Retry-After: 2 about half the time
    set_faults(control, emulator.url, rate_limit_rate=0.5, retry_after_seconds=2, seed=7)
    client.publish(QUEUE, NOTES_PAYLOAD, retry=True)
    # When the client consumes until it gets the message
    messages = []
    for _ in range(5):
        messages = client.consume(QUEUE)
        if messages:
            break
    # Then it succeeded, and every sleep after a 429 waited at least the advertised 2 s
    assert [m.payload for m in messages] == [NOTES_PAYLOAD]
    assert sleeps.delays, "the seeded faults should have rate-limited at least once"
    assert all(d >= 2 for d in sleeps.delays)


def test_within_an_invocation_a_retry_that_would_outlast_it_is_not_made(
    client: InfraiClient, emulator: Any, control: urllib3.PoolManager, sleeps: SleepRecorder
) -> None:
    # Given a service that answers every consume 429 with Retry-After: 2
    set_faults(
        control, emulator.url, rate_limit_rate=1.0, retry_after_seconds=2, routes=["consume"]
    )
    # When the client consumes inside an invocation with 17 s left, each back-off spending
    # its seconds of it (a retry needs its back-off plus one attempt's timeouts, 13.05 s)
    with (
        client.retries_within(lambda: 17_000 - round(1000 * sum(sleeps.delays))),
        pytest.raises(errors.InfraiUnavailable) as failure,
    ):
        client.consume(QUEUE)
    # Then it retried once, while a retry still fitted, and then gave up with Infrai's answer
    assert failure.value.code == "RATE_LIMITED"
    assert len(sleeps.delays) == 1
    # And outside the invocation the bound is gone: all four attempts are made
    with pytest.raises(errors.InfraiUnavailable):
        client.consume(QUEUE)
    assert len(sleeps.delays) == 1 + 3


def test_the_drain_service_bounds_the_client_retries_by_the_time_left(
    emulator: Any, control: urllib3.PoolManager, sleeps: SleepRecorder, database_url: str
) -> None:
    from drainkit import harness  # noqa: PLC0415

    from infrai_jobs.config.settings import DrainSettings  # noqa: PLC0415

    with harness(database_url) as kit:
        kit.publish({"job": "test.db", "id": "a"})
        client = InfraiClient(kit.server.url, "test-key", sleep=sleeps)
        service = kit.lane_service(DrainSettings(queue="billing-jobs"), client)
        # Given every consume answered 429 with Retry-After: 4, and 20 s left in the invocation
        # (just enough for the drain to receive a batch)
        kit.faults(rate_limit_rate=1.0, retry_after_seconds=4, routes=["consume"])
        # When DrainFunction's service runs
        with pytest.raises(errors.InfraiUnavailable):
            service.run(lambda: 20_000 - round(1000 * sum(sleeps.delays)))
        kit.faults()
        service.close()
        client.close()
        # Then the consume was retried once, while a retry (4 s + 13.05 s) fitted in what was
        # left, not three times as without an invocation to fit in
        assert len(sleeps.delays) == 1


def test_dropped_ack_response_is_retried_and_reported_as_not_found(
    client: InfraiClient, emulator: Any, control: urllib3.PoolManager
) -> None:
    # Given a consumed message, and a service that applies acks but drops the answer
    client.publish(QUEUE, NOTES_PAYLOAD)
    (message,) = client.consume(QUEUE)
    set_faults(control, emulator.url, drop_response_rate=1.0, routes=["ack"])
    # When it is acked: the first answer is lost, the retry finds the message gone
    with pytest.raises(errors.QueueMessageNotFound):
        client.ack(QUEUE, message.receipt_handle)
    # Then the ack did land
    set_faults(control, emulator.url)
    assert client.stats(QUEUE).message_count == 0


def test_publish_is_not_retried_by_default(
    client: InfraiClient, emulator: Any, control: urllib3.PoolManager, sleeps: SleepRecorder
) -> None:
    # Given the service applies publishes but drops the answers
    set_faults(control, emulator.url, drop_response_rate=1.0, routes=["publish"])
    # When a job is published
    with pytest.raises(errors.InfraiUnavailable):
        client.publish(QUEUE, NOTES_PAYLOAD)
    # Then exactly one message exists: no retry duplicated it
    set_faults(control, emulator.url)
    assert sleeps.delays == []
    assert client.stats(QUEUE).message_count == 1


def test_opt_in_publish_retries_can_duplicate_which_the_claims_absorb(
    client: InfraiClient, emulator: Any, control: urllib3.PoolManager
) -> None:
    # Given publish answers dropped, with retries opted in
    set_faults(control, emulator.url, drop_response_rate=1.0, routes=["publish"])
    with pytest.raises(errors.InfraiUnavailable):
        client.publish(QUEUE, NOTES_PAYLOAD, retry=True)
    # Then every attempt reached the queue: this is why it is off by default
    set_faults(control, emulator.url)
    assert client.stats(QUEUE).message_count == HttpRetryPolicy().max_attempts


def test_configuration_errors_name_the_setting() -> None:
    with pytest.raises(errors.ConfigurationError, match="INFRAI_BASE_URL"):
        InfraiClient("api.infrai.cc", API_KEY)
    with pytest.raises(errors.ConfigurationError, match="INFRAI_API_KEY"):
        InfraiClient("http://127.0.0.1:1", "")


# --- bodies without the envelope (the notes show stats and discovery that way) ----------------

BARE_ANSWERS: dict[str, tuple[int, bytes]] = {
    "/v1/queue/stats/billing-jobs": (
        200,
        b'{"queue":"billing-jobs","message_count":0,"available_count":0,"in_flight_count":0,'
        b'"delayed_count":0,"dlq_count":0,"oldest_message_age_seconds":0}',
    ),
    "/v1/discovery": (
        200,
        b'{"capabilities":[{"id":"queue.consume","billing":{"price_usd":"0"}},'
        b'{"id":"queue.publish","billing":{"price_usd":0.00002,"unit":"message"}}]}',
    ),
    "/v1/queue/stats/garbage": (200, b"<html>gateway</html>"),
    "/v1/queue/stats/wrong-types": (
        200,
        b'{"ok":true,"data":{"message_count":"3","available_count":0,"in_flight_count":0,'
        b'"delayed_count":0,"dlq_count":0}}',
    ),
    "/v1/queue/stats/teapot": (418, b"short and stout"),
    "/v1/queue/stats/ok-yes": (200, b'{"ok":"yes","data":{}}'),
    "/v1/queue/stats/ok-false-bare": (200, b'{"ok":false}'),
}


ODD_ITEMS = (
    b'{"ok":true,"data":{"items":['
    b'{"message_id":"qmsg_good","payload":{"job":"x"},"delivery_count":1},'
    b'{"payload":{"job":"no id"}},'
    b'{"message_id":"qmsg_badcount","payload":{},"delivery_count":"two"},'
    b'"not an object",'
    b'{"message_id":"qmsg_list","payload":[1,2],"delivery_count":2,"receipt_handle":"rh_1"}'
    b'],"next_cursor":null}}'
)


class BareHandler(QuietJsonHandler):
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = ODD_ITEMS if self.path == "/v1/queue/consume" else b'{"ok":false}'
        self.send_json(200 if self.path == "/v1/queue/consume" else 404, body)

    def do_GET(self) -> None:
        status, body = BARE_ANSWERS.get(self.path, (404, b'{"ok":false}'))
        self.send_json(status, body)


@pytest.fixture(scope="module")
def bare_server() -> Iterator[str]:
    with serving(ThreadingHTTPServer(("127.0.0.1", 0), BareHandler)) as url:
        yield url


def test_bodies_without_the_envelope_are_accepted(bare_server: str) -> None:
    client = InfraiClient(bare_server, API_KEY)
    assert client.stats(QUEUE).dlq_count == 0
    assert client.publish_price().usd_per_message == Decimal("0.00002")


def test_answers_outside_the_contract_raise_invalid_response(bare_server: str) -> None:
    client = InfraiClient(bare_server, API_KEY, retry=HttpRetryPolicy(max_attempts=1))
    with pytest.raises(errors.InfraiInvalidResponse, match="not JSON"):
        client.stats("garbage")
    with pytest.raises(errors.InfraiInvalidResponse, match="message_count"):
        client.stats("wrong-types")
    with pytest.raises(errors.InfraiError) as teapot:
        client.stats("teapot")
    assert (teapot.value.code, teapot.value.status) == ("HTTP_418", 418)
    # A 200 whose envelope neither says ok nor names an error is not an "HTTP_200" failure
    with pytest.raises(errors.InfraiInvalidResponse, match="ok is 'yes'") as yes:
        client.stats("ok-yes")
    assert (yes.value.code, yes.value.status) == ("INVALID_RESPONSE", 200)
    with pytest.raises(errors.InfraiInvalidResponse, match="ok is False"):
        client.stats("ok-false-bare")


def test_malformed_consumed_items_are_logged_and_left_for_redelivery(
    bare_server: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a consume answer mixing good items with ones the contract does not allow
    client = InfraiClient(bare_server, API_KEY)
    # When consumed
    with caplog.at_level(logging.WARNING):
        messages = client.consume(QUEUE)
    # Then the usable items come back typed (a non-object payload is the drain's to reject)
    assert [(m.message_id, m.receipt_handle) for m in messages] == [
        ("qmsg_good", "qmsg_good"),
        ("qmsg_list", "rh_1"),
    ]
    # And each malformed one is named in the log, unacked, so it reaches the DLQ
    reasons = [r.reason for r in caplog.records if getattr(r, "action", "") == "malformed_item"]
    assert len(reasons) == 3
    assert any("message_id is missing" in r for r in reasons)
    assert any("delivery_count is not an integer" in r for r in reasons)
