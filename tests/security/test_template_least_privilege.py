"""IAM least privilege in template.yaml, beyond tests/e2e/test_template.py's wildcard-action check.

The template is translated the way ``sam validate`` does it, so SAM's policy templates are checked
as the statements they become. Where what a role carries depends on parameters (VPC, tracing,
fan-out, a KMS key, a permissions boundary), the translation is then resolved for one set of
parameter values as CloudFormation would: conditions evaluated, Fn::If branches chosen,
AWS::NoValue dropped, managed policies included.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "e2e"))

from parameter_sets import Conditions  # noqa: E402
from test_template import (  # noqa: E402
    as_list,
    load_template,
    managed_policy_names,
    policy_statements,
    translate,
)

# Actions a statement may grant on "*": only the network-interface calls Lambda makes to
# place a function in the VPC (the Describe calls take no resource, and Lambda creates and
# deletes its interfaces when it chooses); the SSM and DynamoDB grants are inline statements on
# one parameter and one table, not SAM's SSMParameterWithSlashPrefixReadPolicy (which adds
# ssm:DescribeParameters on "*") and DynamoDBCrudPolicy (which adds Scan, Query and Batch*).
VPC_ACTIONS = {
    "ec2:CreateNetworkInterface",
    "ec2:DescribeNetworkInterfaces",
    "ec2:DescribeSubnets",
    "ec2:DeleteNetworkInterface",
    "ec2:AssignPrivateIpAddresses",
    "ec2:UnassignPrivateIpAddresses",
}
UNSCOPABLE_ACTIONS: set[str] = VPC_ACTIONS

# The only actions of these services that the code calls (Powertools' get_parameter; its
# idempotency layer's item calls).
EXACT_ACTIONS = {
    "ssm": {"ssm:GetParameter"},
    "dynamodb": {
        "dynamodb:GetItem",
        "dynamodb:PutItem",
        "dynamodb:UpdateItem",
        "dynamodb:DeleteItem",
    },
}

# Where a role calls fewer of them: the watcher only forgets records (DeleteItem).
EXACT_ACTIONS_OF = {"DlqAlertFunctionRole": {"dynamodb": {"dynamodb:DeleteItem"}}}

# What each function may do, by service: a new grant must be added here on purpose.
# logs: each function's own log group, the one grant AWSLambdaBasicExecutionRole would widen.
ALLOWED_SERVICES = {
    # ec2 (every function's role): the network-interface calls, only in a VPC (VPC_ACTIONS).
    # lambda: the backlog fan-out invokes DrainFunction itself, and nothing else.
    "DrainFunctionRole": {"logs", "ssm", "secretsmanager", "kms", "dynamodb", "lambda", "ec2"},
    # dynamodb: the reconcile pass drops the second layer's record of a claim it releases.
    "DlqAlertFunctionRole": {"logs", "ssm", "secretsmanager", "kms", "sns", "dynamodb", "ec2"},
    "RedriveFunctionRole": {"logs", "ssm", "secretsmanager", "kms", "ec2"},
    "PruneFunctionRole": {"logs", "secretsmanager", "kms", "ec2"},
    "OutboxRelayFunctionRole": {"logs", "ssm", "secretsmanager", "kms", "ec2"},
    # The role EventBridge Scheduler invokes the scheduled functions with.
    "SchedulerRole": {"lambda"},
    # The role the ledger's RDS Proxy reads the database secret with (DatabaseProxy create).
    "LedgerProxyRole": {"secretsmanager", "kms"},
}
SCHEDULED_FUNCTIONS = {
    "DrainFunction",
    "DlqAlertFunction",
    "PruneFunction",
    "OutboxRelayFunction",
}
FUNCTION_ROLES = {
    "DrainFunctionRole",
    "DlqAlertFunctionRole",
    "RedriveFunctionRole",
    "PruneFunctionRole",
    "OutboxRelayFunctionRole",
}

BASIC_EXECUTION = "service-role/AWSLambdaBasicExecutionRole"
VPC_ACCESS = "service-role/AWSLambdaVPCAccessExecutionRole"
XRAY_WRITE = "AWSXrayWriteOnlyAccess"

# The one parameter without a default, and the switches that change what a role carries.
REQUIRED = {
    "DatabaseSecretArn": "arn:aws:secretsmanager:eu-west-1:123456789012:secret:ledger-AbC123"
}
IN_VPC = {"SubnetIds": "subnet-0a1b2c3d,subnet-4e5f6a7b", "SecurityGroupIds": "sg-0a1b2c3d"}
TRACING = {"EnableTracing": "true"}
KMS_KEY = {"SecretsKmsKeyId": "1234abcd-12ab-34cd-56ef-1234567890ab"}
BOUNDARY_ARN = "arn:aws:iam::123456789012:policy/workload-boundary"


class Deployment(Conditions):
    """template.yaml as CloudFormation would create it for one set of parameter values."""

    def __init__(self, overrides: dict[str, str] | None = None) -> None:
        template = load_template()
        values = {name: p.get("Default") for name, p in template["Parameters"].items()}
        values |= REQUIRED | (overrides or {})
        # A Ref to a parameter reads as a string, or as a list of strings for a list type.
        translated = translate(template, {k: str(v) for k, v in values.items()})
        super().__init__(
            translated.get("Conditions", {}),
            {
                name: str(value).split(",")
                if template["Parameters"][name]["Type"] == "CommaDelimitedList"
                else str(value)
                for name, value in values.items()
            },
        )
        self.resources: dict[str, dict[str, Any]] = {
            name: self._resolve(resource)
            for name, resource in translated["Resources"].items()
            if "Condition" not in resource or self.condition(resource["Condition"])
        }

    def of_type(self, resource_type: str) -> dict[str, dict[str, Any]]:
        return {
            name: resource["Properties"]
            for name, resource in self.resources.items()
            if resource["Type"] == resource_type
        }

    def statements(self, role: str) -> list[dict[str, Any]]:
        return [
            statement
            for policy in self.of_type("AWS::IAM::Role")[role].get("Policies", [])
            for statement in as_list(policy["PolicyDocument"]["Statement"])
        ]

    def role_of(self, function: str) -> str:
        role = self.of_type("AWS::Lambda::Function")[function]["Role"]
        assert set(role) == {"Fn::GetAtt"}, role
        name: str = role["Fn::GetAtt"][0]
        return name


def _roles() -> dict[str, list[dict[str, Any]]]:
    translated = translate(load_template())
    return {
        name: [
            statement
            for policy in resource["Properties"].get("Policies", [])
            for statement in policy_statements(policy)
        ]
        for name, resource in translated["Resources"].items()
        if resource["Type"] == "AWS::IAM::Role"
    }


def _resource_texts(resource: Any) -> list[str]:
    """The literal text of a Resource: plain strings and the templates of Fn::Sub."""
    texts: list[str] = []
    for value in as_list(resource):
        if isinstance(value, str):
            texts.append(value)
        elif isinstance(value, dict) and "Fn::Sub" in value:
            sub = value["Fn::Sub"]
            texts.append(sub[0] if isinstance(sub, list) else sub)
        elif isinstance(value, dict):
            texts.append("")  # a Ref or GetAtt: one resource, named by the stack
    return texts


def _open_ended(arn: str) -> bool:
    """``*``, a wildcard before the resource, or ``type/*``; ``table/${name}/index/*`` (the
    indexes of one named table) is scoped."""
    if arn == "*":
        return True
    parts = arn.split(":", 5)
    if any("*" in part for part in parts[:5]):
        return True
    resource = parts[5] if len(parts) == 6 else ""
    return resource == "*" or re.fullmatch(r"[A-Za-z0-9_-]*[/:]?\*", resource) is not None


def test_no_statement_grants_every_resource_where_iam_can_scope_it() -> None:
    # Given every inline statement of every execution role, as SAM deploys them
    roles = _roles()
    assert set(roles) == set(ALLOWED_SERVICES)
    for name, statements in roles.items():
        for statement in statements:
            # When its resources are read
            actions = set(as_list(statement["Action"]))
            texts = _resource_texts(statement["Resource"])
            # Then "*" (or an ARN open in its service, region, account or resource type) appears
            # only for actions IAM cannot scope
            wildcard = any(_open_ended(text) for text in texts)
            assert not wildcard or actions <= UNSCOPABLE_ACTIONS, (name, statement)
            # And no statement denies by exclusion or allows by NotResource
            assert "NotResource" not in statement, (name, statement)
            assert statement.get("Effect") == "Allow", (name, statement)


def test_each_function_is_granted_only_the_services_it_uses() -> None:
    # Given every execution role
    for name, statements in _roles().items():
        # When the services of its actions are collected
        services = {a.split(":", 1)[0] for s in statements for a in as_list(s["Action"])}
        # Then they are the ones that function needs, and nothing else
        assert services <= ALLOWED_SERVICES[name], (name, services - ALLOWED_SERVICES[name])


def test_ssm_and_dynamodb_grants_are_exactly_the_calls_the_code_makes() -> None:
    # Given every execution role
    for name, statements in _roles().items():
        actions = {a for s in statements for a in as_list(s["Action"])}
        # When its SSM and DynamoDB actions are collected
        for service, exact in (EXACT_ACTIONS | EXACT_ACTIONS_OF.get(name, {})).items():
            granted = {a for a in actions if a.startswith(f"{service}:")}
            # Then they are the calls the code makes, where the role has the service at all
            assert granted <= exact, (name, granted - exact)
            if service in ALLOWED_SERVICES[name]:
                assert granted == exact, (name, service, granted)


def test_only_the_alert_function_may_publish_alerts() -> None:
    # Given every execution role
    publishers = {
        name
        for name, statements in _roles().items()
        for s in statements
        if any(a.startswith("sns:") for a in as_list(s["Action"]))
    }
    # Then only the DLQ watcher may publish to the topic
    assert publishers == {"DlqAlertFunctionRole"}


def test_every_schedule_invokes_through_a_role_only_this_accounts_scheduler_may_assume() -> None:
    # Given the schedules SAM creates and the resources around them
    translated = translate(load_template())
    resources = translated["Resources"]
    schedules = {
        name: r["Properties"]
        for name, r in resources.items()
        if r["Type"] == "AWS::Scheduler::Schedule"
    }
    # When their targets and the role they name are read
    targets = {name: props["Target"] for name, props in schedules.items()}
    role = resources["SchedulerRole"]["Properties"]
    (trust,) = role["AssumeRolePolicyDocument"]["Statement"]
    # Then every schedule invokes one of the scheduled functions with the stack's own role
    assert {t["Arn"]["Fn::GetAtt"][0] for t in targets.values()} == SCHEDULED_FUNCTIONS
    assert all(t["RoleArn"] == {"Fn::GetAtt": ["SchedulerRole", "Arn"]} for t in targets.values())
    # And no Lambda permission or other role of SAM's opens a function to a service
    assert [r for r in resources.values() if r["Type"] == "AWS::Lambda::Permission"] == []
    # And only EventBridge Scheduler may assume that role, for this account's schedule group
    # only (no confused deputy)
    assert trust["Principal"] == {"Service": "scheduler.amazonaws.com"}
    assert trust["Condition"]["StringEquals"] == {"aws:SourceAccount": {"Ref": "AWS::AccountId"}}
    sources = [s["Fn::Sub"] for s in trust["Condition"]["ArnLike"]["aws:SourceArn"]]
    assert sources
    assert all("${AWS::AccountId}" in s and "${ScheduleGroup}" in s for s in sources), sources
    # And it may invoke exactly the scheduled functions, nothing else
    (statement,) = [s for p in role["Policies"] for s in p["PolicyDocument"]["Statement"]]
    assert statement["Action"] == "lambda:InvokeFunction"
    assert {r["Fn::GetAtt"][0] for r in statement["Resource"]} == SCHEDULED_FUNCTIONS


def test_no_resource_policy_opens_anything_to_every_principal() -> None:
    # Given every resource of the translated template
    translated = translate(load_template())
    for name, resource in translated["Resources"].items():
        document = resource["Properties"].get("PolicyDocument", {})
        # When a resource policy (a topic policy, say) is present
        for statement in as_list(document.get("Statement", [])):
            principal = statement.get("Principal")
            # Then it never names "*" as principal
            assert principal not in ("*", {"AWS": "*"}), (name, statement)


def test_the_alert_topic_is_encrypted_with_a_key_its_alarms_and_publisher_may_use() -> None:
    # Given the alert topic (alerts name queues and keys: encrypted at rest)
    template = load_template()
    key_ref = template["Resources"]["AlertTopic"]["Properties"]["KmsMasterKeyId"]
    # Then its key is one of the stack's own, not the AWS-managed alias/aws/sns, whose policy
    # does not let CloudWatch alarms publish (they would change state and page nobody)
    assert isinstance(key_ref, dict), key_ref
    assert set(key_ref) == {"Ref"}, key_ref
    key = template["Resources"][key_ref["Ref"]]
    assert key["Type"] == "AWS::KMS::Key"
    assert key["Properties"]["EnableKeyRotation"] is True
    # And the key's policy lets CloudWatch, and only on behalf of this account's alarms, encrypt
    statements = as_list(key["Properties"]["KeyPolicy"]["Statement"])
    for_alarms = [
        s for s in statements if s["Principal"] == {"Service": "cloudwatch.amazonaws.com"}
    ]
    assert len(for_alarms) == 1
    assert set(as_list(for_alarms[0]["Action"])) == {"kms:Decrypt", "kms:GenerateDataKey"}
    assert for_alarms[0]["Condition"]["StringEquals"] == {
        "aws:SourceAccount": {"Ref": "AWS::AccountId"}
    }
    assert ":alarm:" in for_alarms[0]["Condition"]["ArnLike"]["aws:SourceArn"]["Fn::Sub"]
    # And every alarm pages through that topic
    alarms = [r for r in template["Resources"].values() if r["Type"] == "AWS::CloudWatch::Alarm"]
    assert alarms
    for alarm in alarms:
        assert alarm["Properties"]["AlarmActions"] == [{"Ref": "AlertTopic"}], alarm
    # And the one role that publishes may encrypt with exactly that key
    roles = _roles()
    kms = [
        s
        for s in roles["DlqAlertFunctionRole"]
        if any(a in ("kms:GenerateDataKey", "kms:Decrypt") for a in as_list(s["Action"]))
        and s["Resource"] == {"Fn::GetAtt": [key_ref["Ref"], "Arn"]}
    ]
    assert kms, roles["DlqAlertFunctionRole"]
    assert {a for s in kms for a in as_list(s["Action"])} == {"kms:GenerateDataKey", "kms:Decrypt"}


def test_the_drain_may_invoke_itself_and_nothing_else() -> None:
    # Given every function's execution role's statements that grant a Lambda action (the
    # scheduler's role is checked on its own)
    roles = {name: s for name, s in _roles().items() if name != "SchedulerRole"}
    lambda_grants = {
        name: [s for s in statements if any(a.startswith("lambda:") for a in as_list(s["Action"]))]
        for name, statements in roles.items()
    }
    # Then only DrainFunction's role has one: InvokeFunction, on its own name only
    assert {name for name, grants in lambda_grants.items() if grants} == {"DrainFunctionRole"}
    (grant,) = lambda_grants["DrainFunctionRole"]
    assert as_list(grant["Action"]) == ["lambda:InvokeFunction"]
    (resource,) = _resource_texts(grant["Resource"])
    drain = load_template()["Resources"]["DrainFunction"]["Properties"]
    assert resource.endswith(":function:" + drain["FunctionName"]["Fn::Sub"])


@pytest.mark.parametrize(
    ("overrides", "extra_policies"),
    [
        pytest.param({}, set(), id="default"),
        pytest.param(IN_VPC, {VPC_ACCESS}, id="vpc"),
        pytest.param(TRACING, {XRAY_WRITE}, id="tracing"),
        pytest.param(IN_VPC | TRACING, {VPC_ACCESS, XRAY_WRITE}, id="vpc-and-tracing"),
    ],
)
def test_vpc_access_and_xray_are_granted_only_when_their_parameters_turn_them_on(
    overrides: dict[str, str], extra_policies: set[str]
) -> None:
    # Given the stack as CloudFormation would create it for these parameter values
    deployment = Deployment(overrides)
    functions = deployment.of_type("AWS::Lambda::Function")
    assert {deployment.role_of(name) for name in functions} == FUNCTION_ROLES
    for name, function in functions.items():
        # When the policies of the role the function runs with are read
        role = deployment.of_type("AWS::IAM::Role")[deployment.role_of(name)]
        managed = managed_policy_names(role.get("ManagedPolicyArns", []))
        inline = {
            action
            for policy in role.get("Policies", [])
            for statement in policy_statements(policy)
            for action in as_list(statement["Action"])
        }
        # Then X-Ray's managed policy is there exactly when tracing is on, and no other: the
        # VPC's network-interface calls are an inline grant, there exactly in a VPC, because
        # AWSLambdaVPCAccessExecutionRole would also grant logs on every group
        assert managed == extra_policies & {XRAY_WRITE}, (name, managed)
        assert (inline >= VPC_ACTIONS) == (VPC_ACCESS in extra_policies), (name, inline)
        assert not inline & {"logs:CreateLogGroup"}, name
        # And the function is in the VPC and traced exactly then too
        assert ("VpcConfig" in function) == (VPC_ACCESS in extra_policies), name
        mode = function.get("TracingConfig", {}).get("Mode", "PassThrough")
        assert (mode == "Active") == (XRAY_WRITE in extra_policies), name
    # And no other role (the scheduler's) carries a managed policy at all
    others = {
        n: r for n, r in deployment.of_type("AWS::IAM::Role").items() if n not in FUNCTION_ROLES
    }
    assert others
    assert all(not r.get("ManagedPolicyArns") for r in others.values()), others


def _invokers(deployment: Deployment) -> set[str]:
    return {
        role
        for role in FUNCTION_ROLES
        for statement in deployment.statements(role)
        if any(a.startswith("lambda:") for a in as_list(statement["Action"]))
    }


def test_only_with_fan_out_on_may_the_drain_invoke_itself() -> None:
    # Given the stack with the default cap of four drains, and with the cap at 1 (fan-out off)
    fanning_out = Deployment()
    single = Deployment({"DrainMaxConcurrency": "1"})
    # When the execution roles that may call Lambda are collected
    # Then with fan-out on only the drain may, and with it off no function's role may
    assert _invokers(fanning_out) == {"DrainFunctionRole"}
    assert _invokers(single) == set()
    # And the drain is told the same cap, so it never tries what its role does not allow
    drain = single.of_type("AWS::Lambda::Function")["DrainFunction"]
    assert drain["Environment"]["Variables"]["DRAIN_MAX_CONCURRENCY"] == "1"
    # And the only Lambda grant left is the scheduler's, on the scheduled functions
    (scheduler,) = single.statements("SchedulerRole")
    assert {r["Fn::GetAtt"][0] for r in scheduler["Resource"]} == SCHEDULED_FUNCTIONS


def _via_services(statement: dict[str, Any]) -> set[str]:
    via = statement.get("Condition", {}).get("StringEquals", {}).get("kms:ViaService", [])
    return {v["Fn::Sub"] if isinstance(v, dict) else v for v in as_list(via)}


def test_every_kms_grant_holds_only_through_the_service_that_uses_the_key() -> None:
    # Given every statement of every role, both branches of every condition
    kms_statements = [
        (name, s)
        for name, statements in _roles().items()
        for s in statements
        if any(a.startswith("kms:") for a in as_list(s["Action"]))
    ]
    assert kms_statements
    # Then each carries a kms:ViaService condition
    for name, statement in kms_statements:
        assert _via_services(statement), (name, statement)
    # And with a customer-managed key for the secrets, each function may decrypt only through
    # the services that hold what it reads (the alert topic's key only through SNS)
    deployment = Deployment(KMS_KEY)
    secrets = {"ssm.${AWS::Region}.amazonaws.com", "secretsmanager.${AWS::Region}.amazonaws.com"}
    expected = {
        "DrainFunctionRole": [secrets],
        "DlqAlertFunctionRole": [{"sns.${AWS::Region}.amazonaws.com"}, secrets],
        "RedriveFunctionRole": [secrets],
        "PruneFunctionRole": [{"secretsmanager.${AWS::Region}.amazonaws.com"}],
        "OutboxRelayFunctionRole": [secrets],
    }
    for role, services in expected.items():
        granted = [
            _via_services(s)
            for s in deployment.statements(role)
            if any(a.startswith("kms:") for a in as_list(s["Action"]))
        ]
        assert granted == services, (role, granted)


def test_a_permissions_boundary_applies_to_every_role_only_when_given() -> None:
    # Given the stack without and with a permissions boundary
    plain = Deployment()
    bounded = Deployment({"PermissionsBoundary": BOUNDARY_ARN})
    # When every role's boundary is read
    # Then none has one by default, and every role has the given one
    assert plain.of_type("AWS::IAM::Role")
    assert all("PermissionsBoundary" not in r for r in plain.of_type("AWS::IAM::Role").values())
    boundaries = {
        n: r.get("PermissionsBoundary") for n, r in bounded.of_type("AWS::IAM::Role").items()
    }
    assert boundaries == {n: BOUNDARY_ARN for n in FUNCTION_ROLES | {"SchedulerRole"}}


def test_a_function_added_without_its_own_role_gets_the_boundary_from_globals() -> None:
    # Given a new function whose role SAM generates (no Role property), as the template's layout
    # invites, translated with a boundary set and with none
    template = load_template()
    template["Resources"]["ExtraFunction"] = {
        "Type": "AWS::Serverless::Function",
        "Properties": {
            "CodeUri": "functions",
            "Handler": "infrai_jobs.handlers.drain.lambda_handler",
        },
    }
    for boundary in ("", BOUNDARY_ARN):
        translated = translate(template, REQUIRED | {"PermissionsBoundary": boundary})
        role = translated["Resources"]["ExtraFunctionRole"]["Properties"]
        # Then Globals give its role the boundary under the stack's condition
        assert role["PermissionsBoundary"] == {
            "Fn::If": [
                "HasPermissionsBoundary",
                {"Ref": "PermissionsBoundary"},
                {"Ref": "AWS::NoValue"},
            ]
        }
        # And SAM attaches the VPC and X-Ray policies to it whatever the parameters say, which
        # is why every function of the template brings its own role
        managed = managed_policy_names(role["ManagedPolicyArns"])
        assert {VPC_ACCESS, XRAY_WRITE} <= managed, managed


DATA_KEY_ARN = "arn:aws:kms:eu-west-1:123456789012:key/1234abcd-12ab-34cd-56ef-1234567890ab"


def test_a_data_kms_key_encrypts_the_log_groups_and_the_second_layers_table() -> None:
    # Given the DynamoDB second layer, without and with DataKmsKeyArn
    plain = Deployment({"IdempotencyBackend": "dynamodb"})
    keyed = Deployment({"IdempotencyBackend": "dynamodb", "DataKmsKeyArn": DATA_KEY_ARN})
    # Then without it nothing names a customer key and no role may use one
    plain_groups = plain.of_type("AWS::Logs::LogGroup")
    assert plain_groups
    assert all("KmsKeyId" not in group for group in plain_groups.values())
    assert plain.of_type("AWS::DynamoDB::Table")["IdempotencyTable"]["SSESpecification"] == {
        "SSEEnabled": False
    }
    assert not [s for s in plain.statements("DrainFunctionRole") if "kms:" in str(s["Action"])]
    # And with it every log group and the table are encrypted with that key
    groups = keyed.of_type("AWS::Logs::LogGroup")
    assert {name: group.get("KmsKeyId") for name, group in groups.items()} == dict.fromkeys(
        groups, DATA_KEY_ARN
    )
    assert keyed.of_type("AWS::DynamoDB::Table")["IdempotencyTable"]["SSESpecification"] == {
        "SSEEnabled": True,
        "SSEType": "KMS",
        "KMSMasterKeyId": DATA_KEY_ARN,
    }
    # And the drain may use the key only through DynamoDB, for the table's records
    kms = [s for s in keyed.statements("DrainFunctionRole") if "kms:" in str(s["Action"])]
    assert len(kms) == 1
    assert kms[0]["Resource"] == DATA_KEY_ARN
    assert sorted(as_list(kms[0]["Action"])) == ["kms:Decrypt", "kms:GenerateDataKey"]
    assert _via_services(kms[0]) == {"dynamodb.${AWS::Region}.amazonaws.com"}
    # And the watcher may only decrypt through DynamoDB (to delete the records it forgets)
    (watcher,) = [
        s for s in keyed.statements("DlqAlertFunctionRole") if s["Resource"] == DATA_KEY_ARN
    ]
    assert (watcher["Resource"], watcher["Action"]) == (DATA_KEY_ARN, "kms:Decrypt")
    assert _via_services(watcher) == {"dynamodb.${AWS::Region}.amazonaws.com"}
    # And no other role gains a right to it
    for role in FUNCTION_ROLES - {"DrainFunctionRole", "DlqAlertFunctionRole"}:
        assert DATA_KEY_ARN not in str(keyed.statements(role)), role


REDIS_SECRET_ARN = "arn:aws:secretsmanager:eu-west-1:123456789012:secret:infrai-redis-AbCdEf"


def test_only_the_drain_and_the_watcher_read_the_redis_secret_and_only_when_named() -> None:
    # Given the Redis second layer without and with RedisSecretArn
    plain = Deployment({"IdempotencyBackend": "redis", "RedisUrl": "rediss://cache.example:6379"})
    named = Deployment(
        {
            "IdempotencyBackend": "redis",
            "RedisUrl": "rediss://cache.example:6379",
            "RedisSecretArn": REDIS_SECRET_ARN,
        }
    )

    def readers(deployment: Deployment) -> dict[str, list[Any]]:
        return {
            role: [
                s["Resource"]
                for s in deployment.statements(role)
                if s["Resource"] == REDIS_SECRET_ARN
            ]
            for role in FUNCTION_ROLES
        }

    # Then nobody may read it until it is named, and then only the drain (its second layer) and
    # the watcher (which drops the records of the claims it releases), GetSecretValue only
    readers_of = {"DrainFunctionRole": "DrainFunction", "DlqAlertFunctionRole": "DlqAlertFunction"}
    assert all(not found for found in readers(plain).values())
    assert {role: bool(found) for role, found in readers(named).items()} == {
        role: role in readers_of for role in FUNCTION_ROLES
    }
    for role, function in readers_of.items():
        (statement,) = [s for s in named.statements(role) if s["Resource"] == REDIS_SECRET_ARN]
        assert statement["Action"] == "secretsmanager:GetSecretValue"
        environment = named.of_type("AWS::Lambda::Function")[function]["Environment"]
        assert environment["Variables"]["REDIS_SECRET_ARN"] == REDIS_SECRET_ARN


@pytest.mark.parametrize("overrides", [{}, TRACING, {"IdempotencyBackend": "dynamodb"}])
def test_each_function_writes_logs_to_its_own_log_group_only(overrides: dict[str, str]) -> None:
    # Given the stack as CloudFormation would create it, outside a VPC
    deployment = Deployment(overrides)
    functions = deployment.of_type("AWS::Lambda::Function")
    for name in functions:
        role = deployment.role_of(name)
        # When the role's logs statements and managed policies are read
        logs = [s for s in deployment.statements(role) if "logs:" in str(s["Action"])]
        managed = managed_policy_names(
            deployment.of_type("AWS::IAM::Role")[role].get("ManagedPolicyArns", [])
        )
        # Then one statement grants streams and events on the function's own log group, and no
        # managed policy grants logs on every group
        assert [s["Resource"] for s in logs] == [{"Fn::GetAtt": [f"{name}LogGroup", "Arn"]}]
        assert sorted(as_list(logs[0]["Action"])) == ["logs:CreateLogStream", "logs:PutLogEvents"]
        assert BASIC_EXECUTION not in managed, name
        # And that group is the one the function logs to
        assert functions[name]["LoggingConfig"]["LogGroup"] == {"Ref": f"{name}LogGroup"}


def test_the_watcher_may_only_delete_the_second_layers_records() -> None:
    # Given the DynamoDB second layer
    deployment = Deployment({"IdempotencyBackend": "dynamodb"})
    # When the watcher's DynamoDB statements are read
    (statement,) = [
        s for s in deployment.statements("DlqAlertFunctionRole") if "dynamodb:" in str(s["Action"])
    ]
    # Then it may delete an item of the stack's table and nothing more
    assert statement["Action"] == "dynamodb:DeleteItem"
    assert statement["Resource"] == {"Fn::GetAtt": ["IdempotencyTable", "Arn"]}
    variables = deployment.of_type("AWS::Lambda::Function")["DlqAlertFunction"]["Environment"]
    assert variables["Variables"]["IDEMPOTENCY_BACKEND"] == "dynamodb"
    assert variables["Variables"]["IDEMPOTENCY_TABLE"] == {"Ref": "IdempotencyTable"}
