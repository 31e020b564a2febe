"""A new job's settings, carried to every place that names the jobs' settings.

``infrai-jobs new-job --setting NAME`` declares ``NAME`` on the job; for the functions to read it,
the project needs, beside the job:

* in ``template.yaml``: a parameter (``RefundIssueUrl`` for ``REFUND_ISSUE_URL``), listed in the
  "Jobs' settings" interface group, and ``NAME: !Ref Param`` in the ``Environment`` of each
  function that loads the jobs' settings (DrainFunction runs the jobs, DlqAlertFunction their
  probes): wherever the settings the jobs declared already are, the new one goes beside them;
* in ``events/env.json``: ``"NAME": ""`` for those functions, so ``--env-vars`` can set it;
* in ``docs/configuration.md``: a row of the variables' table, beside the other jobs' settings;
* in ``samconfig.toml``: ``Param=SET-ME`` in the ``parameter_overrides`` of each environment's
  ``deploy`` and ``sync`` sections.

The parameter takes the shipped URL parameters' pattern (HTTPS without credentials, plain HTTP
to loopback only) and has no default: a deploy that gives it no value is refused by
CloudFormation before anything changes, and so is the placeholder, which does not fit the
pattern. The drain refuses to start without the setting, so an empty value would deploy
functions that refuse every cold start.

``new-job --secret NAME`` declares a secret; it needs a parameter for its ARN, a condition,
``NAME_SECRET_ARN`` in DrainFunction's Environment, a grant to read exactly that ARN in its
role, an ``events/env.json`` entry and a docs row (``plan_secret_edits``).

The template is edited as text, line by line, so its comments and layout stay as they were. A
file the project lacks is left alone, and said so.
"""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from infrai_jobs.config.settings import SECRET_ARN_SUFFIX, secret_parameter_name
from infrai_jobs.errors import ConfigurationError

# The functions whose Environment holds the jobs' settings (they load the jobs and bind them).
SETTING_FUNCTIONS: Final = ("DrainFunction", "DlqAlertFunction")
_GROUP_LABEL: Final = "Jobs' settings"
_GROUP_LIST: Final = re.compile(r"^(?P<head>\s+Parameters:\s*\[)(?P<names>[^\]]*)(?P<tail>\].*)$")
_TOP_LEVEL_KEY: Final = re.compile(r"^\S")
_PARAMETER_KEY: Final = re.compile(r"^  (?P<name>[A-Za-z0-9]+):\s*$")
# What the code accepts for a URL without an opt-out (``check_web_url``), as the shipped URL
# parameters spell it (InfraiBaseUrl; MailProviderUrl's allows empty too): HTTPS, or plain HTTP
# to loopback only, and no user or password before the host.
URL_PATTERN: Final = (
    r"^(https://[^\s/?#@]+([/?#][^\s]*)?"
    r"|http://(localhost|127\.[0-9.]+|\[::1\])(:[0-9]+)?([/?#][^\s]*)?)$"
)
URL_CONSTRAINT: Final = "must be an https:// URL without credentials (http:// only to loopback)"
# A new setting's value in samconfig.toml until the team gives one: it does not fit URL_PATTERN,
# so CloudFormation refuses the deploy, naming the parameter.
PLACEHOLDER: Final = "SET-ME"
# The samconfig.toml sections whose parameter_overrides reach a deployed stack.
DEPLOYING_COMMANDS: Final = ("deploy", "sync")
_TABLE_HEADER: Final = re.compile(r"^\s*\[(?P<name>[A-Za-z0-9_.-]+)\]\s*(#.*)?$")
_OVERRIDES_LINE: Final = re.compile(r"^\s*parameter_overrides\s*=")


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
    _samconfig_edit(project / "samconfig.toml", [parameter_name(s) for s in new], edits)
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
    blocks = [
        "  " + parameter_name(setting) + ":\n"
        "    Type: String\n"
        "    # No default: a deploy without a value is refused (the drain refuses to start\n"
        "    # without it); samconfig.toml's placeholder does not fit the pattern.\n"
        f"    AllowedPattern: {URL_PATTERN}\n"
        f"    ConstraintDescription: {URL_CONSTRAINT}\n"
        f"    Description: {setting}, the URL {job_name} calls (HTTPS, no credentials in the "
        "URL); required.\n"
        for setting in new
    ]
    return _insert_parameters(lines, blocks, beside, edits)


def _insert_parameters(
    lines: list[str], blocks: list[str], beside: Sequence[str], edits: SettingEdits
) -> list[str]:
    """``blocks`` in the template's Parameters section: after the last parameter named in
    ``beside`` (the jobs' settings and secrets), else at the section's start."""
    start = next((i for i, line in enumerate(lines) if line.rstrip() == "Parameters:"), None)
    if start is None:
        edits.left_alone.append("template.yaml has no Parameters section: none was added")
        return lines
    end = next(
        (i for i in range(start + 1, len(lines)) if _TOP_LEVEL_KEY.match(lines[i])), len(lines)
    )
    at = start + 1
    for index in range(start + 1, end):
        match = _PARAMETER_KEY.match(lines[index])
        if match and match["name"] in beside:
            at = _block_end(lines, index, end)
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


def _samconfig_edit(path: Path, params: Sequence[str], edits: SettingEdits) -> None:
    """``Param=SET-ME`` for each of ``params`` in the ``parameter_overrides`` of each
    environment's deploy and sync sections of samconfig.toml, a comment above saying what to
    put there; the file is edited line by line and checked by reading it back."""
    names = ", ".join(params)
    if not path.is_file():
        edits.left_alone.append(
            f"there is no samconfig.toml: give {names} a value wherever you deploy (a deploy "
            "without one is refused)"
        )
        return
    text = path.read_text(encoding="utf-8")
    try:
        edited, sections = _with_placeholders(text, params)
    except (ConfigurationError, tomllib.TOMLDecodeError, ValueError) as exc:
        edits.left_alone.append(
            f"samconfig.toml was left as it is ({exc}): add {names} to the parameter_overrides "
            "of each environment's deploy section by hand (a deploy without them is refused)"
        )
        return
    if not sections:
        edits.left_alone.append(
            "samconfig.toml has no deploy or sync section: give "
            f"{names} a value wherever you deploy (a deploy without one is refused)"
        )
        return
    edits.texts[path] = edited


def _with_placeholders(text: str, params: Sequence[str]) -> tuple[str, list[str]]:
    """``text`` with the placeholders added, and the sections (``env.command``) given them."""
    # Here, not at the top: sam_template needs cfn-lint, which the CLI must not load to start.
    from infrai_local.sam_template import parse_parameter_overrides  # noqa: PLC0415

    document = tomllib.loads(text)
    lines = text.splitlines(keepends=True)
    headers = [(i, m["name"]) for i, line in enumerate(lines) if (m := _TABLE_HEADER.match(line))]
    inserts: list[tuple[int, int, list[str]]] = []  # (start, end, lines) replacing lines[start:end]
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
        given = parse_parameter_overrides(raw) if raw else {}
        missing = [p for p in params if p not in given]
        if not missing:
            continue
        value = " ".join([raw, *(f"{p}={PLACEHOLDER}" for p in missing)]).strip()
        comment = (
            f"# {', '.join(missing)}: the URL of a job's setting (new-job); a deploy refuses "
            f"{PLACEHOLDER}.\n"
        )
        line = f"parameter_overrides = {json.dumps(value, ensure_ascii=False)}\n"
        own = [i for i in range(at + 1, end) if _OVERRIDES_LINE.match(lines[i])]
        if own:
            inserts.append((own[0], own[0] + 1, [comment, line]))
        else:
            last = max((i for i in range(at + 1, end) if lines[i].strip()), default=at)
            inserts.append((last + 1, last + 1, [comment, line]))
        sections.append(f"{environment}.{command}")
    for start, end, added in reversed(inserts):
        lines[start:end] = added
    edited = "".join(lines)
    _check_placeholders(tomllib.loads(edited), sections, params)
    return edited, sections


def _check_placeholders(
    document: dict[str, Any], sections: list[str], params: Sequence[str]
) -> None:
    """Read back: each section's overrides hold every parameter (the placeholder, or a value
    the team gave already)."""
    from infrai_local.sam_template import parse_parameter_overrides  # noqa: PLC0415

    for section in sections:
        environment, command = section.split(".")
        table = document[environment][command]["parameters"]
        given = parse_parameter_overrides(table["parameter_overrides"])
        if any(p not in given for p in params):
            raise ConfigurationError(f"[{section}.parameters] did not take the placeholders")


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
        f"([jobs.md](jobs.md)) | none (required); in AWS: `{parameter_name(setting)}` |\n"
        for setting in new
    ]
    return "".join([*lines[: last + 1], *rows, *lines[last + 1 :]])


# --- A new job's secrets ---------------------------------------------------------------------

# The function whose Environment names the jobs' secrets and whose role may read them: the
# drain runs the jobs. The watcher reads a secret only for a probe (``declared_secrets``), so a
# new job, which has none, grants it nothing; add the same three lines there with a probe.
DRAIN_FUNCTION: Final = "DrainFunction"
_ARN_PATTERN: Final = (
    "^(arn:aws[a-z-]*:secretsmanager:[a-z0-9-]+:[0-9]{12}:secret:[A-Za-z0-9/_+=.@-]+"
    "-[A-Za-z0-9]{6})?$"
)


def plan_secret_edits(
    project: Path,
    job_name: str,
    new: Sequence[str],
    beside: Sequence[str],
    edits: SettingEdits,
) -> None:
    """Add to ``edits`` (after the settings' own) what each secret of ``new`` (those of job
    ``job_name`` no job declared yet) needs: in ``template.yaml`` a parameter for its ARN
    (empty, or a Secrets Manager ARN), a condition, ``NAME_SECRET_ARN`` in DrainFunction's
    Environment and a ``secretsmanager:GetSecretValue`` grant on exactly that ARN in its role,
    only when it is set; an ``events/env.json`` entry; a docs row. ``beside``: the parameters
    of the jobs' settings and secrets already declared, after which the new ones go."""
    if not new:
        return
    template = project / "template.yaml"
    text = edits.texts.get(template) or template.read_text(encoding="utf-8")
    lines = text.splitlines(keepends=True)
    params = [secret_parameter_name(s) for s in new]
    lines = _listed_in_group(lines, params, edits)
    lines = _with_secret_parameters(lines, job_name, new, beside, edits)
    lines = _after_line(
        lines, "Conditions:", [f'  {_has(s)}: !Not [!Equals [!Ref {_param(s)}, ""]]\n' for s in new]
    )
    lines = _in_resource(lines, DRAIN_FUNCTION, "Variables:", _secret_variables(new), edits)
    lines = _in_resource(lines, f"{DRAIN_FUNCTION}Role", "Policies:", _secret_grants(new), edits)
    edits.texts[template] = "".join(lines)
    env_file = project / "events" / "env.json"
    if env_file.is_file():
        document = json.loads(edits.texts.get(env_file) or env_file.read_text(encoding="utf-8"))
        entries = document.setdefault(DRAIN_FUNCTION, {})
        for secret in new:
            entries.setdefault(secret + SECRET_ARN_SUFFIX, "")
        edits.texts[env_file] = json.dumps(document, indent=2) + "\n"
    docs = project / "docs" / "configuration.md"
    if docs.is_file():
        text = edits.texts.get(docs) or docs.read_text(encoding="utf-8")
        rows = [
            f"| `{secret}{SECRET_ARN_SUFFIX}` | Drain | the Secrets Manager secret holding "
            f"`{secret}`, a secret {job_name} declares (written by `infrai-jobs new-job`); "
            f'locally the plain `{secret}` may stand in ([jobs.md](jobs.md), "Secrets") | '
            f"none; in AWS: `{secret_parameter_name(secret)}` |\n"
            for secret in new
        ]
        done = _after_table_row(text, f"`NAME{SECRET_ARN_SUFFIX}`", rows)
        if done is None:
            edits.left_alone.append(f"{docs} has no row of the jobs' secrets to add one beside")
        else:
            edits.texts[docs] = done


def _param(secret: str) -> str:
    return secret_parameter_name(secret)


def _has(secret: str) -> str:
    return "Has" + secret_parameter_name(secret)


def _with_secret_parameters(
    lines: list[str], job_name: str, new: Sequence[str], beside: Sequence[str], edits: SettingEdits
) -> list[str]:
    blocks = [
        "  " + _param(secret) + ":\n"
        "    Type: String\n"
        '    Default: ""\n'
        f"    AllowedPattern: {_ARN_PATTERN}\n"
        "    ConstraintDescription: must be empty or the full ARN of a Secrets Manager secret "
        "(with its -XXXXXX suffix)\n"
        f"    Description: ARN of the Secrets Manager secret holding {secret}, a secret "
        f"{job_name} declares; DrainFunction alone may read it, and refuses to start while it "
        "is empty.\n"
        for secret in new
    ]
    return _insert_parameters(lines, blocks, beside, edits)


def _secret_variables(new: Sequence[str]) -> list[str]:
    return [f"{s}{SECRET_ARN_SUFFIX}: !Ref {_param(s)}\n" for s in new]


def _secret_grants(new: Sequence[str]) -> list[str]:
    grants: list[str] = []
    for secret in new:
        sid = f"ReadThe{secret_parameter_name(secret).removesuffix('Arn')}"
        grants += [
            "- !If\n",
            f"  - {_has(secret)}\n",
            f"  - PolicyName: {sid}\n",
            "    PolicyDocument:\n",
            '      Version: "2012-10-17"\n',
            "      Statement:\n",
            f"        - Sid: {sid}\n",
            "          Effect: Allow\n",
            "          Action: secretsmanager:GetSecretValue\n",
            f"          Resource: !Ref {_param(secret)}\n",
            "  - !Ref AWS::NoValue\n",
        ]
    return grants


def _after_line(lines: list[str], key: str, added: list[str]) -> list[str]:
    at = next((i for i, line in enumerate(lines) if line.rstrip() == key), None)
    if at is None:
        return [*lines, f"\n{key}\n", *added]
    return [*lines[: at + 1], *added, *lines[at + 1 :]]


def _in_resource(
    lines: list[str], resource: str, key: str, added: list[str], edits: SettingEdits
) -> list[str]:
    """``added`` (lines relative to the list's indentation) as the first entries under
    ``key`` inside the top-level resource ``resource``, indented as the entry that follows."""
    start = next((i for i, line in enumerate(lines) if line == f"  {resource}:\n"), None)
    found = None
    if start is not None:
        for index in range(start + 1, len(lines)):
            if re.match(r"^  \S", lines[index]) or _TOP_LEVEL_KEY.match(lines[index]):
                break
            if lines[index].strip() == key:
                found = index
                break
    if found is None or found + 1 >= len(lines):
        edits.left_alone.append(
            f"template.yaml has no {key} in {resource}: add "
            + " ".join(line.strip() for line in added)
            + " there by hand"
        )
        return lines
    # A comment heading the first entry is indented as the entries are.
    following = lines[found + 1]
    indent = following[: len(following) - len(following.lstrip())]
    return [*lines[: found + 1], *(indent + line for line in added), *lines[found + 1 :]]


def _after_table_row(text: str, marker: str, rows: list[str]) -> str | None:
    lines = text.splitlines(keepends=True)
    for index, line in enumerate(lines):
        if line.startswith("| ") and marker in line.split("|")[1]:
            return "".join([*lines[: index + 1], *rows, *lines[index + 1 :]])
    return None
