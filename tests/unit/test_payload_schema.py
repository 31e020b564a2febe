"""Payload schemas: JSON types as the drain checks them, the example jobs' declarations, and
every declaration refused at registration."""

from __future__ import annotations

import json
from typing import Any

import json_strategies
import pytest
from fixture_jobs import build_registry
from hypothesis import given
from hypothesis import strategies as st
from job_modes import noop
from json_strategies import SAFE_INT
from notes_example import NOTES_PAYLOAD

from infrai_jobs.errors import ConfigurationError, InvalidPayload, KeyDerivationError
from infrai_jobs.jobs.keys import PRODUCER_KEY_FIELD as PRODUCER_KEY
from infrai_jobs.jobs.payload_schema import Field, PayloadSchema, json_type_of
from infrai_jobs.jobs.registry import (
    Effect,
    JobDefinition,
    JobRegistry,
)


def registry_with(**declaration: Any) -> JobRegistry:
    """A registry holding one job, ``test.job``, declared with ``declaration``."""
    registry = JobRegistry()
    registry.job("test.job", effect=Effect.DATABASE, **declaration)(noop)
    return registry


# --- Strategies -------------------------------------------------------------------------------

json_values = json_strategies.json_values(text_size=8, key_size=5, leaves=6)
declarable_types = st.sampled_from([str, int, float, bool, dict, list])
# The JSON type names each declared type accepts ("number" takes integers too).
ACCEPTS = {
    str: {"string"},
    int: {"integer"},
    float: {"integer", "number"},
    bool: {"boolean"},
    dict: {"object"},
    list: {"array"},
}


def json_type_after_the_wire(value: object) -> str:
    """The value's JSON type as a consumer sees it: after encoding and decoding, by the JSON
    text's own grammar rather than by the code under test."""
    decoded = json.loads(json.dumps(value))
    kinds = {bool: "boolean", int: "integer", float: "number", str: "string"}
    kinds.update({list: "array", dict: "object", type(None): "null"})
    return kinds[type(decoded)]


# --- Types ------------------------------------------------------------------------------------


@given(declared=declarable_types, value=json_values)
def test_a_present_field_passes_exactly_when_its_json_type_is_the_declared_one(
    declared: type[object], value: object
) -> None:
    # Given a job whose one required field is declared with a JSON type
    registry = registry_with(fields={"f": declared})
    payload = {"job": "test.job", "f": value}
    seen = json_type_after_the_wire(value)
    # When a payload carrying any JSON value there is derived
    # Then it passes if and only if that value is of the declared type (null and "" are missing)
    if seen == "null" or value == "":
        with pytest.raises(InvalidPayload, match=r"missing field\(s\): f$"):
            registry.derive(payload)
    elif seen in ACCEPTS[declared]:
        assert registry.derive(payload).definition.name == "test.job"
    else:
        with pytest.raises(InvalidPayload) as refused:
            registry.derive(payload)
        assert str(refused.value).endswith(f"field 'f' must be {_article(declared)}, got {seen}")


def _article(declared: type[object]) -> str:
    return {
        str: "a string",
        int: "an integer",
        float: "a number",
        bool: "a boolean",
        dict: "an object",
        list: "an array",
    }[declared]


def test_the_issue_example_names_the_job_the_field_and_both_types() -> None:
    registry = build_registry()
    with pytest.raises(InvalidPayload) as refused:
        registry.derive({**NOTES_PAYLOAD, "amount_cents": "4900"})
    assert str(refused.value) == (
        "job 'invoice.finalize': field 'amount_cents' must be an integer, got string"
    )


@pytest.mark.parametrize(
    ("declared", "value", "got"),
    [
        (int, True, "boolean"),
        (int, False, "boolean"),
        (float, True, "boolean"),
        (int, 4900.0, "number"),
        (int, 49.5, "number"),
        (str, 4900, "integer"),
        (dict, [1], "array"),
        (list, {"a": 1}, "object"),
        (bool, 1, "integer"),
    ],
)
def test_booleans_are_not_numbers_and_numbers_with_a_fraction_are_not_integers(
    declared: type[object], value: object, got: str
) -> None:
    registry = registry_with(fields={"f": declared})
    with pytest.raises(InvalidPayload, match=f"got {got}$"):
        registry.derive({"job": "test.job", "f": value})


def test_a_number_field_takes_integers_and_a_union_takes_either_type() -> None:
    registry = registry_with(fields={"ratio": float, "id": (str, int)})
    registry.derive({"job": "test.job", "ratio": 3, "id": 7})
    registry.derive({"job": "test.job", "ratio": 0.5, "id": "inv_7"})
    with pytest.raises(InvalidPayload, match="'id' must be a string or an integer, got boolean"):
        registry.derive({"job": "test.job", "ratio": 1, "id": True})


def test_every_mistyped_field_is_named_in_one_line() -> None:
    registry = registry_with(fields={"a": int, "b": str, "c": bool})
    with pytest.raises(InvalidPayload) as refused:
        registry.derive({"job": "test.job", "a": "1", "b": "fine", "c": "yes"})
    message = str(refused.value)
    assert message == (
        "job 'test.job': field 'a' must be an integer, got string; "
        "field 'c' must be a boolean, got string"
    )
    assert "\n" not in message


def test_missing_fields_are_reported_before_types() -> None:
    registry = registry_with(fields={"a": int, "b": str})
    with pytest.raises(InvalidPayload, match=r"^job 'test.job' is missing field\(s\): b$"):
        registry.derive({"job": "test.job", "a": "not checked yet"})


# --- Required and optional --------------------------------------------------------------------


def test_an_optional_field_may_be_absent_or_null_but_not_of_another_type() -> None:
    registry = registry_with(fields={"id": str, "note": Field(str, required=False)})
    registry.derive({"job": "test.job", "id": "a"})
    registry.derive({"job": "test.job", "id": "a", "note": None})
    registry.derive({"job": "test.job", "id": "a", "note": ""})
    with pytest.raises(InvalidPayload, match="field 'note' must be a string, got integer"):
        registry.derive({"job": "test.job", "id": "a", "note": 5})


def test_the_old_keywords_keep_working_and_identity_fields_are_required() -> None:
    # Given a job declared only with identity= and required=, as before schemas existed
    registry = registry_with(identity=("id",), required=("email",))
    # Then any type is accepted, but a missing, null or empty field is refused as before
    assert registry.derive({"job": "test.job", "id": 7, "email": ["x"]}).idem_key == "test.job:7"
    for missing in ({"email": "e"}, {"id": None, "email": "e"}, {"id": "", "email": "e"}):
        with pytest.raises(InvalidPayload, match=r"missing field\(s\): id$"):
            registry.derive({"job": "test.job", **missing})


def test_a_definition_built_by_hand_is_checked_by_its_identity_and_required_names() -> None:
    # Given a JobDefinition constructed directly, without a schema, as code before schemas did
    registry = JobRegistry()
    registry.register(
        JobDefinition("test.job", Effect.EXTERNAL, noop, identity=("id",), required=("to",))
    )
    # Then both names are required, in that order
    with pytest.raises(InvalidPayload, match=r"missing field\(s\): id, to$"):
        registry.derive({"job": "test.job"})
    assert registry.derive({"job": "test.job", "id": "a", "to": "b"}).idem_key == "test.job:a"


def test_an_identity_field_left_out_of_fields_is_still_required() -> None:
    registry = registry_with(identity=("id",), fields={"amount": int})
    definition = registry.get("test.job")
    assert definition is not None
    assert definition.required == ("id", "amount")
    with pytest.raises(InvalidPayload, match=r"missing field\(s\): id$"):
        registry.derive({"job": "test.job", "amount": 1})


@given(
    extra=st.dictionaries(
        st.text(min_size=1, max_size=8).filter(lambda n: n not in {"job", "id", PRODUCER_KEY}),
        json_values,
        max_size=4,
    )
)
def test_undeclared_and_envelope_fields_are_never_checked_and_never_change_the_key(
    extra: dict[str, object],
) -> None:
    # Given a job with a declared schema, and a payload that matches it
    registry = registry_with(identity=("id",), fields={"id": str})
    plain = {"job": "test.job", "id": "a"}
    # When the producer adds fields the schema does not know (envelope ones included)
    derived = registry.derive({**plain, **extra})
    # Then the payload still passes, keyed as without them
    assert derived.idem_key == "test.job:a"


@given(
    invoice_id=st.text(min_size=1, max_size=10).filter(lambda t: t.isprintable())
    | st.integers(min_value=0, max_value=SAFE_INT),
    amount=st.integers(min_value=-SAFE_INT, max_value=SAFE_INT),
)
def test_declaring_a_schema_changes_no_key_and_no_fingerprint(
    invoice_id: str | int, amount: int
) -> None:
    # Given the same job declared the old way and with its schema
    old = registry_with(identity=("invoice_id",), required=("amount_cents",))
    new = registry_with(
        identity=("invoice_id",), fields={"invoice_id": (str, int), "amount_cents": int}
    )
    payload = {"job": "test.job", "invoice_id": invoice_id, "amount_cents": amount}
    # Then a payload both accept gets the same key and fingerprint: ledger rows keep matching
    before, after = old.derive(payload), new.derive(payload)
    assert (after.idem_key, after.fingerprint) == (before.idem_key, before.fingerprint)


# --- Declarations refused at registration -----------------------------------------------------


@pytest.mark.parametrize(
    ("declaration", "message"),
    [
        ({"fields": {"_trace": str}}, r"field '_trace' cannot be declared"),
        ({"fields": {"job": str}}, r"field 'job' cannot be declared"),
        ({"fields": {"": str}}, r"non-empty strings"),
        ({"fields": {"f": "string"}}, r"field 'f' has type 'string'"),
        ({"fields": {"f": None}}, r"field 'f' has type None"),
        ({"fields": {"f": object}}, r"field 'f' has type"),
        ({"fields": {"f": list[int]}}, r"field 'f' has type list\[int\]"),
        ({"fields": {"f": ()}}, r"field 'f' has type \(\)"),
        ({"fields": {"f": Field(int, required="yes")}}, r"required must be"),  # type: ignore[arg-type]
        ({"fields": ["f"]}, r"fields must map field names to types"),
        ({"identity": ("id",), "fields": {"id": float}}, r"identity field 'id' is declared a"),
        ({"identity": ("id",), "fields": {"id": (str, dict)}}, r"declare it str, int"),
        (
            {"identity": ("id",), "fields": {"id": Field(str, required=False)}},
            r"field 'id' is declared optional",
        ),
        (
            {"required": ("email",), "fields": {"email": Field(str, required=False)}},
            r"field 'email' is declared optional",
        ),
    ],
)
def test_a_schema_that_cannot_be_checked_is_refused_when_registered(
    declaration: dict[str, Any], message: str
) -> None:
    # Given an empty registry
    registry = JobRegistry()
    # When a job is registered with a schema no payload could be checked against as meant
    # Then registration fails at start-up, naming the field, and nothing is registered
    with pytest.raises(ConfigurationError, match=message):
        registry.job("test.job", effect=Effect.DATABASE, **declaration)(noop)
    assert len(registry) == 0


# --- The example jobs -------------------------------------------------------------------------


def test_every_example_job_types_each_of_its_identity_fields() -> None:
    for definition in build_registry():
        typed = {f.name for f in definition.schema.fields if f.accepted is not None}
        assert set(definition.identity) <= typed, definition.name
        assert set(definition.required) <= typed, definition.name


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ({"job": "invoice.finalize", "invoice_id": "inv_1", "amount_cents": True}, "got boolean"),
        ({"job": "invoice.finalize", "invoice_id": {"id": 1}, "amount_cents": 1}, "got object"),
        ({"job": "receipt.send", "invoice_id": "inv_1", "email": ["a@example.com"]}, "got array"),
        ({"job": "digest.build", "tenant_id": 42, "period": "2026-07"}, "'tenant_id' must be a"),
        ({"job": "digest.build", "tenant_id": "t", "period": None}, r"missing field\(s\): period"),
    ],
)
def test_the_example_jobs_refuse_mistyped_payloads(payload: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidPayload, match=message):
        build_registry().derive(payload)


def test_an_integer_invoice_id_keeps_its_key() -> None:
    registry = build_registry()
    derived = registry.derive({"job": "invoice.finalize", "invoice_id": 8812, "amount_cents": 1})
    assert derived.idem_key == "invoice.finalize:8812"


def test_an_unknown_job_close_to_a_known_one_is_named() -> None:
    registry = build_registry()
    with pytest.raises(KeyDerivationError, match=r"did you mean 'invoice\.finalize'\?"):
        registry.derive({**NOTES_PAYLOAD, "job": "invoice.finalise"})


def test_the_schema_names_python_values_by_their_json_types() -> None:
    assert [json_type_of(v) for v in (None, True, 1, 1.5, "", {}, [], ())] == [
        "null",
        "boolean",
        "integer",
        "number",
        "string",
        "object",
        "array",
        "array",
    ]
    assert json_type_of(b"x") == "bytes"
    assert PayloadSchema().required == ()
