"""``new-job``'s placeholders in samconfig.toml: every section that deploys gets them in
``JobSettings`` (and a secret's in ``JobSecretArns``), what SAM CLI reads there is otherwise
unchanged, the rest of the file stays as it was written, and a file it cannot edit safely is
left alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from infrai_jobs.errors import ConfigurationError
from infrai_local.authoring.scaffold_settings import (
    SettingEdits,
    plan_setting_edits,
    with_job_entries,
)
from infrai_local.sam_template import parse_parameter_overrides, samconfig_overrides

PROD_OVERRIDES = (
    r"QueueName=billing-prod DrainScheduleRate=\"rate(1 minute)\" "
    r"""JobSettings='{\"HOOK_URL\": \"https://hooks.example.com\"}' LogLevel=WARNING"""
)
SAMCONFIG = f"""version = 0.1

[default.global.parameters]
stack_name = "jobs"
parameter_overrides = "QueueName=billing LogLevel=INFO"

[default.deploy.parameters]
capabilities = "CAPABILITY_IAM"

[default.local_invoke.parameters]
env_vars = "events/env.json"

[prod.deploy.parameters]
# the production stack
parameter_overrides = "{PROD_OVERRIDES}"

[staging.sync.parameters]
parameter_overrides = "QueueName=billing-staging"
"""
ARN = "arn:aws:secretsmanager:eu-west-1:123456789012:secret:hook-AbC123"


def _edited(
    tmp_path: Path,
    text: str,
    settings: list[str],
    secrets: list[str] = (),  # type: ignore[assignment]
) -> tuple[Path, SettingEdits]:
    samconfig = tmp_path / "samconfig.toml"
    samconfig.write_text(text, encoding="utf-8")
    edits = plan_setting_edits(tmp_path, settings, secrets)
    if samconfig in edits.texts:
        samconfig.write_text(edits.texts[samconfig], encoding="utf-8")
    return samconfig, edits


def _job_settings(samconfig: Path, environment: str, command: str = "deploy") -> dict[str, str]:
    settings: dict[str, str] = json.loads(
        samconfig_overrides(samconfig, environment, command)["JobSettings"]
    )
    return settings


def test_each_deploying_section_gets_the_placeholder_and_keeps_what_it_had(
    tmp_path: Path,
) -> None:
    # Given a samconfig.toml whose sections give overrides in three ways (inherited, own, none)
    # When new-job adds the setting HOOK_URL
    samconfig, _ = _edited(tmp_path, SAMCONFIG, ["HOOK_URL"])
    # Then a deploy section without overrides of its own keeps the global ones, plus the map
    default = samconfig_overrides(samconfig, "default", "deploy")
    assert default == {
        "QueueName": "billing",
        "LogLevel": "INFO",
        "JobSettings": '{"HOOK_URL": "SET-ME"}',
    }
    # And a value the team gave already is kept, with the section's other items as written
    prod = (tmp_path / "samconfig.toml").read_text().split("[prod.deploy.parameters]")[1]
    assert "# the production stack" in prod
    assert 'DrainScheduleRate=\\"rate(1 minute)\\"' in prod
    assert samconfig_overrides(samconfig, "prod", "deploy")["DrainScheduleRate"] == (
        "rate(1 minute)"
    )
    assert _job_settings(samconfig, "prod") == {"HOOK_URL": "https://hooks.example.com"}
    assert _job_settings(samconfig, "staging", "sync") == {"HOOK_URL": "SET-ME"}
    # And a local invocation never sees the placeholder
    assert "JobSettings" not in samconfig_overrides(samconfig, "default")


def test_a_second_setting_joins_the_map_and_the_lines_around_it_stay(tmp_path: Path) -> None:
    # Given the placeholders of a first job
    samconfig, _ = _edited(tmp_path, SAMCONFIG, ["HOOK_URL"])
    before = samconfig.read_text().splitlines()
    # When a second job adds its own setting
    samconfig, _ = _edited(tmp_path, samconfig.read_text(), ["REFUND_API_URL"])
    # Then both are in every deploying section's map, the first one's value untouched
    assert _job_settings(samconfig, "default") == {"HOOK_URL": "SET-ME", "REFUND_API_URL": "SET-ME"}
    assert _job_settings(samconfig, "prod") == {
        "HOOK_URL": "https://hooks.example.com",
        "REFUND_API_URL": "SET-ME",
    }
    # And only parameter_overrides lines changed
    after = samconfig.read_text().splitlines()
    assert len(after) == len(before)
    changed = [a for a, b in zip(after, before, strict=True) if a != b]
    assert changed
    assert all(line.startswith("parameter_overrides = ") for line in changed)


def test_a_secret_gets_its_arn_entry_and_a_placeholder_in_the_list_the_roles_read(
    tmp_path: Path,
) -> None:
    samconfig, _ = _edited(tmp_path, SAMCONFIG, [], ["HOOK_TOKEN"])
    overrides = samconfig_overrides(samconfig, "prod", "deploy")
    assert json.loads(overrides["JobSettings"])["HOOK_TOKEN_SECRET_ARN"] == "SET-ME"
    assert overrides["JobSecretArns"] == "SET-ME-HOOK_TOKEN_SECRET_ARN"
    # And an ARN the team listed already stays, the placeholder beside it
    raw = f"JobSecretArns={ARN} LogLevel=INFO"
    assert parse_parameter_overrides(with_job_entries(raw, [], ["SET-ME-X_SECRET_ARN"])) == {
        "JobSecretArns": f"{ARN},SET-ME-X_SECRET_ARN",
        "LogLevel": "INFO",
        "JobSettings": "{}",
    }


def test_what_sam_cli_reads_is_what_this_project_reads() -> None:
    # Given overrides with quoted values, rewritten with a new entry
    raw = (
        'DrainScheduleRate="rate(1 minute)" JobSettings=\'{"A_URL": "https://a.example.com/x y"}\''
    )
    rewritten = with_job_entries(raw, ["B_URL"], [])
    # Then shlex (SAM CLI's own quoting rules for these items) reads every value back
    assert parse_parameter_overrides(rewritten) == {
        "DrainScheduleRate": "rate(1 minute)",
        "JobSettings": '{"A_URL": "https://a.example.com/x y", "B_URL": "SET-ME"}',
    }
    # And nothing is rewritten when nothing is missing
    assert with_job_entries(rewritten, ["B_URL"], []) == rewritten


@pytest.mark.parametrize(
    "raw",
    [
        "JobSettings='[1, 2]'",
        "JobSettings='{not json'",
        'JobSettings="{\\"A\\": \\"it\'s\\"}"',
        "ParameterKey=QueueName,ParameterValue=billing",
        "QueueName='billing",
    ],
    ids=["not-an-object", "not-json", "a-quote-inside", "long-form", "unclosed-quote"],
)
def test_overrides_it_cannot_rewrite_faithfully_are_refused(raw: str) -> None:
    with pytest.raises(ConfigurationError):
        with_job_entries(raw, ["B_URL"], [])


def test_overrides_it_cannot_rewrite_leave_the_file_alone_and_say_so(tmp_path: Path) -> None:
    text = '[default.deploy.parameters]\nparameter_overrides = ["QueueName=billing"]\n'
    samconfig, edits = _edited(tmp_path, text, ["HOOK_URL"])
    assert samconfig.read_text() == text
    assert any("samconfig.toml was left as it is" in note for note in edits.left_alone)


def test_a_multi_line_string_is_left_alone(tmp_path: Path) -> None:
    text = (
        '[default.deploy.parameters]\nparameter_overrides = """QueueName=billing\n'
        'LogLevel=INFO"""\n'
    )
    samconfig, edits = _edited(tmp_path, text, ["HOOK_URL"])
    assert samconfig.read_text() == text
    assert any("samconfig.toml was left as it is" in note for note in edits.left_alone)


def test_a_project_without_a_deploy_section_is_told_where_the_value_goes(tmp_path: Path) -> None:
    samconfig, edits = _edited(
        tmp_path, "[default.build.parameters]\ncached = true\n", ["HOOK_URL"]
    )
    assert "JobSettings" not in samconfig.read_text()
    assert any("no deploy or sync section" in note for note in edits.left_alone)


def test_the_env_vars_file_gets_an_empty_entry_in_both_functions_maps(tmp_path: Path) -> None:
    # Given events/env.json with the map of the example jobs, and samconfig.toml
    (tmp_path / "events").mkdir()
    env_file = tmp_path / "events" / "env.json"
    given = {"Parameters": {"DATABASE_URL": ""}, "DrainFunction": {"JOB_SETTINGS": '{"A": "x"}'}}
    env_file.write_text(json.dumps(given), encoding="utf-8")
    # When a job's setting and secret are added
    _, edits = _edited(tmp_path, SAMCONFIG, ["HOOK_URL"], ["HOOK_TOKEN"])
    document = json.loads(edits.texts[env_file])
    # Then each function's JOB_SETTINGS holds them empty, for --env-vars to set, as JSON
    assert json.loads(document["DrainFunction"]["JOB_SETTINGS"]) == {
        "A": "x",
        "HOOK_URL": "",
        "HOOK_TOKEN_SECRET_ARN": "",
    }
    assert json.loads(document["DlqAlertFunction"]["JOB_SETTINGS"]) == {
        "HOOK_URL": "",
        "HOOK_TOKEN_SECRET_ARN": "",
    }
    assert document["Parameters"] == {"DATABASE_URL": ""}


def test_nothing_names_a_template(tmp_path: Path) -> None:
    # Given a project with a template
    (tmp_path / "template.yaml").write_text("Resources: {}\n", encoding="utf-8")
    # When new-job plans a setting and a secret, Then it never edits the template
    _, edits = _edited(tmp_path, SAMCONFIG, ["HOOK_URL"], ["HOOK_TOKEN"])
    assert tmp_path / "template.yaml" not in edits.texts
    assert (tmp_path / "template.yaml").read_text() == "Resources: {}\n"
