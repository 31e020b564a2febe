"""The template's RDS Proxy before the ledger (``DatabaseProxy`` ``create``): off by default; when
on, TLS required, a role only RDS may assume that reads the one database secret, the functions
pointed at its endpoint with nothing prepared on the server, and pinned sessions paged on
(docs/configuration.md, "Behind a connection pooler")."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "e2e"))

from test_template import as_list, load_template  # noqa: E402
from test_template_least_privilege import IN_VPC, KMS_KEY, REQUIRED, Deployment  # noqa: E402

SECRET = REQUIRED["DatabaseSecretArn"]
PROXY = {"DatabaseProxy": "create", "DatabaseProxyTarget": "ledger-db", **IN_VPC}
PROXY_RESOURCES = {
    "LedgerProxy",
    "LedgerProxyRole",
    "LedgerProxyTargetGroup",
    "LedgerProxyPinnedSessionsAlarm",
}


def _environments(deployment: Deployment) -> dict[str, dict[str, Any]]:
    return {
        name: function["Environment"]["Variables"]
        for name, function in deployment.of_type("AWS::Lambda::Function").items()
    }


def test_without_the_parameter_there_is_no_proxy_and_nothing_is_prepared() -> None:
    # Given the stack with its defaults
    deployment = Deployment()
    # Then it creates no proxy, and every function connects to the secret's host, preparing
    # nothing on the server
    assert not PROXY_RESOURCES & set(deployment.resources)
    for name, env in _environments(deployment).items():
        assert (env["DATABASE_HOST"], env["DATABASE_PREPARED_STATEMENTS"]) == ("", "false"), name


@pytest.mark.parametrize(
    ("kind", "targets"), [("instance", "DBInstance"), ("cluster", "DBCluster")]
)
def test_the_proxy_requires_tls_logs_in_with_the_secret_and_fronts_the_target(
    kind: str, targets: str
) -> None:
    # Given the stack with DatabaseProxy create, before an RDS instance or an Aurora cluster
    deployment = Deployment(PROXY | {"DatabaseProxyTargetKind": kind})
    (proxy,) = deployment.of_type("AWS::RDS::DBProxy").values()
    (group,) = deployment.of_type("AWS::RDS::DBProxyTargetGroup").values()
    # Then the proxy takes TLS only, for PostgreSQL, logging in with the database secret
    assert (proxy["EngineFamily"], proxy["RequireTLS"]) == ("POSTGRESQL", True)
    (auth,) = proxy["Auth"]
    assert (auth["AuthScheme"], auth["SecretArn"], auth["IAMAuth"]) == (
        "SECRETS",
        SECRET,
        "DISABLED",
    )
    assert proxy["RoleArn"] == {"Fn::GetAtt": ["LedgerProxyRole", "Arn"]}
    assert proxy["VpcSubnetIds"] == IN_VPC["SubnetIds"].split(",")
    # And it fronts the target as its kind
    assert group["DBProxyName"] == {"Ref": "LedgerProxy"}
    assert group[f"{targets}Identifiers"] == ["ledger-db"]
    assert {f"{other}Identifiers" for other in ("DBInstance", "DBCluster")} & set(group) == {
        f"{targets}Identifiers"
    }


def test_the_proxys_role_is_for_rds_of_this_account_and_reads_only_the_database_secret() -> None:
    # Given the proxy's role, with and without a customer-managed key for the secrets
    for overrides in (PROXY, PROXY | KMS_KEY):
        deployment = Deployment(overrides)
        role = deployment.of_type("AWS::IAM::Role")["LedgerProxyRole"]
        (trust,) = as_list(role["AssumeRolePolicyDocument"]["Statement"])
        statements = deployment.statements("LedgerProxyRole")
        # Then only RDS may assume it, on behalf of this account
        assert trust["Principal"] == {"Service": "rds.amazonaws.com"}
        assert trust["Condition"] == {
            "StringEquals": {"aws:SourceAccount": {"Ref": "AWS::AccountId"}}
        }
        assert "ManagedPolicyArns" not in role
        # And it may read the database secret and nothing else
        reads = [s for s in statements if s["Action"] == "secretsmanager:GetSecretValue"]
        assert [s["Resource"] for s in reads] == [SECRET]
        # And decrypt it only with the secrets' key, only as Secrets Manager does
        decrypts = [s for s in statements if s not in reads]
        assert len(decrypts) == (1 if "SecretsKmsKeyId" in overrides else 0)
        for statement in decrypts:
            assert statement["Action"] == "kms:Decrypt"
            via = statement["Condition"]["StringEquals"]["kms:ViaService"]
            assert via == [{"Fn::Sub": "secretsmanager.${AWS::Region}.amazonaws.com"}]


def test_the_functions_go_through_the_proxy_and_pinned_sessions_page() -> None:
    # Given the stack with DatabaseProxy create
    deployment = Deployment(PROXY)
    # Then every function connects to the proxy's endpoint, preparing nothing on the server
    for name, env in _environments(deployment).items():
        assert env["DATABASE_HOST"] == {"Fn::GetAtt": ["LedgerProxy", "Endpoint"]}, name
        assert env["DATABASE_PREPARED_STATEMENTS"] == "false", name
    # And a pinned session at the proxy pages the alert topic
    alarm = deployment.of_type("AWS::CloudWatch::Alarm")["LedgerProxyPinnedSessionsAlarm"]
    assert (alarm["Namespace"], alarm["MetricName"]) == (
        "AWS/RDS",
        "DatabaseConnectionsCurrentlySessionPinned",
    )
    assert alarm["Dimensions"] == [{"Name": "ProxyName", "Value": {"Ref": "LedgerProxy"}}]
    assert (alarm["ComparisonOperator"], alarm["Threshold"]) == ("GreaterThanThreshold", 0)
    assert alarm["AlarmActions"] == [{"Ref": "AlertTopic"}]


def test_a_rule_refuses_a_proxy_without_its_target_and_vpc_or_with_prepared_statements() -> None:
    # Given the template's rule for the proxy
    rule = load_template()["Rules"]["DatabaseProxyNeedsItsTargetAndVpc"]
    asserted = [assertion["Assert"] for assertion in rule["Assertions"]]
    # Then it holds whenever DatabaseProxy is create, and asks for each of them
    assert rule["RuleCondition"] == {"Fn::Equals": [{"Ref": "DatabaseProxy"}, "create"]}
    assert {"Fn::Equals": [{"Ref": "DatabasePreparedStatements"}, "false"]} in asserted
    named = {ref for a in asserted for ref in _refs(a)}
    assert named >= {"DatabaseProxyTarget", "SubnetIds", "SecurityGroupIds"}


def _refs(node: Any) -> set[str]:
    if isinstance(node, dict):
        return {node["Ref"]} if set(node) == {"Ref"} else set().union(*map(_refs, node.values()))
    if isinstance(node, list):
        return set().union(*map(_refs, node))
    return set()
