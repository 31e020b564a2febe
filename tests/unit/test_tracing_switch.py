"""Tracing is off unless the template turns it on; off, the X-Ray SDK is never imported."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import os, sys
os.environ["POWERTOOLS_SERVICE_NAME"] = "t"
os.environ["POWERTOOLS_TRACE_DISABLED"] = sys.argv[1]
from infrai_jobs.runtime.observability import tracing
def handler(event, context):
    return "ok"
wrapped = tracing(handler)
print(wrapped is handler, "aws_xray_sdk" in sys.modules)
"""


def _run(disabled: str) -> str:
    finished = subprocess.run(
        [sys.executable, "-c", CHECK, disabled],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return finished.stdout.strip()


def test_tracing_off_leaves_the_handler_alone_and_skips_the_sdk() -> None:
    assert _run("true") == "True False"


def test_tracing_on_wraps_the_handler_with_the_tracer() -> None:
    assert _run("false") == "False True"
