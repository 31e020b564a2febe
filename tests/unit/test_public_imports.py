"""The job API's import paths: the examples use only them, and the check names the way back."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from infrai_local.public_imports import PUBLIC_API, refused_imports

ROOT = Path(__file__).resolve().parents[2]


def _refusals_of(tmp_path: Path, source: str) -> list[str]:
    job = tmp_path / "job.py"
    job.write_text(source, encoding="utf-8")
    return refused_imports([tmp_path])


@pytest.mark.parametrize(
    ("module", "name"), sorted((m, n) for m, ns in PUBLIC_API.items() for n in ns)
)
def test_every_public_name_is_importable_where_the_docs_say(module: str, name: str) -> None:
    assert hasattr(importlib.import_module(module), name)
    upgrading = (ROOT / "docs" / "upgrading.md").read_text(encoding="utf-8")
    assert f"`{name}`" in upgrading
    assert f"`{module}`" in upgrading


def test_an_internal_module_is_refused_with_the_public_list(tmp_path: Path) -> None:
    [why] = _refusals_of(tmp_path, "from infrai_jobs.jobs.keys import derive_key\n")
    assert why.startswith(
        f"{tmp_path / 'job.py'}:1: `from infrai_jobs.jobs.keys import derive_key`"
    )
    assert "internal" in why
    assert "infrai_jobs.jobs.registry (" in why


def test_a_public_name_from_the_wrong_path_names_its_home(tmp_path: Path) -> None:
    [why] = _refusals_of(
        tmp_path, "import os\nfrom infrai_jobs.jobs.registry import LazyPool, Effect\n"
    )
    assert why.endswith("use `from infrai_jobs.jobs.http_pool import LazyPool`")
    assert ":2: " in why


def test_module_imports_and_the_local_tools_are_refused(tmp_path: Path) -> None:
    source = (
        "import infrai_jobs.drain.loop\n"
        "from infrai_local.sandbox.emulator import app\n"
        "import json\n"
    )
    refused = _refusals_of(tmp_path, source)
    assert [line.split(": ", 1)[0].rsplit(":", 1)[1] for line in refused] == ["1", "2"]


def test_public_imports_and_the_teams_own_modules_pass(tmp_path: Path) -> None:
    source = (
        "import infrai_jobs.errors\n"
        "from infrai_jobs.jobs.registry import Effect, JobRegistry\n"
        "from infrai_jobs.errors import PermanentJobError\n"
        "from payments.helpers import shared\n"
        "from . import sibling\n"
    )
    assert _refusals_of(tmp_path, source) == []


def test_a_file_that_does_not_parse_is_reported_not_skipped(tmp_path: Path) -> None:
    [why] = _refusals_of(tmp_path, "from infrai_jobs.jobs.registry import (\n")
    assert "cannot be read as Python" in why
