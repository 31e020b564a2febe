"""One version, said the same way everywhere: ``infrai_jobs.__version__`` is the source,
``pyproject.toml`` reads it, ``CHANGELOG.md``'s newest section names it and
``infrai-jobs --version`` prints it (the built wheel's name and metadata: tests/e2e/test_dist.py).
"""

from __future__ import annotations

import datetime
import re
import tomllib
from pathlib import Path

import pytest

import infrai_jobs
from infrai_local import cli

ROOT = Path(__file__).resolve().parents[2]
CHANGELOG = ROOT / "CHANGELOG.md"
# Semantic versions, release versions only (no pre-release or build suffix yet).
SEMVER = re.compile(r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)$")
SECTION = re.compile(r"^## (?P<version>\S+) — (?P<when>.+)$")


def changelog_sections() -> list[tuple[str, str]]:
    """(version, what follows the dash) of each ``## `` heading, in file order."""
    sections = []
    for line in CHANGELOG.read_text(encoding="utf-8").splitlines():
        if line.startswith("## "):
            match = SECTION.match(line)
            assert match, f"a version section is '## MAJOR.MINOR.PATCH — DATE': {line!r}"
            sections.append((match["version"], match["when"]))
    return sections


def as_tuple(version: str) -> tuple[int, ...]:
    match = SEMVER.match(version)
    assert match, f"not a semantic version: {version!r}"
    return tuple(int(part) for part in match.groups())


def test_the_version_is_semantic() -> None:
    assert as_tuple(infrai_jobs.__version__) >= (0, 2, 0)


def test_pyproject_reads_the_version_from_the_package() -> None:
    # Given the project's metadata
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    # Then it holds no second copy of the version: it reads infrai_jobs.__version__
    assert "version" not in pyproject["project"]
    assert "version" in pyproject["project"]["dynamic"]
    dynamic = pyproject["tool"]["setuptools"]["dynamic"]["version"]
    assert dynamic == {"attr": "infrai_jobs.__version__"}


def test_the_newest_changelog_section_is_the_packages_version() -> None:
    # Given the changelog's sections
    sections = changelog_sections()
    assert sections
    newest, released = sections[0]
    # Then the first is this version, dated as a day
    assert newest == infrai_jobs.__version__
    assert datetime.date.fromisoformat(released)
    # And the versions go down from there, each named once
    versions = [as_tuple(version) for version, _ in sections]
    assert versions == sorted(versions, reverse=True)
    assert len(set(versions)) == len(versions)


def test_the_cli_prints_the_version(capsys: pytest.CaptureFixture[str]) -> None:
    # When the CLI is asked for its version
    with pytest.raises(SystemExit) as finished:
        cli.main(["--version"])
    # Then it prints the changelog's newest version and exits 0
    assert finished.value.code == 0
    newest, _ = changelog_sections()[0]
    assert capsys.readouterr().out == f"infrai-jobs {newest}\n"
