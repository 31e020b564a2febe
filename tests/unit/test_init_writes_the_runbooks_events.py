"""The event files the shipped pages tell a team to use are in the project `init` writes.

The runbook's dead-letter steps invoke RedriveFunction with `events/redrive-dry-run.json`, then
`events/redrive.json`: a team's project has them, as this repository does. A file only this
repository has is named as the framework repository's.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from infrai_local import project

ROOT = Path(__file__).resolve().parents[2]
# `events/NAME.json`, and whether the page says it is the framework repository's.
_EVENT_FILE = re.compile(r"(framework repository's )?`(events/[\w.-]+\.json)`")


def test_every_event_file_a_page_names_is_in_a_team_project(tmp_path: Path) -> None:
    # Given a team's project as init writes it
    made = tmp_path / "p"
    project.init(made, "payments-jobs")
    # When the shipped pages name an event file, and do not call it the repository's
    named = {
        (page.name, path)
        for page in sorted((ROOT / "docs").glob("*.md"))
        for repositorys, path in _EVENT_FILE.findall(" ".join(page.read_text().split()))
        if not repositorys
    }
    # Then the project has it
    assert ("operations.md", "events/redrive.json") in named
    assert sorted(f"{page}: {path}" for page, path in named if not (made / path).is_file()) == []


def test_init_writes_redrive_functions_events_as_this_repository_has_them(tmp_path: Path) -> None:
    # Given a team's project as init writes it
    made = tmp_path / "p"
    project.init(made, "payments-jobs")
    # Then its events for RedriveFunction are this repository's: the dry run, then the redrive
    for name in ("redrive-dry-run.json", "redrive.json"):
        written = json.loads((made / "events" / name).read_text())
        assert written == json.loads((ROOT / "events" / name).read_text()), name
