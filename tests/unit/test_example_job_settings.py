"""The example jobs, as examples: each declares its own settings (the invoice job none).

Their modules are registered one by one, so a job the team adds beside them changes nothing
here."""

from __future__ import annotations

from infrai_jobs.jobs.registry import JobRegistry
from jobs import digest, invoice, receipt


def test_the_example_jobs_declare_their_own_settings_and_the_invoice_job_none() -> None:
    registry = JobRegistry()
    for example in (invoice, receipt, digest):
        example.register(registry)
    assert registry.declared_settings() == {
        "MAIL_PROVIDER_URL": ("receipt.send",),
        "DIGEST_PROVIDER_URL": ("digest.build",),
    }
