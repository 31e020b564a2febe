"""What the scripts that measure one part of a run share: ``--json``, ``--update`` and the
update itself (that part replaced in stored results files, the chart and page regenerated), and
the times and load averages a result opens with (``Span``)."""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any


def _load_average() -> list[float]:
    return [round(v, 2) for v in os.getloadavg()]


@dataclass(frozen=True)
class Span:
    """A measuring run, from the moment it is made: when it began and the load average then."""

    started_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    started: float = field(default_factory=time.monotonic)
    load_before: list[float] = field(default_factory=_load_average)

    def times(self) -> dict[str, Any]:
        """When it was measured, how long it has taken, and the load average before and now."""
        return {
            "measured_at": self.started_at.isoformat(timespec="seconds"),
            "duration_s": round(time.monotonic() - self.started, 1),
            "load_average_before": self.load_before,
            "load_average_after": _load_average(),
        }


def measured_by(script: str, result: Mapping[str, Any], nproc: int) -> str:
    """The sentence a section of ``docs/performance.md`` opens with: which script measured it,
    when, for how long, and the load average around it on this shared machine."""
    before, after = result["load_average_before"], result["load_average_after"]
    return (
        f"Measured by `bench/{script}` ({result['measured_at']}, {result['duration_s']:.0f} s; "
        f"load average {before[0]:g}, {before[1]:g}, {before[2]:g} before and {after[0]:g}, "
        f"{after[1]:g}, {after[2]:g} after, on {nproc} CPUs shared with other work). "
    )


def add_output_options(
    parser: argparse.ArgumentParser, *, stored_under: str = "", update_help: str = ""
) -> None:
    """``--json`` (print the full result) and ``--update RESULTS_JSON...``: described by
    ``update_help``, or as storing the result under its key ``stored_under``."""
    if stored_under:
        update_help = (
            f"store the result under {stored_under} in these results files and "
            "regenerate the chart and docs/performance.md from the first"
        )
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
