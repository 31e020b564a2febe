"""Reads ``template.yaml`` the way ``sam local invoke`` does, for the functions it declares.

Only what a local invocation needs is resolved: Handler, CodeUri, the layers' ContentUri,
Timeout, MemorySize and the environment, with ``Globals.Function`` merged in. Parameter values
come from the template's defaults, then ``samconfig.toml``'s ``parameter_overrides``, then an
``--env-vars`` file's ``Parameters``; ``Ref``, ``Fn::Sub`` and ``Fn::If`` over those are
evaluated, anything else that would only be known in AWS becomes an empty string.
"""

from __future__ import annotations

import re
import shlex
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

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


class _CfnLoader(yaml.SafeLoader):
    """A YAML loader that turns CloudFormation short forms into their long forms."""


def _construct_tag(loader: yaml.Loader, suffix: str, node: yaml.Node) -> dict[str, Any]:
    if isinstance(node, yaml.ScalarNode):
        value: Any = loader.construct_scalar(node)
    elif isinstance(node, yaml.SequenceNode):
        value = loader.construct_sequence(node, deep=True)
    else:
        value = loader.construct_mapping(node, deep=True)  # type: ignore[arg-type]
    if suffix == "Ref":
        return {"Ref": value}
    if suffix == "GetAtt" and isinstance(value, str):
        value = value.split(".", 1)
    if suffix == "Condition":
        return {"Condition": value}
    return {f"Fn::{suffix}": value}


_CfnLoader.add_multi_constructor("!", _construct_tag)


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


def load_template(path: Path) -> dict[str, Any]:
    try:
        document = yaml.load(path.read_text(), Loader=_CfnLoader)  # noqa: S506 - safe loader subclass
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigurationError(f"cannot read {path}: {exc}") from exc
    if not isinstance(document, dict) or "Resources" not in document:
        raise ConfigurationError(f"{path} is not a SAM template (no Resources)")
    return document


def samconfig_overrides(path: Path, environment: str = "default") -> dict[str, str]:
    """``parameter_overrides`` from samconfig.toml (deploy section first, then global)."""
    if not path.is_file():
        return {}
    config = tomllib.loads(path.read_text())
    env = config.get(environment, {})
    for section in ("deploy", "local_invoke", "global"):
        raw = env.get(section, {}).get("parameters", {}).get("parameter_overrides")
        if raw:
            return _parse_overrides(raw)
    return {}


def _parse_overrides(raw: str | list[str]) -> dict[str, str]:
    items = raw if isinstance(raw, list) else shlex.split(raw)
    overrides: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if sep:
            overrides[name.strip()] = value
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
    resolver = _Resolver(template, parameters)
    globals_ = template.get("Globals", {}).get("Function", {})
    props = {**globals_, **resource.get("Properties", {})}

    environment = {
        **globals_.get("Environment", {}).get("Variables", {}),
        **resource.get("Properties", {}).get("Environment", {}).get("Variables", {}),
    }
    env = {name: _as_env_value(resolver.resolve(value)) for name, value in environment.items()}
    # As in SAM: the env-vars file overrides only variables the template declares.
    for scope in ("Parameters", logical_id):
        for name, value in (env_vars or {}).get(scope, {}).items():
            if name in env:
                env[name] = _as_env_value(value)

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
    )


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


class _Resolver:
    def __init__(self, template: Mapping[str, Any], parameters: Mapping[str, Any]) -> None:
        self.parameters = parameters
        self.conditions = template.get("Conditions", {})

    def resolve(self, value: Any) -> Any:
        if isinstance(value, list):
            return [self.resolve(v) for v in value]
        if not isinstance(value, dict) or len(value) != 1:
            return value
        ((key, arg),) = value.items()
        if key == "Ref":
            return self.parameters.get(arg, "")
        if key == "Fn::Sub":
            return self._sub(arg)
        if key == "Fn::If":
            condition, when_true, when_false = arg
            return self.resolve(when_true if self._condition(condition) else when_false)
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
            value = self.parameters.get(name, "")
            return "" if value is None else str(value)

        return re.sub(r"\$\{([^}!]+)\}", replace, text)

    def _condition(self, name_or_expr: Any) -> bool:
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
            return self._condition(arg)
        return bool(self.resolve(expr))


def _comparable(value: Any) -> Any:
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    return str(value) if isinstance(value, bool | int) else value
