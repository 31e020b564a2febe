"""Reads ``template.yaml`` the way ``sam local invoke`` does, for the functions it declares.

Only what a local invocation needs is resolved: Handler, CodeUri, the layers' ContentUri,
Timeout, MemorySize and the environment, with ``Globals.Function`` merged in. Parameter values
come from the template's defaults, then the ``parameter_overrides`` of ``samconfig.toml``, read
as SAM CLI reads it for ``sam local invoke``: the environment's ``local_invoke`` section over its
``global`` one (never ``deploy``'s), then an ``--env-vars`` file's ``Parameters``. ``Ref``,
``Fn::Sub`` (``${!Literal}`` included), ``Fn::If``, ``Fn::Join``, ``Fn::Select`` and ``Fn::Split``
over those are evaluated; anything that would only be known in AWS becomes an empty string.

The template itself is decoded by cfn-lint (``cfnlint.decode``), the decoder ``sam validate
--lint`` reads it with: short forms become their long forms (``!GetAtt A.B`` a two-item list),
scalars keep YAML's types, and a JSON template is read as well. A nested
``AWS::Serverless::Application`` whose ``Location`` is a template beside it (a team's
``framework.yaml``, ``infrai_local.project``) is read as part of one template.
"""

from __future__ import annotations

import re
import shlex
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cfnlint.decode import decode_str  # type: ignore[import-untyped]

from infrai_jobs.errors import ConfigurationError

LAMBDA_DEFAULT_TIMEOUT = 3
LAMBDA_DEFAULT_MEMORY = 128

# Pseudo parameters as sam local invoke reports them.
PSEUDO_PARAMETERS = {
    "AWS::Region": "us-east-1",
    "AWS::AccountId": "123456789012",
    "AWS::StackName": "infrai-jobs-local",
    "AWS::Partition": "aws",
    "AWS::URLSuffix": "amazonaws.com",
    "AWS::NoValue": None,
}


@dataclass(frozen=True, slots=True)
class FunctionSpec:
    logical_id: str
    handler: str
    code_uri: Path
    layer_dirs: tuple[Path, ...]
    timeout: int
    memory_mb: int
    environment: dict[str, str]
    runtime: str = ""
    architectures: tuple[str, ...] = field(default_factory=tuple)
    # ReservedConcurrentExecutions: at most this many invocations at once; None is no limit.
    reserved_concurrency: int | None = None
    # The variables whose value the template alone decided (a literal, or parameters left at
    # their Default): no parameter override and no env-vars file chose them. A template's
    # default endpoint is the author's suggestion for AWS, not a choice the user made locally.
    template_only: frozenset[str] = frozenset()


def load_template(path: Path) -> dict[str, Any]:
    """The template at ``path`` as cfn-lint decodes it, in plain dicts, lists and scalars, with
    each nested application whose ``Location`` is a local file merged in (``_merge_nested``)."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigurationError(f"cannot read {path}: {exc}") from exc
    template = decode_template(text, path)
    for name, resource in list(template["Resources"].items()):
        if isinstance(resource, dict) and resource.get("Type") == NESTED_APPLICATION:
            location = resource.get("Properties", {}).get("Location")
            if isinstance(location, str) and "://" not in location:
                template = _merge_nested(template, name, path, location)
    return template


def decode_template(text: str, source: Path | str) -> dict[str, Any]:
    """A template's text as cfn-lint decodes it; ``source`` names it in errors."""
    document, problems = decode_str(text)
    if problems:
        message = problems[0].message
        if "line" not in message:
            message += f" (line {problems[0].linenumber})"
        raise ConfigurationError(f"cannot read {source}: {message}")
    if not isinstance(document, dict) or "Resources" not in document:
        raise ConfigurationError(f"{source} is not a SAM template (no Resources)")
    plain: dict[str, Any] = _plain(document)
    return plain


NESTED_APPLICATION = "AWS::Serverless::Application"


def _merge_nested(parent: dict[str, Any], name: str, path: Path, location: str) -> dict[str, Any]:
    """One view of ``parent`` and the application ``name`` nests from ``location`` (a template
    beside it, so that both read relative paths from one folder): the child's parameters,
    conditions, globals and resources, the parent's winning. A parameter passed to the child is
    read only as ``Name: !Ref Name`` (the parent's parameter of the same name, whose definition
    and value then hold for both); anything else passed is refused, naming it."""
    if Path(location).name != location:
        raise ConfigurationError(f"{path}: {name}'s Location {location!r} must sit beside it")
    child = load_template(path.parent / location)
    passed = parent["Resources"][name].get("Properties", {}).get("Parameters", {})
    for key, value in passed.items():
        if value != {"Ref": key} or key not in parent.get("Parameters", {}):
            raise ConfigurationError(
                f"{path}: {name} passes parameter {key} as {value!r}; locally a nested "
                f"application's parameter is read only as `{key}: !Ref {key}`, a parameter of "
                "the same name in this template"
            )
        if key not in child.get("Parameters", {}):
            raise ConfigurationError(f"{path}: {name} passes {key}, which {location} lacks")
    resources = {key: value for key, value in parent["Resources"].items() if key != name}
    clash = sorted(set(resources) & set(child["Resources"]))
    if clash:
        raise ConfigurationError(f"{path}: {', '.join(clash)} also in {location}")
    merged = {**child, **parent, "Resources": {**child["Resources"], **resources}}
    for section in ("Parameters", "Conditions", "Globals", "Mappings"):
        merged[section] = {**child.get(section, {}), **parent.get(section, {})}
    return merged


def _plain(value: Any) -> Any:
    """The decoder's nodes (dicts, lists and strings that carry their line marks) as plain
    ones, so that a FunctionSpec holds nothing of the decoder's."""
    if isinstance(value, dict):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, str):
        return str(value)
    return value


# The samconfig.toml table of `sam local invoke` (SAM joins the command's words with "_").
LOCAL_INVOKE = "local_invoke"
GLOBAL_SECTION = "global"


def read_samconfig(path: Path) -> dict[str, Any]:
    """The whole samconfig.toml; empty when there is none, as SAM CLI treats a missing file."""
    if not path.is_file():
        return {}
    try:
        return tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigurationError(f"cannot read {path}: {exc}") from exc


def samconfig_parameters(
    path: Path, environment: str = "default", command: str = LOCAL_INVOKE
) -> dict[str, Any]:
    """What SAM CLI applies to ``command`` under ``--config-env environment``: the
    ``[environment.command.parameters]`` table over ``[environment.global.parameters]``.

    No other command's table counts: ``deploy``'s ``parameter_overrides`` (a production API-key
    parameter, say) never reach a local invocation. A missing environment or table gives nothing,
    as in SAM CLI.
    """
    env = read_samconfig(path).get(environment, {})
    if not isinstance(env, dict):
        raise ConfigurationError(f"{path}: [{environment}] is not a table")
    merged: dict[str, Any] = {}
    for section in (GLOBAL_SECTION, command):
        table = env.get(section, {})
        parameters = table.get("parameters", {}) if isinstance(table, dict) else None
        if not isinstance(parameters, dict):
            raise ConfigurationError(f"{path}: [{environment}.{section}.parameters] is not a table")
        merged.update(parameters)
    return merged


def samconfig_environments(path: Path) -> list[str]:
    """The environments samconfig.toml defines (its tables other than ``version``)."""
    return [name for name, value in read_samconfig(path).items() if isinstance(value, dict)]


def samconfig_overrides(
    path: Path, environment: str = "default", command: str = LOCAL_INVOKE
) -> dict[str, str]:
    """The ``parameter_overrides`` SAM CLI applies to ``command`` (see ``samconfig_parameters``)."""
    raw = samconfig_parameters(path, environment, command).get("parameter_overrides")
    return parse_parameter_overrides(raw) if raw else {}


# SAM CLI's two spellings: "Name=Value" and "ParameterKey=Name,ParameterValue=Value".
_LONG_FORM = re.compile(r"^ParameterKey=(?P<name>[^,]+),ParameterValue=(?P<value>.*)$", re.DOTALL)


def deploy_values(root: Path, config_env: str) -> tuple[dict[str, Any], dict[str, str]]:
    """The template at ``root`` and its parameters' values as ``sam deploy --config-env
    config_env`` would take them: samconfig.toml's deploy and global sections over the
    template's defaults (what ``make build``'s checks judge)."""
    template = load_template(root / "template.yaml")
    parameters = template.get("Parameters", {})
    values = {name: str(spec.get("Default", "")) for name, spec in parameters.items()}
    return template, values | samconfig_overrides(root / "samconfig.toml", config_env, "deploy")


def parse_parameter_overrides(raw: Any) -> dict[str, str]:
    """Parameter overrides as SAM CLI accepts them: a string of shell-quoted ``Name=Value``
    (or ``ParameterKey=Name,ParameterValue=Value``) items, a list of such strings, or a table."""
    if isinstance(raw, dict):
        return {str(name): _as_env_value(value) for name, value in raw.items()}
    if isinstance(raw, list):
        merged: dict[str, str] = {}
        for item in raw:
            merged.update(parse_parameter_overrides(item))
        return merged
    if not isinstance(raw, str):
        raise ConfigurationError(f"parameter_overrides must be a string, list or table: {raw!r}")
    if raw.startswith("file://"):
        raise ConfigurationError("parameter_overrides from a file:// are not read locally")
    try:
        items = shlex.split(raw)
    except ValueError as exc:
        raise ConfigurationError(f"cannot parse parameter_overrides {raw!r}: {exc}") from exc
    overrides: dict[str, str] = {}
    for item in items:
        long_form = _LONG_FORM.match(item)
        if long_form:
            overrides[long_form["name"]] = long_form["value"]
            continue
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ConfigurationError(f"parameter override {item!r} is not Name=Value")
        overrides[name] = value
    return overrides


def function_names(template: Mapping[str, Any]) -> list[str]:
    return [
        name
        for name, resource in template["Resources"].items()
        if isinstance(resource, dict) and resource.get("Type") == "AWS::Serverless::Function"
    ]


def resolve_function(
    template: Mapping[str, Any],
    logical_id: str,
    root: Path,
    *,
    parameter_overrides: Mapping[str, str] | None = None,
    env_vars: Mapping[str, Any] | None = None,
) -> FunctionSpec:
    resources = template["Resources"]
    resource = resources.get(logical_id)
    if not isinstance(resource, dict) or resource.get("Type") != "AWS::Serverless::Function":
        known = ", ".join(function_names(template)) or "none"
        raise ConfigurationError(f"no function {logical_id!r} in the template (functions: {known})")
    parameters = _parameter_values(template, parameter_overrides or {}, env_vars or {})
    resolver = TemplateResolver(template, parameters)
    globals_ = template.get("Globals", {}).get("Function", {})
    props = {**globals_, **resource.get("Properties", {})}

    environment = {
        **globals_.get("Environment", {}).get("Variables", {}),
        **resource.get("Properties", {}).get("Environment", {}).get("Variables", {}),
    }
    chosen_parameters = {*(parameter_overrides or {}), *(env_vars or {}).get("Parameters", {})}
    env: dict[str, str] = {}
    template_only: set[str] = set()
    for name, value in environment.items():
        resolver.referenced.clear()
        env[name] = _as_env_value(resolver.resolve(value))
        if not resolver.referenced & chosen_parameters:
            template_only.add(name)
    # As in SAM: the env-vars file overrides only variables the template declares.
    for scope in ("Parameters", logical_id):
        for name, value in (env_vars or {}).get(scope, {}).items():
            if name in env:
                env[name] = _as_env_value(value)
                template_only.discard(name)

    layer_dirs = []
    for layer in props.get("Layers", []):
        ref = layer.get("Ref") if isinstance(layer, dict) else None
        layer_resource = resources.get(ref) if ref else None
        if not isinstance(layer_resource, dict):
            raise ConfigurationError(
                f"{logical_id}: layer {layer!r} is not a layer in this template"
            )
        content = layer_resource.get("Properties", {}).get("ContentUri")
        layer_dirs.append(root / str(resolver.resolve(content)))

    handler = resolver.resolve(props.get("Handler"))
    code_uri = resolver.resolve(props.get("CodeUri"))
    if not isinstance(handler, str) or "." not in handler:
        raise ConfigurationError(f"{logical_id}: Handler {handler!r} is not module.function")
    return FunctionSpec(
        logical_id=logical_id,
        handler=handler,
        code_uri=root / str(code_uri),
        layer_dirs=tuple(layer_dirs),
        timeout=int(resolver.resolve(props.get("Timeout", LAMBDA_DEFAULT_TIMEOUT))),
        memory_mb=int(resolver.resolve(props.get("MemorySize", LAMBDA_DEFAULT_MEMORY))),
        environment=env,
        runtime=str(resolver.resolve(props.get("Runtime", ""))),
        architectures=tuple(resolver.resolve(props.get("Architectures", []))),
        reserved_concurrency=_optional_int(
            resolver.resolve(props.get("ReservedConcurrentExecutions"))
        ),
        template_only=frozenset(template_only),
    )


def _optional_int(value: Any) -> int | None:
    return None if value is None or value == "" else int(value)


def _parameter_values(
    template: Mapping[str, Any], overrides: Mapping[str, str], env_vars: Mapping[str, Any]
) -> dict[str, Any]:
    values: dict[str, Any] = dict(PSEUDO_PARAMETERS)
    for name, spec in template.get("Parameters", {}).items():
        values[name] = spec.get("Default", "") if isinstance(spec, dict) else ""
    values.update(overrides)
    values.update(env_vars.get("Parameters", {}))
    return values


def _as_env_value(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


class TemplateResolver:
    """A template's values and Conditions as CloudFormation decides them for ``parameters``
    (local invoke reads a function's settings with it; the security tests, each parameter
    set's Conditions)."""

    def __init__(self, template: Mapping[str, Any], parameters: Mapping[str, Any]) -> None:
        self.parameters = parameters
        self.conditions = template.get("Conditions", {})
        # The parameters read since this was last cleared (Ref and Fn::Sub).
        self.referenced: set[str] = set()

    def resolve(self, value: Any) -> Any:
        if isinstance(value, list):
            return [self.resolve(v) for v in value]
        if not isinstance(value, dict) or len(value) != 1:
            return value
        ((key, arg),) = value.items()
        if key == "Ref":
            self.referenced.add(arg)
            return self.parameters.get(arg, "")
        if key == "Fn::Sub":
            return self._sub(arg)
        if key == "Fn::If":
            condition, when_true, when_false = arg
            return self.resolve(when_true if self.condition(condition) else when_false)
        if key == "Fn::Join":
            separator, parts = arg
            return separator.join(str(self.resolve(p)) for p in self.resolve(parts))
        if key == "Fn::Select":
            index, items = arg
            return self.resolve(items)[int(self.resolve(index))]
        if key == "Fn::Split":
            separator, text = arg
            return str(self.resolve(text)).split(separator)
        return ""  # GetAtt, ImportValue, ...: only AWS knows

    def _sub(self, arg: Any) -> str:
        text, variables = (arg, {}) if isinstance(arg, str) else (arg[0], arg[1])

        def replace(match: re.Match[str]) -> str:
            name = match.group(1)
            if name in variables:
                return str(self.resolve(variables[name]))
            if "." in name:
                return ""
            self.referenced.add(name)
            value = self.parameters.get(name, "")
            return "" if value is None else str(value)

        def render(match: re.Match[str]) -> str:
            # "${!Literal}" is CloudFormation's escape: it renders as "${Literal}", unresolved.
            return (
                "${" + match.group(1)[1:] + "}"
                if match.group(1).startswith("!")
                else replace(match)
            )

        return re.sub(r"\$\{([^}]+)\}", render, text)

    def condition(self, name_or_expr: Any) -> bool:
        expr = self.conditions.get(name_or_expr) if isinstance(name_or_expr, str) else name_or_expr
        return self._evaluate(expr)

    def _evaluate(self, expr: Any) -> bool:
        if not isinstance(expr, dict) or len(expr) != 1:
            return bool(expr)
        ((key, arg),) = expr.items()
        if key == "Fn::Equals":
            left, right = (self.resolve(a) for a in arg)
            return bool(_comparable(left) == _comparable(right))
        if key == "Fn::Not":
            return not self._evaluate(arg[0])
        if key == "Fn::And":
            return all(self._evaluate(a) for a in arg)
        if key == "Fn::Or":
            return any(self._evaluate(a) for a in arg)
        if key == "Condition":
            return self.condition(arg)
        return bool(self.resolve(expr))


def _comparable(value: Any) -> Any:
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    return str(value) if isinstance(value, bool | int) else value
