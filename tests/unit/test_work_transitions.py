"""docs/design.md's state machine table is ``infrai_jobs.work.states.WORK_TRANSITIONS``."""

from __future__ import annotations

from pathlib import Path

from infrai_jobs.work.states import WORK_STATES, WORK_TRANSITIONS

DESIGN_DOC = Path(__file__).resolve().parents[2] / "docs" / "design.md"
BEGIN = (
    "<!-- work-transitions:begin (tests/unit/test_work_transitions.py keeps it equal to the "
    "code) -->"
)
END = "<!-- work-transitions:end -->"


def rendered_table() -> str:
    rows = ["| action | from | to | who | fenced by | made by |", "|---|---|---|---|---|---|"]
    for t in WORK_TRANSITIONS:
        rows.append(
            f"| {t.action} | `{t.source}` | `{t.target}` | {t.who} | {t.fence} | `{t.method}` |"
        )
    return "\n".join(rows)


def test_the_documented_state_machine_is_the_codes() -> None:
    text = DESIGN_DOC.read_text(encoding="utf-8")
    assert BEGIN in text, "docs/design.md needs the work-transitions begin marker"
    assert END in text, "docs/design.md needs the work-transitions end marker"
    table = text.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    expected = rendered_table()
    assert table == expected, f"replace docs/design.md's state machine table with:\n{expected}"


def test_every_state_is_reached_and_left_by_some_transition() -> None:
    # Given the transitions' ends, one state or a list of them each
    def states(side: str) -> set[str]:
        return {s.strip() for s in side.split(",")}

    reached = set().union(*(states(t.target) for t in WORK_TRANSITIONS))
    left = set().union(*(states(t.source) for t in WORK_TRANSITIONS))
    # Then every state is both entered and left (nothing is a trap but by design), and no
    # transition names a state the table does not have
    assert set(WORK_STATES) <= reached
    assert set(WORK_STATES) <= left
    assert (reached | left) - {"(none)"} == set(WORK_STATES)
