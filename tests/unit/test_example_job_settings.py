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
    # Given the template's parameters for the example jobs' settings, and samconfig.toml
    import re  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    from infrai_local.sam_template import load_template, samconfig_environments  # noqa: PLC0415
    from infrai_local.scaffold_settings import parameter_name  # noqa: PLC0415

    root = Path(__file__).resolve().parents[2]
    parameters = load_template(root / "template.yaml")["Parameters"]
    samconfig = (root / "samconfig.toml").read_text(encoding="utf-8")
    assert samconfig_environments(root / "samconfig.toml")
    for setting in ("MAIL_PROVIDER_URL", "DIGEST_PROVIDER_URL"):
        name = parameter_name(setting)
        # Then none has a default, so CloudFormation refuses a deploy that gives none, before
        # any function runs (rather than a drain refusing every cold start)
        assert "Default" not in parameters[name], name
        # And every deploy section names it, with a placeholder its pattern refuses
        assert samconfig.count(f"{name}=SET-ME") == 3, name
        assert re.fullmatch(parameters[name]["AllowedPattern"], "SET-ME") is None
