"""The team's jobs package, imported by the CLI exactly as every function imports it.

Every function's code root is ``functions/`` (one CodeUri): Lambda puts it on ``sys.path`` and a
handler runs ``from jobs import build_registry``. The ``infrai-jobs`` distribution is the
framework and holds no ``jobs`` package (a team's jobs are the team's code), so a project's
virtualenv puts its code root on the path the same way: ``make venv`` writes a ``.pth`` file
naming ``functions/``, and ``infrai-jobs`` runs ``import jobs`` from whatever folder it is
started in. It imports and does not search: a package found by walking up from the working
directory could differ from the one the venv names, and the two would disagree silently.

``--jobs-path FOLDER`` or ``INFRAI_JOBS_PATH`` names another code root (a folder holding
``jobs/``, laid out like ``functions/``); it is put first on ``sys.path``, as a CodeUri would be.

A package that fails to import (a module's syntax error, or what it raises while imported) is a
configuration error in one line: the module and line of the team's code it came from, the
exception's type and its message (the team's own text, on one line and cut at
``MESSAGE_LIMIT`` characters; the command line masks DATABASE_URL's password in it). Python's
traceback stays chained to it, for a caller that shows tracebacks (pytest).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import traceback
from pathlib import Path
from types import ModuleType
from typing import Final

from infrai_jobs.errors import ConfigurationError
from infrai_jobs.jobs.registry import JobRegistry

JOBS_PATH_ENV: Final = "INFRAI_JOBS_PATH"
# The most of an import error's own message that is shown.
MESSAGE_LIMIT: Final = 300


def import_jobs(explicit: str | None = None) -> ModuleType:
    """The ``jobs`` package: from ``explicit`` (``--jobs-path``) or ``INFRAI_JOBS_PATH`` when
    given, else the one on the path (a project's venv puts its code root there)."""
    _put_on_path(explicit)
    try:
        return importlib.import_module("jobs")
    except Exception as exc:  # whatever the team's modules raise: said in one line, re-raised
        if isinstance(exc, ModuleNotFoundError) and exc.name == "jobs":
            raise _no_jobs_package() from None
        raise _import_failed(exc) from exc


def jobs_folder(explicit: str | None = None) -> Path:
    """The folder of the ``jobs`` package ``import_jobs`` would import, found without running
    it (a check of its source must not depend on its imports working)."""
    _put_on_path(explicit)
    spec = importlib.util.find_spec("jobs")
    if spec is None or spec.origin is None:
        raise _no_jobs_package()
    return Path(spec.origin).parent


def _put_on_path(explicit: str | None) -> None:
    overrides = (("--jobs-path", explicit), (JOBS_PATH_ENV, os.environ.get(JOBS_PATH_ENV)))
    for source, given in overrides:
        if given:
            root = Path(given).expanduser().resolve()
            if not (root / "jobs" / "__init__.py").is_file():
                raise ConfigurationError(
                    f"{source} {given!r} holds no jobs package (no {root / 'jobs'}/__init__.py)"
                )
            if str(root) not in sys.path:
                sys.path.insert(0, str(root))
            break


def _no_jobs_package() -> ConfigurationError:
    return ConfigurationError(
        "no jobs package: pass --jobs-path FOLDER or set "
        f"{JOBS_PATH_ENV} to the code root holding jobs/ (a project's functions/), or put "
        "that folder on the virtualenv's path (`make venv` does it for its project)"
    )


def _import_failed(exc: Exception) -> ConfigurationError:
    """``exc``, raised while importing the jobs package, as one line naming where it came from."""
    text = " ".join((exc.msg if isinstance(exc, SyntaxError) else str(exc)).split())
    if len(text) > MESSAGE_LIMIT:
        text = text[: MESSAGE_LIMIT - 3] + "..."
    return ConfigurationError(
        f"importing the jobs package failed{_where(exc)}: {type(exc).__name__}: {text}"
    )


def _where(exc: Exception) -> str:
    """`` at jobs/x.py, line 43``: the innermost line of the code root's files that ``exc``
    came from (a syntax error's own file and line first), relative to the code root; "" when
    none is (an error inside the import machinery)."""
    try:
        spec = importlib.util.find_spec("jobs")
    except (ImportError, ValueError):
        return ""
    if spec is None or spec.origin is None:
        return ""
    root = Path(spec.origin).resolve().parents[1]
    places = [(frame.filename, frame.lineno) for frame in traceback.extract_tb(exc.__traceback__)]
    if isinstance(exc, SyntaxError) and exc.filename:
        places.append((exc.filename, exc.lineno))
    for filename, line in reversed(places):
        path = Path(filename).resolve()
        if path.is_relative_to(root):
            return f" at {path.relative_to(root)}, line {line}"
    return ""


def load_registry(explicit: str | None = None) -> JobRegistry:
    """``jobs.build_registry()``, the registry every function builds (settings not bound)."""
    registry: JobRegistry = import_jobs(explicit).build_registry()
    return registry


def code_root(explicit: str | None = None) -> Path:
    """The folder holding the imported ``jobs`` package: the functions' CodeUri."""
    return Path(str(import_jobs(explicit).__file__)).resolve().parents[1]


def project_root() -> Path:
    """The project the imported jobs package belongs to (template.yaml, events/): the folder
    holding its code root. ``demo`` uses it, so it runs from any folder."""
    return code_root().parent
