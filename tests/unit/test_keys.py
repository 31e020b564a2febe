"""Idempotency keys and fingerprints: exact vectors, properties, and every refusal."""

from __future__ import annotations

import hashlib
import json
import math
import random
from types import MappingProxyType
from typing import Any

import json_strategies
import pytest
import rfc8785
from fixture_jobs import build_registry
from hypothesis import assume, example, given
from hypothesis import strategies as st
from json_strategies import SAFE_INT
from notes_example import NOTES_PAYLOAD

from infrai_jobs.errors import ConfigurationError, KeyDerivationError
from infrai_jobs.jobs.keys import (
    KEY_SCHEME_VERSION,
    MAX_KEY_LENGTH,
    NO_KEY_RULES,
    _plain_canonical_json,
    canonical_json,
    derive_key,
    natural_key,
    payload_fingerprint,
    work_fields,
)

# The key rules the fixture jobs declare (tests/fixture_code): the layer knows none itself.
EXAMPLE_RULES = MappingProxyType(
    {job.name: job.identity for job in build_registry() if job.identity}
)
# A job with no key rule: keyed by its content.
UNRULED_JOB = "report.export"

# --- Strategies -------------------------------------------------------------------------------

json_values = json_strategies.json_values(text_size=12, key_size=6, leaves=8)
work_names = st.text(max_size=8).filter(lambda name: not name.startswith("_") and name != "job")
work_payloads = st.builds(
    lambda fields: {"job": UNRULED_JOB, **fields},
    st.dictionaries(work_names, json_values, max_size=4),
)
envelope_names = st.text(min_size=1, max_size=8).map(lambda name: "_" + name)


def reformat(value: Any, rng: random.Random) -> Any:
    """The same JSON value with every object's keys in a shuffled order."""
    if isinstance(value, dict):
        items = list(value.items())
        rng.shuffle(items)
        return {name: reformat(item, rng) for name, item in items}
    if isinstance(value, list):
        return [reformat(item, rng) for item in value]
    return value


def notes_replacer_array_hash(payload: dict[str, Any]) -> str:
    """The notes' Node fallback, ``JSON.stringify(payload, Object.keys(payload).sort())``.

    A replacer array is an allow-list applied at every depth, so nested objects keep only the
    names that also occur at the top level.
    """
    allowed = sorted(payload)

    def keep_allowed(value: Any) -> Any:
        if isinstance(value, dict):
            return {name: keep_allowed(value[name]) for name in allowed if name in value}
        if isinstance(value, list):
            return [keep_allowed(item) for item in value]
        return value

    text = json.dumps(keep_allowed(payload), separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


# What the stdlib encoder writes for canonical JSON must be rfc8785's bytes: every character
# (control characters, the BMP's top, astral ones), ASCII and non-ASCII names, deep nesting.
any_text = st.text(max_size=12)
plain_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-SAFE_INT - 2, max_value=SAFE_INT + 2)
    | any_text
    | st.sampled_from(
        ["\x00\x08\x0b\x1f\x7f", "\u2028\u2029", "\ud7ff\ue000\uffff\U0001f600", '"\\/']
    )
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(any_text | st.text('ab\x01"\\', max_size=3), children, max_size=4)
    ),
    max_leaves=16,
)


# --- Exact vectors: a change here is a new key scheme, not a refactor ---------------------------


def test_the_scheme_version_is_pinned() -> None:
    # Given the vectors below were written for scheme 1
    # When / Then the module still claims scheme 1
    assert KEY_SCHEME_VERSION == 1


def test_invoice_finalize_key_is_the_node_workers_string() -> None:
    # Given the notes' payload
    # When its key is derived
    key = derive_key(NOTES_PAYLOAD, EXAMPLE_RULES)
    # Then it is exactly what `${payload.job}:${payload.invoice_id}` produces
    assert key == "invoice.finalize:inv_8812"


def test_integer_invoice_id_renders_as_javascript_would() -> None:
    # Given an invoice id sent as a JSON number
    payload = {"job": "invoice.finalize", "invoice_id": 8812}
    # When / Then it renders as the template literal would
    assert derive_key(payload, EXAMPLE_RULES) == "invoice.finalize:8812"


def test_tenant_period_job_key() -> None:
    # Given a digest for one tenant and period
    payload = {"job": "digest.build", "tenant_id": "tenant_42", "period": "2026-07-25", "n": 3}
    # When its key is derived
    key = derive_key(payload, EXAMPLE_RULES)
    # Then it names the job, the tenant and the period, and nothing else
    assert key == "digest.build:tenant_42:2026-07-25"


def test_content_key_matches_an_independent_sha256_of_hand_written_canonical_json() -> None:
    # Given a payload whose canonical form differs from json.dumps(sort_keys=True): keys sorted
    # by UTF-16 code units (U+1F600 is D83D DE00, before U+FB01), 1.0 written as 1, envelope out
    payload = {
        "job": UNRULED_JOB,
        "\ufb01": 2,
        "\U0001f600": 1.0,
        "filter": {"z": True, "a": None, "n": [1, 2.5, "é"]},
        "_trace_id": "abc",
    }
    canonical = '{"filter":{"a":null,"n":[1,2.5,"é"],"z":true},"job":"report.export","😀":1,"ﬁ":2}'
    expected = hashlib.sha256(canonical.encode("utf-8")).hexdigest()
    # When the key and the fingerprint are derived
    key = derive_key(payload, EXAMPLE_RULES)
    fingerprint = payload_fingerprint(payload)
    # Then both rest on exactly that canonical text
    assert canonical_json(work_fields(payload)) == canonical.encode("utf-8")
    assert fingerprint == expected
    assert key == "sha256:" + expected
    assert json.dumps(work_fields(payload), sort_keys=True) != canonical


def test_producer_key_wins_over_the_natural_key() -> None:
    # Given a producer that set its own key on an invoice job
    payload = {**NOTES_PAYLOAD, "_idempotency_key": "order-77/finalize"}
    # When the key is derived
    key = derive_key(payload, EXAMPLE_RULES)
    # Then the producer's key is used as given, and the fingerprint ignores it
    assert key == "order-77/finalize"
    assert payload_fingerprint(payload) == payload_fingerprint(NOTES_PAYLOAD)


def test_any_mapping_is_keyed_like_the_dict_it_holds() -> None:
    # Given the notes' payload behind a read-only mapping
    frozen = MappingProxyType(NOTES_PAYLOAD)
    # When / Then it is keyed and fingerprinted exactly like the dict
    assert derive_key(frozen, EXAMPLE_RULES) == derive_key(NOTES_PAYLOAD, EXAMPLE_RULES)
    assert payload_fingerprint(frozen) == payload_fingerprint(NOTES_PAYLOAD)


# --- Properties ---------------------------------------------------------------------------------


@given(payload=work_payloads, seed=st.integers(), indent=st.sampled_from([None, 0, 2, "\t"]))
def test_key_is_stable_under_key_order_and_formatting(
    payload: dict[str, Any], seed: int, indent: int | str | None
) -> None:
    # Given the same payload written as JSON text with other key order and whitespace
    text = json.dumps(reformat(payload, random.Random(seed)), indent=indent, ensure_ascii=False)
    # When that text is parsed, as the queue client would, and keyed
    reparsed = json.loads(text)
    # Then key and fingerprint are unchanged
    assert derive_key(reparsed, EXAMPLE_RULES) == derive_key(payload, EXAMPLE_RULES)
    assert payload_fingerprint(reparsed) == payload_fingerprint(payload)


@given(pair=st.lists(work_payloads, min_size=2, max_size=2, unique_by=canonical_json))
def test_different_work_gets_a_different_key(pair: list[dict[str, Any]]) -> None:
    # Given two payloads whose work differs as JSON
    first, second = pair
    # When / Then their keys differ
    assert derive_key(first, EXAMPLE_RULES) != derive_key(second, EXAMPLE_RULES)


def test_values_that_loose_encodings_conflate_get_distinct_keys() -> None:
    # Given values that compare equal in Python or print alike in loose serialisations
    values: list[Any] = [1, "1", True, 1.5, None, "null", [], {}, [1], {"1": 1}, "", 0, False]
    # When each is keyed as the same job's work
    keys = {derive_key({"job": UNRULED_JOB, "value": value}, EXAMPLE_RULES) for value in values}
    # Then none collide
    assert len(keys) == len(values)


@given(
    path=st.lists(st.text(min_size=1, max_size=6), min_size=1, max_size=5),
    before=json_values,
    after=json_values,
)
def test_a_change_at_any_depth_changes_the_key(path: list[str], before: Any, after: Any) -> None:
    # Given two payloads that differ only in one leaf, however deeply nested
    assume(canonical_json(before) != canonical_json(after))

    def nest(leaf: Any) -> dict[str, Any]:
        for name in reversed(path):
            leaf = {name: leaf}
        return {"job": UNRULED_JOB, "work": leaf}

    # When both are keyed
    keys = {derive_key(nest(before), EXAMPLE_RULES), derive_key(nest(after), EXAMPLE_RULES)}
    # Then the keys differ
    assert len(keys) == 2


@given(payload=work_payloads, envelope=st.dictionaries(envelope_names, json_values, max_size=3))
def test_envelope_fields_change_neither_key_nor_fingerprint(
    payload: dict[str, Any], envelope: dict[str, Any]
) -> None:
    # Given the same work with envelope fields added (but no producer key)
    assume("_idempotency_key" not in envelope)
    wrapped = {**payload, **envelope}
    # When / Then key and fingerprint are unchanged
    assert derive_key(wrapped, EXAMPLE_RULES) == derive_key(payload, EXAMPLE_RULES)
    assert payload_fingerprint(wrapped) == payload_fingerprint(payload)
    assert work_fields(wrapped) == payload


@given(amount=st.integers(min_value=0, max_value=10**9))
def test_natural_key_ignores_other_fields_but_the_fingerprint_does_not(amount: int) -> None:
    # Given the notes' invoice sent again with a possibly different amount
    resent = {**NOTES_PAYLOAD, "amount_cents": amount}
    # When both are keyed and fingerprinted
    same_key = derive_key(resent, EXAMPLE_RULES) == derive_key(NOTES_PAYLOAD, EXAMPLE_RULES)
    same_fingerprint = payload_fingerprint(resent) == payload_fingerprint(NOTES_PAYLOAD)
    # Then the key is the invoice's, and only the fingerprint can tell a conflict from a duplicate
    assert same_key
    assert same_fingerprint == (amount == 4900)


def test_the_notes_replacer_array_collides_where_our_hash_does_not() -> None:
    # Given two exports that differ only inside a nested object
    first = {"job": UNRULED_JOB, "filter": {"tenant_id": "t_1"}}
    second = {"job": UNRULED_JOB, "filter": {"tenant_id": "t_2"}}
    # When both are keyed by the notes' scheme and by ours
    notes_keys = {notes_replacer_array_hash(first), notes_replacer_array_hash(second)}
    our_keys = {derive_key(first, EXAMPLE_RULES), derive_key(second, EXAMPLE_RULES)}
    # Then the notes' replacer array dropped the nested names and collided; ours did not
    assert len(notes_keys) == 1
    assert len(our_keys) == 2


# --- Key rules ----------------------------------------------------------------------------------


def test_only_the_table_given_names_keys() -> None:
    # Given a registry that declares its own identity fields
    rules = {"mail.welcome": ("user_id",)}
    payload = {"job": "mail.welcome", "user_id": "u_9", "template": "v2"}
    # When keys are derived with that table
    key = derive_key(payload, rules)
    # Then its rule applies, and a job it does not name is keyed by its content
    assert key == "mail.welcome:u_9"
    assert derive_key(NOTES_PAYLOAD, rules).startswith("sha256:")
    assert derive_key(NOTES_PAYLOAD, {**EXAMPLE_RULES, **rules}) == "invoice.finalize:inv_8812"


def test_without_rules_a_key_is_the_producers_or_the_contents() -> None:
    # Given no job's rule (RedriveFunction has no jobs package)
    keyed = {**NOTES_PAYLOAD, "_idempotency_key": "producer-7"}
    # When / Then a producer key still names itself, and everything else is a content key
    assert derive_key(keyed, NO_KEY_RULES) == "producer-7"
    assert derive_key(NOTES_PAYLOAD, NO_KEY_RULES) == "sha256:" + payload_fingerprint(NOTES_PAYLOAD)
    assert dict(NO_KEY_RULES) == {}


def test_only_the_last_identity_field_may_contain_a_colon() -> None:
    # Given tenant ids and periods that could shift a ':' between them
    ambiguous = {"job": "digest.build", "tenant_id": "a:b", "period": "c"}
    fine = {"job": "digest.build", "tenant_id": "a", "period": "b:c"}
    # When / Then the ambiguous one is refused and the other keyed
    with pytest.raises(KeyDerivationError, match="'tenant_id' must not contain ':'"):
        derive_key(ambiguous, EXAMPLE_RULES)
    assert derive_key(fine, EXAMPLE_RULES) == "digest.build:a:b:c"


@pytest.mark.parametrize("fields", ["invoice_id", ()])
def test_a_malformed_rule_is_a_configuration_error(fields: Any) -> None:
    # Given a rule that is a bare string or lists no fields
    # When / Then it is refused as configuration, not blamed on the payload
    with pytest.raises(ConfigurationError, match="must list one or more field names"):
        natural_key("invoice.finalize", fields, NOTES_PAYLOAD)


# --- Refusals -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (math.nan, "NaN or Infinity"),
        (math.inf, "NaN or Infinity"),
        (-math.inf, "NaN or Infinity"),
        (2**53 + 1, r"outside \+/-\(2\*\*53 - 1\)"),
        (-(2**53) - 1, r"outside \+/-\(2\*\*53 - 1\)"),
        (b"bytes", "unsupported type"),
        ({"a", "b"}, "unsupported type"),
        ({1: "x"}, "object keys must be strings"),
        ("lone \ud800 surrogate", "not representable"),
        ({"\udc00": 1}, "lone surrogate"),
    ],
)
def test_unrepresentable_work_is_refused(value: Any, message: str) -> None:
    # Given work that JSON cannot carry exactly
    payload = {"job": UNRULED_JOB, "value": value}
    # When / Then neither a key nor a fingerprint is derived
    with pytest.raises(KeyDerivationError, match=message):
        derive_key(payload, EXAMPLE_RULES)
    with pytest.raises(KeyDerivationError, match=message):
        payload_fingerprint(payload)


@pytest.mark.parametrize(
    ("payload", "type_name"), [([NOTES_PAYLOAD], "list"), ("inv_8812", "str"), (None, "NoneType")]
)
def test_a_payload_that_is_not_an_object_is_refused(payload: Any, type_name: str) -> None:
    # Given a body that is not a JSON object
    # When / Then no key is derived, and the message says what arrived
    with pytest.raises(KeyDerivationError, match=rf"not a JSON object \(got {type_name}\)"):
        derive_key(payload, EXAMPLE_RULES)


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (
            {"job": "invoice.finalize", "amount_cents": 4900},
            "'invoice.finalize' needs field 'invoice_id'",
        ),
        ({"job": "digest.build", "tenant_id": "t_1"}, "'digest.build' needs field 'period'"),
        ({"job": "invoice.finalize", "invoice_id": ""}, "must be a non-empty string or an integer"),
        ({"job": "invoice.finalize", "invoice_id": None}, r"integer \(got null\)"),
        ({"job": "invoice.finalize", "invoice_id": True}, r"integer \(got bool\)"),
        ({"job": "invoice.finalize", "invoice_id": 2**53}, r"outside \+/-\(2\*\*53 - 1\)"),
        ({"job": "invoice.finalize", "invoice_id": "x" * MAX_KEY_LENGTH}, "longer than 512"),
    ],
)
def test_a_ruled_job_without_a_usable_identity_is_refused(
    payload: dict[str, Any], message: str
) -> None:
    # Given a job with a key rule whose identity field is missing or unusable
    # When / Then the error names the job and the field
    with pytest.raises(KeyDerivationError, match=message):
        derive_key(payload, EXAMPLE_RULES)


@pytest.mark.parametrize(
    ("producer_key", "message"),
    [
        ("", "non-empty string"),
        ("   ", "non-empty string"),
        (None, r"got null"),
        (42, r"got int"),
        ("k" * (MAX_KEY_LENGTH + 1), "longer than 512"),
        ("tab\there", "contains U\\+0009: a key takes no control character"),
        ("nul\x00", "contains U\\+0000"),
        ("csi\x9b31m", "contains U\\+009B"),
        ("evil\u202etxt.exe", "contains U\\+202E: .* bidi mark, override or isolate"),
        ("lone \ud800", "contains U\\+D800: .* lone surrogate"),
    ],
)
def test_an_unusable_producer_key_is_refused(producer_key: Any, message: str) -> None:
    # Given a producer key that is empty, not a string, too long or unprintable
    payload = {**NOTES_PAYLOAD, "_idempotency_key": producer_key}
    # When / Then it is refused rather than silently replaced by the natural key
    with pytest.raises(KeyDerivationError, match=message):
        derive_key(payload, EXAMPLE_RULES)


# What a key must never carry: it reaches terminals, the console's pages and PostgreSQL. C0 and
# C1 controls and DEL (U+009B is a one-byte CSI: terminal escapes), the bidi marks, overrides and
# isolates that reorder what a reader sees (U+061C, U+200E, U+200F, U+202A-U+202E,
# U+2066-U+2069), lone surrogates.
UNFIT = [*map(chr, range(0x20)), *map(chr, range(0x7F, 0xA0)), "\u061c", "\u200e", "\u200f"]
UNFIT += [*map(chr, range(0x202A, 0x202F)), *map(chr, range(0x2066, 0x206A)), "\ud800", "\udfff"]
fit_text = st.text(
    st.characters(exclude_characters="".join(UNFIT), exclude_categories=["Cs"]), max_size=40
)


@given(before=fit_text, unfit=st.sampled_from(UNFIT), after=fit_text)
def test_a_key_with_an_unfit_character_anywhere_is_refused(
    before: str, unfit: str, after: str
) -> None:
    # Given text with one control, bidi or surrogate character somewhere in it
    text = before + unfit + after
    assume(text.strip())
    # When it is a producer's key, or the identity a job's key is made of
    for payload in (
        {**NOTES_PAYLOAD, "_idempotency_key": text},
        {**NOTES_PAYLOAD, "invoice_id": text},
    ):
        # Then it is refused, naming the character
        with pytest.raises(KeyDerivationError, match=f"contains U\\+{ord(unfit):04X}"):
            derive_key(payload, EXAMPLE_RULES)


@given(text=fit_text)
@example(text="caf\u00e9 \U0001f469\u200d\U0001f4bb \ufeff")
def test_a_key_of_any_other_characters_is_kept_as_given(text: str) -> None:
    # Given a non-blank key of any other characters (marks, joiners, emoji, any script)
    assume(text.strip())
    # When / Then a producer's key is the key as given, and an identity field is its last part
    assert derive_key({**NOTES_PAYLOAD, "_idempotency_key": text}, EXAMPLE_RULES) == text
    key = derive_key({**NOTES_PAYLOAD, "invoice_id": text}, EXAMPLE_RULES)
    assert key == f"invoice.finalize:{text}"


# --- The fast path of canonical JSON ------------------------------------------------------------


@given(value=plain_values)
@example(value={"b\x01": "\x1f", "a\\": ['"', "\u2028", None, True, -(2**53) + 1]})
@example(value={"k": "lone \ud800 surrogate"})
@example(value={"\ue000": 1, "\U0001f600": 2})
def test_the_stdlib_encoder_writes_exactly_what_rfc8785_writes(value: Any) -> None:
    # Given any JSON value, plain or not
    # When the fast path takes it
    fast = _plain_canonical_json(value)
    # Then its bytes are rfc8785's, byte for byte; what it declines goes to rfc8785 anyway
    if fast is not None:
        assert fast == rfc8785.dumps(value)


@pytest.mark.parametrize(
    ("value", "plain"),
    [
        (NOTES_PAYLOAD, True),
        (
            {"job": UNRULED_JOB, "lines": [{"sku": "a-1", "qty": 2}], "note": "caf\u00e9 \u2603"},
            True,
        ),
        ({"amount": 1.5}, False),  # ECMAScript and Python write floats differently
        ({"caf\u00e9": 1}, False),  # a non-ASCII name: UTF-16 order may differ
        ({"id": 2**53}, False),  # outside what a JSON number holds exactly
        ({"s": "lone \ud800 surrogate"}, False),
        ({"deep": json.loads("[" * 40 + "]" * 40)}, False),
    ],
)
def test_plain_work_takes_the_fast_path_and_the_rest_does_not(value: Any, plain: bool) -> None:
    assert (_plain_canonical_json(value) is not None) is plain


@pytest.mark.parametrize("mark", ["\u200e", "\u200f", "\u061c"])
def test_a_bidi_mark_in_a_producer_key_is_refused(mark: str) -> None:
    # LRM, RLM and ALM reorder what a terminal or a page shows, as the overrides do
    with pytest.raises(KeyDerivationError, match=f"U\\+{ord(mark):04X}"):
        derive_key({**NOTES_PAYLOAD, "_idempotency_key": f"tenant{mark}42"}, EXAMPLE_RULES)
