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


def test_a_deploy_must_give_each_example_setting_a_value() -> None:
    # Given the example jobs' settings and samconfig.toml's deploying sections
    import json  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    from infrai_local.checks.job_settings_check import job_settings_problems  # noqa: PLC0415
    from infrai_local.sam_template import samconfig_overrides  # noqa: PLC0415

    registry = JobRegistry()
    for example in (receipt, digest):
        example.register(registry)
    samconfig = Path(__file__).resolve().parents[2] / "samconfig.toml"
    for environment, command in (("default", "deploy"), ("default", "sync"), ("prod", "deploy")):
        overrides = samconfig_overrides(samconfig, environment, command)
        # Then each names every example setting in JobSettings, with the placeholder
        given = json.loads(overrides["JobSettings"])
        assert given == dict.fromkeys(registry.declared_settings(), "SET-ME")
        # And make build refuses it there, one line per setting, before anything deploys
        problems = job_settings_problems(overrides, registry.declared_settings(), {}, environment)
        assert len(problems) == 2
        assert all("still holds SET-ME" in problem for problem in problems)
