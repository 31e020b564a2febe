"""A function's handler module, imported afresh for a test. Importable from every test folder,
as ``child_process`` is."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from fixture_project import fixture_jobs_as_jobs

HANDLERS = Path(__file__).resolve().parent.parent / "layers" / "common" / "infrai_jobs" / "handlers"


def load_function_app(function: str) -> Any:
    """``infrai_jobs/handlers/FUNCTION.py``, the function's entry point, as a new module of its
    own, not the one ``import`` caches:
    what it reads and builds at import (its settings, its cached adapters) starts from nothing,
    under the environment the test set. Its ``jobs`` is the fixture code root's package."""
    spec = importlib.util.spec_from_file_location(
        f"{function}_app_under_test", HANDLERS / f"{function}.py"
    )
    assert spec is not None
    assert spec.loader is not None
    app = importlib.util.module_from_spec(spec)
    # It binds the jobs package when imported: the fixture jobs, never the team's.
    with fixture_jobs_as_jobs():
        spec.loader.exec_module(app)
    return app
