"""IAM least privilege in template.yaml, beyond tests/e2e/test_template.py's wildcard-action check.

The template is translated the way ``sam validate`` does it, so SAM's policy templates are checked
as the statements they become.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "e2e"))

from test_template import as_list, load_template, policy_statements, translate  # noqa: E402

# Actions IAM cannot scope to a resource, which a statement may grant on "*". None: the SSM
# and DynamoDB grants are inline statements on one parameter and one table, not SAM's
# SSMParameterWithSlashPrefixReadPolicy (which adds ssm:DescribeParameters on "*") and
# DynamoDBCrudPolicy (which adds Scan, Query and the Batch* calls).
UNSCOPABLE_ACTIONS: set[str] = set()

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

# What each function may do, by service: a new grant must be added here on purpose.
ALLOWED_SERVICES = {
    # lambda: the backlog fan-out invokes DrainFunction itself, and nothing else.
    "DrainFunctionRole": {"ssm", "secretsmanager", "kms", "dynamodb", "lambda"},
    "DlqAlertFunctionRole": {"ssm", "secretsmanager", "kms", "sns"},
    "RedriveFunctionRole": {"ssm", "secretsmanager", "kms"},
    "PruneFunctionRole": {"secretsmanager", "kms"},
    # The role EventBridge Scheduler invokes the scheduled functions with.
    "SchedulerRole": {"lambda"},
}
SCHEDULED_FUNCTIONS = {"DrainFunction", "DlqAlertFunction", "PruneFunction"}


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
        for service, exact in EXACT_ACTIONS.items():
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
