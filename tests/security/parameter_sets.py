"""Every parameter set the template offers, each rendered as the template CloudFormation sees.

A parameter changes what deploys only through a Condition (a resource that exists or not, an
``Fn::If`` branch) or a value. ``PARAMETER_SETS`` crosses the switches the issue names (each
second-layer backend, in a VPC or not, tracing on or off, an alert e-mail or none) and gives
every other Condition both of its values across the sets, so no branch of the template goes
unseen. ``render`` decides each Condition for one set, keeps the resources and the branches that
hold, and writes every parameter's value in place of its ``Ref``: a scanner reading the result
sees one deployment, not both sides of an ``Fn::If``.
"""

from __future__ import annotations

import itertools
from typing import Any

from infrai_local.sam_template import TemplateResolver

# The one parameter without a default.
REQUIRED = {
    "DatabaseSecretArn": "arn:aws:secretsmanager:eu-west-1:123456789012:secret:ledger-AbC123"
}
BACKENDS: dict[str, dict[str, str]] = {
    "off": {},
    "dynamodb": {"IdempotencyBackend": "dynamodb"},
    "redis": {
        "IdempotencyBackend": "redis",
        "RedisUrl": "rediss://cache.example.com:6379",
        "RedisSecretArn": "arn:aws:secretsmanager:eu-west-1:123456789012:secret:redis-AbC123",
    },
}
IN_VPC = {"SubnetIds": "subnet-0a1b2c3d,subnet-4e5f6a7b", "SecurityGroupIds": "sg-0a1b2c3d"}
TRACING = {"EnableTracing": "true"}
ALERT_EMAIL = {"AlertEmail": "on-call@example.com"}
# An RDS Proxy before the ledger lives in the VPC: it is on in the VPC sets with an alert e-mail,
# before an Aurora cluster in those with tracing too, so each of its Conditions goes both ways.
PROXY = {"DatabaseProxy": "create", "DatabaseProxyTarget": "ledger-db"}
ON_A_CLUSTER = {"DatabaseProxyTargetKind": "cluster"}
# The other switches, each on in every other set: both values of each are rendered.
DATA_KEY_ARN = "arn:aws:kms:eu-west-1:123456789012:key/1234abcd-12ab-34cd-56ef-123456789012"
JOB_SECRET_ARNS = (
    "arn:aws:secretsmanager:eu-west-1:123456789012:secret:mail-token-AbC123,"
    "arn:aws:secretsmanager:eu-west-1:123456789012:secret:hook-token-DeF456"
)
OTHER_SWITCHES: tuple[dict[str, str], ...] = (
    {"DataKmsKeyArn": DATA_KEY_ARN},
    {"SecretsKmsKeyId": "1234abcd-12ab-34cd-56ef-1234567890ab"},
    # The jobs' secrets (two, so a role's grant lists each) ride with the permissions boundary.
    {
        "PermissionsBoundary": "arn:aws:iam::123456789012:policy/workload-boundary",
        "JobSecretArns": JOB_SECRET_ARNS,
    },
    {"DrainMaxConcurrency": "1"},
    # Sets 0-23 reach bit 4 at most: the connection budget's output rides with the schedule.
    {"DrainScheduleEnabled": "false", "DatabaseMaxConnections": "400"},
)


def _parameter_sets() -> dict[str, dict[str, str]]:
    sets: dict[str, dict[str, str]] = {}
    product = itertools.product(BACKENDS, (False, True), (False, True), (False, True))
    for index, (backend, vpc, tracing, email) in enumerate(product):
        name = "-".join(
            [
                f"backend_{backend}",
                "vpc" if vpc else "novpc",
                "tracing" if tracing else "notracing",
                "email" if email else "noemail",
            ]
        )
        values = dict(REQUIRED) | BACKENDS[backend]
        values |= (IN_VPC if vpc else {}) | (TRACING if tracing else {})
        values |= ALERT_EMAIL if email else {}
        if vpc and email:
            values |= PROXY | (ON_A_CLUSTER if tracing else {})
            name += "-proxy"
        # Switch k is on in the sets whose index has bit k set: each switch both ways.
        for bit, switch in enumerate(OTHER_SWITCHES):
            if index >> bit & 1:
                values |= switch
        sets[name] = values
    return sets


PARAMETER_SETS = _parameter_sets()

_NO_VALUE = object()


class Conditions:
    """A template's Conditions decided for one set of parameter values (``values``: a Ref to a
    parameter reads as a string, or as a list of strings for a list type)."""

    def __init__(self, conditions: dict[str, Any], values: dict[str, Any]) -> None:
        # Decided by local invoke's own reading of a template: one evaluator in the tree.
        self._decide = TemplateResolver({"Conditions": conditions}, values)
        self.values = values

    def condition(self, name: str) -> bool:
        assert name in self._decide.conditions, f"no Condition {name!r} in the template"
        return self._decide.condition(name)

    def _resolve(self, node: Any) -> Any:
        """``node`` with each Fn::If decided, AWS::NoValue dropped and parameter Refs read."""
        if isinstance(node, list):
            items = [self._resolve(item) for item in node]
            return [item for item in items if item is not _NO_VALUE]
        if not isinstance(node, dict):
            return node
        if set(node) == {"Fn::If"}:
            name, when_true, when_false = node["Fn::If"]
            return self._resolve(when_true if self.condition(name) else when_false)
        if node == {"Ref": "AWS::NoValue"}:
            return _NO_VALUE
        if set(node) == {"Ref"} and node["Ref"] in self.values:
            return self.values[node["Ref"]]
        resolved = {key: self._resolve(value) for key, value in node.items()}
        return {key: value for key, value in resolved.items() if value is not _NO_VALUE}


class Rendering(Conditions):
    """``template`` (a plain dict, as cfn-lint's decoder reads it) for one parameter set."""

    def __init__(self, template: dict[str, Any], overrides: dict[str, str]) -> None:
        parameters = template["Parameters"]
        values = {name: str(p.get("Default", "")) for name, p in parameters.items()}
        unknown = set(overrides) - set(values)
        assert not unknown, f"not parameters of the template: {sorted(unknown)}"
        values |= overrides
        super().__init__(
            template.get("Conditions", {}),
            {
                name: value.split(",")
                if parameters[name]["Type"] == "CommaDelimitedList"
                else value
                for name, value in values.items()
            },
        )
        self.template = self._render(template)

    def _render(self, template: dict[str, Any]) -> dict[str, Any]:
        rendered = {k: v for k, v in template.items() if k not in ("Conditions", "Rules")}
        rendered["Resources"] = {
            name: self._resolve({k: v for k, v in resource.items() if k != "Condition"})
            for name, resource in template["Resources"].items()
            if "Condition" not in resource or self.condition(resource["Condition"])
        }
        rendered["Outputs"] = {
            name: self._resolve({k: v for k, v in output.items() if k != "Condition"})
            for name, output in template.get("Outputs", {}).items()
            if "Condition" not in output or self.condition(output["Condition"])
        }
        if "Globals" in template:
            rendered["Globals"] = self._resolve(template["Globals"])
        return rendered
