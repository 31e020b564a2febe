"""The drain's jobs package, loaded for the CLI the way DrainFunction loads it.

DrainFunction's code root is ``functions/drain``: Lambda puts it on ``sys.path`` and ``app.py``
runs ``from jobs import build_registry``. The CLI does the same with the folder found here, so
``drain``, ``dlq`` and ``redrive`` derive every key with the registry the function runs; the
layer itself knows no job by name.

Where the folder is looked for, the first that holds ``jobs/__init__.py`` winning:

1. ``--jobs-path`` (an error if it holds no jobs package);
2. ``INFRAI_JOBS_PATH`` (likewise);
3. ``functions/drain`` in the working directory or any folder above it;
4. ``functions/drain`` of the checkout this command is installed from (``pip install -e``).

Without one, the commands that derive keys stop before they read a message: a key derived
without the job's own rule would name no claim, and ``dlq`` would report "no claim" for work
the ledger holds.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Final

from infrai_jobs.errors import ConfigurationError
from infrai_jobs.jobs import JobRegistry

JOBS_PATH_ENV: Final = "INFRAI_JOBS_PATH"
FUNCTION_FOLDER: Final = Path("functions", "drain")
# local/infrai_local/jobs_package.py -> the checkout holding local/.
_INSTALLED_FROM: Final = Path(__file__).resolve().parents[2]


def holds_jobs(folder: Path) -> bool:
    return (folder / "jobs" / "__init__.py").is_file()


def find_jobs_folder(explicit: str | None = None) -> Path:
    """The folder holding the drain's ``jobs`` package; ``ConfigurationError`` names where it
    looked when there is none."""
    given_by = (("--jobs-path", explicit), (JOBS_PATH_ENV, os.environ.get(JOBS_PATH_ENV)))
    for source, given in given_by:
        if given:
            folder = Path(given).expanduser().resolve()
            if not holds_jobs(folder):
                raise ConfigurationError(
                    f"{source} {given!r} holds no jobs package (no {folder / 'jobs'}/__init__.py)"
                )
            return folder
    looked = list(_default_candidates())
    for folder in looked:
        if holds_jobs(folder):
            return folder
    raise ConfigurationError(
        "no jobs package found (looked for functions/drain/jobs in the working directory, the "
        "folders above it and the checkout this command is installed from); run from the "
        f"project, pass --jobs-path FOLDER or set {JOBS_PATH_ENV}"
    )


def _default_candidates() -> Iterator[Path]:
    here = Path.cwd().resolve()
    for folder in (here, *here.parents):
        yield folder / FUNCTION_FOLDER
    yield _INSTALLED_FROM / FUNCTION_FOLDER


def load_registry(folder: Path, provider_url: str) -> JobRegistry:
    """``jobs.build_registry(provider_url)`` from ``folder``, imported as DrainFunction imports
    it (the folder on ``sys.path``, then ``import jobs``)."""
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    jobs = importlib.import_module("jobs")
    origin = Path(getattr(jobs, "__file__", "") or "").resolve()
    if origin.parent.parent != folder:
        raise ConfigurationError(
            f"`import jobs` found {origin}, not the package in {folder}: another module named "
            "jobs comes first on the path"
        )
    registry: JobRegistry = jobs.build_registry(provider_url)
    return registry
