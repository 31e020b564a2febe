"""The project as deployed, with the fixture jobs in place of the team's: what the end-to-end
tests invoke. Importable from every test folder, as ``child_process`` is.

``infrai-jobs invoke`` runs a function with its CodeUri (``functions/``) and the layer on the
path, so its ``jobs`` package is whatever that folder holds. This project's ``functions/`` holds
the real handlers (linked, not copied) beside the fixture code root's ``jobs`` and
``fixture_jobs`` packages; ``template.yaml``, ``samconfig.toml``, ``events/`` and the layer are
the repository's own.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import fixture_jobs

ROOT = Path(__file__).resolve().parent.parent


def build_fixture_project(folder: Path) -> Path:
    """Lay the project out in ``folder`` (an empty or missing one) and return it."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("template.yaml", "samconfig.toml"):
        shutil.copyfile(ROOT / name, folder / name)
    shutil.copytree(ROOT / "events", folder / "events")
    (folder / "layers").symlink_to(ROOT / "layers", target_is_directory=True)
    code = folder / "functions"
    code.mkdir()
    for handler in (ROOT / "functions").iterdir():
        if (handler / "app.py").is_file():
            (code / handler.name).symlink_to(handler, target_is_directory=True)
    for package in ("jobs", "fixture_jobs"):
        (code / package).symlink_to(fixture_jobs.CODE_ROOT / package, target_is_directory=True)
    return folder
