"""``infrai-jobs invoke`` runs template functions as Lambda would, with the repo's event files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import boto3
import fixture_jobs
import psycopg
import pytest
import urllib3
from cfnlint.decode import cfn_yaml  # type: ignore[import-untyped]
from child_process import LineSink, clean_env, run_captured

from infrai_jobs.errors import ConfigurationError
from infrai_jobs.queue.client import InfraiClient
from infrai_local.migrations import apply_migrations, jobs_migrations_folder, read_migrations
from infrai_local.sam_template import (
    function_names,
    load_template,
    parse_parameter_overrides,
    samconfig_overrides,
)
from infrai_local.sandbox.invoke import dependency_path, invoke, resolve
from infrai_local.sandbox.queues import ensure_queue

ROOT = Path(__file__).resolve().parents[2]
EVENTS = ROOT / "events"


def test_drain_function_drains_the_emulator_into_the_ledger(
    services: dict[str, str], billing_queue: InfraiClient, project: Path
) -> None:
    # Given the notes' job published twice to the emulator
    payload = {"job": "invoice.finalize", "invoice_id": "inv_8812", "amount_cents": 4900}
    billing_queue.publish("billing-jobs", payload)
    billing_queue.publish("billing-jobs", payload)
    # When DrainFunction is invoked with the repo's schedule event and env-vars file
    spec = resolve("DrainFunction", root=project, env_vars=EVENTS / "env.json")
    logs = LineSink()
    result = invoke(spec, EVENTS / "drain-schedule.json", log_stream=logs, extra_env=services)
    # Then it returned the summary, the ledger holds one done claim, and the queue is empty
    assert result.ok, result.payload
    assert result.payload["consumed"] == 2
    assert result.payload["done"] == 1
    assert result.payload["acked"] == 2
    with psycopg.connect(services["DATABASE_URL"]) as conn:
        assert conn.execute("SELECT idem_key, state FROM job_claims").fetchall() == [
            ("invoice.finalize:inv_8812", "done")
        ]
    assert billing_queue.stats("billing-jobs").message_count == 0
    # And its logs are Powertools JSON lines carrying the message fields
    records = [json.loads(line) for line in logs.lines if line.startswith("{")]
    done = [r for r in records if r.get("action") == "done"]
    assert done
    assert done[0]["idem_key"] == "invoice.finalize:inv_8812"
    assert {"message_id", "delivery_count", "job"} <= done[0].keys()
    assert "local-dev-key" not in "".join(logs.lines)
    # And every log line, the library's included, carries the schedule event's id
    assert_every_line_correlates(logs, EVENTS / "drain-schedule.json")


def test_the_template_and_env_file_resolve_like_sam() -> None:
    spec = resolve("DrainFunction", root=ROOT, env_vars=EVENTS / "env.json")
    # Globals, the function's own variables, parameter defaults and the env-vars file combine
    assert spec.handler == "infrai_jobs.handlers.drain.lambda_handler"
    assert spec.code_uri == ROOT / "functions"
    assert spec.layer_dirs == (ROOT / "layers" / "common",)
    assert spec.timeout == 240
    assert spec.environment["INFRAI_QUEUE"] == "billing-jobs"
    assert spec.environment["POWERTOOLS_SERVICE_NAME"] == "infrai-jobs"
    assert spec.environment["INFRAI_BASE_URL"] == ""  # env.json leaves it to the shell
    assert spec.environment["DRAIN_BATCH_BUDGET_MS"] == "20000"  # parameter default


@pytest.mark.parametrize("function", function_names(load_template(ROOT / "template.yaml")))
def test_every_handler_imports_with_only_its_code_and_the_layer(function: str) -> None:
    # Given the function's code, its layers and their installed dependencies, nothing else
    spec = resolve(function, root=ROOT)
    module, _, attr = spec.handler.rpartition(".")
    path = [str(spec.code_uri), *map(str, spec.layer_dirs), *dependency_path()]
    check = f"import {module}; assert callable({module}.{attr}); import sys; " + (
        "assert 'infrai_local' not in sys.modules"
    )
    env = {
        "PATH": os.environ["PATH"],
        "PYTHONPATH": os.pathsep.join(path),
        "POWERTOOLS_SERVICE_NAME": "check",
        "POWERTOOLS_METRICS_NAMESPACE": "check",
    }
    # When its handler module is imported in a bare interpreter
    finished = _bare_python(check, spec.code_uri, env)
    # Then it imports, and the local-only package is not reachable
    assert finished.returncode == 0, finished.stderr
    leak = _bare_python("import infrai_local", spec.code_uri, env)
    assert leak.returncode != 0


def test_the_context_counts_down_from_the_timeout_and_a_slow_handler_is_killed(
    tmp_path: Path,
) -> None:
    # Given a template whose function has a 2 s timeout
    (tmp_path / "fn").mkdir()
    (tmp_path / "fn" / "app.py").write_text(
        textwrap.dedent(
            """
        import time
        def handler(event, context):
            if event.get("sleep"):
                time.sleep(event["sleep"])
            remaining = context.get_remaining_time_in_millis()
            return {"remaining": remaining, "name": context.function_name}
        """
        )
    )
    (tmp_path / "template.yaml").write_text(
        textwrap.dedent(
            """
        Transform: AWS::Serverless-2016-10-31
        Resources:
          Quick:
            Type: AWS::Serverless::Function
            Properties: {CodeUri: fn, Handler: app.handler, Runtime: python3.13, Timeout: 2}
        """
        )
    )
    (tmp_path / "fast.json").write_text("{}")
    (tmp_path / "slow.json").write_text('{"sleep": 120}')
    spec = resolve("Quick", root=tmp_path)
    # When invoked quickly, Then the remaining time is within the timeout
    fast = invoke(spec, tmp_path / "fast.json", log_stream=LineSink())
    assert fast.ok
    assert 0 < fast.payload["remaining"] <= 2000
    assert fast.payload["name"] == "Quick"
    # When the handler outlives its timeout, Then it is killed and reported as Lambda does
    slow = invoke(spec, tmp_path / "slow.json", log_stream=LineSink())
    assert slow.timed_out
    assert slow.payload == {"errorMessage": "Task timed out after 2.00 seconds"}
    # Killed, not waited for: long before its 120 s sleep could have ended
    assert slow.duration_ms < 60_000


def test_the_cli_reports_a_handler_error_with_exit_code_1(tmp_path: Path) -> None:
    (tmp_path / "fn").mkdir()
    (tmp_path / "fn" / "app.py").write_text(
        "def handler(event, context):\n    raise KeyError('x')\n"
    )
    (tmp_path / "template.yaml").write_text(
        "Resources:\n  Broken:\n    Type: AWS::Serverless::Function\n"
        "    Properties: {CodeUri: fn, Handler: app.handler}\n"
    )
    (tmp_path / "e.json").write_text("{}")
    finished = _cli_invoke("Broken", tmp_path)
    assert finished.returncode == 1
    answer = json.loads(finished.stdout)
    assert answer["errorType"] == "KeyError"
    # The error answer names the error, and shows no stack trace
    assert "stackTrace" not in answer
    assert "Traceback" not in finished.stdout + finished.stderr
    unknown = _cli_invoke("Nope", tmp_path)
    assert unknown.returncode == 2
    assert "no function 'Nope'" in unknown.stderr


def _cli_invoke(function: str, folder: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """``infrai-jobs invoke FUNCTION`` on the template and ``e.json`` event in ``folder``."""
    return subprocess.run(
        [
            str(Path(sys.executable).parent / "infrai-jobs"),
            "invoke",
            function,
            "--event",
            str(folder / "e.json"),
            "--template",
            str(folder / "template.yaml"),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.usefixtures("billing_queue")
def test_a_fanned_out_drain_correlates_its_lines_with_its_slot(
    services: dict[str, str], tmp_path: Path, project: Path
) -> None:
    # Given a fan-out event, as one drain sends another it starts (no event id of its own)
    slot = "6b1f2a3c-4d5e-4f60-8a7b-9c0d1e2f3a4b"
    event = {"infrai_jobs_fan_out": {"queue": "billing-jobs", "drain_id": slot, "started_by": "x"}}
    (tmp_path / "fan-out.json").write_text(json.dumps(event))
    spec = resolve("DrainFunction", root=project, env_vars=EVENTS / "env.json")
    logs = LineSink()
    # When DrainFunction is invoked with it
    result = invoke(spec, tmp_path / "fan-out.json", log_stream=logs, extra_env=services)
    # Then every log line carries the slot's id as its correlation id
    assert result.ok, result.payload
    records = [json.loads(line) for line in logs.lines if line.startswith("{")]
    log_lines = [r for r in records if "level" in r and "message" in r]
    assert log_lines
    assert {r.get("correlation_id") for r in log_lines} == {slot}


def assert_every_line_correlates(logs: LineSink, event_file: Path) -> None:
    """Every Powertools log line of the invocation has the event's id as its correlation id."""
    event_id = json.loads(event_file.read_text())["id"]
    records = [json.loads(line) for line in logs.lines if line.startswith("{")]
    log_lines = [r for r in records if "level" in r and "message" in r]
    assert log_lines, "the invocation logged nothing"
    assert [r for r in log_lines if r.get("correlation_id") != event_id] == []


def _dead_letter(services: dict[str, str], payload: dict[str, object]) -> InfraiClient:
    client = InfraiClient(services["INFRAI_BASE_URL"], "local-dev-key")
    ensure_queue(client, "billing-jobs", dlq="billing-jobs-dlq")
    client.publish("billing-jobs", payload)
    for _ in range(3):
        assert client.consume("billing-jobs")
        urllib3.request(
            "POST",
            f"{services['INFRAI_BASE_URL']}/_emulator/clock",
            json={"advance_seconds": 301},
        )
    assert client.stats("billing-jobs").dlq_count == 1
    return client


def test_dlq_alert_function_reports_a_dead_lettered_message(
    services: dict[str, str], project: Path
) -> None:
    # Given a message dead-lettered in the emulator
    _dead_letter(services, {"job": "invoice.finalize", "invoice_id": "inv_1", "amount_cents": 1})
    # When DlqAlertFunction is invoked with its schedule event (no topic locally: it prints)
    spec = resolve("DlqAlertFunction", root=project, env_vars=EVENTS / "env.json")
    logs = LineSink()
    result = invoke(
        spec,
        EVENTS / "dlq-alert-schedule.json",
        log_stream=logs,
        extra_env={**services, "ALERT_TOPIC_ARN": ""},
    )
    # Then the report names the queue and the alert, and the EMF carries the DLQ count
    assert result.ok, result.payload
    (queue,) = result.payload["queues"]
    assert (queue["queue"], queue["dlq_count"]) == ("billing-jobs", 1)
    (alert,) = result.payload["alerts"]
    assert alert["subject"] == "[infrai-jobs] 1 new dead letter(s) on billing-jobs"
    emf = [json.loads(line) for line in logs.lines if line.startswith('{"_aws"')]
    assert any(doc.get("DlqCount") == [1.0] and doc.get("queue") == "billing-jobs" for doc in emf)
    # And every log line carries the schedule event's id
    assert_every_line_correlates(logs, EVENTS / "dlq-alert-schedule.json")


def test_redrive_function_moves_dead_letters_back(services: dict[str, str], project: Path) -> None:
    # Given a dead-lettered job whose invoice now exists
    client = _dead_letter(
        services, {"job": "invoice.finalize", "invoice_id": "inv_8812", "amount_cents": 4900}
    )
    spec = resolve("RedriveFunction", root=project, env_vars=EVENTS / "env.json")
    # When RedriveFunction is first invoked with events/redrive-dry-run.json
    looked = invoke(
        spec, EVENTS / "redrive-dry-run.json", log_stream=LineSink(), extra_env=services
    )
    # Then it moved the dead letter into the ledger and published nothing
    assert looked.ok, looked.payload
    assert (looked.payload["dry_run"], looked.payload["recorded"]) == (True, 1)
    assert (looked.payload["published"], looked.payload["stopped"]) == (0, "")
    assert [row["idem_key"] for row in looked.payload["seen"]] == ["invoice.finalize:inv_8812"]
    assert client.stats("billing-jobs").dlq_count == 0
    # When it is invoked with events/redrive.json right after (no visibility timeout to wait)
    result = invoke(spec, EVENTS / "redrive.json", log_stream=LineSink(), extra_env=services)
    # Then it published the ledger's dead letter and says what the publishes cost
    assert result.ok, result.payload
    assert (result.payload["selected"], result.payload["published"]) == (1, 1)
    assert result.payload["stopped"] == ""
    assert result.payload["cost_usd"] == "0.00002"
    stats = client.stats("billing-jobs")
    assert (stats.dlq_count, stats.available_count) == (0, 1)


def test_redrive_function_rejects_a_bad_event_clearly(
    services: dict[str, str], tmp_path: Path
) -> None:
    (tmp_path / "bad.json").write_text('{"max_messages": "all"}')
    spec = resolve("RedriveFunction", root=ROOT, env_vars=EVENTS / "env.json")
    result = invoke(spec, tmp_path / "bad.json", log_stream=LineSink(), extra_env=services)
    assert not result.ok
    assert result.payload["errorType"] == "ConfigurationError"
    assert result.payload["errorMessage"] == "max_messages must be an integer"


def test_prune_function_deletes_old_settled_claims(services: dict[str, str]) -> None:
    with psycopg.connect(services["DATABASE_URL"], autocommit=True) as conn:
        conn.execute(
            "INSERT INTO job_claims (idem_key, state, message_id, claimed_at) VALUES"
            " ('old', 'done', 'm', now() - interval '60 days'), ('new', 'done', 'm', now())"
        )
    spec = resolve("PruneFunction", root=ROOT, env_vars=EVENTS / "env.json")
    logs = LineSink()
    result = invoke(spec, EVENTS / "prune-schedule.json", log_stream=logs, extra_env=services)
    assert result.ok, result.payload
    assert result.payload == {"deleted": 1, "batches": 1, "older_than_days": 30}
    assert_every_line_correlates(logs, EVENTS / "prune-schedule.json")


def test_drain_cold_start_imports_no_provider_http_client_and_no_boto3(project: Path) -> None:
    # Given DrainFunction's code, layer and environment, with plain secrets (no fetch by name)
    spec = resolve("DrainFunction", root=project)
    path = [str(spec.code_uri), *map(str, spec.layer_dirs), *dependency_path()]
    env = {
        **spec.environment,
        "PATH": os.environ["PATH"],
        "PYTHONPATH": os.pathsep.join(path),
        "INFRAI_BASE_URL": "http://127.0.0.1:9",
        "INFRAI_API_KEY": "cold-key",
        "DATABASE_URL": "postgresql://cold@127.0.0.1:9/cold",
        **fixture_jobs.provider_settings("http://127.0.0.1:9"),
        "POWERTOOLS_TRACE_DISABLED": "true",
    }
    check = textwrap.dedent(
        """
        import sys
        from infrai_jobs.handlers import drain as app
        app.service()
        # (Powertools imports botocore's bare package, under a millisecond, for its user agent)
        print(sorted(m for m in ("urllib3", "boto3", "botocore.client") if m in sys.modules))
        """
    )
    # When its handler module is imported and the service built, as on a first invocation
    finished = _bare_python(check, spec.code_uri, env)
    # Then neither the example jobs' HTTP client nor boto3 has been imported: a batch of
    # database jobs never needs them
    assert finished.returncode == 0, finished.stderr
    assert finished.stdout.strip() == "[]"


def _bare_python(code: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run ``code`` without site-packages (``-S``): only what ``PYTHONPATH`` names is found."""
    return run_captured([sys.executable, "-S", "-c", code], env=env, cwd=cwd, timeout=60)


# --- SAM parity: the template loader, samconfig.toml, Fn::Sub -------------------------------


def _one_function_template(head: str, name: str, variables: str) -> str:
    """A SAM template: ``head`` (from its first line to its Conditions), then its one resource,
    the function ``name`` of ``fn/app.py`` whose environment is ``variables`` (YAML lines)."""
    resources = f"""Resources:
  {name}:
    Type: AWS::Serverless::Function
    Properties:
      CodeUri: fn
      Handler: app.handler
      Environment:
        Variables:
"""
    return head + resources + textwrap.indent(variables.lstrip("\n"), " " * 10)


EVERY_SHORT_FORM = _one_function_template(
    """
AWSTemplateFormatVersion: "2010-09-09"
Transform: AWS::Serverless-2016-10-31
Parameters:
  Name: {Type: String, Default: "a b"}
  Flag: {Type: String, Default: "true"}
Conditions:
  IsOn: !Equals [!Ref Flag, "true"]
  Both: !And [!Condition IsOn, !Not [!Equals [!Ref Name, ""]]]
""",
    "Fn",
    """
LITERAL: !Sub "${!Literal}-${Name}"
LISTED: !Sub ["${X}-${AWS::Region}", {X: !Ref Name}]
DOTTED: !GetAtt Fn.Arn
LISTED_ATT: !GetAtt [Fn, Arn]
CHOSEN: !If [Both, "on", "off"]
JOINED: !Join [",", [!Select [0, !Split [" ", !Ref Name]], !Base64 x]]
MAPPED: !FindInMap [M, k, v]
IMPORTED: !ImportValue other
ZONES: !GetAZs ""
CIDR: !Cidr [10.0.0.0/16, 2, 8]
OCTAL: 0755
BARE_ON: on
DATE: 2026-12-01
BLOCK: |
  multi
  line
""",
)


def _as_json(document: object) -> object:
    return json.loads(json.dumps(document, default=str))


@pytest.mark.parametrize("which", ["framework.yaml", "every short form"])
def test_the_template_loader_reads_yaml_as_cfn_lint_decodes_it(which: str, tmp_path: Path) -> None:
    # Given the framework's template, and one using every intrinsic's short form
    path = ROOT / "framework.yaml"
    if which != "framework.yaml":
        path = tmp_path / "template.yaml"
        path.write_text(EVERY_SHORT_FORM)
    # When it is read by invoke's loader and by cfn-lint's decoder (what sam validate lints)
    ours = _as_json(load_template(path))
    theirs = _as_json(cfn_yaml.load(str(path)))
    # Then both give the same document: tags become the same long forms, scalars the same types
    assert ours == theirs


def _node_types(value: object) -> set[type]:
    if isinstance(value, dict):
        return {type(value)}.union(*(_node_types(v) for v in [*value, *value.values()]))
    if isinstance(value, list):
        return {type(value)}.union(*(_node_types(v) for v in value))
    return {type(value)}


def test_the_loaded_template_holds_plain_values_only() -> None:
    # Given / When the repository's template is loaded
    template = load_template(ROOT / "template.yaml")
    # Then it holds plain dicts, lists and scalars, none of the decoder's marked nodes
    assert _node_types(template) <= {dict, list, str, int, float, bool, type(None)}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Resources:\n  A: {Type: X}\n  A: {Type: Y}\n", "Duplicate found 'A' (line 2)"),
        ("Resources:\n  A: [unclosed\n", "line 3"),
        ("Parameters: {}\n", "is not a SAM template"),
    ],
)
def test_an_unreadable_template_is_a_configuration_error_naming_it(
    tmp_path: Path, text: str, expected: str
) -> None:
    # Given a template with a duplicate key, broken YAML, or no Resources
    path = tmp_path / "template.yaml"
    path.write_text(text)
    # When it is loaded / Then the error names the file and what is wrong
    with pytest.raises(ConfigurationError) as raised:
        load_template(path)
    assert str(path) in str(raised.value)
    assert expected in str(raised.value)


def test_fn_sub_renders_an_escaped_literal_as_cloudformation_does(tmp_path: Path) -> None:
    # Given a function whose environment uses Fn::Sub's escape and both of its forms
    (tmp_path / "template.yaml").write_text(EVERY_SHORT_FORM)
    # When it is resolved
    env = resolve("Fn", root=tmp_path).environment
    # Then "${!Literal}" renders as "${Literal}", unresolved, and the rest is substituted
    assert env["LITERAL"] == "${Literal}-a b"
    assert env["LISTED"] == "a b-us-east-1"
    # And conditions, joins, selects and splits are evaluated; only AWS knows an attribute
    assert env["CHOSEN"] == "on"
    assert env["JOINED"].startswith("a,")
    assert env["DOTTED"] == ""


SAMCONFIG_WITH_EVERY_SECTION = """
version = 0.1
[default.global.parameters]
stack_name = "app"
parameter_overrides = "Region=from-global Queue=from-global"
[default.deploy.parameters]
parameter_overrides = "Queue=from-deploy ApiKeyParameterName=/app/deploy-key"
[default.local_invoke.parameters]
parameter_overrides = ["Queue=from-local-invoke"]
[prod.global.parameters]
parameter_overrides = "Region=from-prod-global"
[prod.deploy.parameters]
parameter_overrides = "ApiKeyParameterName=/app/prod/api-key Queue=prod-queue"
"""

ECHO_TEMPLATE = _one_function_template(
    """
Transform: AWS::Serverless-2016-10-31
Parameters:
  Queue: {Type: String, Default: template-queue}
  Region: {Type: String, Default: template-region}
  ApiKeyParameterName: {Type: String, Default: /app/api-key}
""",
    "Echo",
    """
QUEUE: !Ref Queue
REGION: !Ref Region
API_KEY_PARAMETER: !Ref ApiKeyParameterName
""",
)


def _echo_project(folder: Path, samconfig: str) -> None:
    """A template whose function returns the three variables, and a samconfig.toml."""
    (folder / "fn").mkdir()
    (folder / "fn" / "app.py").write_text(
        "import os\n"
        "def handler(event, context):\n"
        "    return {k: os.environ[k] for k in ('QUEUE', 'REGION', 'API_KEY_PARAMETER')}\n"
    )
    (folder / "template.yaml").write_text(ECHO_TEMPLATE)
    (folder / "samconfig.toml").write_text(samconfig)
    (folder / "e.json").write_text("{}")


def test_samconfig_applies_local_invokes_section_over_global_and_never_deploys(
    tmp_path: Path,
) -> None:
    # Given a samconfig.toml whose deploy sections override what local invoke must not see
    _echo_project(tmp_path, SAMCONFIG_WITH_EVERY_SECTION)
    # When the function is resolved for the default environment
    env = resolve("Echo", root=tmp_path).environment
    # Then local_invoke's parameter_overrides replace global's whole (SAM CLI merges the two
    # sections option by option), and deploy's apply to nothing
    assert env["QUEUE"] == "from-local-invoke"
    assert env["REGION"] == "template-region"
    assert env["API_KEY_PARAMETER"] == "/app/api-key"
    # And under --config-env prod, without a local_invoke section, only prod's global ones apply
    prod = resolve("Echo", root=tmp_path, config_env="prod").environment
    assert (prod["QUEUE"], prod["REGION"], prod["API_KEY_PARAMETER"]) == (
        "template-queue",
        "from-prod-global",
        "/app/api-key",
    )
    # And the command line's overrides win over samconfig.toml's
    cli = resolve("Echo", root=tmp_path, parameter_overrides={"Queue": "from-cli"})
    assert cli.environment["QUEUE"] == "from-cli"


def test_invoke_with_config_env_prod_does_not_apply_the_repositorys_deploy_only_overrides(
    tmp_path: Path,
) -> None:
    # Given the repository's samconfig.toml, whose prod deploy names prod's API-key parameter
    samconfig = (ROOT / "samconfig.toml").read_text()
    assert "ApiKeyParameterName=/infrai-jobs/prod/api-key" in samconfig
    assert samconfig_overrides(ROOT / "samconfig.toml", "prod") == {}
    # When DrainFunction is resolved under --config-env prod
    drain = resolve("DrainFunction", root=ROOT, config_env="prod")
    # Then it reads the template's default parameter, and prod's deploy-only rate is not applied
    assert drain.environment["INFRAI_API_KEY_PARAMETER"] == "/infrai-jobs/api-key"
    # And the command does the same, end to end, for a function that echoes its environment
    _echo_project(tmp_path, samconfig.replace("/infrai-jobs/prod/api-key", "/app/prod/api-key"))
    (tmp_path / "template.yaml").write_text(
        ECHO_TEMPLATE.replace("/app/api-key", "/infrai-jobs/api-key")
    )
    finished = _cli_invoke("Echo", tmp_path, "--config-env", "prod")
    assert finished.returncode == 0, finished.stderr
    assert json.loads(finished.stdout) == {
        "QUEUE": "template-queue",
        "REGION": "template-region",
        "API_KEY_PARAMETER": "/infrai-jobs/api-key",
    }


def test_the_command_reads_local_invoke_env_vars_and_says_when_an_environment_is_missing(
    tmp_path: Path,
) -> None:
    # Given a samconfig.toml whose local_invoke section names an env-vars file
    _echo_project(
        tmp_path,
        '[default.local_invoke.parameters]\nenv_vars = "env.json"\n'
        'parameter_overrides = "Region=from-local-invoke"\n',
    )
    (tmp_path / "env.json").write_text(json.dumps({"Echo": {"QUEUE": "from-env-vars"}}))
    # When the command runs without --env-vars, then with an environment the file lacks
    configured = _cli_invoke("Echo", tmp_path)
    missing = _cli_invoke("Echo", tmp_path, "--config-env", "staging")
    # Then the configured file and overrides apply, as with sam local invoke
    assert configured.returncode == 0, configured.stderr
    assert json.loads(configured.stdout)["QUEUE"] == "from-env-vars"
    assert json.loads(configured.stdout)["REGION"] == "from-local-invoke"
    # And a missing environment runs on the template's defaults, with a one-line note
    assert missing.returncode == 0, missing.stderr
    assert json.loads(missing.stdout)["QUEUE"] == "template-queue"
    assert "note: samconfig.toml has no [staging] environment" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_parameter_overrides_are_parsed_in_every_spelling_sam_accepts() -> None:
    # Given overrides spelled as SAM CLI accepts them
    # When they are parsed
    # Then each spelling gives the same names and values, quotes removed
    assert parse_parameter_overrides('A=1 B="two words" C=') == {
        "A": "1",
        "B": "two words",
        "C": "",
    }
    assert parse_parameter_overrides("ParameterKey=A,ParameterValue=x=y") == {"A": "x=y"}
    assert parse_parameter_overrides(["A=1", "B=2"]) == {"A": "1", "B": "2"}
    assert parse_parameter_overrides({"A": 1, "B": True}) == {"A": "1", "B": "true"}


# --- What a SAM user expects: the README's command, template defaults, AWS settings ----------


def readme_invoke_command() -> str:
    """The local-invoke command line of the README's "Run it locally" block, as written."""
    section = (ROOT / "README.md").read_text().split("\n## Run it locally\n", 1)[1]
    block = section.split("```sh\n", 1)[1].split("```", 1)[0]
    (command,) = [line for line in block.splitlines() if " invoke " in line]
    return command


def test_the_readmes_invoke_command_runs_as_written_in_a_fresh_shell() -> None:
    # Given a shell with nothing of this project's exported, and the README's command line
    command = readme_invoke_command()
    assert command.startswith(".venv/bin/infrai-jobs invoke DrainFunction")
    env = clean_env(PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    # When bash runs it from the project's root
    finished = run_captured(["bash", "-c", command], env=env, cwd=ROOT, timeout=180)
    output = finished.stdout + finished.stderr
    # Then it ran in the sandbox, said so first, and the drain returned its summary
    assert finished.returncode == 0, output
    assert "Traceback" not in output
    assert finished.stderr.startswith("sandbox: nothing real is configured"), finished.stderr
    assert json.loads(finished.stdout)["stopped"] == "empty"
    # And nothing named the hosted Infrai, which nobody asked for
    assert "api.infrai.cc" not in output


def _invoke_from_shell(
    project: Path, function: str, event: str, env_vars: Path, *, env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    """``infrai-jobs invoke FUNCTION --event EVENT --env-vars ENV_VARS`` in a child process,
    run from ``project``'s root with only ``env`` as its environment."""
    return run_captured(
        [
            str(Path(sys.executable).parent / "infrai-jobs"),
            "invoke",
            function,
            "--event",
            event,
            "--env-vars",
            str(env_vars),
        ],
        env=env,
        cwd=project,
        timeout=120,
    )


def test_a_template_default_endpoint_is_not_a_choice_the_user_made(
    database_url: str, project: Path
) -> None:
    # Given an env-vars file that sets nothing, so InfraiBaseUrl keeps the template's Default
    spec = resolve("DrainFunction", root=project)
    assert spec.environment["INFRAI_BASE_URL"] == "https://api.infrai.cc"
    assert "INFRAI_BASE_URL" in spec.template_only
    # And one where the user chose it, on the command line
    chosen = resolve(
        "DrainFunction", root=project, parameter_overrides={"InfraiBaseUrl": "http://127.0.0.1:9"}
    )
    assert "INFRAI_BASE_URL" not in chosen.template_only
    # When DrainFunction is invoked with a real ledger from the shell and no Infrai URL
    with psycopg.connect(database_url, autocommit=True) as conn:
        apply_migrations(conn, read_migrations(jobs_migrations_folder(project / "functions")))
    finished = _invoke_from_shell(
        project,
        "DrainFunction",
        "events/drain-schedule.json",
        EVENTS / "env.json",
        env=clean_env(DATABASE_URL=database_url),
    )
    # Then INFRAI_BASE_URL counts as unset: a configuration error naming it, no handler ran,
    # and the hosted service's address appears nowhere
    assert finished.returncode == 2, finished.stderr
    assert "INFRAI_BASE_URL" in finished.stderr.split("are not set", 1)[0]
    assert "END DrainFunction" not in finished.stderr
    assert "api.infrai.cc" not in finished.stdout + finished.stderr


def test_invoke_forwards_the_shells_aws_credentials_region_and_endpoint(
    services: dict[str, str], tmp_path: Path, project: Path
) -> None:
    # Given SNS served by moto over HTTP, a topic with a queue subscribed to read it back, and
    # a shell naming moto's endpoint, credentials and a region (AWS_DEFAULT_REGION only)
    from moto.server import ThreadedMotoServer  # noqa: PLC0415 - only this test serves AWS

    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    try:
        host, port = moto.get_host_and_port()
        aws = {
            "AWS_ACCESS_KEY_ID": "forwarded-key-id",
            "AWS_SECRET_ACCESS_KEY": "forwarded-secret",
            "AWS_DEFAULT_REGION": "eu-west-1",
            "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        }
        session = boto3.session.Session(
            aws_access_key_id=aws["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=aws["AWS_SECRET_ACCESS_KEY"],
            region_name=aws["AWS_DEFAULT_REGION"],
        )
        sns = session.client("sns", endpoint_url=aws["AWS_ENDPOINT_URL"])
        sqs = session.client("sqs", endpoint_url=aws["AWS_ENDPOINT_URL"])
        topic = sns.create_topic(Name="infrai-jobs-alerts")["TopicArn"]
        inbox = sqs.create_queue(QueueName="pager")["QueueUrl"]
        inbox_arn = sqs.get_queue_attributes(QueueUrl=inbox, AttributeNames=["QueueArn"])
        sns.subscribe(
            TopicArn=topic,
            Protocol="sqs",
            Endpoint=inbox_arn["Attributes"]["QueueArn"],
            Attributes={"RawMessageDelivery": "true"},
        )
        # And a dead letter in the emulator, and an env-vars file naming the topic
        poison = {"job": "invoice.finalize", "invoice_id": "inv_1", "amount_cents": 1}
        _dead_letter(services, poison)
        env_vars = tmp_path / "env.json"
        # (the jobs' settings in the watcher's JOB_SETTINGS, as events/env.json gives them)
        settings = fixture_jobs.provider_settings(services["MAIL_PROVIDER_URL"])
        watcher = {"ALERT_TOPIC_ARN": topic, "JOB_SETTINGS": json.dumps(settings)}
        env_vars.write_text(json.dumps({"Parameters": services, "DlqAlertFunction": watcher}))
        # When DlqAlertFunction is invoked from that shell
        finished = _invoke_from_shell(
            project,
            "DlqAlertFunction",
            "events/dlq-alert-schedule.json",
            env_vars,
            env=clean_env(**aws),
        )
        # Then the alert went to SNS through moto, signed with the forwarded credentials
        assert finished.returncode == 0, finished.stdout + finished.stderr
        assert json.loads(finished.stdout)["alerts"][0]["subject"].endswith(
            "new dead letter(s) on billing-jobs"
        )
        received = sqs.receive_message(QueueUrl=inbox, WaitTimeSeconds=1)["Messages"]
        assert "infrai-jobs dlq" in received[0]["Body"]
        assert "Unable to locate credentials" not in finished.stderr
        assert "forwarded-secret" not in finished.stdout + finished.stderr
    finally:
        moto.stop()


def test_a_jobs_setting_exported_in_the_shell_reaches_the_function_as_in_sam(
    services: dict[str, str], billing_queue: InfraiClient, tmp_path: Path, project: Path
) -> None:
    # Given an env-vars file that leaves every job setting empty, and a shell that exports the
    # endpoints and the jobs' settings (the template declares each on DrainFunction, so
    # `sam local invoke` would take its value from the shell)
    env_vars = tmp_path / "env.json"
    env_vars.write_text(json.dumps({"DrainFunction": {}}))
    billing_queue.publish(
        "billing-jobs",
        {"job": "receipt.send", "invoice_id": "inv_exported", "email": "a@example.com"},
    )
    # When DrainFunction is invoked from that shell
    finished = _invoke_from_shell(
        project, "DrainFunction", "events/drain-schedule.json", env_vars, env=clean_env(**services)
    )
    # Then the receipt was sent through the exported MAIL_PROVIDER_URL, and nothing stood in
    assert finished.returncode == 0, finished.stdout + finished.stderr
    assert json.loads(finished.stdout)["done"] == 1
    assert "sandbox" not in finished.stderr
    state = urllib3.request("GET", f"{services['MAIL_PROVIDER_URL']}/_sink/state").json()
    assert state["mail_effects"] == 1


def test_a_job_settings_map_that_is_not_json_stops_the_invocation_before_anything_runs(
    services: dict[str, str], tmp_path: Path, project: Path
) -> None:
    # Given an env-vars file whose DrainFunction JOB_SETTINGS is not a JSON object of strings
    env_vars = tmp_path / "env.json"
    env_vars.write_text(json.dumps({"DrainFunction": {"JOB_SETTINGS": '{"MAIL_PROVIDER_URL": 1}'}}))
    # When DrainFunction is invoked
    finished = _invoke_from_shell(
        project, "DrainFunction", "events/drain-schedule.json", env_vars, env=clean_env(**services)
    )
    # Then it is a configuration error naming the variable, and no handler ran
    assert finished.returncode == 2, finished.stdout + finished.stderr
    assert "DrainFunction's JOB_SETTINGS is not a JSON object of strings" in finished.stderr
    assert "END DrainFunction" not in finished.stderr
