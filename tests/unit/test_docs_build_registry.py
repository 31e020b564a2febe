"""The docs build a registry the way the jobs package does: ``build_registry()`` takes no
argument (the example jobs' and the one ``new-job`` writes to; settings are bound later, by the
drain), so no document shows it taking one. No sockets."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
_CALL = re.compile(r"\bbuild_registry\(([^)]*)\)")


def test_the_jobs_package_builds_its_registry_from_nothing() -> None:
    source = (ROOT / "functions" / "jobs" / "__init__.py").read_text()
    (found,) = [
        node
        for node in ast.parse(source).body
        if isinstance(node, ast.FunctionDef) and node.name == "build_registry"
    ]
    assert ast.unparse(found.args) == ""


def test_no_document_calls_build_registry_with_an_argument() -> None:
    # Given every call of build_registry the README and the docs show
    calls = [
        (path.name, match.group(0))
        for path in DOCUMENTS
        for match in _CALL.finditer(path.read_text())
    ]
    # Then there are some, and each is the jobs package's, without an argument
    assert calls
    assert [call for call in calls if call[1] != "build_registry()"] == []
