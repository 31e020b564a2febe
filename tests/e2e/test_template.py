"""template.yaml, samconfig.toml and events/: what deploys, checked offline.

The template is read with cfn-lint's decoder (it understands ``!Ref``/``!If``/``!Sub``), linted
with cfn-lint's API, and, for IAM, translated with the same SAM translator ``sam validate`` uses,
so the policy templates are checked as the statements they become.
"""

from __future__ import annotations

import ast
import copy
import json
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from cfnlint.api import lint_file  # type: ignore[import-untyped]
from cfnlint.decode import cfn_yaml  # type: ignore[import-untyped]
from samtranslator.parser.parser import Parser  # type: ignore[import-untyped]
from samtranslator.translator.translator import Translator  # type: ignore[import-untyped]

from infrai_jobs.drain.model import DrainSummary
from infrai_jobs.operations.alerting import AlertReport, StuckClaims
from infrai_jobs.outbox.relay import RelayReport
from infrai_jobs.outbox.status import OutboxStatus
from infrai_jobs.queue.models import QueueStats
from infrai_jobs.queue_contract import DEFAULT_VISIBILITY_TIMEOUT_SECONDS
from infrai_jobs.runtime.observability import (
    record_alert_check,
    record_drain,
    record_outbox_relay,
)
from infrai_local import project
from infrai_local.sam_template import parse_parameter_overrides

ROOT = Path(__file__).resolve().parents[2]
# The framework's resources; the stack's own template.yaml nests them (tests at the end).
TEMPLATE = ROOT / "framework.yaml"
STACK_TEMPLATE = ROOT / "template.yaml"
SAMCONFIG = ROOT / "samconfig.toml"
EVENTS = ROOT / "events"
LAMBDA_DEFAULT_TIMEOUT = 3
# The only managed policies a role may carry: logs, and X-Ray and VPC network interfaces when
# their parameters turn them on (tests/security/test_template_least_privilege.py checks when).
LAMBDA_MANAGED_POLICIES = {
    "service-role/AWSLambdaBasicExecutionRole",
    "AWSXrayWriteOnlyAccess",
    "service-role/AWSLambdaVPCAccessExecutionRole",
}
SECRET_VALUE_VARIABLES = {"INFRAI_API_KEY", "DATABASE_URL"}


def load_template() -> dict[str, Any]:
    # A plain-dict copy: the decoder's nodes carry line marks the translator doesn't expect.
    template: dict[str, Any] = json.loads(json.dumps(cfn_yaml.load(str(TEMPLATE))))
    return template


def stack_template() -> dict[str, Any]:
    """template.yaml alone, its nested application not followed."""
    template: dict[str, Any] = json.loads(json.dumps(cfn_yaml.load(str(STACK_TEMPLATE))))
    return template


def functions(template: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each AWS::Serverless::Function's properties with Globals.Function merged under them."""
    globals_ = template.get("Globals", {}).get("Function", {})
    merged = {}
    for name, resource in template["Resources"].items():
        if resource["Type"] == "AWS::Serverless::Function":
            props = {**globals_, **resource.get("Properties", {})}
            props["Environment"] = {
                "Variables": {
                    **globals_.get("Environment", {}).get("Variables", {}),
                    **resource.get("Properties", {}).get("Environment", {}).get("Variables", {}),
                }
            }
            merged[name] = props
    return merged


def parameter_default(template: dict[str, Any], value: Any) -> Any:
    assert isinstance(value, dict), f"{value!r} is not a Ref to a parameter"
    assert set(value) == {"Ref"}, f"{value!r} is not a Ref to a parameter"
    return template["Parameters"][value["Ref"]].get("Default")


def translate(
    template: dict[str, Any], parameter_values: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The CloudFormation SAM would deploy, as `sam validate` produces it offline; SAM reads
    ``parameter_values`` (the defaults otherwise) where it resolves a Ref itself."""
    document = copy.deepcopy(template)
    for resource in document["Resources"].values():
        for uri in ("CodeUri", "ContentUri"):
            if uri in resource.get("Properties", {}):
                resource["Properties"][uri] = "s3://bucket/key"
    translator = Translator(None, Parser(), boto_session=boto3.Session(region_name="us-east-1"))
    result: dict[str, Any] = translator.translate(
        document, parameter_values=dict(parameter_values or {}), get_managed_policy_map=dict
    )
    return result


def policy_statements(policy: Any) -> Iterator[dict[str, Any]]:
    """Every statement of a role's inline policy, including both branches of an Fn::If."""
    if isinstance(policy, dict) and "Fn::If" in policy:
        for branch in policy["Fn::If"][1:]:
            yield from policy_statements(branch)
    elif isinstance(policy, dict) and "PolicyDocument" in policy:
        statements = policy["PolicyDocument"]["Statement"]
        yield from statements if isinstance(statements, list) else [statements]


def as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def managed_policy_names(arns: list[Any]) -> set[str]:
    """The names in a role's ManagedPolicyArns: plain ARNs, Fn::Sub templates, and both branches
    of an Fn::If (its AWS::NoValue branch names none)."""
    names: set[str] = set()
    for arn in arns:
        if isinstance(arn, dict) and "Fn::If" in arn:
            names |= managed_policy_names(arn["Fn::If"][1:])
        elif isinstance(arn, dict) and "Fn::Sub" in arn:
            names.add(arn["Fn::Sub"].split(":policy/", 1)[1])
        elif isinstance(arn, str):
            names.add(arn.split(":policy/", 1)[1])
    return names


def test_cfn_lint_reports_no_findings() -> None:
    # Given the template as committed
    # When cfn-lint checks it with its default rules
    findings = lint_file(TEMPLATE)
    # Then it finds nothing at all, not even a warning
    assert [str(f) for f in findings] == []


def test_every_function_times_out_before_the_queue_redelivers() -> None:
    # Given every function of the template, Globals applied
    template = load_template()
    # When their effective timeouts are read
    timeouts = {
        name: int(props.get("Timeout", LAMBDA_DEFAULT_TIMEOUT))
        for name, props in functions(template).items()
    }
    # Then each ends before the queue's visibility timeout hands its messages to another drain
    assert "DrainFunction" in timeouts
    too_long = {n: t for n, t in timeouts.items() if t >= DEFAULT_VISIBILITY_TIMEOUT_SECONDS}
    assert too_long == {}, f"timeouts must stay below {DEFAULT_VISIBILITY_TIMEOUT_SECONDS} s"


def test_every_handler_names_a_function_defined_in_the_layer() -> None:
    # Given every function's Handler: an entry point of the layer, which is on the function's
    # path beside its CodeUri (that holds only the team's jobs package)
    layer = ROOT / load_template()["Resources"]["CommonLayer"]["Properties"]["ContentUri"]
    for name, props in functions(load_template()).items():
        module_name, _, attribute = props["Handler"].rpartition(".")
        assert module_name.startswith("infrai_jobs.handlers."), name
        module_file = layer / (module_name.replace(".", "/") + ".py")
        # When the module file is parsed (not imported)
        assert module_file.is_file(), f"{name}: {module_file} does not exist"
        tree = ast.parse(module_file.read_text(), filename=str(module_file))
        defined = {
            node.name
            for node in tree.body
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        }
        # Then it defines the handler function at module level
        assert attribute in defined, f"{name}: {module_file} defines no {attribute}()"


def test_every_function_shares_one_code_uri_holding_the_jobs_package() -> None:
    # Given every function of the template
    props = functions(load_template())
    # When their code locations are read
    code_uris = {name: p["CodeUri"] for name, p in props.items()}
    # Then there is one, functions/, and it holds the jobs package every handler imports
    assert set(code_uris.values()) == {"functions"}, code_uris
    assert (ROOT / "functions" / "jobs" / "__init__.py").is_file()
    # And nothing else: every Handler is the layer's, so a team's functions/ is only its jobs
    assert sorted(e.name for e in (ROOT / "functions").iterdir() if e.name != "__pycache__") == [
        "jobs"
    ]
    handlers = sorted(p["Handler"] for p in props.values())
    assert len(set(handlers)) == len(props), handlers


def test_the_layer_holds_the_package_and_its_pinned_requirements() -> None:
    # Given the layer resource
    layer = load_template()["Resources"]["CommonLayer"]
    content = ROOT / layer["Properties"]["ContentUri"]
    # When its ContentUri folder is looked at
    # Then SAM finds requirements.txt to pip-install and infrai_jobs to copy into python/
    assert (content / "requirements.txt").is_file()
    assert (content / "infrai_jobs" / "__init__.py").is_file()
    # And it is built for the runtime every function uses
    assert layer["Metadata"] == {"BuildMethod": "python3.13", "BuildArchitecture": "arm64"}
    assert layer["Properties"]["CompatibleRuntimes"] == ["python3.13"]
    assert layer["Properties"]["CompatibleArchitectures"] == ["arm64"]


def test_every_function_runs_python313_on_arm64_with_the_layer() -> None:
    # Given every function, Globals applied
    for name, props in functions(load_template()).items():
        # When its runtime settings are read
        # Then it matches what the layer is built for, and uses the layer
        assert props["Runtime"] == "python3.13", name
        assert props["Architectures"] == ["arm64"], name
        assert {"Ref": "CommonLayer"} in props["Layers"], name


def test_no_iam_statement_allows_a_wildcard_action() -> None:
    # Given the template translated the way SAM deploys it (policy templates expanded)
    translated = translate(load_template())
    roles = {
        name: resource["Properties"]
        for name, resource in translated["Resources"].items()
        if resource["Type"] == "AWS::IAM::Role"
    }
    assert roles, "the translation produced no execution role"
    for name, role in roles.items():
        # When every inline statement of every role is read
        statements = [s for policy in role.get("Policies", []) for s in policy_statements(policy)]
        actions = [a for s in statements for a in as_list(s.get("Action", []))]
        # Then no action is a wildcard and none is granted by exclusion
        assert actions, f"{name} has no inline statements"
        assert [a for a in actions if "*" in a] == [], name
        assert [s for s in statements if "NotAction" in s] == [], name
        # And reading a secret is scoped to that secret, never to every resource
        for statement in statements:
            reads_secret = any(
                a.startswith(("ssm:GetParameter", "secretsmanager:GetSecretValue", "kms:"))
                for a in as_list(statement["Action"])
            )
            assert not (reads_secret and statement["Resource"] == "*"), statement
        # And the only managed policies are the ones for logs, X-Ray and VPC
        managed = managed_policy_names(role.get("ManagedPolicyArns", []))
        assert managed <= LAMBDA_MANAGED_POLICIES, f"{name}: {managed - LAMBDA_MANAGED_POLICIES}"


def test_no_environment_variable_holds_a_secret_value() -> None:
    # Given every function's environment, Globals applied
    template = load_template()
    for name, props in functions(template).items():
        variables = props["Environment"]["Variables"]
        # When the secret-bearing variables are looked up
        # Then they are at most declared empty (so --env-vars can set them locally)
        for secret in SECRET_VALUE_VARIABLES & set(variables):
            assert variables[secret] == "", f"{name}: {secret} must not carry a value"
        # And the secrets are referenced by name and ARN only
        assert parameter_default(template, variables["INFRAI_API_KEY_PARAMETER"]).startswith("/")
        secret_arn = template["Parameters"][variables["DATABASE_SECRET_ARN"]["Ref"]]
        assert secret_arn["AllowedPattern"].startswith("^arn:aws"), name
        # And no literal value looks like a URL with a password in it
        literals = [v for v in variables.values() if isinstance(v, str)]
        assert [v for v in literals if re.search(r"://[^/@\s]+:[^/@\s]+@", v)] == [], name


def test_the_drain_runs_every_minute_by_default() -> None:
    # Given DrainFunction's events
    template = load_template()
    events = template["Resources"]["DrainFunction"]["Properties"]["Events"]
    schedules = [
        e["Properties"] for e in events.values() if e["Type"] in ("Schedule", "ScheduleV2")
    ]
    # When the schedule's expression is resolved to its parameter's default
    assert len(schedules) == 1, events
    rate = parameter_default(
        template, schedules[0].get("Schedule") or schedules[0].get("ScheduleExpression")
    )
    # Then it fires once a minute
    assert rate == "rate(1 minute)"


def test_every_scheduled_function_pages_when_it_fails_and_the_watcher_when_silent() -> None:
    # Given the functions that run on a schedule, and the alarms
    template = load_template()
    resources = template["Resources"]
    scheduled = {
        name
        for name, props in functions(template).items()
        if any(e["Type"] in ("Schedule", "ScheduleV2") for e in props.get("Events", {}).values())
    }
    assert scheduled == {
        "DrainFunction",
        "DlqAlertFunction",
        "PruneFunction",
        "OutboxRelayFunction",
    }
    alarms = [r["Properties"] for r in resources.values() if r["Type"] == "AWS::CloudWatch::Alarm"]

    def watched(metric: str) -> set[str]:
        return {
            d["Value"]["Ref"]
            for a in alarms
            if a.get("MetricName") == metric and a["AlarmActions"] == [{"Ref": "AlertTopic"}]
            for d in a["Dimensions"]
            if d["Name"] == "FunctionName"
        }

    # Then each one's errors page through the alert topic (nobody invokes them by hand)
    assert scheduled <= watched("Errors")
    # And the DLQ watcher pages when it stops running, within its alarm's period
    assert "DlqAlertFunction" in watched("Invocations")
    (silent,) = [a for a in alarms if a.get("MetricName") == "Invocations"]
    pattern = re.compile(template["Parameters"]["DlqAlertScheduleRate"]["AllowedPattern"])
    for rate, allowed in [
        ("rate(5 minutes)", True),
        ("rate(1 minute)", True),
        ("rate(29 minutes)", True),
        ("rate(30 minutes)", False),
        ("rate(1 hour)", False),
        ("cron(0 * * * ? *)", False),
    ]:
        assert bool(pattern.fullmatch(rate)) is allowed, rate
    assert silent["Period"] * silent["EvaluationPeriods"] >= 30 * 60


def test_every_function_logs_to_its_own_log_group_with_retention() -> None:
    # Given every function's logging configuration
    template = load_template()
    log_groups = []
    for name, props in functions(template).items():
        # When its log group is followed to the resource
        group = props["LoggingConfig"]["LogGroup"]
        resource = template["Resources"][group["Ref"]]
        # Then it is an explicit log group whose retention is the operator's parameter
        assert resource["Type"] == "AWS::Logs::LogGroup", name
        assert resource["Properties"]["RetentionInDays"] == {"Ref": "LogRetentionDays"}, name
        log_groups.append(group["Ref"])
    assert len(log_groups) == len(set(log_groups)), "each function needs its own log group"


def test_every_parameter_and_output_tells_the_operator_what_it_is() -> None:
    # Given the template's parameters and outputs
    template = load_template()
    # When their descriptions are read
    undescribed = [
        name
        for section in ("Parameters", "Outputs")
        for name, spec in template[section].items()
        if not spec.get("Description")
    ]
    # Then none is left without one, and each function's name, ARN and log group are output
    assert undescribed == []
    for name in functions(template):
        for suffix in ("Name", "Arn", "LogGroupName"):
            assert f"{name}{suffix}" in template["Outputs"], f"{name}{suffix}"


def test_samconfig_is_version_01_as_a_number_with_a_prod_environment() -> None:
    # Given samconfig.toml
    # When TOML parses it
    config = tomllib.loads(SAMCONFIG.read_text())
    # Then the version is the number 0.1 that SAM requires, not a string
    assert isinstance(config["version"], float)
    assert config["version"] == pytest.approx(0.1)
    # And default and prod deploy to different stacks (whatever a team names them), each asking
    # before it changes anything
    stacks = [config[env]["global"]["parameters"]["stack_name"] for env in ("default", "prod")]
    assert all(stacks)
    assert stacks[0] != stacks[1]
    for environment in ("default", "prod"):
        deploy = config[environment]["deploy"]["parameters"]
        assert deploy["confirm_changeset"] is True, environment
        # (AUTO_EXPAND: the stack nests the framework as an application)
        assert deploy["capabilities"] == "CAPABILITY_IAM CAPABILITY_AUTO_EXPAND", environment
        assert isinstance(deploy["parameter_overrides"], str), environment
        assert config[environment]["validate"]["parameters"]["lint"] is True, environment
    build = config["default"]["build"]["parameters"]
    assert build["cached"] is True
    assert build["parallel"] is True


def test_samconfig_overrides_name_only_template_parameters() -> None:
    # Given the stack template's own parameters (a deploy gives values to those only; the
    # framework's reach the nested application through them) and every environment's overrides
    parameters = set(stack_template()["Parameters"])
    config = tomllib.loads(SAMCONFIG.read_text())
    for environment in ("default", "prod"):
        overrides = config[environment]["deploy"]["parameters"]["parameter_overrides"]
        # When the overrides are split into names
        names = set(re.findall(r"(?:^|\s)([A-Za-z0-9]+)=", overrides))
        # Then each names a parameter the template declares (a typo would be ignored silently)
        assert names, environment
        assert names <= parameters, f"{environment}: {names - parameters}"


def test_samconfig_syncs_the_default_stack_with_every_required_parameter() -> None:
    # Given the template's parameters, and samconfig.toml's default environment
    template_parameters = load_template()["Parameters"]
    required = {name for name, spec in template_parameters.items() if "Default" not in spec}
    default = tomllib.loads(SAMCONFIG.read_text())["default"]
    # When `sam sync` reads its section (sync has no --guided to ask for what is missing)
    sync = default["sync"]["parameters"]
    overrides = parse_parameter_overrides(sync["parameter_overrides"])
    # Then every parameter without a default is given, as deploy's other overrides are
    assert required
    assert required <= set(overrides), required - set(overrides)
    deploy = parse_parameter_overrides(default["deploy"]["parameters"]["parameter_overrides"])
    assert {name: overrides[name] for name in deploy} == deploy
    assert set(overrides) <= set(stack_template()["Parameters"])
    assert {"CAPABILITY_IAM", "CAPABILITY_AUTO_EXPAND"} <= set(sync["capabilities"].split())
    # And the secret's ARN is a placeholder CloudFormation refuses by the parameter's own
    # pattern, so a first sync before it is replaced stops there, naming the parameter
    pattern = template_parameters["DatabaseSecretArn"]["AllowedPattern"]
    assert not re.fullmatch(pattern, overrides["DatabaseSecretArn"])
    assert "ConstraintDescription" in template_parameters["DatabaseSecretArn"]
    # And only the default environment syncs: production is deployed, never synced
    assert "sync" not in tomllib.loads(SAMCONFIG.read_text())["prod"]


SAMPLE_EVENTS = {
    "DrainFunction": "drain-schedule.json",
    "DlqAlertFunction": "dlq-alert-schedule.json",
    "PruneFunction": "prune-schedule.json",
    "OutboxRelayFunction": "outbox-relay-schedule.json",
}


@pytest.mark.parametrize(("function", "sample"), SAMPLE_EVENTS.items())
def test_the_sample_schedule_events_are_what_each_schedule_sends(
    function: str, sample: str
) -> None:
    # Given the function's schedule and its sample event in events/
    template = load_template()
    ((event_name, schedule),) = template["Resources"][function]["Properties"]["Events"].items()
    event = json.loads((EVENTS / sample).read_text())
    # When the schedule's input is parsed with Scheduler's context attributes filled in
    sent = json.loads(
        schedule["Properties"]["Input"]
        .replace("<aws.scheduler.execution-id>", event["id"])
        .replace("<aws.scheduler.scheduled-time>", event["time"])
        .replace("<aws.scheduler.schedule-arn>", event["resources"][0])
    )
    # Then the sample is exactly that event: an EventBridge-shaped scheduled event
    assert event == sent
    assert (event["version"], event["detail-type"], event["source"]) == (
        "0",
        "Scheduled Event",
        "aws.scheduler",
    )
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", event["time"])
    # And its resource is the schedule's ARN: the stack's group, the name SAM gives it
    arn = event["resources"][0].split(":")
    assert arn[:3] == ["arn", "aws", "scheduler"]
    assert arn[5] == f"schedule/infrai-jobs/{function}{event_name}"


def test_the_env_vars_file_sets_only_variables_the_template_declares() -> None:
    # Given events/env.json in SAM's --env-vars format
    env_file = json.loads((EVENTS / "env.json").read_text())
    declared = {
        name: set(props["Environment"]["Variables"])
        for name, props in functions(load_template()).items()
    }
    for scope, variables in env_file.items():
        # When each scope's variables are compared with what the template declares
        # ("Parameters" applies to every function; SAM ignores undeclared variables silently)
        targets = declared.values() if scope == "Parameters" else [declared.get(scope, set())]
        assert scope == "Parameters" or scope in declared, f"no function {scope}"
        # Then every one is declared, and every value is a string
        for names in targets:
            assert set(variables) <= names, f"{scope}: {set(variables) - names}"
        assert all(isinstance(v, str) for v in variables.values()), scope


# --- Schedules, alarms and the dashboard -------------------------------------------------------

SCHEDULE_PLACEHOLDERS = re.compile(r"<aws\.scheduler\.[a-z-]+>")


def alarms(template: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        name: resource
        for name, resource in template["Resources"].items()
        if resource["Type"] == "AWS::CloudWatch::Alarm"
    }


def alarm_metrics(alarm: dict[str, Any]) -> list[dict[str, Any]]:
    """The metrics an alarm reads: its one metric, or every MetricStat of its metric math."""
    props = alarm["Properties"]
    if "MetricName" in props:
        return [
            {
                "Namespace": props["Namespace"],
                "MetricName": props["MetricName"],
                "Dimensions": props.get("Dimensions", []),
            }
        ]
    return [q["MetricStat"]["Metric"] for q in props["Metrics"] if "MetricStat" in q]


def globals_variable(template: dict[str, Any], name: str) -> str:
    value = template["Globals"]["Function"]["Environment"]["Variables"][name]
    assert isinstance(value, str), f"{name} must be a literal for the alarms to name it"
    return value


def emitted_metrics(
    template: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> dict[str, tuple[str, dict[str, str]]]:
    """What the functions' code emits as EMF, run with the template's namespace and service:
    {metric: (namespace, {dimension: value})}, the queue named as QueueName's default."""
    from aws_lambda_powertools import Metrics  # noqa: PLC0415 - only these tests need it

    queue = template["Parameters"]["QueueName"]["Default"]
    namespace = globals_variable(template, "POWERTOOLS_METRICS_NAMESPACE")
    service = globals_variable(template, "POWERTOOLS_SERVICE_NAME")
    capsys.readouterr()
    metrics = Metrics(namespace=namespace, service=service)
    stats = QueueStats(queue, 3, 1, 1, 0, 1, 12.5)
    record_alert_check(metrics, AlertReport(stats=[stats], stuck=StuckClaims(1, 960.0)))
    metrics.flush_metrics()
    record_drain(metrics, queue, DrainSummary())
    metrics.flush_metrics()
    record_outbox_relay(metrics, RelayReport(), OutboxStatus(0, 0.0, 0, 0, 0))
    metrics.flush_metrics()
    found: dict[str, tuple[str, dict[str, str]]] = {}
    for line in capsys.readouterr().out.splitlines():
        document = json.loads(line)
        for directive in document["_aws"]["CloudWatchMetrics"]:
            (dimension_names,) = directive["Dimensions"]
            dimensions = {d: document[d] for d in dimension_names}
            for metric in directive["Metrics"]:
                found[metric["Name"]] = (directive["Namespace"], dimensions)
    return found


def resolved_dimensions(template: dict[str, Any], dimensions: list[dict[str, Any]]) -> dict:
    """An alarm's dimensions with each Ref to a parameter replaced by its default."""
    return {
        d["Name"]: parameter_default(template, d["Value"])
        if isinstance(d["Value"], dict)
        else d["Value"]
        for d in dimensions
    }


def alarm_reading_emitted(
    template: dict[str, Any], emitted: dict[str, Any], alarm_name: str, metric: str
) -> dict[str, Any]:
    """The properties of the alarm ``alarm_name``, once it is seen to read ``metric`` in the
    series the code emits: the same namespace, metric name and dimensions (a parameter's default
    standing for its Ref)."""
    props: dict[str, Any] = alarms(template)[alarm_name]["Properties"]
    namespace, dimensions = emitted[metric]
    assert (props["Namespace"], props["MetricName"]) == (namespace, metric)
    assert resolved_dimensions(template, props["Dimensions"]) == dimensions
    return props


def alarm_on_emitted_series(
    capsys: pytest.CaptureFixture[str], alarm_name: str, metric: str
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The template, what its functions' code emits (``emitted_metrics``), and the properties
    of ``alarm_name`` once seen to read ``metric`` among them (``alarm_reading_emitted``)."""
    template = load_template()
    emitted = emitted_metrics(template, capsys)
    return template, emitted, alarm_reading_emitted(template, emitted, alarm_name, metric)


def age_alarm_on_emitted_series(
    capsys: pytest.CaptureFixture[str], what: str, command: str
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """``alarm_on_emitted_series`` for the alarm on the age of the oldest ``what``, named as
    every such alarm is (``Oldest<what>Alarm`` on ``Oldest<what>AgeSeconds``): it pages when the
    series' maximum is above the parameter ``<what>AgeAlarmSeconds``, and its description names
    the ``command`` to look."""
    alarm_name, metric = f"Oldest{what}Alarm", f"Oldest{what}AgeSeconds"
    template, emitted, props = alarm_on_emitted_series(capsys, alarm_name, metric)
    assert props["Threshold"] == {"Ref": f"{what}AgeAlarmSeconds"}
    assert (props["Statistic"], props["ComparisonOperator"]) == ("Maximum", "GreaterThanThreshold")
    assert command in " ".join(props["AlarmDescription"].split())
    return template, emitted, props


def drain_schedule_rate_seconds(template: dict[str, Any]) -> int:
    rate = template["Parameters"]["DrainScheduleRate"]["Default"]
    match = re.fullmatch(r"rate\((\d+) minutes?\)", rate)
    assert match, rate
    return int(match.group(1)) * 60


def test_every_schedule_is_an_eventbridge_scheduler_schedule_set_deliberately() -> None:
    # Given every scheduled event of every function
    template = load_template()
    events = {
        f"{name}.{event_name}": event
        for name, props in functions(template).items()
        for event_name, event in props.get("Events", {}).items()
        if event["Type"] in ("Schedule", "ScheduleV2")
    }
    assert len(events) == 4, events
    for name, event in events.items():
        props = event["Properties"]
        # When its type and properties are read
        # Then it is EventBridge Scheduler (ScheduleV2) in the stack's own schedule group
        assert event["Type"] == "ScheduleV2", name
        assert props["GroupName"] == {"Ref": "ScheduleGroup"}, name
        # And its retry policy and flexible window are set, not left to Scheduler's defaults
        # (185 retries over 24 hours, which would replay day-old ticks)
        policy = props["RetryPolicy"]
        assert set(policy) == {"MaximumRetryAttempts", "MaximumEventAgeInSeconds"}, name
        assert 60 <= policy["MaximumEventAgeInSeconds"] <= 3600, name
        assert props["FlexibleTimeWindow"]["Mode"] in ("OFF", "FLEXIBLE"), name
        # And its input is an EventBridge-shaped event whose id is Scheduler's execution id
        document = json.loads(SCHEDULE_PLACEHOLDERS.sub("x", props["Input"]))
        assert '"id": "<aws.scheduler.execution-id>"' in props["Input"], name
        assert document["detail-type"] == "Scheduled Event", name
    # And the drain's ticks are on time and never retried past its own rate
    drain = events["DrainFunction.DrainSchedule"]["Properties"]
    assert drain["FlexibleTimeWindow"] == {"Mode": "OFF"}
    assert drain["RetryPolicy"]["MaximumEventAgeInSeconds"] <= drain_schedule_rate_seconds(template)
    assert drain["State"] == {"Fn::If": ["DrainScheduled", "ENABLED", "DISABLED"]}
    group = template["Resources"]["ScheduleGroup"]
    assert group["Type"] == "AWS::Scheduler::ScheduleGroup"
    assert group["Properties"]["Name"] == {"Fn::Sub": "${AWS::StackName}"}


def test_drain_memory_is_a_parameter() -> None:
    # Given DrainFunction and the template's parameters
    template = load_template()
    drain = template["Resources"]["DrainFunction"]["Properties"]
    # When its memory is read
    parameter = template["Parameters"]["DrainMemorySize"]
    # Then it is the DrainMemorySize parameter, within what Lambda allows, 512 MB by default
    assert drain["MemorySize"] == {"Ref": "DrainMemorySize"}
    assert (parameter["Type"], parameter["Default"]) == ("Number", 512)
    assert (parameter["MinValue"], parameter["MaxValue"]) == (128, 10240)


def test_every_alarm_pages_the_alert_topic_and_says_what_to_run() -> None:
    # Given every alarm of the template
    found = alarms(load_template())
    assert len(found) >= 10
    for name, alarm in found.items():
        props = alarm["Properties"]
        # When its actions and description are read
        # Then it pages (and clears) through the alert topic
        assert props["AlarmActions"] == [{"Ref": "AlertTopic"}], name
        assert props["OKActions"] == [{"Ref": "AlertTopic"}], name
        # And its description names at least one command to run, within CloudWatch's limit
        description = props["AlarmDescription"]
        assert re.search(r"`(infrai-jobs|aws) [^`]+`", description), name
        assert len(description) <= 1024, name


def test_drain_throttles_and_a_p99_duration_near_its_timeout_page() -> None:
    # Given the drain's throttle and duration alarms
    template = load_template()
    found = alarms(template)
    timeout_ms = template["Resources"]["DrainFunction"]["Properties"]["Timeout"] * 1000
    drain = [{"Name": "FunctionName", "Value": {"Ref": "DrainFunction"}}]
    throttles = found["DrainThrottlesAlarm"]["Properties"]
    duration = found["DrainDurationNearTimeoutAlarm"]["Properties"]
    # When their metric and threshold are read
    # Then sustained throttling pages
    assert (throttles["Namespace"], throttles["MetricName"]) == ("AWS/Lambda", "Throttles")
    assert throttles["Dimensions"] == drain
    assert (throttles["Statistic"], throttles["Threshold"]) == ("Sum", 1)
    assert throttles["ComparisonOperator"] == "GreaterThanOrEqualToThreshold"
    # (for fifteen minutes in a row: drains at their reserved concurrency turn a tick away now
    # and then, which is no reason to page)
    assert (throttles["Period"], throttles["EvaluationPeriods"]) == (300, 3)
    assert throttles["DatapointsToAlarm"] == 3
    # And a p99 above 80% of DrainFunction's own Timeout pages
    assert (duration["Namespace"], duration["MetricName"]) == ("AWS/Lambda", "Duration")
    assert duration["Dimensions"] == drain
    assert duration["ExtendedStatistic"] == "p99"
    assert duration["Threshold"] == 0.8 * timeout_ms
    assert duration["ComparisonOperator"] == "GreaterThanThreshold"


def test_a_silent_drain_pages_only_while_its_schedule_is_enabled() -> None:
    # Given the drain's silence alarm
    template = load_template()
    alarm = alarms(template)["DrainSilentAlarm"]
    props = alarm["Properties"]
    queries = {q["Id"]: q for q in props["Metrics"]}
    # When its condition and metric math are read
    (stat,) = [q["MetricStat"] for q in queries.values() if "MetricStat" in q]
    (returned,) = [q for q in queries.values() if q.get("ReturnData", True)]
    # Then it exists only while the stack enables the schedule
    assert alarm["Condition"] == "DrainScheduled"
    assert template["Conditions"]["DrainScheduled"] == {
        "Fn::Equals": [{"Ref": "DrainScheduleEnabled"}, "true"]
    }
    # And it counts DrainFunction's invocations per minute, a minute without any as zero
    assert stat["Metric"]["MetricName"] == "Invocations"
    assert stat["Metric"]["Dimensions"] == [
        {"Name": "FunctionName", "Value": {"Ref": "DrainFunction"}}
    ]
    assert (stat["Period"], stat["Stat"]) == (60, "Sum")
    (source,) = [i for i, q in queries.items() if "MetricStat" in q]
    assert returned["Expression"] == f"FILL({source}, 0)"
    # And it pages after DrainSilentMinutes minutes in a row without one, or without any data
    assert props["EvaluationPeriods"] == {"Ref": "DrainSilentMinutes"}
    assert props["DatapointsToAlarm"] == {"Ref": "DrainSilentMinutes"}
    assert (props["Threshold"], props["ComparisonOperator"]) == (1, "LessThanThreshold")
    assert props["TreatMissingData"] == "breaching"
    minutes = template["Parameters"]["DrainSilentMinutes"]
    assert minutes["Default"] * 60 > drain_schedule_rate_seconds(template)


def test_failed_schedule_invocations_page() -> None:
    # Given the schedules' failure alarm
    alarm = alarms(load_template())["ScheduleFailuresAlarm"]["Properties"]
    # When the metrics it adds up are read
    read = {
        (m["Namespace"], m["MetricName"]): m["Dimensions"]
        for m in alarm_metrics({"Properties": alarm})
    }
    # Then they are Scheduler's target errors and dropped invocations of the stack's group
    group = [{"Name": "ScheduleGroup", "Value": {"Ref": "ScheduleGroup"}}]
    assert read == {
        ("AWS/Scheduler", "TargetErrorCount"): group,
        ("AWS/Scheduler", "InvocationDroppedCount"): group,
    }
    (total,) = [q for q in alarm["Metrics"] if "Expression" in q]
    assert total["Expression"] == "FILL(target_errors, 0) + FILL(dropped, 0)"
    assert (alarm["Threshold"], alarm["ComparisonOperator"]) == (
        1,
        "GreaterThanOrEqualToThreshold",
    )


@pytest.mark.parametrize(
    ("alarm_name", "metric"),
    [("DlqCountAlarm", "DeadLetters"), ("StuckClaimsAlarm", "StuckClaims")],
)
def test_dlq_count_and_stuck_claims_page_on_the_metrics_the_watcher_emits(
    alarm_name: str, metric: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given the backstop alarm and the EMF the watcher's code emits with the template's settings
    # When the alarm's namespace, metric and dimensions are compared with what is emitted
    # Then they are the same series, and any value above zero pages
    _, _, props = alarm_on_emitted_series(capsys, alarm_name, metric)
    assert (props["Threshold"], props["ComparisonOperator"]) == (0, "GreaterThanThreshold")
    assert props["Statistic"] == "Maximum"
    # And between two checks the last verdict stands
    assert props["TreatMissingData"] == "ignore"


def test_a_visibility_mismatch_pages_and_is_on_the_dashboard(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Given the visibility mismatch alarm and what the drain's code emits
    # When the alarm's series is compared with the drain's
    # Then it reads the drain's own series, and one mismatch in five minutes pages
    template, _, props = alarm_on_emitted_series(
        capsys, "VisibilityMismatchAlarm", "VisibilityMismatch"
    )
    assert (props["Statistic"], props["Period"]) == ("Sum", 300)
    assert (props["Threshold"], props["ComparisonOperator"]) == (
        1,
        "GreaterThanOrEqualToThreshold",
    )
    # And the description names the setting to fix
    assert "INFRAI_VISIBILITY_TIMEOUT_SECONDS" in props["AlarmDescription"]
    # And the dashboard charts the metric and shows the alarm
    assert_on_the_dashboard(template, "VisibilityMismatchAlarm", "VisibilityMismatch")


def dashboard(template: dict[str, Any]) -> dict[str, Any]:
    body = template["Resources"]["Dashboard"]["Properties"]["DashboardBody"]["Fn::Sub"]
    defaults = {name: str(spec.get("Default", "")) for name, spec in template["Parameters"].items()}

    def value(match: re.Match[str]) -> str:
        name = match.group(1)
        assert (
            name in defaults
            or name.split(".")[0] in template["Resources"]
            or name.startswith("AWS::")
        ), f"${{{name}}} names nothing"
        return defaults.get(name, f"<{name}>")

    document: dict[str, Any] = json.loads(re.sub(r"\$\{([^}]+)\}", value, body))
    return document


def dashboard_charts_and_alarms(template: dict[str, Any]) -> tuple[set[str], set[str]]:
    """The metric names the dashboard charts, and the alarms (as ``<Name.Arn>``) it shows."""
    widgets = dashboard(template)["widgets"]
    charted = {row[1] for w in widgets for row in w["properties"].get("metrics", [])}
    shown_alarms = {a for w in widgets for a in w["properties"].get("alarms", [])}
    return charted, shown_alarms


def assert_on_the_dashboard(template: dict[str, Any], alarm_name: str, *metrics: str) -> None:
    """The dashboard charts each of ``metrics`` and shows the alarm ``alarm_name``."""
    charted, shown_alarms = dashboard_charts_and_alarms(template)
    assert set(metrics) <= charted, set(metrics) - charted
    assert f"<{alarm_name}.Arn>" in shown_alarms


def test_the_dashboard_shows_the_drain_queue_ledger_and_function_figures(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Given the dashboard's body, resolved with the parameters' defaults
    template = load_template()
    widgets = dashboard(template)["widgets"]
    emitted = emitted_metrics(template, capsys)
    shown: dict[tuple[str, str], dict[str, str]] = {}
    for widget in widgets:
        for row in widget["properties"].get("metrics", []):
            names = [part for part in row if isinstance(part, str)]
            namespace, metric, *pairs = names
            shown[(namespace, metric)] = dict(zip(pairs[::2], pairs[1::2], strict=True))
    # When the metrics it charts are collected
    charted = {metric for _, metric in shown}
    # Then it charts consumed, done, duplicates and acked, every outcome, the queue's DLQ,
    # available, in-flight and age figures, the ledger's stuck claims and oldest running claim
    required = {"MessagesConsumed", "JobsDone", "DuplicatesSkipped", "MessagesAcked"}
    required |= {name for name in emitted if name.startswith("Outcome")}
    required |= {"DlqCount", "AvailableCount", "InFlightCount", "OldestMessageAgeSeconds"}
    required |= {"StuckClaims", "OldestRunningClaimAgeSeconds"}
    required |= {"ReconciledDone", "ReconciledNotDone", "ReconciledUnknown"}
    assert len([n for n in required if n.startswith("Outcome")]) == 13
    assert required <= charted, required - charted
    # And each of those is charted with the namespace and dimensions the code emits
    for (namespace, metric), dimensions in shown.items():
        if namespace.startswith("AWS/"):
            continue
        assert (namespace, dimensions) == emitted.get(metric), metric
    # And DrainFunction's duration, errors and throttles, and the schedules' failures
    drain = {"FunctionName": "<DrainFunction>"}
    for metric in ("Duration", "Errors", "Throttles", "Invocations"):
        assert shown[("AWS/Lambda", metric)] == drain, metric
    assert ("AWS/Scheduler", "TargetErrorCount") in shown
    # And the widgets fit the dashboard's 24-column grid, and its URL is an output
    assert all(w["x"] + w["width"] <= 24 for w in widgets)
    url = template["Outputs"]["DashboardUrl"]["Value"]["Fn::Sub"]
    assert url.endswith("#dashboards/dashboard/${Dashboard}")
    assert "region=${AWS::Region}" in url


def test_the_oldest_deferred_job_pages_past_its_parameter_and_is_on_the_dashboard(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Given the deferred-age alarm, the dashboard, and what the watcher's code emits
    # When the alarm's series is compared with the watcher's
    # Then it reads that series, and pages above the parameter's threshold (an hour by default)
    template, emitted, _ = age_alarm_on_emitted_series(
        capsys, "Deferred", "claims list --state deferred"
    )
    assert template["Parameters"]["DeferredAgeAlarmSeconds"]["Default"] == 3600
    # And the watcher emits the backlog too, and the dashboard charts all three with the alarm
    assert "DeferredBacklog" in emitted
    charted = ("JobsDeferred", "DeferredBacklog", "OldestDeferredAgeSeconds")
    assert_on_the_dashboard(template, "OldestDeferredAlarm", *charted)


def test_job_policies_reach_the_drain_from_a_parameter_empty_by_default() -> None:
    # Given the template's JobPolicies parameter and DrainFunction's environment
    template = load_template()
    parameter = template["Parameters"]["JobPolicies"]
    drain = functions(template)["DrainFunction"]["Environment"]["Variables"]
    # Then the parameter is a string overriding nothing by default, passed as JOB_POLICIES
    assert (parameter["Type"], parameter["Default"]) == ("String", "")
    assert drain["JOB_POLICIES"] == {"Ref": "JobPolicies"}


def test_the_jobs_settings_reach_the_two_functions_that_run_jobs_in_one_parameter() -> None:
    # Given the template's JobSettings parameter and its functions' environments
    template = load_template()
    parameter = template["Parameters"]["JobSettings"]
    environments = {
        name: props["Environment"]["Variables"] for name, props in functions(template).items()
    }
    # Then it is a string holding an empty JSON object by default, passed as JOB_SETTINGS to
    # the drain (which runs the jobs) and the watcher (their probes) and to no other function
    assert (parameter["Type"], parameter["Default"]) == ("String", "{}")
    assert json.loads(parameter["Default"]) == {}
    given = {name for name, env in environments.items() if "JOB_SETTINGS" in env}
    assert given == {"DrainFunction", "DlqAlertFunction"}
    for name in given:
        assert environments[name]["JOB_SETTINGS"] == {"Ref": "JobSettings"}


def test_the_template_names_no_setting_or_secret_of_any_job() -> None:
    # Given the settings and secrets jobs declare (the framework tests' jobs, which declare what
    # the example jobs do), and the name of a secret's ARN
    from fixture_jobs import build_registry  # noqa: PLC0415

    registry = build_registry()
    assert registry.declared_settings()
    declared = {*registry.declared_settings(), *registry.declared_secrets()}
    declared |= {f"{name}_SECRET_ARN" for name in [*registry.declared_secrets(), "MAIL_API_TOKEN"]}
    template = load_template()
    # Then no function's environment names one (they reach the functions in JOB_SETTINGS), and
    # no parameter is one's, so a team nests this template unchanged whatever its jobs
    for name, props in functions(template).items():
        assert not declared & set(props["Environment"]["Variables"]), name
    text = TEMPLATE.read_text(encoding="utf-8")
    assert [name for name in declared if name in text] == []
    assert not [p for p in template["Parameters"] if p.endswith("ProviderUrl")]


def _job_secrets_grant(role: dict[str, Any]) -> Any:
    (grant,) = [
        policy
        for policy in role["Properties"]["Policies"]
        if "Fn::If" in policy and policy["Fn::If"][0] == "HasJobSecrets"
    ]
    return grant


def test_the_roles_that_run_jobs_read_exactly_the_secrets_job_secret_arns_lists() -> None:
    # Given the JobSecretArns parameter and the roles of the drain and the watcher
    template = load_template()
    parameter = template["Parameters"]["JobSecretArns"]
    # Then it is a list, empty by default, of Secrets Manager ARNs each (with their suffix)
    assert (parameter["Type"], parameter["Default"]) == ("CommaDelimitedList", "")
    pattern = re.compile(parameter["AllowedPattern"])
    assert pattern.fullmatch("arn:aws:secretsmanager:eu-west-1:123456789012:secret:mail-AbC123")
    for refused in ("SET-ME", "*", "arn:aws:secretsmanager:eu-west-1:123456789012:secret:*"):
        assert not pattern.fullmatch(refused), refused
    # And the grant exists only when the list is not empty
    condition = template["Conditions"]["HasJobSecrets"]
    assert condition == {
        "Fn::Not": [{"Fn::Equals": [{"Fn::Join": ["", {"Ref": "JobSecretArns"}]}, ""]}]
    }
    for role in ("DrainFunctionRole", "DlqAlertFunctionRole"):
        grant = _job_secrets_grant(template["Resources"][role])
        assert grant["Fn::If"][2] == {"Ref": "AWS::NoValue"}
        # And it allows reading exactly those ARNs, and nothing else
        (statement,) = policy_statements(grant["Fn::If"][1])
        assert statement["Effect"] == "Allow"
        assert statement["Action"] == "secretsmanager:GetSecretValue"
        assert statement["Resource"] == {"Ref": "JobSecretArns"}
    # And no other role may read them
    for name, resource in template["Resources"].items():
        if resource["Type"] == "AWS::IAM::Role" and name not in (
            "DrainFunctionRole",
            "DlqAlertFunctionRole",
        ):
            assert "JobSecretArns" not in json.dumps(resource), name


def test_the_drain_fans_out_within_its_reserved_concurrency_without_async_retries() -> None:
    # Given the drain function as deployed
    template = load_template()
    drain = functions(template)["DrainFunction"]
    variables = drain["Environment"]["Variables"]
    # Then its reserved concurrency is the fan-out's cap, one parameter for both
    assert drain["ReservedConcurrentExecutions"] == {"Ref": "DrainMaxConcurrency"}
    assert variables["DRAIN_MAX_CONCURRENCY"] == {"Ref": "DrainMaxConcurrency"}
    assert variables["DRAIN_FANOUT_AFTER_SECONDS"] == {"Ref": "DrainFanOutAfterSeconds"}
    assert parameter_default(template, variables["DRAIN_FANOUT_AFTER_SECONDS"]) == 30
    # And a fan-out event that fails is not retried by Lambda's async queue
    assert drain["EventInvokeConfig"]["MaximumRetryAttempts"] == 0
    # And idle polling is opt-in, its window below the one-minute schedule
    assert parameter_default(template, variables["DRAIN_IDLE_POLL_MS"]) == 0
    assert parameter_default(template, variables["DRAIN_IDLE_WINDOW_SECONDS"]) < 60


def test_the_oldest_outbox_row_pages_past_its_parameter_and_is_on_the_dashboard(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Given the outbox alarm, the dashboard, and what the relay's code emits
    # When the alarm's series is compared with the relay's
    # Then it reads that series and pages above its parameter, and when the relay goes silent
    template, _, props = age_alarm_on_emitted_series(capsys, "Outbox", "infrai-jobs outbox status")
    assert props["TreatMissingData"] == "breaching"
    # And the dashboard charts the backlog and the oldest row beside the alarm
    assert_on_the_dashboard(
        template, "OldestOutboxAlarm", "OutboxPending", "OldestOutboxAgeSeconds", "OutboxPublished"
    )
    # And the relay runs every minute by default, one at a time
    relay = template["Resources"]["OutboxRelayFunction"]["Properties"]
    assert template["Parameters"]["OutboxRelayScheduleRate"]["Default"] == "rate(1 minute)"
    assert relay["ReservedConcurrentExecutions"] == 1


def test_an_outbox_row_the_relay_gives_up_pages_and_says_what_to_run(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Given the alarm on the rows the relay gives up, and what the relay's code emits
    template, _, props = alarm_on_emitted_series(
        capsys, "OutboxDeadLetteredAlarm", "OutboxDeadLettered"
    )
    # Then it pages on the first row given up in five minutes, and not on a quiet relay
    assert (props["Statistic"], props["Period"], props["Threshold"]) == ("Sum", 300, 1)
    assert props["ComparisonOperator"] == "GreaterThanOrEqualToThreshold"
    assert props["TreatMissingData"] == "notBreaching"
    # And it names the operator's commands for the outbox's rows
    description = " ".join(props["AlarmDescription"].split())
    for command in ("infrai-jobs outbox list", "infrai-jobs outbox retry", "outbox discard"):
        assert command in description
    # And the dashboard shows it beside the series it reads
    assert_on_the_dashboard(template, "OutboxDeadLetteredAlarm", "OutboxDeadLettered")


SECURITY_OPT_OUT_PATTERN = '{ $.action = "security_opt_out" }'


def test_every_functions_security_opt_outs_are_counted_and_page() -> None:
    # Given every function's log group and the template's metric filters
    template = load_template()
    namespace = globals_variable(template, "POWERTOOLS_METRICS_NAMESPACE")
    filters = {
        props["LogGroupName"]["Ref"]: props
        for resource in template["Resources"].values()
        if resource["Type"] == "AWS::Logs::MetricFilter"
        for props in [resource["Properties"]]
    }
    for name, props in functions(template).items():
        # When the filter on its log group is read
        found = filters.get(props["LoggingConfig"]["LogGroup"]["Ref"])
        # Then it counts each line logged with action security_opt_out, beside the EMF metrics
        assert found is not None, f"{name}'s opt-outs are not counted"
        assert found["FilterPattern"] == SECURITY_OPT_OUT_PATTERN, name
        (counted,) = found["MetricTransformations"]
        assert (counted["MetricNamespace"], counted["MetricName"]) == (namespace, "SecurityOptOuts")
        assert (counted["MetricValue"], counted["Unit"]) == ("1", "Count")
        assert "Dimensions" not in counted, name
    # And one alarm reads that series (no dimension, as the filters write it): any opt-out in
    # the last day pages, since a function logs one only when it starts
    alarm = alarms(template)["SecurityOptOutAlarm"]["Properties"]
    assert (alarm["Namespace"], alarm["MetricName"]) == (namespace, "SecurityOptOuts")
    assert "Dimensions" not in alarm
    assert (alarm["Statistic"], alarm["Threshold"]) == ("Sum", 1)
    assert alarm["ComparisonOperator"] == "GreaterThanOrEqualToThreshold"
    assert alarm["Period"] * alarm["EvaluationPeriods"] == 86_400
    assert alarm["DatapointsToAlarm"] == 1
    assert alarm["TreatMissingData"] == "notBreaching"
    assert "without AUTH" in alarm["AlarmDescription"]


def test_the_stack_nests_the_framework_as_init_lays_a_project_out() -> None:
    # Given the stack's own template.yaml
    stack = stack_template()
    # Then its one resource is the framework, nested from framework.yaml beside it
    assert set(stack["Resources"]) == {"Framework"}
    framework = stack["Resources"]["Framework"]
    assert framework["Type"] == "AWS::Serverless::Application"
    assert framework["Properties"]["Location"] == "framework.yaml"
    # And each framework parameter it passes is its own parameter of the same name, unchanged
    passed = framework["Properties"]["Parameters"]
    assert passed == {name: {"Ref": name} for name in stack["Parameters"]}
    assert set(passed) <= set(load_template()["Parameters"])
    # And every framework parameter without a default is among them (else no deploy could work)
    required = {n for n, p in load_template()["Parameters"].items() if "Default" not in p}
    assert required <= set(passed)
    # And it is the template `infrai-jobs init` writes, but for this stack's own choices
    made = project._team_template(load_template(), "infrai-jobs").text
    ours = STACK_TEMPLATE.read_text()
    assert (
        ours.split("AWSTemplateFormatVersion", 1)[1].replace("billing-jobs", "infrai-jobs")
        == (made.split("AWSTemplateFormatVersion", 1)[1])
    )
