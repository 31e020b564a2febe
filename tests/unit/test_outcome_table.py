"""docs/design.md's outcome table is ``infrai_jobs.work.outcomes.OUTCOME_RULES``, row for row."""

from __future__ import annotations

import logging
from pathlib import Path

from infrai_jobs.work.outcomes import OUTCOME_RULES

DESIGN_DOC = Path(__file__).resolve().parents[2] / "docs" / "design.md"
BEGIN = "<!-- outcome-table:begin (tests/unit/test_outcome_table.py keeps it equal to the code) -->"
END = "<!-- outcome-table:end -->"


def rendered_table() -> str:
    rows = [
        "| outcome | when | ledger | acked | summary | logged at | metric |",
        "|---|---|---|---|---|---|---|",
    ]
    for outcome, rule in OUTCOME_RULES.items():
        rows.append(
            f"| `{outcome.value}` | {rule.meaning} | {rule.ledger} | "
            f"{'yes' if rule.ack else 'no'} | `{rule.bucket}` | "
            f"{logging.getLevelName(rule.level)} | `{rule.metric}` |"
        )
    return "\n".join(rows)


def test_the_documented_outcome_table_is_the_codes() -> None:
    text = DESIGN_DOC.read_text(encoding="utf-8")
    assert BEGIN in text, f"docs/design.md needs the outcome table after {BEGIN!r}"
    assert END in text, f"docs/design.md needs {END!r} after the outcome table"
    table = text.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    expected = rendered_table()
    assert table == expected, f"replace docs/design.md's outcome table with:\n{expected}"
