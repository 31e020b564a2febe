"""The console's chart, drawn on the server as SVG: what settled per minute over the last hour,
stacked by outcome (done, failed, dead-lettered), from the ledger's own rows."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Final

from markupsafe import Markup, escape

MINUTES: Final = 60
OUTCOMES: Final = ("done", "failed", "dead_letter")
_LABELS: Final = {"done": "done", "failed": "failed", "dead_letter": "dead-lettered"}
_WIDTH, _HEIGHT, _LEFT, _BOTTOM, _TOP = 720, 200, 36, 24, 12


@dataclass(frozen=True, slots=True)
class Minute:
    start: datetime
    counts: Mapping[str, int]

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def minutes(now_minute: datetime, rows: Iterable[Mapping[str, Any]]) -> list[Minute]:
    """The last hour, oldest minute first, ending with ``now_minute``; minutes with nothing
    settled count zero, and rows outside the hour are left out."""
    first = now_minute - timedelta(minutes=MINUTES - 1)
    table: dict[datetime, dict[str, int]] = {
        first + timedelta(minutes=i): dict.fromkeys(OUTCOMES, 0) for i in range(MINUTES)
    }
    for row in rows:
        counts = table.get(row["minute"])
        if counts is not None and row["outcome"] in counts:
            counts[row["outcome"]] += int(row["n"])
    return [Minute(start, counts) for start, counts in table.items()]


def totals(series: Iterable[Minute]) -> dict[str, int]:
    out = dict.fromkeys(OUTCOMES, 0)
    for minute in series:
        for outcome, n in minute.counts.items():
            out[outcome] += n
    return out


def svg(series: list[Minute]) -> Markup:
    """Stacked bars, one per minute; each bar's title says its minute and counts."""
    peak = max((m.total for m in series), default=0) or 1
    plot_h = _HEIGHT - _BOTTOM - _TOP
    bar_w = (_WIDTH - _LEFT) / max(len(series), 1)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" viewBox="0 0 {_WIDTH} {_HEIGHT}" '
        f'role="img" aria-label="jobs settled per minute over the last hour">',
        f'<line class="axis" x1="{_LEFT}" y1="{_TOP + plot_h}" x2="{_WIDTH}" '
        f'y2="{_TOP + plot_h}"/>',
        f'<text class="tick" x="{_LEFT - 4}" y="{_TOP + 4}" text-anchor="end">{peak}</text>',
        f'<text class="tick" x="{_LEFT - 4}" y="{_TOP + plot_h}" text-anchor="end">0</text>',
    ]
    for index, minute in enumerate(series):
        x = _LEFT + index * bar_w
        base = float(_TOP + plot_h)
        label = ", ".join(f"{n} {_LABELS[o]}" for o, n in minute.counts.items() if n) or "none"
        parts.append(f"<g><title>{escape(minute.start.strftime('%H:%M'))}: {escape(label)}</title>")
        for outcome in OUTCOMES:
            n = minute.counts.get(outcome, 0)
            if not n:
                continue
            height = plot_h * n / peak
            base -= height
            parts.append(
                f'<rect class="bar-{outcome}" x="{x + 1:.1f}" y="{base:.1f}" '
                f'width="{max(bar_w - 2, 1):.1f}" height="{height:.1f}"/>'
            )
        parts.append("</g>")
    if series:
        for index in (0, len(series) // 2, len(series) - 1):
            x = _LEFT + index * bar_w + bar_w / 2
            stamp = escape(series[index].start.strftime("%H:%M"))
            parts.append(
                f'<text class="tick" x="{x:.1f}" y="{_HEIGHT - 6}" text-anchor="middle">'
                f"{stamp}</text>"
            )
    parts.append("</svg>")
    return Markup("".join(parts))  # noqa: S704 - built here from numbers and escaped text


def label(outcome: str) -> str:
    return _LABELS.get(outcome, outcome)
