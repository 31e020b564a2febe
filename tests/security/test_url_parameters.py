"""Every URL parameter of the template, however it is named, keeps plain HTTP off loopback and
credentials out of a deploy: the shipped ones and those ``infrai-jobs new-job`` adds.

A parameter is a URL parameter when its name ends in ``Url``/``URL`` or its default or
``AllowedPattern`` is URL-shaped (a scheme, ``https?``, ``rediss?``); CloudFormation refuses a
value its ``AllowedPattern`` does not match as a whole, so the pattern is what a deploy
enforces, before any function reads the value at its cold start.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from infrai_local.sam_template import load_template, samconfig_overrides
from infrai_local.scaffold_settings import plan_setting_edits

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
    assert {"InfraiBaseUrl", "MailProviderUrl", "DigestProviderUrl", "RedisUrl"} <= set(found)
    # Then each refuses plain HTTP off loopback and credentials, and accepts what it is for
    for name, spec in found.items():
        assert_keeps_plain_http_and_credentials_out(name, spec)


@pytest.fixture
def scaffolded(tmp_path: Path) -> Path:
    """A project whose template and samconfig.toml ``new-job`` gave two settings: HOOK_URL, and
    WEBHOOK_TARGET, whose name says nothing of a URL."""
    for name in ("template.yaml", "samconfig.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    declared = ["MAIL_PROVIDER_URL", "DIGEST_PROVIDER_URL"]
    edits = plan_setting_edits(tmp_path, "hook.deliver", ["HOOK_URL", "WEBHOOK_TARGET"], declared)
    for path, text in edits.texts.items():
        path.write_text(text, encoding="utf-8")
    return tmp_path


def test_the_url_parameters_new_job_adds_are_as_strict_as_the_shipped_ones(
    scaffolded: Path,
) -> None:
    template = load_template(scaffolded / "template.yaml")
    found = url_parameters(template)
    # Then both new parameters are URL parameters, and keep plain HTTP and credentials out
    assert {"HookUrl", "WebhookTarget"} <= set(found)
    for name, spec in found.items():
        assert_keeps_plain_http_and_credentials_out(name, spec)
    # With the shipped pattern and constraint text (InfraiBaseUrl's: a value is required), and
    # a description naming no parameter the template lacks
    shipped = template["Parameters"]["InfraiBaseUrl"]
    for name in ("HookUrl", "WebhookTarget"):
        spec = template["Parameters"][name]
        assert spec["AllowedPattern"] == shipped["AllowedPattern"]
        assert spec["ConstraintDescription"] == shipped["ConstraintDescription"]
        assert "AllowPlainHttp" not in spec["Description"]


def test_a_deploy_without_a_value_for_a_new_setting_is_refused_by_cloudformation(
    scaffolded: Path,
) -> None:
    template = load_template(scaffolded / "template.yaml")
    for name in ("HookUrl", "WebhookTarget"):
        spec = template["Parameters"][name]
        # Then the parameter has no default (CloudFormation refuses a stack without its value)
        assert "Default" not in spec
        # And each environment's deploy carries the placeholder, which its pattern refuses
        for environment in ("default", "prod"):
            overrides = samconfig_overrides(scaffolded / "samconfig.toml", environment, "deploy")
            assert overrides[name] == PLACEHOLDER
            assert not re.fullmatch(spec["AllowedPattern"], overrides[name])
            assert not re.fullmatch(spec["AllowedPattern"], "")
        # And `sam sync`'s section too, while a local invocation never sees the placeholder
        assert samconfig_overrides(scaffolded / "samconfig.toml", "default", "sync")[name]
        assert name not in samconfig_overrides(scaffolded / "samconfig.toml", "default")
