"""What the deployed layer may hold: what the functions import, and nothing that belongs to the
never-deployed tools (DESIGN.md's layout and "One home for each rule")."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

LAYER = Path(__file__).resolve().parents[2] / "layers" / "common" / "infrai_jobs"
MODULES = sorted(LAYER.glob("*.py"))
MAX_LINES = 600


def imported_modules(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_a_layer_module_imports_nothing_of_the_tools_or_the_jobs(path: Path) -> None:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    imported = imported_modules(tree)
    upward = sorted(
        name
        for name in imported
        if name.split(".")[0] in {"infrai_local", "jobs", "argparse", "importlib"}
    )
    assert upward == [], f"{path.name} imports {upward}"
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    assert "import_module" not in names


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_no_layer_module_is_over_600_lines(path: Path) -> None:
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_LINES, f"{path.name} has {lines} lines"


def test_the_layer_ships_no_fakes_and_no_command_line() -> None:
    shipped = {path.name for path in MODULES}
    assert not shipped & {"testing.py", "fakes.py", "cli.py", "cli_ops.py"}


def test_every_public_exception_class_is_in_errors() -> None:
    elsewhere = []
    for path in MODULES:
        module = importlib.import_module(f"infrai_jobs.{path.stem}")
        for name, value in vars(module).items():
            if (
                inspect.isclass(value)
                and issubclass(value, BaseException)
                and value.__module__ == module.__name__
                and not name.startswith("_")
                and path.stem != "errors"
            ):
                elsewhere.append(f"{path.stem}.{name}")
    assert elsewhere == []


def test_driver_errors_are_caught_in_at_most_two_modules() -> None:
    catching = set()
    for path in MODULES:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.ExceptHandler)
                and node.type is not None
                and "psycopg" in ast.unparse(node.type)
            ):
                catching.add(path.name)
    assert len(catching) <= 2, sorted(catching)


def _code_strings(tree: ast.AST) -> set[str]:
    """The string constants a module's code uses: docstrings are documentation, not rules."""
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docstrings
    }


def test_the_layer_names_no_job_of_the_jobs_package() -> None:
    # The jobs' names and key rules live in functions/jobs; the registry hands them over.
    from jobs import build_registry  # noqa: PLC0415 - the example jobs, on the test path

    job_names = {job.name for job in build_registry()}
    assert job_names, "the example registry declares no job"
    named = {
        path.name: sorted(job_names & _code_strings(ast.parse(path.read_text(encoding="utf-8"))))
        for path in MODULES
    }
    assert {name: jobs for name, jobs in named.items() if jobs} == {}
