"""The example jobs' guarantees, each asserted in one line with the test kit
(``infrai_local.testkit``), the way a team tests its own jobs."""

from __future__ import annotations

import hashlib
import json

import pytest

from infrai_local.testkit import JobKit, JobKitError

INVOICE = {"job": "invoice.finalize", "invoice_id": "inv_8812", "amount_cents": 4900}
RECEIPT = {"job": "receipt.send", "invoice_id": "inv_8812", "email": "ada@example.com"}
DIGEST = {"job": "digest.build", "tenant_id": "t_42", "period": "2026-11"}


def test_invoice_finalize_keeps_its_guarantees(job_kit: JobKit) -> None:
    # The invoices table is the invoice job's own migration; the producer's rows are not
    job_kit.sql("INSERT INTO invoices (id) VALUES ('inv_8812'), ('inv_0001')")
    job_kit.assert_runs_once(INVOICE)
    assert job_kit.sql("SELECT status, total_cents FROM invoices WHERE id = 'inv_8812'") == [
        ("final", 4900)
    ]
    job_kit.assert_conflict(INVOICE, {**INVOICE, "amount_cents": 1})
    job_kit.assert_retried_then_dead_lettered({**INVOICE, "invoice_id": "inv_missing"})


def test_receipt_send_keeps_its_guarantees(job_kit: JobKit) -> None:
    job_kit.assert_runs_once(RECEIPT)
    job_kit.assert_conflict(RECEIPT, {**RECEIPT, "email": "other@example.com"})
    job_kit.assert_retried_then_dead_lettered(
        {**RECEIPT, "invoice_id": "inv_2"}, raising=ConnectionError("mail provider is down")
    )
    job_kit.assert_stuck_when_uncertain({**RECEIPT, "invoice_id": "inv_3"})


def test_a_receipt_result_holds_no_email_address(job_kit: JobKit) -> None:
    # Given a receipt sent to a mixed-case address
    payload = {**RECEIPT, "invoice_id": "inv_pii", "email": " Ada.Lovelace@Example.com"}
    # When it runs (its result goes to the ledger, and to the second layer when on)
    row = job_kit.assert_runs_once(payload)
    # Then the stored result names the recipient only by the SHA-256 of the normalised address
    stored = json.dumps(row.result).lower()
    assert "ada.lovelace" not in stored
    assert "example.com" not in stored
    assert isinstance(row.result, dict)
    assert row.result["to_sha256"] == hashlib.sha256(b"ada.lovelace@example.com").hexdigest()


def test_digest_build_keeps_its_guarantees(job_kit: JobKit) -> None:
    job_kit.assert_runs_once(DIGEST)
    job_kit.assert_retried_then_dead_lettered(
        {**DIGEST, "period": "2026-10"}, raising=TimeoutError("digest service timed out")
    )
    job_kit.assert_stuck_when_uncertain({**DIGEST, "period": "2026-09"})


def test_the_kit_fails_when_a_guarantee_does_not_hold(job_kit: JobKit) -> None:
    job_kit.sql("INSERT INTO invoices (id) VALUES ('inv_0001')")
    # Given an invoice that does not exist: the handler fails, so it never runs once
    missing = {**INVOICE, "invoice_id": "inv_nowhere"}
    # When the kit asserts it runs once, Then it fails, saying what it saw
    with pytest.raises(JobKitError, match=r"completed 0 times, not once"):
        job_kit.assert_runs_once(missing)
    # And a database job cannot be asked to be stuck
    with pytest.raises(JobKitError, match="database job"):
        job_kit.assert_stuck_when_uncertain({**INVOICE, "invoice_id": "inv_0001"})
