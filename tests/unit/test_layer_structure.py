"""What the deployed layer may hold: what the functions import, and nothing that belongs to the
never-deployed tools (docs/design.md, "Layout": one home for each rule)."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAYER = ROOT / "layers" / "common" / "infrai_jobs"
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


def test_driver_errors_are_caught_in_exactly_one_module() -> None:
    # Every package of the layer, not only its root: the one translation of driver errors
    # (ledger.postgres.ledger_errors) is the only place that names a psycopg exception.
    catching = set()
    for path in sorted(LAYER.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.ExceptHandler)
                and node.type is not None
                and "psycopg" in ast.unparse(node.type)
            ):
                catching.add(path.relative_to(LAYER).as_posix())
    assert catching == {"ledger/postgres.py"}


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


# The example jobs this repository ships. A team's own jobs (new-job adds them beside these) may
# share a name with an example in a docstring by chance; the examples may never appear.
EXAMPLE_MODULES = {"jobs.invoice", "jobs.receipt", "jobs.digest"}


def _example_names() -> set[str]:
    """The example jobs' names and the settings they declare (their endpoints)."""
    from jobs import build_registry  # noqa: PLC0415 - the example jobs, on the test path

    examples = [job for job in build_registry() if job.handler.__module__ in EXAMPLE_MODULES]
    names = {job.name for job in examples} | {s for job in examples for s in job.settings}
    assert len(names) >= 5, "the example registry declares no jobs or no settings"
    return names


def test_the_layer_names_no_job_of_the_jobs_package_and_no_endpoint() -> None:
    # The jobs' names, key rules and settings live in functions/jobs; the registry hands them
    # over. The framework's old single downstream setting is gone too.
    forbidden = _example_names() | {"PROVIDER_URL"}
    named = {
        path.name: sorted(forbidden & _code_strings(ast.parse(path.read_text(encoding="utf-8"))))
        for path in MODULES
    }
    assert {name: jobs for name, jobs in named.items() if jobs} == {}
    # Not even as an example in a comment or docstring: the names are the jobs' own
    for path in MODULES:
        text = path.read_text(encoding="utf-8")
        assert "PROVIDER_URL" not in text.replace("infrai-jobs provider-sink", ""), path.name
        assert sorted(name for name in _example_names() if name in text) == [], path.name


# The CLI's own machinery: what runs for every team's jobs. The demo, example-data and the
# provider sink exist to show the example jobs, so they may name them.
CLI_MODULES = sorted(
    path
    for path in (ROOT / "local" / "infrai_local").rglob("*.py")
    if path.name not in {"demo.py", "example_data.py", "provider_sink.py"}
)


@pytest.mark.parametrize("path", CLI_MODULES, ids=lambda p: p.name)
def test_the_cli_names_no_example_job_and_searches_no_path_for_jobs(path: Path) -> None:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    strings = _code_strings(tree)
    # No example job's name or setting: the CLI learns them from the registry
    assert (
        sorted(_example_names() & {word.strip("'\"{}:,") for s in strings for word in s.split()})
        == []
    )
    # And no path search for the jobs package: no function folder named, no walk up from the
    # working directory (a template is read from the working directory, as sam does)
    assert not [s for s in strings if "functions/drain" in s], path.name
    walks_up = [
        ast.unparse(node)
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr == "parents"
        and "cwd" in ast.unparse(node.value)
    ]
    assert walks_up == [], path.name


def _imports_jobs(tree: ast.AST) -> bool:
    """Whether a module imports the jobs package: ``import jobs``, ``from jobs import ...`` or
    ``import_module("jobs")``."""
    for node in ast.walk(tree):
        if "jobs" in {name.split(".")[0] for name in imported_modules(node)} and isinstance(
            node, ast.Import | ast.ImportFrom
        ):
            return True
        if (
            isinstance(node, ast.Call)
            and ast.unparse(node.func).endswith("import_module")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and node.args[0].value == "jobs"
        ):
            return True
    return False


def test_the_cli_imports_the_jobs_package_one_way() -> None:
    # The one import of `jobs` is jobs_package.import_jobs; everything else goes through it
    importing = sorted(
        path.name
        for path in CLI_MODULES
        if _imports_jobs(ast.parse(path.read_text(encoding="utf-8")))
    )
    assert importing == ["jobs_package.py"]
    # And it imports, it does not search: nothing relative to the working directory, no
    # folder of the project spelled out
    tree = ast.parse((ROOT / "local" / "infrai_local" / "jobs_package.py").read_text())
    code = ast.unparse(tree)
    assert "cwd" not in code
    assert "getcwd" not in code
    assert not {"functions", "drain"} & _code_strings(tree)
