"""A new job's settings, carried to every place that names the jobs' settings.

``infrai-jobs new-job --setting NAME`` declares ``NAME`` on the job; for the functions to read it,
the project needs, beside the job:

* in ``template.yaml``: a parameter (``RefundIssueUrl`` for ``REFUND_ISSUE_URL``), listed in the
  "Jobs' settings" interface group, and ``NAME: !Ref Param`` in the ``Environment`` of each
  function that loads the jobs' settings (DrainFunction runs the jobs, DlqAlertFunction their
  probes): wherever the settings the jobs declared already are, the new one goes beside them;
* in ``events/env.json``: ``"NAME": ""`` for those functions, so ``--env-vars`` can set it;
* in ``docs/configuration.md``: a row of the variables' table, beside the other jobs' settings.

The template is edited as text, line by line, so its comments and layout stay as they were. A
file the project lacks is left alone, and said so.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

# The functions whose Environment holds the jobs' settings (they load the jobs and bind them).
SETTING_FUNCTIONS: Final = ("DrainFunction", "DlqAlertFunction")
_GROUP_LABEL: Final = "Jobs' settings"
_GROUP_LIST: Final = re.compile(r"^(?P<head>\s+Parameters:\s*\[)(?P<names>[^\]]*)(?P<tail>\].*)$")
_TOP_LEVEL_KEY: Final = re.compile(r"^\S")
_PARAMETER_KEY: Final = re.compile(r"^  (?P<name>[A-Za-z0-9]+):\s*$")


def parameter_name(setting: str) -> str:
    """``REFUND_ISSUE_URL`` -> ``RefundIssueUrl``: a template parameter's name for a setting."""
    return "".join(part.capitalize() for part in setting.split("_") if part)


@dataclass
class SettingEdits:
    """The new texts of the files that name the jobs' settings, and what could not be done."""

    texts: dict[Path, str] = field(default_factory=dict)
    left_alone: list[str] = field(default_factory=list)


def plan_setting_edits(
    project: Path, job_name: str, new: Sequence[str], declared: Sequence[str]
) -> SettingEdits:
    """The edits that give the settings ``new`` (those of job ``job_name`` that no job has
    declared yet) a parameter, an environment entry and a docs row; ``declared`` are the
    settings the jobs declare already, beside which they go."""
    edits = SettingEdits()
    if not new:
        return edits
    template = project / "template.yaml"
    edits.texts[template] = _template_text(
        template.read_text(encoding="utf-8"), job_name, new, declared, edits
    )
    env_file = project / "events" / "env.json"
    if env_file.is_file():
        edits.texts[env_file] = _env_text(env_file.read_text(encoding="utf-8"), new)
    else:
        edits.left_alone.append(f"{env_file} does not exist: no --env-vars entry was added")
    docs = project / "docs" / "configuration.md"
    if docs.is_file():
        text = _docs_text(docs.read_text(encoding="utf-8"), job_name, new, declared)
        if text is None:
            edits.left_alone.append(f"{docs} has no row of a job's setting to add one beside")
        else:
            edits.texts[docs] = text
    return edits


def _template_text(
    text: str, job_name: str, new: Sequence[str], declared: Sequence[str], edits: SettingEdits
) -> str:
    lines = text.splitlines(keepends=True)
    params = [parameter_name(s) for s in new]
    lines = _listed_in_group(lines, params, edits)
    lines = _with_parameters(lines, job_name, new, [parameter_name(s) for s in declared], edits)
    lines = _with_environment(lines, new, declared, edits)
    return "".join(lines)


def _listed_in_group(lines: list[str], params: list[str], edits: SettingEdits) -> list[str]:
    for index, line in enumerate(lines[:-1]):
        if _GROUP_LABEL in line:
            match = _GROUP_LIST.match(lines[index + 1].rstrip("\n"))
            if match is None:
                break
            names = [n.strip() for n in match["names"].split(",") if n.strip()]
            lines[index + 1] = f"{match['head']}{', '.join([*names, *params])}{match['tail']}\n"
            return lines
    edits.left_alone.append(
        f'template.yaml has no "{_GROUP_LABEL}" parameter group: list {", ".join(params)} '
        "in its Metadata by hand if you keep one"
    )
    return lines


def _with_parameters(
    lines: list[str],
    job_name: str,
    new: Sequence[str],
    beside: Sequence[str],
    edits: SettingEdits,
) -> list[str]:
    start = next((i for i, line in enumerate(lines) if line.rstrip() == "Parameters:"), None)
    if start is None:
        edits.left_alone.append("template.yaml has no Parameters section: none was added")
        return lines
    end = next(
        (i for i in range(start + 1, len(lines)) if _TOP_LEVEL_KEY.match(lines[i])), len(lines)
    )
    # After the last parameter of a job's setting, else at the section's start.
    at = start + 1
    for index in range(start + 1, end):
        match = _PARAMETER_KEY.match(lines[index])
        if match and match["name"] in beside:
            at = _block_end(lines, index, end)
    blocks = [
        "  " + parameter_name(setting) + ":\n"
        "    Type: String\n"
        '    Default: ""\n'
        "    AllowedPattern: ^(https?://[^\\s]+)?$\n"
        f"    Description: {setting}, a setting {job_name} declares (HTTPS; see AllowPlainHttp).\n"
        for setting in new
    ]
    return [*lines[:at], *blocks, *lines[at:]]


def _block_end(lines: list[str], index: int, end: int) -> int:
    for later in range(index + 1, end):
        if _PARAMETER_KEY.match(lines[later]) or _TOP_LEVEL_KEY.match(lines[later]):
            return later
    return end


def _with_environment(
    lines: list[str], new: Sequence[str], declared: Sequence[str], edits: SettingEdits
) -> list[str]:
    pattern = re.compile(
        r"^(?P<indent>\s+)(?P<name>" + "|".join(map(re.escape, declared or ["$^"])) + r"):\s*!Ref\s"
    )
    out: list[str] = []
    added = 0
    for index, line in enumerate(lines):
        out.append(line)
        match = pattern.match(line)
        following = lines[index + 1] if index + 1 < len(lines) else ""
        if match and not pattern.match(following):
            # The end of a run of the jobs' settings: the new ones follow it.
            out += [f"{match['indent']}{s}: !Ref {parameter_name(s)}\n" for s in new]
            added += 1
    if not added:
        edits.left_alone.append(
            "template.yaml names no job's setting in an Environment: add "
            + ", ".join(f"{s}: !Ref {parameter_name(s)}" for s in new)
            + f" to the Environment of {' and '.join(SETTING_FUNCTIONS)} by hand"
        )
    return out


def _env_text(text: str, new: Sequence[str]) -> str:
    document = json.loads(text)
    for function in SETTING_FUNCTIONS:
        entries = document.setdefault(function, {})
        for setting in new:
            entries.setdefault(setting, "")
    return json.dumps(document, indent=2) + "\n"


def _docs_text(text: str, job_name: str, new: Sequence[str], declared: Sequence[str]) -> str | None:
    lines = text.splitlines(keepends=True)
    last = None
    for index, line in enumerate(lines):
        if line.startswith("| `") and any(f"`{s}`" in line.split("|")[1] for s in declared):
            last = index
    if last is None:
        return None
    rows = [
        f"| `{setting}` | Drain, DlqAlert (its reconcile probes) | a setting {job_name} declares "
        f"(written by `infrai-jobs new-job`): its downstream, HTTPS or loopback HTTP "
        f"([jobs.md](jobs.md)) | none; in AWS: `{parameter_name(setting)}` |\n"
        for setting in new
    ]
    return "".join([*lines[: last + 1], *rows, *lines[last + 1 :]])
