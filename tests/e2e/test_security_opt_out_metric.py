"""A secure default turned off is counted, not only logged: DrainFunction invoked as deployed
(``infrai-jobs invoke``, the template's parameters) with a Redis second layer that takes commands
without AUTH writes, at its cold start, a JSON log line that the template's ``SecurityOptOuts``
metric filter counts (its pattern applied as CloudWatch Logs applies it), and drains as usual."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from child_process import LineSink
from test_template import SECURITY_OPT_OUT_PATTERN, load_template

from infrai_local.sandbox.invoke import invoke, resolve

ROOT = Path(__file__).resolve().parents[2]
EVENTS = ROOT / "events"


def counted_by(pattern: str, record: dict[str, Any]) -> bool:
    """Whether a JSON metric filter of the form ``{ $.field = "value" }`` matches ``record``."""
    match = re.fullmatch(r'\{ \$\.(\w+) = "([^"*]*)" \}', pattern)
    assert match is not None, f"not a single-field equality filter: {pattern}"
    return record.get(match.group(1)) == match.group(2)


@pytest.mark.usefixtures("billing_queue")
def test_a_redis_second_layer_without_auth_is_counted_at_each_cold_start(
    services: dict[str, str], project: Path
) -> None:
    # Given DrainFunction deployed with a Redis second layer over TLS, with no password and no
    # RedisSecretArn: every client that reaches it may read or drop its records
    overrides = {"IdempotencyBackend": "redis", "RedisUrl": "rediss://cache.example.com:6379"}
    spec = resolve(
        "DrainFunction",
        root=project,
        env_vars=EVENTS / "env.json",
        parameter_overrides=overrides,
    )
    filters = [
        r["Properties"]
        for r in load_template()["Resources"].values()
        if r["Type"] == "AWS::Logs::MetricFilter"
        and r["Properties"]["LogGroupName"] == {"Ref": "DrainFunctionLogGroup"}
    ]
    assert [f["FilterPattern"] for f in filters] == [SECURITY_OPT_OUT_PATTERN]
    # When it is invoked twice, each a cold start (a child process of its own)
    counted = []
    for _ in range(2):
        logs = LineSink()
        result = invoke(spec, EVENTS / "drain-schedule.json", log_stream=logs, extra_env=services)
        # Then it drains as usual: an opt-out is said, not refused
        assert result.ok, result.payload
        records = [json.loads(line) for line in logs.lines if line.startswith("{")]
        counted += [r for r in records if counted_by(SECURITY_OPT_OUT_PATTERN, r)]
    # And each cold start wrote one line the metric filter counts, saying how to turn AUTH on
    assert len(counted) == 2
    assert all("without AUTH" in r["message"] for r in counted)
    assert all("REDIS_SECRET_ARN" in r["message"] for r in counted)
