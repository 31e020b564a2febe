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
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Final

from infrai_jobs.errors import ConfigurationError
from infrai_jobs.jobs.registry import JobRegistry

JOBS_PATH_ENV: Final = "INFRAI_JOBS_PATH"


def import_jobs(explicit: str | None = None) -> ModuleType:
    """The ``jobs`` package: from ``explicit`` (``--jobs-path``) or ``INFRAI_JOBS_PATH`` when
    given, else the one on the path (a project's venv puts its code root there)."""
    _put_on_path(explicit)
    try:
        return importlib.import_module("jobs")
    except ModuleNotFoundError as exc:
        if exc.name != "jobs":
            raise
        raise _no_jobs_package() from None


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
