"""The outbox keys a row as the drain will key its message: the registry's rule for a job it
knows (schema included), else the producer's key, never in another job's key space; and it
takes only queue names and body sizes Infrai would. Pure, no database."""

from __future__ import annotations

import pytest

from infrai_jobs.config.settings import DEFAULT_MAX_ANSWER_BYTES
from infrai_jobs.errors import InvalidPayload, KeyDerivationError, OutboxError
from infrai_jobs.jobs.registry import Effect, JobContext, JobRegistry, JsonValue, Payload
from infrai_jobs.outbox.writer import (
    MAX_BODY_BYTES,
    body_size_refusal,
    check_queue_name,
    outbox_key,
)
from infrai_jobs.queue_contract import CONSUME_CAP


def registry() -> JobRegistry:
    jobs = JobRegistry()

    @jobs.job(
        "refund.issue",
        effect=Effect.DATABASE,
        identity=("refund_id",),
        fields={"refund_id": str, "amount_cents": int},
    )
    def issue(payload: Payload, ctx: JobContext) -> JsonValue:
        return None

    return jobs


def test_a_known_job_is_keyed_and_checked_exactly_as_the_drain_derives_it() -> None:
    jobs = registry()
    payload = {"job": "refund.issue", "refund_id": "r_1", "amount_cents": 5}
    body, key, job = outbox_key(payload, key=None, registry=jobs)
    assert key == jobs.derive(payload).idem_key == "refund.issue:r_1"
    assert (body, job) == (payload, "refund.issue")
    # A field of the wrong type is the drain's own refusal
    with pytest.raises(InvalidPayload, match="amount_cents"):
        outbox_key({**payload, "amount_cents": "5"}, key=None, registry=jobs)


def test_key_is_sent_as_the_producers_key_so_the_drain_agrees() -> None:
    jobs = registry()
    payload = {"job": "refund.issue", "refund_id": "r_1", "amount_cents": 5}
    body, key, _ = outbox_key(payload, key="refund-request-77", registry=jobs)
    assert key == "refund-request-77"
    assert body["_idempotency_key"] == "refund-request-77"
    # The drain, reading the published body, derives that very key
    assert jobs.derive(body).idem_key == key
    # And the caller's payload is left as it was
    assert "_idempotency_key" not in payload


def test_an_unknown_job_needs_a_key_and_a_contradicting_key_is_refused() -> None:
    body, key, job = outbox_key(
        {"job": "node.worker", "_idempotency_key": "n-1"}, key=None, registry=None
    )
    assert (key, job) == ("n-1", "node.worker")
    with pytest.raises(KeyDerivationError, match="registry="):
        outbox_key({"job": "node.worker"}, key=None, registry=None)
    with pytest.raises(KeyDerivationError, match="unknown job"):
        outbox_key({"job": "refund.isue", "refund_id": "r"}, key=None, registry=registry())
    with pytest.raises(OutboxError, match="differs"):
        outbox_key({"job": "x", "_idempotency_key": "a"}, key="b", registry=None)
    with pytest.raises(KeyDerivationError, match="not a JSON object"):
        outbox_key(["job"], key=None, registry=None)  # type: ignore[arg-type]
    assert body["_idempotency_key"] == "n-1"


def test_a_producer_key_in_another_jobs_key_space_is_refused() -> None:
    jobs = registry()
    # The review's case: a receipt taking an invoice's natural key, registry or not
    hijack = {"job": "receipt.send", "_idempotency_key": "invoice.finalize:victim"}
    for known in (None, jobs):
        with pytest.raises(KeyDerivationError, match=r"key space of job 'invoice\.finalize'"):
            outbox_key(hijack, key=None, registry=known)
    # A job the registry knows, by key= too, and whatever job the payload names
    with pytest.raises(KeyDerivationError, match=r"key space of job 'refund\.issue'"):
        outbox_key({"job": "node.worker"}, key="refund.issue:r_1", registry=jobs)
    with pytest.raises(KeyDerivationError, match="names no job"):
        outbox_key({"n": 1}, key="refund.issue:r_1", registry=None)
    # The content keys' space is the drain's own
    with pytest.raises(KeyDerivationError, match="content keys"):
        outbox_key({"job": "node.worker"}, key="sha256:" + "0" * 64, registry=None)


def test_a_registered_job_without_a_dot_is_protected_when_the_registry_is_given() -> None:
    jobs = registry()

    @jobs.job("mailer", effect=Effect.DATABASE, identity=("id",))
    def mail(payload: Payload, ctx: JobContext) -> JsonValue:
        return None

    with pytest.raises(KeyDerivationError, match="key space of job 'mailer'"):
        outbox_key({"job": "node.worker"}, key="mailer:7", registry=jobs)
    # Without the registry such a key is not recognisably a job's
    assert outbox_key({"job": "node.worker"}, key="mailer:7", registry=None)[1] == "mailer:7"


def test_a_producer_key_in_its_own_jobs_space_or_in_none_is_kept() -> None:
    jobs = registry()
    own = {"job": "refund.issue", "refund_id": "r_1", "amount_cents": 5}
    assert outbox_key(own, key="refund.issue:r_1:again", registry=jobs)[1] == (
        "refund.issue:r_1:again"
    )
    for plain in ("tenant_42:order-7", "refund-request-77", "a:b:c"):
        assert outbox_key({"job": "node.worker"}, key=plain, registry=jobs)[1] == plain


def test_queue_names_follow_infrais_rule() -> None:
    for good in (None, "billing-jobs", "a", "Q.1_x-y", "q" * 80):
        check_queue_name(good)
    for bad in ("", ".dot-first", "-dash-first", "q" * 81, "a b", "q'); DROP TABLE outbox;--"):
        with pytest.raises(OutboxError, match="not a queue name Infrai takes"):
            check_queue_name(bad)


def test_a_full_consume_of_bodies_at_the_limit_fits_the_clients_default_cap() -> None:
    # Each consumed item carries its body and a few short fields (id, queue, status, counts,
    # a timestamp): a generous 4 KiB each, and the envelope
    item_fields, envelope = 4096, 1024
    answer = CONSUME_CAP * (MAX_BODY_BYTES + item_fields) + envelope
    assert answer < DEFAULT_MAX_ANSWER_BYTES
    # And the limit is the documented one
    assert MAX_BODY_BYTES == 1024 * 1024
    assert body_size_refusal("x" * MAX_BODY_BYTES) is None
    assert body_size_refusal("é" * (MAX_BODY_BYTES // 2 + 1)) is not None  # UTF-8 bytes count
