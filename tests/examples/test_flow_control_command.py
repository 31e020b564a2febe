"""docs/flow-control.md's ``infrai-jobs invoke`` with a JSON override (a rate for the example
``receipt.send``), run as bash reads it from the project's root: the JSON reaches DrainFunction
whole."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from child_process import clean_env, run_captured

ROOT = Path(__file__).resolve().parents[2]


def flow_control_invoke_command() -> str:
    """docs/flow-control.md's ``infrai-jobs invoke`` with a JSON override, as bash reads it."""
    text = (ROOT / "docs" / "flow-control.md").read_text()
    block = text.split("```sh\n.venv/bin/infrai-jobs invoke ", 1)[1].split("```", 1)[0]
    return (".venv/bin/infrai-jobs invoke " + block).replace("\\\n", " ").strip()


def test_a_json_override_quoted_as_the_docs_show_reaches_the_drain_whole() -> None:
    # Given docs/flow-control.md's command, JobPolicies quoted SAM's way, and the same with a
    # rate nobody can mean
    command = flow_control_invoke_command()
    assert '--parameter-overrides \'JobPolicies="{\\"receipt.send\\": ' in command
    refused = command.replace('\\"per_second\\": 20', '\\"per_second\\": 0')
    assert refused != command
    env = clean_env(PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    # When bash runs each from the project's root (in the sandbox)
    ran = run_captured(["bash", "-c", command], env=env, cwd=ROOT, timeout=180)
    failed = run_captured(["bash", "-c", refused], env=env, cwd=ROOT, timeout=180)
    # Then the JSON reached DrainFunction whole: it drains with it, and refuses the bad rate by
    # job and field at its cold start
    assert ran.returncode == 0, ran.stderr
    assert failed.returncode == 1, failed.stderr
    assert json.loads(failed.stdout)["errorMessage"] == (
        "JOB_POLICIES: job 'receipt.send': rate.per_second must be positive (got 0)"
    )
    # And neither prints a warning or a traceback beside its result
    for finished in (ran, failed):
        assert "Warning" not in finished.stderr, finished.stderr
        assert "Traceback" not in finished.stderr, finished.stderr
