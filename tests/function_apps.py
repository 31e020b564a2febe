"""A function's handler module, imported afresh for a test. Importable from every test folder,
as ``child_process`` is."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

FUNCTIONS = Path(__file__).resolve().parent.parent / "functions"


def load_function_app(function: str) -> Any:
    """``functions/FUNCTION/app.py`` as a new module of its own, not the one ``import`` caches:
    what it reads and builds at import (its settings, its cached adapters) starts from nothing,
    under the environment the test set."""
    spec = importlib.util.spec_from_file_location(
        f"{function}_app_under_test", FUNCTIONS / function / "app.py"
    )
    assert spec is not None
    assert spec.loader is not None
    app = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(app)
    return app
