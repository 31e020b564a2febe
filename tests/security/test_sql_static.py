"""Every SQL statement is static and parameterised: checked on the source, not by review.

The check parses (never imports) every module that talks to PostgreSQL and fails on SQL built from
strings at run time: an f-string, ``%``-formatting, ``+`` concatenation or ``str.format`` as the
statement of an ``execute()``, directly or through a variable, and any such construction whose
text reads like SQL anywhere in those modules. Constants, ``LiteralString`` parameters and
``psycopg.sql`` compositions (``sql.SQL(...).format(sql.Identifier(...))``) are fine.
"""

from __future__ import annotations

import ast
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEPLOYED = [
    *sorted((ROOT / "layers" / "common" / "infrai_jobs").rglob("*.py")),
    *sorted((ROOT / "functions").rglob("*.py")),
]
LOCAL_TOOLS = sorted((ROOT / "local" / "infrai_local").rglob("*.py"))
EXECUTE_METHODS = {"execute", "executemany"}
# A statement starts with one of these; messages that merely mention SQL ("run ALTER ROLE ...")
# do not, and are not statements.
SQL_START = re.compile(
    r"\s*(SELECT|INSERT|UPDATE|DELETE|CREATE|ALTER|DROP|TRUNCATE|GRANT|WITH|BEGIN)\b"
)
# Annotations under which a value is static SQL: mypy --strict enforces LiteralString at every
# call site, and psycopg.sql objects quote what they compose.
SAFE_ANNOTATIONS = {"LiteralString", "SQL", "Composed", "Composable", "Query"}


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    problem: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.problem}"


Function = ast.FunctionDef | ast.AsyncFunctionDef


class _Checker(ast.NodeVisitor):
    """Finds execute() calls and string-built SQL; resolves names through their scopes."""

    def __init__(self, tree: ast.Module, path: str, *, strict_parameters: bool) -> None:
        self.path = path
        self.strict_parameters = strict_parameters
        self.findings: list[Finding] = []
        self.calls = 0
        self.module_scope = _Scope(tree.body, [])
        self.stack: list[_Scope] = []
        # The module's own functions whose result mypy --strict holds to LiteralString: a call
        # to one of them with static arguments is static text.
        self.literal_functions = {
            node.name
            for node in tree.body
            if isinstance(node, ast.FunctionDef)
            and node.returns is not None
            and ast.unparse(node.returns).rsplit(".", 1)[-1] == "LiteralString"
        }
        # Names imported from the project's own modules: static when their home module
        # annotates them LiteralString (mypy --strict holds that everywhere).
        self.imported = {
            alias.asname or alias.name: (node.module, alias.name)
            for node in tree.body
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
            for alias in node.names
        }

    @property
    def scope(self) -> _Scope:
        return self.stack[-1] if self.stack else self.module_scope

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._visit_function(node)

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> None:
        self._visit_function(node)

    def _visit_function(self, node: Function) -> None:
        arguments = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
        self.stack.append(_Scope(node.body, arguments))
        self.generic_visit(node)
        self.stack.pop()

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in EXECUTE_METHODS and node.args:
            self.calls += 1
            problem = self._statement_problem(node.args[0])
            if problem:
                self._report(node, f"{func.attr}() runs {problem}")
        self.generic_visit(node)

    def generic_visit(self, node: ast.AST) -> None:
        if isinstance(node, ast.expr):
            built = self.building(node)
            if built and SQL_START.match(_literal_text(node)):
                self._report(node, f"SQL-looking text built by {built}")
        super().generic_visit(node)

    def _report(self, node: ast.AST, problem: str) -> None:
        self.findings.append(Finding(self.path, getattr(node, "lineno", 0), problem))

    def _statement_problem(self, statement: ast.expr) -> str | None:
        built = self.building(statement)
        if built:
            return f"SQL built by {built}"
        if isinstance(statement, ast.Name):
            return self._name_problem(statement.id)
        return None  # a constant, a psycopg.sql composition, an attribute of a constant

    def _name_problem(self, name: str) -> str | None:
        for scope in [*reversed(self.stack), self.module_scope]:
            if name in scope.parameters:
                annotation = scope.parameters[name]
                if annotation.rsplit(".", 1)[-1] in SAFE_ANNOTATIONS or not self.strict_parameters:
                    return None
                return f"parameter {name!r} annotated {annotation or 'nothing'}, not LiteralString"
            for value in scope.bindings.get(name, []):
                if built := self.building(value):
                    return f"{name!r}, SQL built by {built}"
            if name in scope.bindings:
                return None
        return None

    def building(self, node: ast.expr) -> str | None:
        """How ``node`` builds a string from run-time values, or None when it does not."""
        if isinstance(node, ast.JoinedStr) and any(
            isinstance(part, ast.FormattedValue) for part in node.values
        ):
            return "an f-string"
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod) and _stringish(node.left):
            return "%-formatting"
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            strings = _stringish(node.left) or _stringish(node.right)
            if strings and not (self.static(node.left) and self.static(node.right)):
                return "+ concatenation"
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "format"
            and _stringish(node.func.value)
        ):
            return "str.format()"
        return None

    def static(self, node: ast.expr, seen: frozenset[str] = frozenset()) -> bool:
        """Whether ``node`` is text fixed when the code is written (LiteralString in spirit)."""
        if isinstance(node, ast.Constant):
            return isinstance(node.value, str)
        if isinstance(node, ast.JoinedStr):
            return self.building(node) is None
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return self.static(node.left, seen) and self.static(node.right, seen)
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in self.literal_functions
        ):
            arguments = [*node.args, *(keyword.value for keyword in node.keywords)]
            return all(self.static(argument, seen) for argument in arguments)
        if isinstance(node, ast.Name) and node.id not in seen:
            for scope in [*reversed(self.stack), self.module_scope]:
                if node.id in scope.parameters:
                    annotation = scope.parameters[node.id].rsplit(".", 1)[-1]
                    return annotation in SAFE_ANNOTATIONS
                if scope.annotations.get(node.id, "").rsplit(".", 1)[-1] in SAFE_ANNOTATIONS:
                    return True
                if node.id in scope.bindings:
                    values = scope.bindings[node.id]
                    return all(self.static(v, seen | {node.id}) for v in values)
            if node.id in self.imported:
                return _imported_literal(*self.imported[node.id])
        return False


class _Scope:
    def __init__(self, body: list[ast.stmt], arguments: list[ast.arg]) -> None:
        self.parameters = {
            a.arg: ast.unparse(a.annotation) if a.annotation else "" for a in arguments
        }
        self.bindings: dict[str, list[ast.expr]] = {}
        self.annotations: dict[str, str] = {}
        for statement in body:
            for node in _walk_without_functions(statement):
                if isinstance(node, ast.Assign):
                    for target in node.targets:
                        if isinstance(target, ast.Name):
                            self.bindings.setdefault(target.id, []).append(node.value)
                elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    self.annotations[node.target.id] = ast.unparse(node.annotation)
                    if node.value is not None:
                        self.bindings.setdefault(node.target.id, []).append(node.value)
                elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
                    self.bindings.setdefault(node.target.id, []).append(
                        ast.BinOp(ast.Name(node.target.id), node.op, node.value)
                    )


# Where the project's own packages live, for names one module imports from another.
PACKAGE_ROOTS = {
    "infrai_jobs": ROOT / "layers" / "common" / "infrai_jobs",
    "infrai_local": ROOT / "local" / "infrai_local",
}


def _imported_literal(module: str, name: str) -> bool:
    """Whether ``module`` (one of the project's) annotates its module-level ``name`` as
    LiteralString; False for anything else, or a module this check cannot find."""
    package, _, rest = module.partition(".")
    if package not in PACKAGE_ROOTS:
        return False
    path = PACKAGE_ROOTS[package].joinpath(*rest.split(".")).with_suffix(".py") if rest else None
    if path is None or not path.is_file():
        return False
    scope = _Scope(ast.parse(path.read_text()).body, [])
    return scope.annotations.get(name, "").rsplit(".", 1)[-1] in SAFE_ANNOTATIONS


def _walk_without_functions(node: ast.AST) -> list[ast.AST]:
    """The nodes of one scope: nested functions and classes have scopes of their own."""
    found = [node]
    for child in ast.iter_child_nodes(node):
        if not isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            found += _walk_without_functions(child)
    return found


def _stringish(node: ast.expr) -> bool:
    return isinstance(node, ast.JoinedStr) or (
        isinstance(node, ast.Constant) and isinstance(node.value, str)
    )


def _literal_text(node: ast.expr) -> str:
    """The literal text inside a string construction (to tell SQL from messages)."""
    return " ".join(
        part.value
        for part in ast.walk(node)
        if isinstance(part, ast.Constant) and isinstance(part.value, str)
    )


def check_source(
    source: str, path: str = "<source>", *, strict_parameters: bool = True
) -> tuple[list[Finding], int]:
    """Findings in one module's source, and how many execute() calls it has.

    ``strict_parameters``: a statement received as a parameter must be annotated
    ``LiteralString`` (or a psycopg.sql type). Required of deployed code; the local tools' test
    helpers take ``str`` and are held to the other rules only.
    """
    tree = ast.parse(source, filename=path)
    checker = _Checker(tree, path, strict_parameters=strict_parameters)
    checker.visit(tree)
    return sorted(set(checker.findings), key=lambda f: f.line), checker.calls


# --- The checker itself -----------------------------------------------------------------------

STRING_BUILT = {
    "f-string": 'conn.execute(f"SELECT * FROM t WHERE k = {key}")',
    "percent": "conn.execute(\"SELECT * FROM t WHERE k = '%s'\" % key)",
    "concatenation": 'cur.execute("DELETE FROM t WHERE k = \'" + key + "\'")',
    "format": 'conn.execute("UPDATE t SET v = {}".format(v))',
    "via a variable": 'query = f"DROP TABLE {name}"\nconn.execute(query)',
    "via a str parameter": "def run(conn, query: str):\n    conn.execute(query)",
    "a constant joined to a value": '_B = "SELECT * FROM t WHERE k = " + key\nconn.execute(_B)',
    "built away from execute": 'QUERY = "SELECT a FROM t WHERE b = " + str(b)',
    "a LiteralString function of a run-time value": (
        "def part(row: LiteralString) -> LiteralString:\n    return row\n"
        '_Q = "SELECT " + part(name) + " FROM t"\nconn.execute(_Q)'
    ),
    "a function that is not LiteralString": (
        'def part(row):\n    return row\n_Q = "SELECT " + part("c") + " FROM t"\nconn.execute(_Q)'
    ),
    "joined to an import that is not LiteralString": (
        'from infrai_jobs.ledger.postgres import MASK\n_Q = "SELECT " + MASK\nconn.execute(_Q)'
    ),
}
STATIC = {
    "constant": 'conn.execute("SELECT 1")',
    "module constant": (
        '_Q: LiteralString = "SELECT %(k)s"\ndef f(conn):\n    conn.execute(_Q, {"k": 1})'
    ),
    "constants joined": '_A = "SELECT 1"\n_B = "BEGIN;\\n" + _A\nconn.execute(_B)',
    "LiteralString parameter": "def run(conn, q: LiteralString):\n    conn.execute(q, {})",
    "sql composition": (
        'conn.execute(sql.SQL("DROP DATABASE {}").format(sql.Identifier(name)))\n'
        '_C = sql.SQL("CREATE DATABASE {}")\nconn.execute(_C.format(sql.Identifier(n)))'
    ),
    "messages that are not SQL": 'raise ValueError(f"job {name!r} is missing field {field}")',
    "joined to an imported LiteralString": (
        "from infrai_jobs.work.statements import CLAIM_COLUMNS\n"
        '_Q = "SELECT " + CLAIM_COLUMNS + " FROM job_claims"\nconn.execute(_Q)'
    ),
    "joined to a LiteralString function of static text": (
        'def part(row: LiteralString) -> LiteralString:\n    return row + ".lease_until"\n'
        '_Q = "SELECT " + part("c") + " FROM job_claims c"\nconn.execute(_Q)'
    ),
}


@pytest.mark.parametrize("source", STRING_BUILT.values(), ids=STRING_BUILT.keys())
def test_the_checker_catches_string_built_sql(source: str) -> None:
    # Given source that builds a statement from strings at run time
    # When it is checked
    findings, _ = check_source(textwrap.dedent(source))
    # Then it is reported
    assert findings, source


@pytest.mark.parametrize("source", STATIC.values(), ids=STATIC.keys())
def test_the_checker_accepts_static_sql(source: str) -> None:
    # Given source whose statements are constants or psycopg.sql compositions
    # When it is checked
    findings, _ = check_source(textwrap.dedent(source))
    # Then nothing is reported
    assert findings == []


# --- The code ---------------------------------------------------------------------------------


def test_every_sql_statement_in_the_code_is_static_and_parameterised() -> None:
    # Given every module of the package, the functions and the local tools
    findings: list[Finding] = []
    calls = 0
    for path in DEPLOYED + LOCAL_TOOLS:
        # When each is parsed and its execute() calls resolved
        found, counted = check_source(
            path.read_text(), str(path.relative_to(ROOT)), strict_parameters=path in DEPLOYED
        )
        findings += found
        calls += counted
    # Then the check saw the ledger's statements, and none of them is built from strings
    assert calls >= 30, f"only {calls} execute() calls found: is the check looking?"
    assert [str(f) for f in findings] == []
