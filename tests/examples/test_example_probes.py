"""Probes check what they settle, and what they store is bounded.

The example jobs' probes are tested as examples here: the receipt probe settles ``done`` only
for a mail that is this invoice's receipt, the digest probe only for a digest under this claim's
key. Any probe's ``Done`` result is bounded in size before the ledger stores it, with a note
saying it was cut. Real PostgreSQL, the provider sink (and a stand-in provider) over HTTP.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from http.server import ThreadingHTTPServer

import pytest
from drainkit import FUNCTIONS_CODE, OPERATOR, Harness, harness
from stub_servers import QuietJsonHandler, serving
from test_reconcile import DIGEST, RECEIPT, seed_dead_worker_claim, sink_call

import jobs
from infrai_jobs.jobs.probes import MAX_PROBE_RESULT_BYTES, Done, ProbeAnswer
from infrai_jobs.jobs.registry import Effect, JobContext, JsonValue, Payload
from infrai_jobs.operations.reconcile import Reconciler
from infrai_jobs.work.admin import WorkStore
from infrai_local.operator.verbs import reconcile_one


@pytest.fixture
def kit(database_url: str) -> Iterator[Harness]:
    """The harness running the team's example jobs (``functions/jobs``, with their tables)
    instead of the framework tests' fixture jobs."""
    with harness(database_url, jobs=jobs.build_registry, code_root=FUNCTIONS_CODE) as example_kit:
        yield example_kit


def _reconcile(kit: Harness, key: str) -> tuple[str, str]:
    reconciler = Reconciler(WorkStore(kit.database_url), kit.registry, actor=OPERATOR)
    report = reconcile_one(reconciler, key)
    ((outcome),) = report.outcomes
    return outcome.answer, outcome.action


def _send_mail(kit: Harness, invoice_id: str, template: str) -> None:
    body = {"to": "ada@example.com", "template": template, "invoice_id": invoice_id}
    sink_call(kit, "POST", "/v1/mail/send", json=body)


def test_the_receipt_probe_does_not_settle_on_a_mail_that_is_not_this_invoices_receipt(
    kit: Harness,
) -> None:
    # Given a stuck receipt for inv_1, and the provider holding a reminder for that invoice
    key = seed_dead_worker_claim(kit, RECEIPT)
    _send_mail(kit, "inv_1", "reminder")
    # When the claim is reconciled
    answer = _reconcile(kit, key)
    # Then no receipt was found: the claim is released for its one more try, not settled done
    assert answer == ("not_done", "released")
    assert kit.row(key) is None


def test_the_receipt_probe_settles_on_this_invoices_receipt(kit: Harness) -> None:
    # Given a stuck receipt for inv_1, a receipt of another invoice and this invoice's receipt
    key = seed_dead_worker_claim(kit, RECEIPT)
    _send_mail(kit, "inv_2", "receipt")
    _send_mail(kit, "inv_1", "receipt")
    # When the claim is reconciled
    answer = _reconcile(kit, key)
    # Then it is done, with this receipt's provider id
    assert answer == ("done", "settled_done")
    row = kit.row(key)
    assert row is not None
    assert row.state == "done"
    assert isinstance(row.result, dict)
    assert row.result["reconciled"] is True
    assert row.result["provider_message_id"] == kit.sink.state.sent["inv_1"][-1]["id"]


class _WrongKeyProvider(QuietJsonHandler):
    """A digest provider whose lookup answers a digest built under another key."""

    def do_GET(self) -> None:
        data = json.dumps({"id": "dg_other", "idempotency_key": "digest.build:someone-else"})
        self.send_json(200, data.encode())


@pytest.fixture
def wrong_key_provider() -> Iterator[str]:
    with serving(ThreadingHTTPServer(("127.0.0.1", 0), _WrongKeyProvider)) as url:
        yield url


def test_the_digest_probe_does_not_settle_on_a_digest_of_another_key(
    kit: Harness, wrong_key_provider: str
) -> None:
    # Given a stuck digest, and a provider whose lookup answers another key's digest
    key = seed_dead_worker_claim(kit, DIGEST)
    settings = dict.fromkeys(kit.registry.declared_settings(), kit.sink.url)
    kit.registry.bind_settings({**settings, "DIGEST_PROVIDER_URL": wrong_key_provider})
    # When the claim is reconciled
    answer = _reconcile(kit, key)
    # Then the answer is unknown and the claim stays stuck for a human
    assert answer == ("unknown", "unchanged")
    row = kit.row(key)
    assert row is not None
    assert row.state == "running"


def test_a_probes_stored_result_is_bounded_with_a_note_when_cut(kit: Harness) -> None:
    # Given a job whose probe answers done with a 2 MB provider answer
    def huge(payload: Payload, ctx: JobContext) -> ProbeAnswer:
        return Done({"provider_answer": "x" * 2_000_000})

    def job(payload: Payload, ctx: JobContext) -> JsonValue:
        return None

    kit.registry.job("test.huge", effect=Effect.EXTERNAL, identity=("id",), probe=huge)(job)
    key = seed_dead_worker_claim(kit, {"job": "test.huge", "id": "h1"})
    # When the claim is reconciled
    answer = _reconcile(kit, key)
    # Then it is done, and what the ledger stores is small and says it was cut
    assert answer == ("done", "settled_done")
    stored = kit.sql("SELECT result::text FROM job_claims WHERE idem_key = %s", (key,))[0][0]
    assert len(stored.encode()) <= MAX_PROBE_RESULT_BYTES
    result = json.loads(stored)
    assert result["truncated"] is True
    assert "2000" in result["note"]
    history = kit.sql(
        "SELECT max(length(after::text)) FROM claim_history WHERE idem_key = %s", (key,)
    )
    assert history[0][0] is None or history[0][0] <= 2 * MAX_PROBE_RESULT_BYTES


def test_a_small_probe_result_is_stored_as_it_is() -> None:
    assert Done({"digest_id": "dg_1"}).result == {"digest_id": "dg_1"}
