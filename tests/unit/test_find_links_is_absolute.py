"""Where the docs set PIP_FIND_LINKS to a folder of wheels, they set it by its absolute path.

The README's "Your own project" steps install from `dist/` and then `cd` into the new project,
whose `make test` runs pip there: a relative `PIP_FIND_LINKS=dist` then names a folder that is
not there, and pip finds no version at all. The same holds for the README and the Makefile
`init` writes, whose `make` runs pip in the project's folder.
"""

from __future__ import annotations

import re
from pathlib import Path

from infrai_local import project

ROOT = Path(__file__).resolve().parents[2]
# PIP_FIND_LINKS=VALUE, the value quoted or not.
_ASSIGNED = re.compile(r"PIP_FIND_LINKS=\"?([^\s\"`']+)")
# What a shell, or make, expands to an absolute path.
_ABSOLUTE = ("/", "$PWD", "${PWD}", "$(pwd)", "$(CURDIR)")


def assignments(text: str) -> list[str]:
    return _ASSIGNED.findall(text)


def test_the_readmes_own_project_steps_name_the_wheels_by_an_absolute_path() -> None:
    # Given the README's "Your own project" steps
    steps = (ROOT / "README.md").read_text().split("\n## Your own project\n", 1)[1]
    steps = steps.split("\n## ", 1)[0]
    # Then they say how to install from this clone's wheels, by a path that still names them
    # once the steps have gone into the new project
    values = assignments(steps)
    assert values, "the steps no longer say how to install from `make dist`'s wheels"
    assert all(value.startswith(_ABSOLUTE) for value in values), values


def test_no_page_and_no_file_init_writes_sets_a_relative_folder_of_wheels(tmp_path: Path) -> None:
    # Given the docs, the README and what init writes
    made = tmp_path / "p"
    project.init(made, "payments-jobs")
    texts = {
        **{
            path.relative_to(ROOT).as_posix(): path.read_text()
            for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
        },
        "init's README.md": (made / "README.md").read_text(),
        "init's Makefile": (made / "Makefile").read_text(),
    }
    # Then every value they give PIP_FIND_LINKS is an absolute path
    relative = {
        name: value
        for name, text in texts.items()
        for value in assignments(text)
        if not value.startswith(_ABSOLUTE)
    }
    assert relative == {}
