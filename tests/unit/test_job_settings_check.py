"""make build's check of the jobs' settings and secrets: CloudFormation cannot look inside the
JobSettings JSON, so the build refuses a deploy whose map lacks a declared setting, still holds
SET-ME, is not JSON, or holds a URL a deployed function must not call, and a secret whose ARN
JobSecretArns does not list; one line each, naming the environment, the entry and the jobs."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from infrai_local.checks.job_settings_check import job_settings_problems

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = {"HOOK_URL": ("hook.deliver",), "REFUND_API_URL": ("refund.issue", "refund.check")}
SECRETS = {"HOOK_TOKEN": ("hook.deliver",)}
ARN = "arn:aws:secretsmanager:eu-west-1:123456789012:secret:hook-token-AbC123"
GOOD = {
    "HOOK_URL": "https://hooks.example.com/v1",
    "REFUND_API_URL": "https://refunds.example.com",
    "HOOK_TOKEN_SECRET_ARN": ARN,
}


def _problems(job_settings: object, arns: str = ARN, raw: str | None = None) -> list[str]:
    values = {
        "JobSettings": raw if raw is not None else json.dumps(job_settings),
        "JobSecretArns": arns,
    }
    return job_settings_problems(values, SETTINGS, SECRETS, "prod")


def test_a_deploy_giving_every_setting_and_listing_every_secret_passes() -> None:
    assert _problems(GOOD) == []


def test_a_project_whose_jobs_declare_nothing_passes_on_the_default() -> None:
    assert job_settings_problems({"JobSettings": "{}", "JobSecretArns": ""}, {}, {}, "dev") == []


@pytest.mark.parametrize(
    ("value", "refusal"),
    [
        (None, "is missing"),
        ("", "is missing"),
        ("SET-ME", "still holds SET-ME"),
        ("http://refunds.example.com", "is not an https:// URL"),
        ("http://127.0.0.1:8766", "is not an https:// URL"),
        ("refunds.example.com", "is not an https:// URL"),
        ("https://user:pw@refunds.example.com", "carries credentials"),
        ("https://tok@refunds.example.com", "carries credentials"),
    ],
)
def test_a_setting_missing_left_as_placeholder_or_not_https_is_refused_naming_it_and_its_jobs(
    value: str | None, refusal: str
) -> None:
    # Given a deploy whose map gives REFUND_API_URL that value (or none)
    given = {name: v for name, v in {**GOOD, "REFUND_API_URL": value}.items() if v is not None}
    # When the check judges it, Then one line says so, naming the env, the setting and its jobs
    (line,) = _problems(given)
    assert line.startswith("build-check: [prod] JobSettings: REFUND_API_URL")
    assert "(for refund.issue, refund.check)" in line
    assert refusal in line
    assert "pw" not in line.replace("https", "")
    assert "\n" not in line


@pytest.mark.parametrize(
    ("raw", "refusal"),
    [
        ("{not json", "is not valid JSON"),
        ('["HOOK_URL"]', "must be a JSON object of strings"),
        ('{"HOOK_URL": 443}', "must be a JSON object of strings"),
    ],
)
def test_a_map_that_is_not_a_json_object_of_strings_is_refused(raw: str, refusal: str) -> None:
    (line,) = _problems(None, raw=raw)
    assert line.startswith("build-check: [prod] JobSettings")
    assert refusal in line


def test_a_secret_needs_its_arn_in_the_map_and_in_the_list_the_roles_may_read() -> None:
    # Given the secret's ARN in JobSettings but not in JobSecretArns
    (line,) = _problems(GOOD, arns="")
    # Then the functions could not read it: refused, naming the list, the entry and the job
    assert "JobSecretArns lacks HOOK_TOKEN_SECRET_ARN's ARN (for hook.deliver)" in line
    assert ARN in line
    # And an ARN another secret's (or none at all) is refused as missing or malformed
    missing = {k: v for k, v in GOOD.items() if k != "HOOK_TOKEN_SECRET_ARN"}
    assert "HOOK_TOKEN_SECRET_ARN (for hook.deliver) is missing" in _problems(missing)[0]
    (malformed,) = _problems({**GOOD, "HOOK_TOKEN_SECRET_ARN": "hook-token"})
    assert "not the full ARN of a Secrets Manager secret" in malformed


def test_the_placeholders_new_job_writes_for_a_secret_are_refused() -> None:
    given = {**GOOD, "HOOK_TOKEN_SECRET_ARN": "SET-ME"}
    problems = _problems(given, arns="SET-ME-HOOK_TOKEN_SECRET_ARN")
    assert any("HOOK_TOKEN_SECRET_ARN (for hook.deliver) still holds SET-ME" in p for p in problems)
    assert any("JobSecretArns still holds SET-ME-HOOK_TOKEN_SECRET_ARN" in p for p in problems)


def test_a_secret_value_in_the_map_is_refused_without_showing_it() -> None:
    problems = _problems({**GOOD, "HOOK_TOKEN": "tok-never-shown"})
    assert any("holds HOOK_TOKEN itself (for hook.deliver)" in p for p in problems)
    assert not any("tok-never-shown" in p for p in problems)


JOBS_PACKAGE = """
from infrai_jobs.jobs.registry import Effect, JobRegistry


def build_registry() -> JobRegistry:
    registry = JobRegistry()
    registry.job(
        "hook.deliver", effect=Effect.EXTERNAL_IDEMPOTENT, identity=("hook_id",),
        settings=("HOOK_URL",), secrets=("HOOK_TOKEN",),
    )(lambda payload, ctx: None)
    return registry
"""


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """This repository's template and samconfig.toml, with a jobs package of its own."""
    shutil.copy(ROOT / "template.yaml", tmp_path / "template.yaml")
    shutil.copy(ROOT / "framework.yaml", tmp_path / "framework.yaml")
    samconfig = (ROOT / "samconfig.toml").read_text(encoding="utf-8")
    overrides = (
        'JobSettings=\'{\\"HOOK_URL\\": \\"SET-ME\\", \\"HOOK_TOKEN_SECRET_ARN\\": \\"SET-ME\\"}\''
    )
    samconfig = re.sub(r"JobSettings='[^']*'", lambda _: overrides, samconfig)
    (tmp_path / "samconfig.toml").write_text(samconfig, encoding="utf-8")
    (tmp_path / "functions" / "jobs").mkdir(parents=True)
    (tmp_path / "functions" / "jobs" / "__init__.py").write_text(
        textwrap.dedent(JOBS_PACKAGE), encoding="utf-8"
    )
    return tmp_path


def _check(project: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable,
        "-m",
        "infrai_local.checks.job_settings_check",
        "--root",
        str(project),
    ]
    return subprocess.run([*command, *argv], capture_output=True, text=True, check=False)


def test_make_build_stops_on_a_project_whose_placeholders_are_still_there(project: Path) -> None:
    # When make build's check runs on the project's prod environment
    completed = _check(project, "--config-env", "prod")
    # Then it stops the build, one line per entry, naming the environment, entry and job
    assert completed.returncode == 1, completed.stderr
    assert "Traceback" not in completed.stderr
    lines = completed.stderr.splitlines()
    assert (
        "build-check: [prod] JobSettings: HOOK_URL (for hook.deliver) still holds SET-ME"
        in (lines[0])
    )
    assert any("HOOK_TOKEN_SECRET_ARN (for hook.deliver) still holds SET-ME" in x for x in lines)


def test_make_build_passes_once_the_real_values_are_given(project: Path) -> None:
    # Given the prod section with the real URL, the secret's ARN in both parameters
    samconfig = project / "samconfig.toml"
    real = json.dumps({"HOOK_URL": "https://hooks.example.com", "HOOK_TOKEN_SECRET_ARN": ARN})
    text = re.sub(
        r"JobSettings='[^']*'",
        lambda _: f"JobSettings='{real}' JobSecretArns={ARN}".replace('"', '\\"'),
        samconfig.read_text(encoding="utf-8"),
    )
    samconfig.write_text(text, encoding="utf-8")
    # When the check runs, Then it passes and says what it checked
    completed = _check(project, "--config-env", "prod")
    assert completed.returncode == 0, completed.stderr
    assert "1 setting(s) and 1 secret(s) declared" in completed.stdout


def test_make_build_runs_the_check_and_ci_turns_it_off() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^build: .*\bjob-settings-check\b", makefile, re.M)
    assert "-m infrai_local.checks.job_settings_check" in makefile
    assert "JOB_SETTINGS_CHECK=off" in (ROOT / ".ci" / "run").read_text()
