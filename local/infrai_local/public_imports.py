"""What a team's job modules may import from the framework, and the check that holds them to it.

The public job API is a short list of names, each at one import path (docs/upgrading.md, "What is
public"). Everything else in ``infrai_jobs`` and ``infrai_local`` is internal and may move in any
release; a job that imports it breaks on an upgrade that changes nothing it was promised, and
because every function imports every job module, one such import stops every job. So the
scaffold writes only public imports, and a team's tests run :func:`refused_imports` over its
jobs package (``infrai_local.testkit.assert_public_imports`` does, in the test ``new-job`` writes
once, ``tests/unit/test_jobs_import_public_api.py``) to catch an internal import the day it is
written rather than the day of an upgrade.

The check reads the source with :mod:`ast`; it imports nothing and runs nothing.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Final

# The public job API: import path -> the names a job module may take from it. A name moves here
# only in a release that keeps the old path working and deprecated (docs/upgrading.md).
PUBLIC_API: Final[Mapping[str, frozenset[str]]] = {
    "infrai_jobs.jobs.registry": frozenset(
        {"JobRegistry", "Effect", "JobContext", "JsonValue", "Payload"}
    ),
    "infrai_jobs.errors": frozenset({"PermanentJobError", "EffectUncertain"}),
    "infrai_jobs.jobs.probes": frozenset({"Done", "NotDone", "Unknown", "ProbeAnswer"}),
    "infrai_jobs.jobs.policy": frozenset({"RetryPolicy", "RateLimit", "ConcurrencyLimit"}),
    "infrai_jobs.jobs.payload_schema": frozenset({"Field"}),
    "infrai_jobs.jobs.http_pool": frozenset({"LazyPool"}),
    "infrai_jobs.outbox": frozenset({"enqueue"}),
    "infrai_jobs.queue.producer": frozenset({"publish_checked"}),
    "infrai_local.testkit": frozenset(
        {"JobKit", "JobKitError", "Route", "assert_public_imports", "open_job_kit"}
    ),
}
FRAMEWORK: Final = ("infrai_jobs", "infrai_local")
_HOME: Final = {name: module for module, names in PUBLIC_API.items() for name in names}


def refused_imports(paths: Iterable[Path]) -> list[str]:
    """One line per import of the framework that is not public, naming what to import instead.

    ``paths`` are Python files or folders (searched for ``*.py``); an empty list means every
    import is public. A file that does not parse is reported as such, not skipped.
    """
    found: list[str] = []
    for file in sorted(_python_files(paths)):
        try:
            tree = ast.parse(file.read_text(encoding="utf-8"), filename=str(file))
        except (SyntaxError, UnicodeDecodeError) as exc:
            found.append(f"{file}: cannot be read as Python ({exc})")
            continue
        found.extend(f"{file}:{line}: {why}" for line, why in _refusals(tree))
    return found


def _python_files(paths: Iterable[Path]) -> Iterable[Path]:
    for path in paths:
        if path.is_dir():
            yield from (p for p in path.rglob("*.py") if "__pycache__" not in p.parts)
        else:
            yield path


def _refusals(tree: ast.AST) -> Iterable[tuple[int, str]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_framework(alias.name) and alias.name not in PUBLIC_API:
                    yield node.lineno, f"`import {alias.name}` is internal; {_instead(None)}"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _is_framework(node.module):
            yield from ((node.lineno, why) for why in _from_refusals(node))


def _from_refusals(node: ast.ImportFrom) -> Iterable[str]:
    allowed = PUBLIC_API.get(node.module or "", frozenset())
    for alias in node.names:
        if alias.name in allowed:
            continue
        where = f"`from {node.module} import {alias.name}`"
        if alias.name in _HOME:
            home = _HOME[alias.name]
            yield f"{where} is not a public path: use `from {home} import {alias.name}`"
        else:
            yield f"{where} is internal and may move in any release; {_instead(alias.name)}"


def _is_framework(module: str | None) -> bool:
    return module is not None and module.split(".", maxsplit=1)[0] in FRAMEWORK


def _instead(name: str | None) -> str:
    public = ", ".join(
        f"{module} ({', '.join(sorted(names))})" for module, names in PUBLIC_API.items()
    )
    subject = f"{name} is not part of the job API" if name else "import names, not modules"
    return f"{subject}; the public imports are: {public} (docs/upgrading.md)"
