"""``new-job --setting``'s placeholder in samconfig.toml: every section that deploys gets it, what
SAM CLI reads there is otherwise unchanged, and a file it cannot edit safely is left alone."""

from __future__ import annotations

from pathlib import Path

from infrai_local.sam_template import samconfig_overrides
from infrai_local.scaffold_settings import SettingEdits, plan_setting_edits

SAMCONFIG = """version = 0.1

[default.global.parameters]
stack_name = "jobs"
parameter_overrides = "QueueName=billing LogLevel=INFO"

[default.deploy.parameters]
capabilities = "CAPABILITY_IAM"

[default.local_invoke.parameters]
env_vars = "events/env.json"

[prod.deploy.parameters]
# the production stack
parameter_overrides = 'QueueName=billing-prod DrainScheduleRate="rate(1 minute)" HookUrl=https://hooks.example.com'

[staging.sync.parameters]
parameter_overrides = "QueueName=billing-staging"
"""


def _edited(tmp_path: Path, text: str) -> tuple[Path, SettingEdits]:
    (tmp_path / "template.yaml").write_text("Parameters:\nResources: {}\n", encoding="utf-8")
    samconfig = tmp_path / "samconfig.toml"
    samconfig.write_text(text, encoding="utf-8")
    edits = plan_setting_edits(tmp_path, "hook.deliver", ["HOOK_URL"], [])
    if samconfig in edits.texts:
        samconfig.write_text(edits.texts[samconfig], encoding="utf-8")
    return samconfig, edits


def test_each_deploying_section_gets_the_placeholder_and_keeps_what_it_had(
    tmp_path: Path,
) -> None:
    samconfig, _ = _edited(tmp_path, SAMCONFIG)
    # A deploy section without overrides of its own keeps the global ones, plus the placeholder
    assert samconfig_overrides(samconfig, "default", "deploy") == {
        "QueueName": "billing",
        "LogLevel": "INFO",
        "HookUrl": "SET-ME",
    }
    # A value the team gave already is kept, and quoted values survive the rewrite
    assert samconfig_overrides(samconfig, "prod", "deploy") == {
        "QueueName": "billing-prod",
        "DrainScheduleRate": "rate(1 minute)",
        "HookUrl": "https://hooks.example.com",
    }
    assert samconfig_overrides(samconfig, "staging", "sync")["HookUrl"] == "SET-ME"
    # A local invocation never sees the placeholder
    assert "HookUrl" not in samconfig_overrides(samconfig, "default")
    # And the comment says what to put there
    assert "# HookUrl: the URL of a job's setting (new-job); a deploy refuses SET-ME." in (
        samconfig.read_text()
    )


def test_overrides_it_cannot_rewrite_leave_the_file_alone_and_say_so(tmp_path: Path) -> None:
    text = '[default.deploy.parameters]\nparameter_overrides = ["QueueName=billing"]\n'
    samconfig, edits = _edited(tmp_path, text)
    assert samconfig.read_text() == text
    assert any("samconfig.toml was left as it is" in note for note in edits.left_alone)


def test_a_project_without_a_deploy_section_is_told_where_the_value_goes(tmp_path: Path) -> None:
    samconfig, edits = _edited(tmp_path, "[default.build.parameters]\ncached = true\n")
    assert "HookUrl" not in samconfig.read_text()
    assert any("no deploy or sync section" in note for note in edits.left_alone)
