"""Where ``infrai-jobs invoke`` differs from ``sam local invoke``: each difference its --help
and docs/development.md name is checked here to be what the code does."""

from __future__ import annotations

from pathlib import Path

import pytest

from infrai_local.sam_template import load_template, resolve_function
from infrai_local.sandbox.invoke import PARITY_GAPS, aws_environment, main

ROOT = Path(__file__).resolve().parents[2]


def test_a_profile_is_forwarded_as_a_profile_not_resolved_into_keys() -> None:
    # Given a shell with a profile and no keys
    shell = {"AWS_PROFILE": "dev", "AWS_REGION": "eu-west-1", "HOME": "/nowhere"}
    # When invoke picks the AWS variables for the function
    forwarded = aws_environment(shell)
    # Then the function gets the profile to resolve itself (SAM would pass resolved keys)
    assert forwarded["AWS_PROFILE"] == "dev"
    assert "AWS_ACCESS_KEY_ID" not in forwarded
    assert "AWS_PROFILE" in PARITY_GAPS


def test_the_env_vars_files_parameters_section_also_sets_template_parameters() -> None:
    # Given an env-vars file whose Parameters section names a template parameter
    template = load_template(ROOT / "template.yaml")
    env_vars = {"Parameters": {"QueueName": "other-queue"}}
    # When the drain is resolved with it
    spec = resolve_function(template, "DrainFunction", ROOT, env_vars=env_vars)
    # Then the parameter's value reaches the variables that refer to it (SAM would only set a
    # variable named QueueName, which the template does not declare)
    assert spec.environment["INFRAI_QUEUE"] == "other-queue"
    assert "QueueName" not in spec.environment
    assert '"Parameters" section' in PARITY_GAPS


def test_help_names_each_difference(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    shown = capsys.readouterr().out
    differences = ("AWS_PROFILE", "AWS_LAMBDA_LOG_GROUP_NAME", "AWS_ACCOUNT_ID", "Parameters")
    for difference in (*differences, "NAME_SECRET_ARN"):
        assert difference in shown
    # And the docs name them too
    development = (ROOT / "docs" / "development.md").read_text()
    for difference in ("AWS_LAMBDA_LOG_GROUP_NAME", "AWS_ACCOUNT_ID", '"Parameters"', "SECRET_ARN"):
        assert difference in development
