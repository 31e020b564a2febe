"""What the deployed layer may hold and how it hangs together: what the functions import, in
packages on floors, and nothing that belongs to the never-deployed tools (docs/design.md,
"Layout": one home for each rule).

The checks read every module under ``layers/common/infrai_jobs/``, its imports (at the top,
under ``if TYPE_CHECKING:`` and inside functions alike) and the names its code uses, not only
its file name.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from child_process import run_captured

ROOT = Path(__file__).resolve().parents[2]
LAYER = ROOT / "layers" / "common" / "infrai_jobs"
PACKAGE = "infrai_jobs"
MODULES = sorted(LAYER.rglob("*.py"))
MAX_LINES = 600
DESIGN_DOC = ROOT / "docs" / "design.md"

# The layer's floors, in this one place ("" is the root's modules; docs/design.md's "Layout"
# lists the same, and a test below keeps the two equal). A module imports from its own package
# or from a package on a lower floor: never from a higher floor, never from another package on
# its own floor.
FLOORS: dict[str, int] = {
    "": 0,
    "config": 1,
    "jobs": 1,
    "queue": 2,
    "ledger": 2,
    "aws": 3,
    "flow": 3,
    "outbox": 3,
    "work": 4,
    "drain": 5,
    "operations": 5,
    "runtime": 6,
    "handlers": 7,
}
# What the root holds: the package itself, and the modules every floor may share.
ROOT_FILES = {"__init__.py", "errors.py", "queue_contract.py", "py.typed"}

# Only the command line parses arguments, asks who is at the keyboard or imports by name; the
# layer never imports the tools (infrai_local), and only the functions' entry points (handlers/,
# Lambda's Handler) import the team's jobs package: below them the registry hands the jobs over.
FORBIDDEN_IMPORTS = {"infrai_local", "jobs", "argparse", "getpass", "importlib"}
ENTRY_POINTS = "handlers"
# The one module that reads the environment: everything else is handed a Settings.
ENVIRONMENT_READER = LAYER / "config" / "settings.py"
_ENVIRONMENT_NAMES = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}
_IDENTITY_NAMES = {"getuser", "getlogin", "getpwuid", "geteuid", "getuid"}


def _id(path: Path) -> str:
    return path.relative_to(LAYER).as_posix()


def _every_module() -> list[object]:
    """Every module, as a test parameter named by its path in the layer."""
    return [pytest.param(path, id=_id(path)) for path in MODULES]


def module_name(path: Path) -> str:
    """``infrai_jobs.ledger.postgres`` for ``ledger/postgres.py``; a package for its
    ``__init__.py``."""
    parts = path.relative_to(LAYER).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join((PACKAGE, *parts))


LAYER_MODULES = {module_name(path): path for path in MODULES}


def package_of(module: str) -> str:
    """The package a layer module belongs to: "" for the root's modules."""
    parts = LAYER_MODULES[module].relative_to(LAYER).parts
    return parts[0] if len(parts) > 1 else ""


def floor_of(module: str) -> int:
    return FLOORS[package_of(module)]


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def imports_of(path: Path) -> Iterator[tuple[str, int]]:
    """Every module ``path`` imports and the line it does so on, wherever the import stands;
    relative imports resolved, and ``from package import module`` counted as that module."""
    name = module_name(path)
    here = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            yield module, node.lineno
            for alias in node.names:
                if f"{module}.{alias.name}" in LAYER_MODULES:
                    yield f"{module}.{alias.name}", node.lineno


def layer_imports(path: Path) -> set[str]:
    """The layer's own modules that ``path`` imports (itself excluded)."""
    own = module_name(path)
    return {m for m, _ in imports_of(path) if m in LAYER_MODULES and m != own}


def _names(tree: ast.AST) -> set[str]:
    """Every name and attribute the code uses, and every name it imports (as is and as bound)."""
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    names |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names |= {alias.name.rpartition(".")[2] for alias in node.names}
            names |= {alias.asname for alias in node.names if alias.asname}
    return names


# --- The shape: a root of shared modules, packages on floors -----------------------------------


def test_the_root_holds_only_the_shared_modules_and_the_packages() -> None:
    entries = [entry for entry in LAYER.iterdir() if entry.name != "__pycache__"]
    files = {entry.name for entry in entries if entry.is_file()}
    folders = {entry.name for entry in entries if entry.is_dir()}
    assert files == ROOT_FILES
    assert folders == set(FLOORS) - {""}
    # Every module is in a package with a floor: no module without a package, none nested deeper
    for path in MODULES:
        parts = path.relative_to(LAYER).parts
        assert len(parts) <= 2, f"{_id(path)} is nested below a package"
    for package in folders:
        assert (LAYER / package / "__init__.py").is_file(), f"{package}/ is not a package"


@pytest.mark.parametrize("package", sorted(set(FLOORS) - {""}))
def test_each_package_says_in_one_line_what_it_owns(package: str) -> None:
    docstring = ast.get_docstring(_tree(LAYER / package / "__init__.py")) or ""
    # One line, and more than its own name (the placeholder the split left)
    assert len(docstring.splitlines()) == 1, docstring
    assert docstring.rstrip(".").strip().lower() != package
    assert len(docstring.split()) >= 5, docstring


def documented_floors() -> dict[str, int]:
    """The floors docs/design.md's "Layout" lists: ``- floor N...: `name/` (...), ...``."""
    text = DESIGN_DOC.read_text(encoding="utf-8")
    layout = text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    floors: dict[str, int] = {}
    for match in re.finditer(r"^- floor (\d+)[^:]*:(.*(?:\n  .*)*)", layout, re.MULTILINE):
        floor = int(match.group(1))
        for name in re.findall(r"`([\w.]+/?)`", match.group(2)):
            floors["" if name.endswith(".py") else name.rstrip("/")] = floor
    return floors


def test_the_design_doc_lists_the_same_floors() -> None:
    assert documented_floors() == FLOORS


def test_every_import_of_the_layer_names_one_of_its_modules() -> None:
    # Else the floor and cycle checks below would not see it
    unknown = sorted(
        f"{_id(path)}:{line}: {module}"
        for path in MODULES
        for module, line in imports_of(path)
        if module.split(".")[0] == PACKAGE and module not in LAYER_MODULES
    )
    assert unknown == []


@pytest.mark.parametrize("path", _every_module())
def test_a_module_imports_only_its_own_package_or_a_lower_floor(path: Path) -> None:
    own = package_of(module_name(path))
    wrong = sorted(
        f"line {line}: {module} (floor {floor_of(module)})"
        for module, line in imports_of(path)
        if module in LAYER_MODULES and package_of(module) != own and floor_of(module) >= FLOORS[own]
    )
    assert wrong == [], f"{_id(path)} (floor {FLOORS[own]}) imports upward or sideways"


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(cycles)


def test_the_cycle_finder_finds_a_cycle() -> None:
    # Given modules a -> b -> c -> a, and d -> a outside the cycle
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    # Then exactly that cycle is found, and none once it is broken
    assert import_cycles(graph) == [["a", "b", "c"]]
    assert import_cycles({**graph, "c": set()}) == []


def test_no_import_cycle_between_layer_modules() -> None:
    # Including the imports under `if TYPE_CHECKING:` and inside functions: a cycle there is
    # still two modules that cannot be understood (or moved) one without the other
    graph = {module: layer_imports(path) for module, path in LAYER_MODULES.items()}
    assert import_cycles(graph) == []


# --- Nothing of the command line, the tools or the environment ----------------------------------


@pytest.mark.parametrize("path", MODULES, ids=_id)
def test_a_layer_module_imports_nothing_of_the_tools_the_jobs_or_the_command_line(
    path: Path,
) -> None:
    imported = {module for module, _ in imports_of(path)}
    forbidden = (
        FORBIDDEN_IMPORTS - {"jobs"} if _id(path).startswith(ENTRY_POINTS) else FORBIDDEN_IMPORTS
    )
    upward = sorted(name for name in imported if name.split(".")[0] in forbidden)
    assert upward == [], f"{_id(path)} imports {upward}"
    assert "import_module" not in _names(_tree(path))


@pytest.mark.parametrize("path", MODULES, ids=_id)
def test_the_layer_never_asks_who_the_operator_is(path: Path) -> None:
    # The command line names who is acting (OPERATOR, else the login name); the layer records
    # the actor its caller names
    tree = _tree(path)
    assert not _IDENTITY_NAMES & _names(tree), _id(path)
    assert "OPERATOR" not in _code_strings(tree), _id(path)


@pytest.mark.parametrize("path", _every_module())
def test_only_the_settings_module_reads_the_environment(path: Path) -> None:
    if path == ENVIRONMENT_READER:
        # The one reader: if it stopped reading, this rule would point at the wrong module
        assert "environ" in _names(_tree(path))
        return
    used = sorted(_ENVIRONMENT_NAMES & _names(_tree(path)))
    assert used == [], f"{_id(path)} reads the environment: {used}"


# The schema is the ledger's SQL files (work/migrations/NNNN_name.sql): shipped in the layer,
# applied only by the tools in local/. The layer's code reads the version a database is at and
# never creates or alters a table (nor a temporary or unlogged one).
_DDL = re.compile(r"\b(?:CREATE|ALTER)\s+(?:[A-Z]+\s+){0,2}TABLE\b")


@pytest.mark.parametrize("path", MODULES, ids=_id)
def test_the_layer_holds_no_ddl(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    lines = [text.count("\n", 0, match.start()) + 1 for match in _DDL.finditer(text)]
    where = "a migration is a new SQL file in work/migrations/"
    assert lines == [], f"{_id(path)} creates or alters a table: {where}"


def test_importing_the_settings_loads_no_database_driver() -> None:
    # Given a fresh interpreter (nothing imported yet), When it imports the settings
    script = (
        "import sys, infrai_jobs.config.settings\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'psycopg'))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(LAYER.parent)}
    finished = run_captured([sys.executable, "-c", script], env=env)
    # Then it ran, and psycopg was not among what it loaded
    assert finished.returncode == 0, finished.stderr
    assert finished.stdout.strip() == "[]"


# --- Size, files, exceptions ---------------------------------------------------------------------


@pytest.mark.parametrize("path", MODULES, ids=_id)
def test_no_layer_module_is_over_600_lines(path: Path) -> None:
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_LINES, f"{_id(path)} has {lines} lines"


# The drain's layer as a whole, the producers' package (outbox/) aside: one state machine and one
# settings table took it under 10,800, and it stays there with the functions' five entry points
# (handlers/) inside it. A feature that needs more should first find a mechanism to change
# instead of a second one to add.
MAX_LAYER_LINES = 10_800


def test_the_layer_without_the_outbox_stays_within_its_size() -> None:
    counted = [path for path in MODULES if _id(path).split("/")[0] != "outbox"]
    total = sum(len(path.read_text(encoding="utf-8").splitlines()) for path in counted)
    assert total <= MAX_LAYER_LINES, f"the layer (outbox/ aside) has {total} lines"


def test_the_layer_ships_no_fakes_and_no_command_line() -> None:
    shipped = {path.name for path in MODULES}
    assert len(shipped) > len(FLOORS)  # the walk found the packages' modules
    assert not shipped & {"testing.py", "fakes.py", "cli.py", "cli_ops.py", "operator.py"}


def test_every_public_exception_class_is_in_errors() -> None:
    elsewhere = []
    for name in sorted(LAYER_MODULES):
        module = importlib.import_module(name)
        for attribute, value in vars(module).items():
            if (
                inspect.isclass(value)
                and issubclass(value, BaseException)
                and value.__module__ == module.__name__
                and not attribute.startswith("_")
                and name != f"{PACKAGE}.errors"
            ):
                elsewhere.append(f"{name}.{attribute}")
    assert elsewhere == []
    # And the command line's own complaint (argparse's) is not among the layer's errors
    errors = importlib.import_module(f"{PACKAGE}.errors")
    assert not hasattr(errors, "UsageError")


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


def test_claim_history_has_one_writer_in_the_layer() -> None:
    # Every change an operator, the watcher, the drain or a redrive records goes through
    # ledger.postgres.record_history; the command line's changes call it too.
    writers = {
        path.relative_to(LAYER).as_posix()
        for path in MODULES
        if any(
            "insert into claim_history" in " ".join(text.lower().split())
            for text in _code_strings(_tree(path))
        )
    }
    assert writers == {"ledger/postgres.py"}


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


# The example jobs' names as this repository ships them (functions/jobs), with the settings they
# declare (their endpoints); the framework tests' fixture jobs answer to the same names. Written
# here, not read from the jobs package: the layer may never name them, whatever a team did to the
# examples (kept, changed or deleted). A team's own jobs may share a word with them by chance.
EXAMPLE_NAMES = frozenset(
    {"invoice.finalize", "receipt.send", "digest.build", "MAIL_PROVIDER_URL", "DIGEST_PROVIDER_URL"}
)


def test_the_layer_names_no_job_of_the_jobs_package_and_no_endpoint() -> None:
    # The jobs' names, key rules and settings live in functions/jobs; the registry hands them
    # over. The framework's old single downstream setting is gone too.
    forbidden = EXAMPLE_NAMES | {"PROVIDER_URL"}
    named = {
        path.name: sorted(forbidden & _code_strings(ast.parse(path.read_text(encoding="utf-8"))))
        for path in MODULES
    }
    assert {name: jobs for name, jobs in named.items() if jobs} == {}
    # Not even as an example in a comment or docstring: the names are the jobs' own
    for path in MODULES:
        text = path.read_text(encoding="utf-8")
        assert "PROVIDER_URL" not in text.replace("infrai-jobs provider-sink", ""), path.name
        assert sorted(name for name in EXAMPLE_NAMES if name in text) == [], path.name


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
        sorted(EXAMPLE_NAMES & {word.strip("'\"{}:,") for s in strings for word in s.split()}) == []
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


def imported_modules(tree: ast.AST) -> set[str]:
    """The modules a (CLI) module's code imports, as written."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


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
