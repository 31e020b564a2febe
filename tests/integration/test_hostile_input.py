"""Hostile input: message payloads and Infrai answers that a broken or malicious peer could send.

Each must end in a clear error that names what is wrong (``InfraiInvalidResponse`` from the
client; ``KeyDerivationError``, that is a ``rejected`` message, in the drain), the rest of the
batch must still be processed, and nothing may be written anywhere but the ledger and the job's
own effect table.

Payloads travel through the emulator (it takes JSON objects only, as Infrai does). Answers the
emulator would never give (wrong types, NaN, duplicate keys, invalid UTF-8, giant numbers) come
from a small stdlib server that answers whatever bytes a test sets.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from http.server import ThreadingHTTPServer
from typing import Any

import psycopg
import pytest
from drainkit import QUEUE, Harness, harness
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from psycopg import sql
from stub_servers import QuietJsonHandler, serving

from infrai_jobs.drain.loop import drain
from infrai_jobs.drain.model import DrainConfig, DrainSummary
from infrai_jobs.errors import ConsumeAnswerLost, InfraiError, InfraiInvalidResponse
from infrai_jobs.jobs.registry import Effect, JobContext, JsonValue, Payload
from infrai_jobs.ledger.postgres import array_literal
from infrai_jobs.queue.client import HttpRetryPolicy, InfraiClient
from infrai_jobs.work.ledger import PostgresLedger
from infrai_local.sandbox.embedded_db import scratch_database

HOSTILE_SETTINGS = settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
TEN_MB = 10 * 1024 * 1024

SQL_LIKE = [
    "'; DROP TABLE job_claims; --",
    "x' OR '1'='1",
    "%(keys)s",
    "%s %s %s",
    "$1",
    "'); DELETE FROM test_effects; --",
    "\\'; SELECT pg_sleep(10); --",
    "E'\\\\x00'",
    "job_claims",
    "NULL",
    # What means something inside a PostgreSQL array literal (the ledger sends its lists so)
    '{"a","b"}',
    'x", "y',
    '\\"',
    "a,b,NULL",
]
ODD_TEXT = ["\x00", "a\x00b", "\ud800", "\udfff\ud800", "\u202e", "\ufeff", "\n\r\t", "\\u0000"]

texts = st.one_of(
    st.text(max_size=30),
    st.sampled_from(SQL_LIKE + ODD_TEXT),
    st.integers(0, 50_000).map(lambda n: "x" * n),
)
numbers = st.one_of(
    st.integers(-(10**40), 10**40),
    st.floats(allow_nan=False, allow_infinity=False),
)


def nested(depth: int) -> JsonValue:
    value: JsonValue = "bottom"
    for level in range(depth):
        value = [value] if level % 2 else {"n": value}
    return value


json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), numbers, texts),
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(texts, children, max_size=4)
    ),
    max_leaves=12,
)
values = st.one_of(json_values, st.integers(1, 600).map(nested))
# "mode" steers drainkit's test jobs into failing on purpose; "job" is set on its own.
field_names = texts.filter(lambda name: name not in ("job", "mode"))


@st.composite
def hostile_payloads(draw: st.DrawFn) -> dict[str, Any]:
    job = draw(st.one_of(st.sampled_from(["test.db", "hostile.echo", "no.such.job"]), texts))
    payload: dict[str, Any] = {"job": job}
    if draw(st.booleans()):
        payload["id"] = draw(st.one_of(texts, st.integers(-(10**20), 10**20), values))
    payload.update(draw(st.dictionaries(field_names, values, max_size=4)))
    if draw(st.integers(0, 4)) == 0:
        payload["_idempotency_key"] = draw(texts)
    return payload


# --- Fixtures ---------------------------------------------------------------------------------


def echo(payload: Payload, ctx: JobContext) -> JsonValue:
    """A database job keyed by its content; it returns hostile data for the ledger to store."""
    assert ctx.db is not None
    ctx.db.execute(
        "INSERT INTO test_effects (idem_key, message_id) VALUES (%s, %s)",
        (ctx.idem_key, ctx.message_id),
    )
    return {"fields": len(payload), "id": payload.get("id")}


@pytest.fixture(scope="module")
def kit(pg_server_url: str) -> Iterator[Harness]:
    # Module-scoped (hypothesis runs many examples per test): one database for the module.
    with scratch_database(pg_server_url) as url, harness(url) as h:
        h.registry.job("hostile.echo", effect=Effect.DATABASE)(echo)
        yield h


@dataclass
class CraftedInfrai:
    """Answers each path with the bytes a test sets; records the receipt handles acked."""

    answers: dict[str, tuple[int, bytes]] = field(default_factory=dict)
    acked: list[str] = field(default_factory=list)
    consumes: list[dict[str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    url: str = ""

    def answer(self, path: str, body: bytes, status: int = 200) -> None:
        with self.lock:
            self.answers[path] = (status, body)

    def consume_answer(self, items: list[Any]) -> None:
        document = {"ok": True, "data": {"items": items, "next_cursor": None}}
        self.answer("/v1/queue/consume", json.dumps(document).encode())

    def take_acked(self) -> list[str]:
        with self.lock:
            acked, self.acked = self.acked, []
        return acked

    def consume_requests(self) -> list[dict[str, Any]]:
        """The consume requests received since the last call."""
        with self.lock:
            consumes, self.consumes = self.consumes, []
        return consumes


class _CraftedHandler(QuietJsonHandler):
    protocol_version = "HTTP/1.1"
    server: _CraftedServer

    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        crafted = self.server.crafted
        if self.path == "/v1/queue/ack":
            with crafted.lock:
                crafted.acked.append(json.loads(raw)["receipt_handle"])
            self.send_json(200, b'{"ok":true,"data":{"acked":true}}')
            return
        if self.path == "/v1/queue/consume":
            with crafted.lock:
                crafted.consumes.append(json.loads(raw))
        self.do_GET()

    def do_GET(self) -> None:
        with self.server.crafted.lock:
            status, body = self.server.crafted.answers.get(self.path, (404, b'{"ok":false}'))
        self.send_json(status, body)


class _CraftedServer(ThreadingHTTPServer):
    daemon_threads = True
    crafted: CraftedInfrai


@pytest.fixture(scope="module")
def crafted() -> Iterator[CraftedInfrai]:
    server = _CraftedServer(("127.0.0.1", 0), _CraftedHandler)
    with serving(server) as url:
        server.crafted = CraftedInfrai(url=url)
        yield server.crafted


def crafted_client(crafted: CraftedInfrai) -> InfraiClient:
    return InfraiClient(crafted.url, "test-key", retry=HttpRetryPolicy(max_attempts=1))


# --- Helpers ----------------------------------------------------------------------------------


def table_counts(database_url: str) -> Counter[str]:
    """Rows in every table of the public schema: what "nothing written elsewhere" is checked by."""
    counts: Counter[str] = Counter()
    with psycopg.connect(database_url, autocommit=True) as conn:
        tables = conn.execute(
            "SELECT table_name FROM information_schema.tables "
            "WHERE table_schema = 'public' AND table_type = 'BASE TABLE'"
        ).fetchall()
        for (table,) in tables:
            query = sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(table))
            row = conn.execute(query).fetchone()
            counts[table] = int(row[0]) if row else 0
    return counts


def written(before: Counter[str], after: Counter[str]) -> dict[str, int]:
    return {t: after[t] - before[t] for t in after if after[t] != before[t]}


@dataclass
class Outcomes:
    """The drain's per-message log lines: outcome and detail by message id."""

    records: list[logging.LogRecord] = field(default_factory=list)

    def of(self, message_id: str) -> tuple[str, str]:
        for record in self.records:
            if getattr(record, "message_id", None) == message_id and hasattr(record, "acked"):
                return str(getattr(record, "action", "")), str(getattr(record, "detail", ""))
        return "", ""

    def malformed(self) -> list[str]:
        return [
            str(getattr(r, "reason", ""))
            for r in self.records
            if getattr(r, "action", "") == "malformed_item"
        ]


class _ListHandler(logging.Handler):
    def __init__(self, sink: list[logging.LogRecord]) -> None:
        super().__init__(logging.INFO)
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        self.sink.append(record)


@contextmanager
def drain_log() -> Iterator[Outcomes]:
    outcomes = Outcomes()
    handler = _ListHandler(outcomes.records)
    package = logging.getLogger("infrai_jobs")
    previous = package.level
    package.addHandler(handler)
    package.setLevel(logging.INFO)
    try:
        yield outcomes
    finally:
        package.removeHandler(handler)
        package.setLevel(previous)


def drain_once(queue: Any, ledger: PostgresLedger, kit: Harness) -> DrainSummary:
    return drain(queue, ledger, kit.registry, DrainConfig(queue=QUEUE, max_batches=1), _time_left)


def _time_left() -> int:
    return 120_000


def good_payload() -> dict[str, Any]:
    return {"job": "test.db", "id": f"good-{uuid.uuid4().hex}"}


def item(payload: Any, **overrides: Any) -> dict[str, Any]:
    message_id = f"qmsg_{uuid.uuid4().hex[:24]}"
    base = {
        "message_id": message_id,
        "queue": QUEUE,
        "payload": payload,
        "status": "in_flight",
        "delivery_count": 1,
        "published_at": "2026-07-26T00:38:42.320888Z",
        "receipt_handle": message_id,
    }
    return {**base, **overrides}


# --- Payloads through the emulator ------------------------------------------------------------


@HOSTILE_SETTINGS
@given(payload=hostile_payloads())
def test_hostile_payloads_end_clearly_and_the_batch_goes_on(kit: Harness, payload: Any) -> None:
    # Given a hostile payload published between two ordinary jobs
    assert kit.client.stats(QUEUE).available_count == 0
    first, second = good_payload(), good_payload()
    (first_id,) = kit.publish(first)
    (hostile_id,) = kit.publish(payload)
    (second_id,) = kit.publish(second)
    before = table_counts(kit.database_url)
    # When one batch is drained
    with drain_log() as log:
        summary = kit.drain(max_batches=1)
    # Then the neighbours are done and acked, whatever the hostile message did
    assert summary.consumed == 3
    assert summary.stopped == "max_batches"
    assert log.of(first_id)[0] == "done"
    assert log.of(second_id)[0] == "done"
    # And the hostile message ended in an outcome of the contract, with a reason when refused
    outcome, detail = log.of(hostile_id)
    assert outcome in {"done", "duplicate_done", "rejected", "conflict"}, (outcome, detail)
    if outcome in ("rejected", "conflict"):
        assert len(detail) > 10
    # And only the ledger and the job's own effect table were written
    new_rows = 3 if outcome == "done" else 2
    assert written(before, table_counts(kit.database_url)) == {
        "job_claims": new_rows,
        "test_effects": new_rows,
    }


def test_ten_megabyte_payload_runs_once_beside_its_neighbours(kit: Harness) -> None:
    # Given a 10 MB body between two ordinary jobs (the emulator takes up to 11 MiB)
    big = {"job": "hostile.echo", "blob": "x" * TEN_MB}
    first_id, big_id, second_id = (
        kit.publish(good_payload())[0],
        kit.publish(big)[0],
        kit.publish(good_payload())[0],
    )
    before = table_counts(kit.database_url)
    # When one batch is drained
    with drain_log() as log:
        summary = kit.drain(max_batches=1)
    # Then all three are done and acked, and each effect happened once
    assert [log.of(m)[0] for m in (first_id, big_id, second_id)] == ["done"] * 3
    assert summary.acked == 3
    assert written(before, table_counts(kit.database_url)) == {
        "job_claims": 3,
        "test_effects": 3,
    }


def test_the_client_refuses_to_publish_what_json_cannot_carry(kit: Harness) -> None:
    # Given bodies JSON cannot represent exactly
    before = kit.client.stats(QUEUE).message_count
    # When they are published, Then the client refuses before sending anything
    with pytest.raises(ValueError, match="JSON compliant"):
        kit.client.publish(QUEUE, {"job": "test.db", "id": "nan", "x": float("nan")})
    with pytest.raises(ValueError, match="JSON compliant"):
        kit.client.publish(QUEUE, {"job": "test.db", "id": "inf", "x": float("inf")})
    assert kit.client.stats(QUEUE).message_count == before


# --- Consumed items Infrai should never send --------------------------------------------------

WRONG = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 5),
    st.integers(2**63, 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=5),
    st.sampled_from(SQL_LIKE),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
MISSING = object()


def _valid_for(name: str, value: Any) -> bool:
    """Whether the contract allows ``value`` in field ``name`` of a consumed item."""
    if name in ("message_id", "queue"):
        return isinstance(value, str) and bool(value)
    if name == "delivery_count":
        return isinstance(value, int) and not isinstance(value, bool) and value >= 1
    if name == "receipt_handle":
        return value is None or (isinstance(value, str) and bool(value))
    return False


ITEM_FIELDS = ["message_id", "delivery_count", "receipt_handle", "queue"]
# Absent, these take a default: delivery 1, the message id as handle, the consumed queue.
OPTIONAL_FIELDS = ["delivery_count", "receipt_handle", "queue"]
# Informational fields: a wrong value is ignored, never a reason to refuse the work.
LENIENT_FIELDS = ["status", "published_at"]


@HOSTILE_SETTINGS
@given(
    name=st.sampled_from(ITEM_FIELDS + LENIENT_FIELDS + ["payload"]),
    value=st.one_of(WRONG, st.just(MISSING)),
)
# Found by this test: an empty queue name was taken as a queue.
@example(name="queue", value="")
def test_a_wrong_type_in_any_item_field_spares_the_rest_of_the_batch(
    kit: Harness, crafted: CraftedInfrai, name: str, value: Any
) -> None:
    # Given a consume answer whose middle item has a wrong value (or none) in one field
    if value is not MISSING and _valid_for(name, value):
        return  # a valid value: nothing hostile to check
    first, second = item(good_payload()), item(good_payload())
    hostile = item({"job": "test.db", "id": f"h-{uuid.uuid4().hex}"})
    if value is MISSING:
        del hostile[name]
    else:
        hostile[name] = value
    crafted.consume_answer([first, hostile, second])
    crafted.take_acked()
    before = table_counts(kit.database_url)
    # When one batch is drained from it
    client = crafted_client(crafted)
    with drain_log() as log:
        summary = drain_once(client, kit.ledger, kit)
    # Then both neighbours are done and acked
    assert log.of(first["message_id"])[0] == "done"
    assert log.of(second["message_id"])[0] == "done"
    acked = crafted.take_acked()
    assert {first["receipt_handle"], second["receipt_handle"]} <= set(acked)
    # And the hostile item is skipped with a reason naming the field, refused, or (for an
    # informational field, or a missing optional one) processed as usual
    if name in LENIENT_FIELDS or (value is MISSING and name in OPTIONAL_FIELDS):
        assert summary.consumed == 3
        assert summary.done == 3
    elif name == "payload":
        assert summary.consumed == 3
        outcome, detail = log.of(str(hostile["message_id"]))
        assert outcome == "rejected"
        assert "payload" in detail or "job" in detail
    else:
        assert summary.consumed == 2
        assert len(log.malformed()) == 1
        assert name in log.malformed()[0]
    assert written(before, table_counts(kit.database_url)) == {
        "job_claims": summary.done,
        "test_effects": summary.done,
    }


def test_sql_looking_strings_in_every_item_field_are_stored_as_data(
    kit: Harness, crafted: CraftedInfrai
) -> None:
    # Given items whose every string field reads like SQL
    items = [
        item(
            {"job": "test.db", "id": f"{text}-{n}", "note": text, text: text},
            message_id=f"{text} #{n}",
            receipt_handle=f"{text} handle {n}",
            queue=text,
            status=text,
            published_at=text,
        )
        for n, text in enumerate(SQL_LIKE)
    ]
    crafted.consume_answer(items)
    crafted.take_acked()
    before = table_counts(kit.database_url)
    # When one batch is drained
    summary = drain_once(crafted_client(crafted), kit.ledger, kit)
    # Then every job ran once and its strings were stored as data, verbatim
    assert summary.done == len(SQL_LIKE)
    assert len(crafted.take_acked()) == len(SQL_LIKE)
    stored = {
        row[0]
        for row in kit.sql(
            "SELECT message_id FROM job_claims WHERE message_id = ANY(%s)",
            ([i["message_id"] for i in items],),
        )
    }
    assert stored == {i["message_id"] for i in items}
    assert written(before, table_counts(kit.database_url)) == {
        "job_claims": len(SQL_LIKE),
        "test_effects": len(SQL_LIKE),
    }


@HOSTILE_SETTINGS
@given(
    values=st.lists(
        st.one_of(
            st.none(),
            st.text(alphabet=st.characters(exclude_categories=("Cs",), exclude_characters="\x00")),
        ),
        max_size=12,
    )
)
@example(values=[None, "NULL", "", '"', "\\", '{"a",NULL}', "a,b", " padded ", '\\"\\'])
def test_the_ledgers_list_parameters_reach_postgresql_element_for_element(
    kit: Harness, values: list[str | None]
) -> None:
    # Given any list of texts and nulls, written as the ledger writes its list parameters
    literal = array_literal(values)
    # When PostgreSQL reads it as a text array, bound server-side and client-side
    (server_side,) = kit.sql("SELECT %s::text[]", (literal,))[0]
    with psycopg.connect(kit.database_url) as conn, psycopg.ClientCursor(conn) as cur:
        (client_side,) = cur.execute("SELECT %s::text[]", (literal,)).fetchone() or (None,)
    # Then both are the same list, element for element
    assert server_side == values
    assert client_side == values


def test_nan_infinity_and_big_integers_in_a_payload_are_rejected_by_name(
    kit: Harness, crafted: CraftedInfrai
) -> None:
    # Given items whose payloads hold what JSON numbers cannot carry exactly
    cases = {
        "NaN": ({"job": "hostile.echo", "x": float("nan")}, "NaN or Infinity"),
        "Infinity": ({"job": "hostile.echo", "x": float("-inf")}, "NaN or Infinity"),
        "big integer": ({"job": "hostile.echo", "x": 2**64}, "outside"),
        "big id": ({"job": "test.db", "id": 2**60}, "outside"),
        "float id": ({"job": "test.db", "id": 1.5}, "must be a non-empty string or an integer"),
    }
    items = {name: item(payload) for name, (payload, _) in cases.items()}
    neighbour = item(good_payload())
    crafted.answer(
        "/v1/queue/consume",
        json.dumps({"ok": True, "data": {"items": [*items.values(), neighbour]}}).encode(),
    )
    before = table_counts(kit.database_url)
    # When one batch is drained
    with drain_log() as log:
        summary = drain_once(crafted_client(crafted), kit.ledger, kit)
    # Then each is rejected with a message that says why, and the neighbour is done
    for name, (_, reason) in cases.items():
        outcome, detail = log.of(items[name]["message_id"])
        assert outcome == "rejected", name
        assert reason in detail, (name, detail)
    assert log.of(neighbour["message_id"])[0] == "done"
    assert summary.done == 1
    assert written(before, table_counts(kit.database_url)) == {
        "job_claims": 1,
        "test_effects": 1,
    }


def test_duplicate_json_keys_key_the_work_the_handler_sees(
    kit: Harness, crafted: CraftedInfrai
) -> None:
    # Given an item whose payload names its id twice (JSON allows it; parsers differ)
    message_id = f"qmsg_dup_{uuid.uuid4().hex[:16]}"
    first, last = f"first-{uuid.uuid4().hex}", f"last-{uuid.uuid4().hex}"
    payload = f'{{"job":"test.db","id":"{first}","id":"{last}"}}'
    raw = (
        f'{{"ok":true,"data":{{"items":[{{"message_id":"{message_id}",'
        f'"delivery_count":1,"payload":{payload}}}]}}}}'
    ).encode()
    crafted.answer("/v1/queue/consume", raw)
    # When it is drained
    summary = drain_once(crafted_client(crafted), kit.ledger, kit)
    # Then the key and the effect agree on one value (the last, as Python's parser reads it)
    assert summary.done == 1
    assert kit.row(f"test.db:{last}") is not None
    assert kit.row(f"test.db:{first}") is None
    assert kit.effects(f"test.db:{last}") == 1


def test_a_ten_megabyte_consume_answer_is_processed(kit: Harness, crafted: CraftedInfrai) -> None:
    # Given a consume answer of about 10 MB: one huge item and an ordinary one
    big = item({"job": "hostile.echo", "blob": "y" * TEN_MB})
    neighbour = item(good_payload())
    crafted.consume_answer([big, neighbour])
    crafted.take_acked()
    # When one batch is drained
    summary = drain_once(crafted_client(crafted), kit.ledger, kit)
    # Then both ran and were acked
    assert summary.done == 2
    assert sorted(crafted.take_acked()) == sorted([big["message_id"], neighbour["message_id"]])


# --- Whole answers that are not what the contract says ----------------------------------------

RAW_GARBAGE = {
    "invalid UTF-8": b'{"ok":true,"data":{"items":[{"message_id":"\xff\xfe"}]}}',
    "truncated": b'{"ok":true,"data":{"items":[',
    "not JSON at all": b"<html>502 Bad Gateway</html>",
    "a number of 5,000 digits": b'{"ok":true,"data":{"items":[],"n":' + b"7" * 5000 + b"}}",
}


@pytest.mark.parametrize("body", RAW_GARBAGE.values(), ids=RAW_GARBAGE.keys())
def test_an_unparseable_consume_answer_is_an_invalid_response_and_writes_nothing(
    kit: Harness, crafted: CraftedInfrai, body: bytes
) -> None:
    # Given Infrai answering every consume with bytes that are not the contract's JSON
    crafted.answer("/v1/queue/consume", body)
    crafted.consume_requests()
    before = table_counts(kit.database_url)
    # When a drain tries to consume, Then, after a few lost answers in a row, it fails with
    # the package's error, saying why: the answers may have spent deliveries
    with pytest.raises(ConsumeAnswerLost, match="not JSON") as raised:
        drain_once(crafted_client(crafted), kit.ledger, kit)
    assert (raised.value.call, raised.value.code) == ("consume", "INVALID_RESPONSE")
    # And each consume after the first asked for one message only
    assert [r["max_messages"] for r in crafted.consume_requests()] == [10, 1, 1]
    # And nothing was written but the queue's one-at-a-time window
    assert written(before, table_counts(kit.database_url)) == {"consume_isolation": 1}
    kit.sql("DELETE FROM consume_isolation")  # the module's other tests drain in batches


def _stats(**overrides: Any) -> dict[str, Any]:
    return {
        "queue": QUEUE,
        "message_count": 1,
        "available_count": 1,
        "in_flight_count": 0,
        "delayed_count": 0,
        "dlq_count": 0,
        "oldest_message_age_seconds": 3,
        **overrides,
    }


STATS_COUNTS = ["message_count", "available_count", "in_flight_count", "delayed_count", "dlq_count"]


@HOSTILE_SETTINGS
@given(
    name=st.sampled_from([*STATS_COUNTS, "oldest_message_age_seconds"]),
    value=st.one_of(WRONG, st.just(MISSING)),
    enveloped=st.booleans(),
)
# A missing age is refused, not read as 0: the watcher would call a lagging drain caught up.
@example(name="oldest_message_age_seconds", value=MISSING, enveloped=True)
def test_a_wrong_type_in_any_stats_field_is_an_invalid_response_naming_it(
    crafted: CraftedInfrai, name: str, value: Any, enveloped: bool
) -> None:
    # Given a stats answer with a wrong value (or none) in one field, with or without envelope
    is_count = name in STATS_COUNTS
    if value is not MISSING and not isinstance(value, bool):
        if is_count and isinstance(value, int) and value >= 0:
            return  # a valid count
        if not is_count and isinstance(value, int | float) and not value < 0:
            return  # a valid age (non-finite ones: see the test below)
    data = _stats()
    if value is MISSING:
        del data[name]
    else:
        data[name] = value
    document = {"ok": True, "data": data} if enveloped else data
    crafted.answer(f"/v1/queue/stats/{QUEUE}", json.dumps(document).encode())
    # When stats are read, Then the error names the field
    with pytest.raises(InfraiInvalidResponse, match=name):
        crafted_client(crafted).stats(QUEUE)


@pytest.mark.parametrize("age", ["NaN", "Infinity"])
def test_a_non_finite_message_age_in_stats_is_an_invalid_response(
    crafted: CraftedInfrai, age: str
) -> None:
    # Given a stats answer whose oldest message age is not a finite number
    body = json.dumps({"ok": True, "data": _stats()}).replace(
        '"oldest_message_age_seconds": 3', f'"oldest_message_age_seconds": {age}'
    )
    crafted.answer(f"/v1/queue/stats/{QUEUE}", body.encode())
    # When stats are read, Then the answer is refused, naming the field
    with pytest.raises(InfraiInvalidResponse, match="oldest_message_age_seconds"):
        crafted_client(crafted).stats(QUEUE)


@HOSTILE_SETTINGS
@given(value=st.one_of(WRONG, st.just(MISSING)), enveloped=st.booleans())
def test_a_publish_answer_without_a_message_id_string_is_an_invalid_response(
    crafted: CraftedInfrai, value: Any, enveloped: bool
) -> None:
    # Given a publish answer whose message_id is missing or not a non-empty string
    if isinstance(value, str) and value:
        return
    data = {} if value is MISSING else {"message_id": value}
    document = {"ok": True, "data": data} if enveloped else data
    crafted.answer("/v1/queue/publish", json.dumps(document).encode())
    # When a message is published, Then the client says the answer lacks the id
    with pytest.raises(InfraiInvalidResponse, match="message_id"):
        crafted_client(crafted).publish(QUEUE, {"job": "test.db", "id": "p"})


def _is_price_text(text: str) -> bool:
    try:
        price = Decimal(text)
    except InvalidOperation:
        return False
    return price.is_finite() and price >= 0


def _discovery(price: Any = "0.00002", billing: Any = MISSING, caps: Any = MISSING) -> Any:
    bill = {"unit": "message", "price_usd": price} if billing is MISSING else billing
    capabilities = [{"id": "queue.publish", "billing": bill}] if caps is MISSING else caps
    return {"capabilities": capabilities}


@HOSTILE_SETTINGS
@given(
    where=st.sampled_from(["capabilities", "billing", "price", "answer"]),
    value=st.one_of(WRONG, st.sampled_from(["NaN", "-1", "1e999", "free"])),
)
def test_a_wrong_type_anywhere_in_discovery_is_an_invalid_response(
    crafted: CraftedInfrai, where: str, value: Any
) -> None:
    # Given a discovery answer with a wrong value at one place
    if where == "capabilities":
        if isinstance(value, list):
            return  # a list (of nothing useful) is reported as "no capability" below
        document: Any = _discovery(caps=value)
    elif where == "billing":
        if isinstance(value, dict):
            value = {"unit": "message"}  # an object without any price field
        document = _discovery(billing=value)
    elif where == "price":
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if number and math.isfinite(value) and value >= 0:
            return  # a valid price
        if isinstance(value, str) and _is_price_text(value):
            return  # a price as text ("0.00002" is how discovery writes it): valid too
        document = _discovery(price=value)
    else:
        if isinstance(value, dict):
            return  # an object: covered by the other places
        document = value
    crafted.answer("/v1/discovery", json.dumps({"ok": True, "data": document}).encode())
    # When today's price is read, Then the client refuses the answer with a reason
    with pytest.raises(InfraiInvalidResponse) as raised:
        crafted_client(crafted).publish_price()
    assert raised.value.call == "discovery"
    assert len(raised.value.message) > 10


@pytest.mark.parametrize(
    ("document", "expected"),
    [
        ({"ok": True, "data": []}, "items"),
        ({"ok": True, "data": {"items": {"0": {}}}}, "items"),
        ({"ok": True, "data": "items"}, "items"),
        ({"ok": True}, "items"),
    ],
)
def test_a_consume_answer_without_an_items_list_is_an_invalid_response(
    crafted: CraftedInfrai, document: Any, expected: str
) -> None:
    # Given a consume answer whose data holds no list of items
    crafted.answer("/v1/queue/consume", json.dumps(document).encode())
    # When consumed, Then the client says so: whatever it served is lost
    with pytest.raises(ConsumeAnswerLost, match=expected) as raised:
        crafted_client(crafted).consume(QUEUE)
    assert (raised.value.code, raised.value.max_messages) == ("INVALID_RESPONSE", 10)


def test_an_envelope_with_a_non_boolean_ok_is_refused_as_an_error(crafted: CraftedInfrai) -> None:
    # Given a 200 answer whose envelope says ok "yes" (not true)
    crafted.answer(f"/v1/queue/stats/{QUEUE}", json.dumps({"ok": "yes", "data": _stats()}).encode())
    # When stats are read, Then the answer is not trusted
    with pytest.raises(InfraiError) as raised:
        crafted_client(crafted).stats(QUEUE)
    assert raised.value.status == 200


# --- Findings: each fails today; the reason says what to fix ----------------------------------


def test_an_answer_nested_deeper_than_the_parser_allows_is_an_invalid_response(
    crafted: CraftedInfrai,
) -> None:
    # Given a consume answer whose one item's payload is nested 5,000 levels deep
    deep = b"[" * 5000 + b"]" * 5000
    crafted.answer(
        "/v1/queue/consume",
        b'{"ok":true,"data":{"items":[{"message_id":"qmsg_deep","payload":' + deep + b"}]}}",
    )
    # When consumed, Then the client answers with its own error, naming the call and the ids
    # the answer still shows
    with pytest.raises(ConsumeAnswerLost, match="nested too deeply") as raised:
        crafted_client(crafted).consume(QUEUE)
    assert (raised.value.call, raised.value.message_ids) == ("consume", ("qmsg_deep",))


STORABLE_IDS = {"NUL byte": "qmsg_a\x00b", "lone surrogate": "qmsg_\ud800"}


@pytest.mark.parametrize("message_id", STORABLE_IDS.values(), ids=STORABLE_IDS.keys())
def test_a_message_id_postgres_cannot_store_spares_the_rest_of_the_batch(
    kit: Harness, crafted: CraftedInfrai, message_id: str
) -> None:
    # Given a consume answer whose middle item's id PostgreSQL cannot store as text
    first, second = item(good_payload()), item(good_payload())
    hostile = item(good_payload(), message_id=message_id, receipt_handle=None)
    crafted.consume_answer([first, hostile, second])
    # When one batch is drained
    ledger = PostgresLedger(kit.database_url)
    try:
        summary = drain_once(crafted_client(crafted), ledger, kit)
    finally:
        ledger.close()
    # Then the neighbours are done, and the hostile item is skipped or refused, not the batch
    assert summary.done == 2
    assert summary.stopped == "max_batches"
