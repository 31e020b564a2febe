"""A new job's settings and secrets, carried to where a deploy and a local invocation read them.

The framework's template is never edited: DrainFunction and DlqAlertFunction read every job's
settings and secrets' ARNs from one parameter, ``JobSettings`` (a JSON object, passed as
``JOB_SETTINGS``), and may read the secrets ``JobSecretArns`` lists. So for each setting
``new-job --setting NAME`` declares that no job declared before, and each ``--secret NAME``:

* in ``samconfig.toml``, the ``parameter_overrides`` of each environment's ``deploy`` and
  ``sync`` sections: ``"NAME": "SET-ME"`` in ``JobSettings`` (a secret: ``"NAME_SECRET_ARN":
  "SET-ME"``, and ``SET-ME-NAME_SECRET_ARN`` in ``JobSecretArns``), which ``make build`` refuses
  until the team puts the real value there (``job_settings_check``);
* in ``events/env.json``: ``"NAME": ""`` (``"NAME_SECRET_ARN": ""``) in the ``JOB_SETTINGS`` JSON
  string of both functions, so that ``--env-vars`` can set it.

Both files are parsed and written back: ``samconfig.toml`` is read with ``tomllib``, only the
``parameter_overrides`` line of a deploying section is rewritten (its other items kept as they
were written, comments and layout untouched), and the result is read back and compared with
what was meant; ``events/env.json`` is JSON. A file the project lacks, or one that cannot be
edited safely, is left alone, and said so.
"""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from infrai_jobs.config.settings import JOB_SETTINGS_ENV, SECRET_ARN_SUFFIX
from infrai_jobs.errors import ConfigurationError

# The functions that read JOB_SETTINGS (they load the jobs and bind their settings).
SETTING_FUNCTIONS: Final = ("DrainFunction", "DlqAlertFunction")
JOB_SETTINGS_PARAMETER: Final = "JobSettings"
JOB_SECRET_ARNS_PARAMETER: Final = "JobSecretArns"  # noqa: S105 - a parameter name, not a secret
# A new value in samconfig.toml until the team gives one: `make build` refuses a deploy with it.
PLACEHOLDER: Final = "SET-ME"
# The samconfig.toml sections whose parameter_overrides reach a deployed stack.
DEPLOYING_COMMANDS: Final = ("deploy", "sync")
# A TOML table header and a parameter_overrides line: where a section starts, and its line.
_TABLE_HEADER: Final = re.compile(r"^\s*\[(?P<name>[A-Za-z0-9_.-]+)\]\s*(#.*)?$")
_OVERRIDES_LINE: Final = re.compile(r"^\s*parameter_overrides\s*=")


def secret_arn_placeholder(secret: str) -> str:
    """``JobSecretArns``' placeholder for ``secret``'s ARN, naming the entry it stands for."""
    return f"{PLACEHOLDER}-{secret}{SECRET_ARN_SUFFIX}"


@dataclass
class SettingEdits:
    """The new texts of the files that name the jobs' settings, and what could not be done."""

    texts: dict[Path, str] = field(default_factory=dict)
    left_alone: list[str] = field(default_factory=list)


def plan_setting_edits(
    project: Path, settings: Sequence[str], secrets: Sequence[str] = ()
) -> SettingEdits:
    """The edits that give the ``settings`` and ``secrets`` a new job declares (those no job
    declared yet) their placeholders in samconfig.toml and their entries in events/env.json."""
    edits = SettingEdits()
    entries = [*settings, *(secret + SECRET_ARN_SUFFIX for secret in secrets)]
    if not entries:
        return edits
    arns = [secret_arn_placeholder(secret) for secret in secrets]
    _samconfig_edit(project / "samconfig.toml", entries, arns, edits)
    env_file = project / "events" / "env.json"
    if not env_file.is_file():
        edits.left_alone.append(f"{env_file} does not exist: no --env-vars entry was added")
        return edits
    try:
        edits.texts[env_file] = _env_text(env_file.read_text(encoding="utf-8"), entries)
    except (ValueError, ConfigurationError) as exc:
        edits.left_alone.append(
            f"{env_file} was left as it is ({exc}): add {', '.join(entries)} to the "
            f"{JOB_SETTINGS_ENV} of {' and '.join(SETTING_FUNCTIONS)} by hand"
        )
    return edits


def _samconfig_edit(
    path: Path, entries: Sequence[str], arns: Sequence[str], edits: SettingEdits
) -> None:
    what = f"{', '.join(entries)} to {JOB_SETTINGS_PARAMETER}" + (
        f" and their ARNs to {JOB_SECRET_ARNS_PARAMETER}" if arns else ""
    )
    if not path.is_file():
        edits.left_alone.append(
            f"there is no samconfig.toml: add {what} wherever you deploy (`make build` reads "
            "samconfig.toml)"
        )
        return
    text = path.read_text(encoding="utf-8")
    try:
        edited, sections = _with_placeholders(text, entries, arns)
    except (ConfigurationError, tomllib.TOMLDecodeError, ValueError) as exc:
        edits.left_alone.append(
            f"samconfig.toml was left as it is ({exc}): add {what} in the parameter_overrides "
            "of each environment's deploy section by hand"
        )
        return
    if not sections:
        edits.left_alone.append(
            f"samconfig.toml has no deploy or sync section: add {what} wherever you deploy"
        )
        return
    if edited != text:
        edits.texts[path] = edited


def _with_placeholders(
    text: str, entries: Sequence[str], arns: Sequence[str]
) -> tuple[str, list[str]]:
    """``text`` with the placeholders added to each deploying section's overrides, and those
    sections (``env.command``); read back and compared before it is returned."""
    document = tomllib.loads(text)
    lines = text.splitlines(keepends=True)
    headers = [(i, m["name"]) for i, line in enumerate(lines) if (m := _TABLE_HEADER.match(line))]
    replaced: list[tuple[int, int, str]] = []  # (start, end, line) replacing lines[start:end]
    meant: dict[tuple[str, str], str] = {}
    sections: list[str] = []
    for number, (at, name) in enumerate(headers):
        environment, _, rest = name.partition(".")
        command = rest.removesuffix(".parameters")
        if command not in DEPLOYING_COMMANDS or rest != f"{command}.parameters":
            continue
        end = headers[number + 1][0] if number + 1 < len(headers) else len(lines)
        table = document[environment][command]["parameters"]
        inherited = document[environment].get("global", {}).get("parameters", {})
        raw = table.get("parameter_overrides", inherited.get("parameter_overrides", ""))
        if not isinstance(raw, str):
            raise ConfigurationError(f"[{name}] parameter_overrides is not one string")
        value = with_job_entries(raw, entries, arns)
        sections.append(f"{environment}.{command}")
        line = f"parameter_overrides = {json.dumps(value, ensure_ascii=False)}\n"
        own = [i for i in range(at + 1, end) if _OVERRIDES_LINE.match(lines[i])]
        if own and tomllib.loads(lines[own[0]]).get("parameter_overrides") != raw:
            raise ConfigurationError(f"[{name}] parameter_overrides spans more than its line")
        if value == raw:
            continue
        meant[(environment, command)] = value
        if own:
            replaced.append((own[0], own[0] + 1, line))
        else:
            last = max((i for i in range(at + 1, end) if lines[i].strip()), default=at)
            replaced.append((last + 1, last + 1, line))
    for start, end, line in reversed(replaced):
        lines[start:end] = [line]
    edited = "".join(lines)
    _check_read_back(document, tomllib.loads(edited), meant)
    return edited, sections


def _check_read_back(
    before: dict[str, Any], after: dict[str, Any], meant: dict[tuple[str, str], str]
) -> None:
    """What was meant, and nothing else: the rewritten overrides, every other value as it was."""
    for (environment, command), value in meant.items():
        before[environment][command]["parameters"]["parameter_overrides"] = value
    if after != before:
        raise ConfigurationError("reading it back did not give the values meant")


def with_job_entries(raw: str, entries: Sequence[str], arns: Sequence[str]) -> str:
    """Parameter overrides ``raw`` with each of ``entries`` that ``JobSettings`` lacks added to
    it as ``SET-ME`` and each of ``arns`` added to ``JobSecretArns``; every other item is kept
    as written, so SAM CLI reads it as before."""
    items = _override_items(raw)
    values = {name: value for name, value, _ in items}
    try:
        settings = json.loads(values.get(JOB_SETTINGS_PARAMETER) or "{}")
    except ValueError:
        settings = None
    if not isinstance(settings, dict):
        raise ConfigurationError(f"{JOB_SETTINGS_PARAMETER} is not a JSON object")
    listed = [arn for arn in values.get(JOB_SECRET_ARNS_PARAMETER, "").split(",") if arn]
    if all(entry in settings for entry in entries) and all(arn in listed for arn in arns):
        return raw
    for entry in entries:
        settings.setdefault(entry, PLACEHOLDER)
    listed += [arn for arn in arns if arn not in listed]
    rewritten = {
        JOB_SETTINGS_PARAMETER: _item(
            JOB_SETTINGS_PARAMETER, json.dumps(settings, ensure_ascii=False)
        ),
        JOB_SECRET_ARNS_PARAMETER: _item(JOB_SECRET_ARNS_PARAMETER, ",".join(listed)),
    }
    if not listed:
        del rewritten[JOB_SECRET_ARNS_PARAMETER]
    kept = [rewritten.pop(name) if name in rewritten else text for name, _, text in items]
    return " ".join([*kept, *rewritten.values()])


def _override_items(raw: str) -> list[tuple[str, str, str]]:
    """Each ``Name=Value`` item of ``raw``: its name, its value as SAM CLI and ``shlex`` read
    it, and its text as written. Only the short form, which is what this project writes."""
    items: list[tuple[str, str, str]] = []
    quote, start, escaped = "", None, False
    for index, char in enumerate(f"{raw} "):
        if start is None and not char.isspace():
            start = index
        if escaped:
            escaped = False
        elif quote == '"' and char == "\\":
            escaped = True
        elif quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "\\":
            raise ConfigurationError("a backslash outside quotes in parameter_overrides")
        elif char.isspace() and start is not None:
            text = raw[start:index]
            (item,) = shlex.split(text)
            name, sep, value = item.partition("=")
            if not sep or not name or name.startswith("ParameterKey"):
                raise ConfigurationError(f"parameter override {text!r} is not Name=Value")
            items.append((name, value, text))
            start = None
    if quote:
        raise ConfigurationError("an unclosed quote in parameter_overrides")
    return items


def _item(name: str, value: str) -> str:
    """``Name=Value``, single-quoted when it must be: SAM CLI and ``shlex`` then read it alike."""
    if "'" in value or "\\" in value:
        raise ConfigurationError(f"{name}'s value holds a quote or a backslash")
    return f"{name}={value}" if value and shlex.quote(value) == value else f"{name}='{value}'"


def _env_text(text: str, entries: Sequence[str]) -> str:
    document = json.loads(text)
    if not isinstance(document, dict):
        raise ConfigurationError("it is not a JSON object")
    for function in SETTING_FUNCTIONS:
        variables = document.setdefault(function, {})
        mapped = json.loads(variables.get(JOB_SETTINGS_ENV) or "{}")
        if not isinstance(mapped, dict):
            raise ConfigurationError(f"{function}'s {JOB_SETTINGS_ENV} is not a JSON object")
        for entry in entries:
            mapped.setdefault(entry, "")
        variables[JOB_SETTINGS_ENV] = json.dumps(mapped)
    return json.dumps(document, indent=2) + "\n"
