"""Every URL parameter of the template, however it is named, keeps plain HTTP off loopback and
credentials out of a deploy; and so does ``make build`` for the jobs' settings, which travel in
one JSON parameter (JobSettings) that CloudFormation cannot look into, whatever ``infrai-jobs
new-job`` added.

A parameter is a URL parameter when its name ends in ``Url``/``URL`` or its default or
``AllowedPattern`` is URL-shaped (a scheme, ``https?``, ``rediss?``); CloudFormation refuses a
value its ``AllowedPattern`` does not match as a whole, so the pattern is what a deploy
enforces, before any function reads the value at its cold start.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from infrai_local.authoring.scaffold_settings import plan_setting_edits
from infrai_local.checks.job_settings_check import job_settings_problems
from infrai_local.sam_template import load_template, samconfig_overrides

ROOT = Path(__file__).resolve().parents[2]
_URL_SHAPED = re.compile(r"[a-z][a-z0-9+.-]*:(//|\\?/\\?/)|\bhttps\?|\brediss\?", re.IGNORECASE)
# What no URL parameter may take: plain HTTP to a host off loopback, a user or password before
# the host (in any scheme), another scheme.
REFUSED = [
    "http://hooks.example.com",
    "http://hooks.example.com:8080/deliveries",
    "http://10.0.0.7:8080",
    "https://u:p@hooks.example.com",
    "https://tok@hooks.example.com",
    "https://:tok@hooks.example.com/path",
    "http://u:p@127.0.0.1:9000",
    "rediss://u:p@cache.example.com:6379",
    "redis://:tok@cache.example.com",
    "ftp://files.example.com",
]
# One of these a URL parameter accepts: what it is for.
# The value new-job writes into samconfig.toml until the team gives one (docs/jobs.md).
PLACEHOLDER = "SET-ME"
ACCEPTED = ("https://hooks.example.com/v1", "rediss://cache.example.com:6379")


def url_parameters(template: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The template's URL parameters, found by name or by the shape of their values."""
    return {
        name: spec
        for name, spec in template["Parameters"].items()
        if name.lower().endswith("url")
        or any(
            _URL_SHAPED.search(str(spec.get(field, ""))) for field in ("Default", "AllowedPattern")
        )
    }


def assert_keeps_plain_http_and_credentials_out(name: str, spec: dict[str, Any]) -> None:
    pattern = spec.get("AllowedPattern")
    assert pattern, f"{name}: a URL parameter without an AllowedPattern takes anything"
    compiled = re.compile(pattern)
    accepted = [url for url in REFUSED if compiled.fullmatch(url)]
    assert accepted == [], f"{name} lets a deploy set {accepted}"
    assert any(compiled.fullmatch(url) for url in ACCEPTED), f"{name} accepts no URL at all"
    assert "credentials" in spec.get("ConstraintDescription", ""), name


def test_every_url_parameter_of_the_template_refuses_plain_http_and_credentials() -> None:
    # Given the shipped template's URL parameters, found by name and by shape
    found = url_parameters(load_template(ROOT / "template.yaml"))
    assert {"InfraiBaseUrl", "RedisUrl"} <= set(found)
    # Then each refuses plain HTTP off loopback and credentials, and accepts what it is for
    for name, spec in found.items():
        assert_keeps_plain_http_and_credentials_out(name, spec)


NEW_SETTINGS = ["HOOK_URL", "WEBHOOK_TARGET"]


@pytest.fixture
def scaffolded(tmp_path: Path) -> Path:
    """A project whose samconfig.toml ``new-job`` gave two settings: HOOK_URL, and
    WEBHOOK_TARGET, whose name says nothing of a URL."""
    for name in ("template.yaml", "framework.yaml", "samconfig.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    edits = plan_setting_edits(tmp_path, NEW_SETTINGS)
    for path, text in edits.texts.items():
        path.write_text(text, encoding="utf-8")
    return tmp_path


def test_new_settings_add_no_parameter_the_template_would_have_to_check(
    scaffolded: Path,
) -> None:
    # Then the template is the shipped one: no parameter per setting, so nothing unchecked
    for name in ("template.yaml", "framework.yaml"):
        assert (scaffolded / name).read_bytes() == (ROOT / name).read_bytes()
    assert set(url_parameters(load_template(scaffolded / "template.yaml"))) == set(
        url_parameters(load_template(ROOT / "template.yaml"))
    )


@pytest.mark.parametrize("refused", [*REFUSED, PLACEHOLDER, ""])
def test_make_build_refuses_what_a_url_parameter_refuses_for_each_new_setting(
    scaffolded: Path, refused: str
) -> None:
    declared = {name: ("hook.deliver",) for name in NEW_SETTINGS}
    for name in NEW_SETTINGS:
        # Given a deploy whose JobSettings gives the new setting that value
        settings = dict.fromkeys(NEW_SETTINGS, ACCEPTED[0]) | {name: refused}
        values = {"JobSettings": json.dumps(settings)}
        # Then make build refuses it, naming the setting, never echoing a credential
        (problem,) = job_settings_problems(values, declared, {}, "prod")
        assert f"{name} (for hook.deliver)" in problem
        assert ":p@" not in problem
        assert ":tok@" not in problem
    # And the value it is for passes
    values = {"JobSettings": json.dumps(dict.fromkeys(NEW_SETTINGS, ACCEPTED[0]))}
    assert job_settings_problems(values, declared, {}, "prod") == []


def test_every_deploy_holds_a_placeholder_make_build_refuses_until_a_value_is_given(
    scaffolded: Path,
) -> None:
    declared = {name: ("hook.deliver",) for name in NEW_SETTINGS}
    for environment in ("default", "prod"):
        overrides = samconfig_overrides(scaffolded / "samconfig.toml", environment, "deploy")
        given = json.loads(overrides["JobSettings"])
        assert {name: given[name] for name in NEW_SETTINGS} == dict.fromkeys(
            NEW_SETTINGS, PLACEHOLDER
        )
        problems = job_settings_problems(overrides, declared, {}, environment)
        assert len(problems) == len(NEW_SETTINGS)
        assert all(f"[{environment}]" in problem for problem in problems)
    # And `sam sync`'s section too, while a local invocation never sees the placeholder
    sync = samconfig_overrides(scaffolded / "samconfig.toml", "default", "sync")
    assert set(NEW_SETTINGS) <= set(json.loads(sync["JobSettings"]))
    assert "JobSettings" not in samconfig_overrides(scaffolded / "samconfig.toml", "default")
