"""What the scripts that measure one part of a run share: ``--json``, ``--update`` and the
update itself (that part replaced in stored results files, the chart and page regenerated)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


def add_output_options(parser: argparse.ArgumentParser, *, update_help: str) -> None:
    """``--json`` (print the full result) and ``--update RESULTS_JSON...``, described by
    ``update_help``."""
    parser.add_argument("--json", action="store_true", help="print the full result as JSON")
    parser.add_argument("--update", type=Path, nargs="+", metavar="RESULTS_JSON", help=update_help)


def update_results(paths: list[Path], change: Callable[[Path, dict[str, Any]], None]) -> None:
    """Apply ``change`` to each results file (its path and its document) and rewrite it, then
    regenerate the chart and ``docs/performance.md`` from the first (``report.main``)."""
    import report  # noqa: PLC0415 - only an update needs the report (and matplotlib)

    for path in paths:
        document = json.loads(path.read_text())
        change(path, document)
        path.write_text(json.dumps(document, indent=2) + "\n")
    report.main([str(paths[0])])
