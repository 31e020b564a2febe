"""invoke's template reader follows a nested application whose Location is a file beside it."""

from __future__ import annotations

from pathlib import Path

import pytest

from infrai_jobs.errors import ConfigurationError
from infrai_local.sam_template import deploy_values, load_template, resolve_function

CHILD = """\
Transform: AWS::Serverless-2016-10-31
Parameters:
  QueueName: {Type: String, Default: billing-jobs}
  LogLevel: {Type: String, Default: INFO}
Conditions:
  Debugging: !Equals [!Ref LogLevel, DEBUG]
Resources:
  DrainFunction:
    Type: AWS::Serverless::Function
    Properties:
      Handler: infrai_jobs.handlers.drain.lambda_handler
      CodeUri: functions
      Environment:
        Variables:
          INFRAI_QUEUE: !Ref QueueName
          LOG_LEVEL: !If [Debugging, DEBUG, !Ref LogLevel]
"""

PARENT = """\
Transform: AWS::Serverless-2016-10-31
Parameters:
  QueueName: {{Type: String, Default: payments-jobs}}
  Other: {{Type: String, Default: x}}
Resources:
  Framework:
    Type: AWS::Serverless::Application
    Properties:
      Location: framework.yaml
      Parameters:
        {passed}
"""


def project(tmp_path: Path, passed: str) -> Path:
    (tmp_path / "framework.yaml").write_text(CHILD)
    (tmp_path / "template.yaml").write_text(PARENT.format(passed=passed))
    return tmp_path


def test_the_parents_parameter_passed_by_the_same_name_wins(tmp_path: Path) -> None:
    # Given a team template that passes its QueueName to the framework's
    root = project(tmp_path, "QueueName: !Ref QueueName")
    # When invoke reads it
    template = load_template(root / "template.yaml")
    spec = resolve_function(template, "DrainFunction", root, parameter_overrides={})
    # Then the child's function is there, with the parent's default and the child's own
    # parameters and conditions for the rest; the application itself is gone
    assert spec.environment == {"INFRAI_QUEUE": "payments-jobs", "LOG_LEVEL": "INFO"}
    assert spec.code_uri == root / "functions"
    assert "Framework" not in template["Resources"]
    # And an override of the parent's parameter reaches the child's function
    spec = resolve_function(template, "DrainFunction", root, parameter_overrides={"QueueName": "q"})
    assert spec.environment["INFRAI_QUEUE"] == "q"


def test_the_build_checks_read_the_same_view(tmp_path: Path) -> None:
    root = project(tmp_path, "QueueName: !Ref QueueName")
    template, values = deploy_values(root, "default")
    assert "DrainFunction" in template["Resources"]
    assert values["QueueName"] == "payments-jobs"
    assert values["LogLevel"] == "INFO"


@pytest.mark.parametrize(
    ("passed", "named"),
    [
        ("QueueName: fixed-name", "QueueName"),
        ("QueueName: !Ref Other", "QueueName"),
        ("LogLevel: !Ref LogLevel", "LogLevel"),
        ("Missing: !Ref Other", "Missing"),
    ],
)
def test_anything_else_passed_is_refused_naming_it(tmp_path: Path, passed: str, named: str) -> None:
    root = project(tmp_path, passed)
    with pytest.raises(ConfigurationError, match=named):
        load_template(root / "template.yaml")
