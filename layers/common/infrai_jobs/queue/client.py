"""The Infrai queue client: one keep-alive pool, explicit timeouts, careful retries (rules:
docs/infrai-api.md, "What the client does with it"). Not retried: a consume whose answer is lost
after it was sent (``ConsumeAnswerLost``: it may have been served, spending a delivery of each
message unseen), a TLS failure (``UntrustedServer``), and publish unless its policy says so (Infrai
does not dedupe producers; only the drain's keys make a duplicate safe). The API key never appears
in a repr, log line or exception message."""

from __future__ import annotations

import json
import logging
import random
import re
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Unpack
from urllib.parse import quote

from infrai_jobs.config.rotation import fetch_again
from infrai_jobs.config.settings import DEFAULT_BASE_URL, check_web_url
from infrai_jobs.errors import (
    AnswerTooLarge,
    ConfigurationError,
    ConsumeAnswerLost,
    InfraiError,
    InfraiInvalidResponse,
    InfraiUnavailable,
    QueueMessageNotFound,
    TlsVerificationFailed,
    TransportError,
    UntrustedServer,
)
from infrai_jobs.queue.models import (
    Pending,
    PublishPrice,
    QueueMessage,
    QueueStats,
    parse_publish_price,
)
from infrai_jobs.queue.ports import PublishOptions
from infrai_jobs.queue.transport import HttpPool, PoolOptions
from infrai_jobs.queue_contract import CONSUME_CAP

logger = logging.getLogger(__name__)

USER_AGENT = "infrai-jobs/0.1"
# Built once: json.dumps with any option builds a new encoder per call (1.5 µs, every ack).
_BODY_JSON = json.JSONEncoder(separators=(",", ":"), allow_nan=False, ensure_ascii=False)
_ASCII_BODY_JSON = json.JSONEncoder(separators=(",", ":"), allow_nan=False)
_HEADERS = {"Accept": "application/json", "User-Agent": USER_AGENT}
_MESSAGE_ID = re.compile(rb'"message_id"\s*:\s*"([A-Za-z0-9_-]{1,80})"')


@dataclass(frozen=True, slots=True)
class HttpRetryPolicy:
    """Which of the client's calls are retried, and how they back off: full jitter, capped,
    bounded in attempts. A publish only with ``publish`` (INFRAI_PUBLISH_RETRIES), or when asked."""

    publish: bool = False
    max_attempts: int = 4
    base_delay: float = 0.1
    max_delay: float = 5.0
    # A longer Retry-After fails the call instead (as does one past ``retries_within``'s time).
    max_retry_after: float = 30.0

    def backoff(self, attempt: int) -> float:
        return random.uniform(0, min(self.max_delay, self.base_delay * (2**attempt)))


class InfraiClient:
    """Talks to Infrai's queue API (``/v1/queue/*`` and ``/v1/discovery``)."""

    def __init__(
        self,
        base_url: str,
        api_key: str,
        *,
        pool: PoolOptions | None = None,
        retry: HttpRetryPolicy | None = None,
        sleep: Callable[[float], None] = time.sleep,
        refresh_api_key: Callable[[], str] | None = None,
        allow_plain_http: bool = False,
    ) -> None:
        # The settings' rule again, for a client built without them: the key is in every request.
        check_web_url(
            "INFRAI_BASE_URL", base_url, allow_plain_http=allow_plain_http, example=DEFAULT_BASE_URL
        )
        _check_api_key(api_key)
        self._base_url = base_url.rstrip("/")
        self._api_key = api_key
        # Fetches the key again (bypassing the secret cache) after a 401: a rotated key.
        self._refresh_api_key = refresh_api_key
        self._retry = retry or HttpRetryPolicy()
        self._sleep = sleep
        # Set by retries_within() for the length of one invocation; None: no deadline.
        self._time_left_ms: Callable[[], int] | None = None
        options = pool or PoolOptions()
        # The longest one attempt may take, which a retry must still fit (``retries_within``).
        self._attempt_at_most = options.connect_timeout + options.read_timeout
        try:
            self._pool = HttpPool(base_url, options)
        except ValueError as exc:
            raise ConfigurationError(f"INFRAI_BASE_URL: {exc}") from None

    def __repr__(self) -> str:
        return f"InfraiClient(base_url={self._base_url!r}, api_key=<redacted>)"

    @property
    def base_url(self) -> str:
        return self._base_url

    def close(self) -> None:
        self._pool.close()

    @contextmanager
    def retries_within(self, time_left_ms: Callable[[], int]) -> Iterator[None]:
        """Within the block, a call is retried only if the back-off and one more attempt fit in
        ``time_left_ms()``, so a Lambda fails with Infrai's error instead of being killed asleep
        by its timeout. One invocation at a time: every thread using the client shares it."""
        self._time_left_ms = time_left_ms
        try:
            yield
        finally:
            self._time_left_ms = None

    def publish(
        self, queue: str, body: Mapping[str, Any], **options: Unpack[PublishOptions]
    ) -> str:
        """Publish one message, returning its id; retried if ``retry`` (else as the policy says)."""
        if unknown := options.keys() - PublishOptions.__optional_keys__:
            raise TypeError(f"publish() got unknown options: {', '.join(sorted(unknown))}")
        request: dict[str, Any] = {"queue": queue, "body": body}
        if (delay_seconds := options.get("delay_seconds")) is not None:
            request["delay_seconds"] = delay_seconds
        retry = options.get("retry")
        retryable = self._retry.publish if retry is None else retry
        data = self._call(QueueCall("publish", "POST", "/v1/queue/publish", request), retryable)
        message_id = data.get("message_id") if isinstance(data, Mapping) else None
        if not isinstance(message_id, str) or not message_id:
            raise InfraiInvalidResponse(
                "INVALID_RESPONSE", "publish answered without a message_id", 0, call="publish"
            )
        return message_id

    def consume(self, queue: str, max_messages: int = CONSUME_CAP) -> list[QueueMessage]:
        """Receive up to ``max_messages`` (capped at 10), each spending one of its deliveries.
        A malformed item is logged and left unacked, to be dead-lettered after three."""
        return self.send_consume(queue, max_messages).wait()

    def send_consume(
        self, queue: str, max_messages: int = CONSUME_CAP
    ) -> Pending[list[QueueMessage]]:
        """``consume``, sent now and answered by ``Pending.wait()``."""
        if isinstance(max_messages, bool) or not isinstance(max_messages, int) or max_messages < 1:
            raise ValueError(f"max_messages must be an integer >= 1, got {max_messages!r}")
        served = min(max_messages, CONSUME_CAP)
        body = {"queue": queue, "max_messages": served}
        request = QueueCall("consume", "POST", "/v1/queue/consume", body, (queue, served))
        first = self._send(request)

        def finish() -> list[QueueMessage]:
            return _messages(self._call(request, True, first), queue, served)

        return Pending(finish, lambda: _messages(first.answer(), queue, served))

    def ack(self, queue: str, receipt_handle: str) -> None:
        """Acknowledge a delivery. Raises ``QueueMessageNotFound`` when the handle is gone."""
        self.send_ack(queue, receipt_handle).wait()

    def send_ack(self, queue: str, receipt_handle: str) -> Pending[None]:
        """``ack``, sent now and answered by ``Pending.wait()``, each on its own connection."""
        body = {"queue": queue, "receipt_handle": receipt_handle}
        request = QueueCall("ack", "POST", "/v1/queue/ack", body)
        first = self._send(request)

        def finish() -> None:
            self._call(request, True, first)

        return Pending(finish, first.answer)

    def stats(self, queue: str) -> QueueStats:
        path = "/v1/queue/stats/" + quote(queue, safe="")
        return QueueStats.from_api(self._call(QueueCall("stats", "GET", path), True), queue=queue)

    def publish_price(self) -> PublishPrice:
        """Today's publish price from discovery (only publishing is metered)."""
        return parse_publish_price(self._call(QueueCall("discovery", "GET", "/v1/discovery"), True))

    def _call(self, request: QueueCall, retryable: bool, first: _Attempt | None = None) -> Any:
        """Make a call with its retries. ``first``, when given, is a request already sent: its
        answer is the first attempt's; the retries send afresh."""
        sent: list[_Attempt] = []
        try:
            return self._with_retries(request, retryable, first, sent)
        except InfraiError as exc:
            if exc.status != 401:
                raise
            # Requests sent together before a rotation all carry the old key: the first 401
            # read fetches the new one, the others just use it.
            if sent[-1].key == self._api_key and not self._take_refreshed_key():
                raise
        # A 401 is answered before anything is applied, so one more try is safe for every call.
        return self._with_retries(request, retryable, None, [])

    def _take_refreshed_key(self) -> bool:
        if (fresh := fetch_again(self._refresh_api_key, self._api_key, "API key")) is None:
            return False
        _check_api_key(fresh)
        logger.warning(
            "Infrai answered 401; retrying once with the API key fetched again",
            extra={"action": "secret_refresh"},
        )
        self._api_key = fresh
        return True

    def _with_retries(
        self, request: QueueCall, retry: bool, first: _Attempt | None, sent: list[_Attempt]
    ) -> Any:
        attempts = self._retry.max_attempts if retry else 1
        for attempt in range(attempts):
            current = first if attempt == 0 and first is not None else self._send(request)
            sent.append(current)
            try:
                return current.answer()
            except ConsumeAnswerLost:
                # Never repeated: the lost answer may have served messages, and a repeat would
                # spend a delivery of the next ones too.
                raise
            except InfraiUnavailable as exc:
                retry_after = exc.retry_after
                out_of_time = retry_after is not None and retry_after > self._retry.max_retry_after
                delay = self._retry.backoff(attempt)
                if retry_after is not None:
                    delay = retry_after + random.uniform(0, self._retry.base_delay)
                if attempt + 1 >= attempts or out_of_time or not self._retry_fits(delay):
                    raise
                # WARNING: a run of retries is how an outage looks before anything else fails.
                logger.warning(
                    "retrying an Infrai call",
                    extra={
                        "action": "http_retry",
                        "call": request.call,
                        "queue": request.body.get("queue") if request.body else None,
                        "code": exc.code,
                        "attempt": attempt + 1,
                        "delay_seconds": round(delay, 3),
                    },
                )
                self._sleep(delay)
        raise AssertionError("unreachable: the loop returns or raises")  # pragma: no cover

    def _retry_fits(self, delay: float) -> bool:
        if (time_left_ms := self._time_left_ms) is None:
            return True
        return (delay + self._attempt_at_most) * 1000 <= time_left_ms()

    def _send(self, request: QueueCall) -> _Attempt:
        """Send one attempt; its ``answer()`` returns the call's data or raises (a request that
        could not be sent, as a retryable connection error). A consume's answer then cut off,
        too large, unreadable or a 5xx raises ``ConsumeAnswerLost``, as the queue may have served
        it (a 429 was not, and retries)."""
        call, body, spends = request.call, request.body, request.spends
        key = self._api_key
        headers = {"Authorization": f"Bearer {key}", **_HEADERS}
        encoded: bytes | None = None
        if body is not None:
            headers["Content-Type"] = "application/json"
            encoded = _encode_body(body)
        try:
            exchange = self._pool.send(request.method, request.path, headers, encoded)
        except TransportError as exc:
            # A certificate that does not verify is final: a retry meets the same one.
            failure: InfraiError = (
                UntrustedServer("TLS_VERIFICATION_FAILED", str(exc), 0, call=call)
                if isinstance(exc, TlsVerificationFailed)
                else InfraiUnavailable("CONNECTION_ERROR", str(exc), 0, call=call)
            )
            failure.__cause__ = exc  # as "raise ... from exc" would have chained it

            def failed() -> Any:
                raise failure

            return _Attempt(key, failed)

        def answer() -> Any:
            try:
                response = self._pool.receive(exchange)
            except TransportError as exc:
                if spends is None:
                    raise InfraiUnavailable("CONNECTION_ERROR", str(exc), 0, call=call) from exc
                if isinstance(exc, AnswerTooLarge):
                    raise _lost(spends, "ANSWER_TOO_LARGE", str(exc), 0, size=exc.size) from exc
                raise _lost(spends, "CONNECTION_ERROR", str(exc), 0) from exc
            raw = response.body
            try:
                return _unwrap(response.status, raw, response.headers.get("retry-after"), call)
            except (InfraiUnavailable, InfraiInvalidResponse) as exc:
                if spends is None or exc.status == 429:
                    raise
                # The message ids the answer still shows, at most one batch of them.
                found = (m.group(1).decode("ascii") for m in _MESSAGE_ID.finditer(raw))
                ids = tuple(dict.fromkeys(found))[:CONSUME_CAP]
                raise _lost(
                    spends, exc.code, exc.message, exc.status, size=len(raw), message_ids=ids
                ) from exc

        return _Attempt(key, answer)


class QueueCall(NamedTuple):
    """One call, as each of its attempts sends it. ``spends`` (queue, messages asked for) marks
    a consume, whose lost answer may have spent a delivery of each message it served."""

    call: str
    method: str
    path: str
    body: Mapping[str, Any] | None = None
    spends: tuple[str, int] | None = None


def _encode_body(body: Mapping[str, Any]) -> bytes:
    """UTF-8, so non-ASCII text is not tripled by ``\\u`` escapes; escaped only for text UTF-8
    cannot carry (a lone surrogate)."""
    try:
        return _BODY_JSON.encode(body).encode("utf-8")
    except UnicodeEncodeError:
        return _ASCII_BODY_JSON.encode(body).encode("ascii")


def _check_api_key(key: str) -> None:
    if not key:
        raise ConfigurationError("INFRAI_API_KEY is empty; set it to your Infrai API key")
    # It travels in a header: a line break would split the request. Never print the key.
    if any(c in key for c in "\r\n\x00") or not key.isascii():
        raise ConfigurationError(
            "INFRAI_API_KEY contains a line break, NUL or non-ASCII character; "
            "check how the secret was stored"
        )


@dataclass(frozen=True, slots=True)
class _Attempt:
    """One request sent: the API key it carried and how to read its answer."""

    key: str = field(repr=False)
    answer: Callable[[], Any]


def _lost(
    spends: tuple[str, int], code: str, message: str, status: int, **found: Any
) -> ConsumeAnswerLost:
    """``found``: the answer's ``size`` and the ``message_ids`` it still shows, when known."""
    queue, served = spends
    return ConsumeAnswerLost(code, message, status, queue=queue, max_messages=served, **found)


def _messages(data: Any, queue: str, served: int) -> list[QueueMessage]:
    items = data.get("items") if isinstance(data, Mapping) else None
    if not isinstance(items, list):
        raise _lost(
            (queue, served), "INVALID_RESPONSE", "consume answered without an items list", 200
        )
    messages: list[QueueMessage] = []
    for item in items:
        try:
            messages.append(QueueMessage.from_api(item, queue=queue))
        except InfraiInvalidResponse as exc:
            logger.warning(
                "skipping a malformed consumed item",
                extra={"action": "malformed_item", "queue": queue, "reason": exc.message},
            )
    return messages


def _unwrap(status: int, raw: bytes, retry_after_header: str | None, call: str) -> Any:
    """Turn a response into its data, accepting bodies with and without the envelope."""

    def invalid(what: str) -> InfraiInvalidResponse:
        return InfraiInvalidResponse(
            "INVALID_RESPONSE", f"answered HTTP {status} {what}", status, call=call
        )

    success = 200 <= status < 300
    try:
        document = json.loads(raw) if raw else None
    except RecursionError:
        raise invalid("with JSON nested too deeply") from None
    except ValueError:
        document = None
        if success:
            raise invalid("with a body that is not JSON") from None
    code, message = f"HTTP_{status}", "no error envelope in the answer"
    if isinstance(document, Mapping) and "ok" in document:
        if document["ok"] is True and success:
            return document.get("data")
        error = document.get("error")
        if isinstance(error, Mapping):
            code = str(error.get("code") or code)
            message = str(error.get("message") or "")
        elif success:
            # Neither ok nor an error ("ok": "yes", "ok": false alone): outside the contract.
            raise invalid(f"with an envelope whose ok is {document['ok']!r:.20}")
    elif success:
        return document
    if status == 429 or status >= 500:
        unavailable = InfraiUnavailable(code, message, status, call=call)
        unavailable.retry_after = _parse_retry_after(retry_after_header)
        raise unavailable
    if code == "QUEUE_MESSAGE_NOT_FOUND":
        raise QueueMessageNotFound(code, message, status, call=call)
    raise InfraiError(code, message, status, call=call)


def _parse_retry_after(value: str | None) -> float | None:
    # Infrai does not use the HTTP-date form: anything but seconds falls back to back-off.
    try:
        seconds = float(value or "-1")
    except ValueError:
        return None
    return seconds if seconds >= 0 else None
