"""The framework's tests never depend on which jobs a team has.

They run the fixture jobs (``tests/fixture_code``), never the team's ``jobs`` package
(``functions/jobs``): a team that changes, deletes or adds jobs (``infrai-jobs new-job``) keeps
them green. Only the example jobs' own tests (``tests/examples``, what a team's project holds
for its jobs), which test the examples as examples, import the team's package; a test module
anywhere else that imports it, in its own code or in a child script it runs, fails this test.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import fixture_jobs

TESTS = Path(__file__).resolve().parents[1]

# The example jobs' own tests, as a team's project holds them: they may import its jobs.
EXAMPLES = "examples/"
# Framework test modules that may import the team's jobs package all the same, each with why.
ALLOWED = {
    # A drain process of the soak: its `jobs` is the fixture code root's package, first on the
    # path the soak gives it, whose build_registry it wraps before the drain handler binds it.
    "chaos/drain_worker.py": "its `jobs` is the fixture code root's (soak.py's PYTHONPATH)",
}
# Other ways into the team's package: the settings the installed jobs declare, and the tables of
# the repository's own functions/jobs. Only the examples' tests use them.
_OTHER_ROUTES = re.compile(r"\bsink_settings\(|jobs_migrations_folder\(\s*ROOT\s*/\s*\"functions\"")
# Where a test's child script (a string) imports the jobs package.
_SCRIPT_IMPORT = re.compile(r"^\s*(?:import jobs\b|from jobs(?:\.\w+)* import )", re.M)


def _imports_the_jobs_package(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "jobs"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] == "jobs":
                found.append(node.module)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found += [m.strip() for m in _SCRIPT_IMPORT.findall(node.value)]
    return found


def _framework_test_modules() -> list[Path]:
    fixture_code = fixture_jobs.CODE_ROOT
    return sorted(p for p in TESTS.rglob("*.py") if fixture_code not in p.parents)


def test_no_framework_test_imports_the_teams_jobs_package() -> None:
    # Given every module of the test tree but the fixture jobs themselves
    modules = _framework_test_modules()
    assert len(modules) > 100, "the test tree was not found"
    # When their imports are read, child scripts included
    importing = {
        path.relative_to(TESTS).as_posix(): found
        for path in modules
        if (found := _imports_the_jobs_package(ast.parse(path.read_text(encoding="utf-8"))))
    }
    framework = {n: found for n, found in importing.items() if not n.startswith(EXAMPLES)}
    # Then outside the examples' folder only the allowed modules import the team's jobs package
    assert {name: found for name, found in framework.items() if name not in ALLOWED} == {}
    # And every allowed one still does: an entry no longer needed goes
    assert sorted(ALLOWED) == sorted(framework)


def test_no_framework_test_reaches_the_teams_jobs_another_way() -> None:
    # Given every module of the test tree but the fixture jobs themselves
    # When their text is searched for the installed jobs' settings or functions/jobs' tables
    reaching = sorted(
        path.relative_to(TESTS).as_posix()
        for path in _framework_test_modules()
        if path.name != Path(__file__).name and _OTHER_ROUTES.search(path.read_text("utf-8"))
    )
    # Then only the examples' own tests do
    assert [name for name in reaching if not name.startswith(EXAMPLES)] == []


def test_the_guard_sees_an_import_in_code_and_in_a_child_script() -> None:
    # (The package's name is filled in, so that this module's own strings import nothing.)
    code = "import {0}.digest as d\nfrom {0} import build_registry\nimport {0}worth\n".format(
        "jobs"
    )
    script = f"SCRIPT = {code!r}\n"
    assert _imports_the_jobs_package(ast.parse(code)) == ["jobs.digest", "jobs"]
    assert len(_imports_the_jobs_package(ast.parse(script))) == 2


def test_the_fixture_jobs_import_no_jobs_package() -> None:
    # The fixture jobs are written apart from the examples: not one import of a jobs package
    # (the code root's `jobs` beside them imports them, not the other way round)
    modules = list((fixture_jobs.CODE_ROOT / "fixture_jobs").rglob("*.py"))
    assert len(modules) >= 4
    for path in modules:
        assert _imports_the_jobs_package(ast.parse(path.read_text(encoding="utf-8"))) == [], path
