"""make build's connection budget: the fleet's worst case is one number, checked against
DatabaseMaxConnections as the deploy would take it, and a build over it stops naming each term.
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import pytest
from child_process import run_captured

from infrai_local.checks.connection_budget import budget_of, connection_budget, main

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def clone(tmp_path: Path) -> Path:
    shutil.copy(ROOT / "template.yaml", tmp_path / "template.yaml")
    shutil.copy(ROOT / "framework.yaml", tmp_path / "framework.yaml")
    shutil.copy(ROOT / "samconfig.toml", tmp_path / "samconfig.toml")
    return tmp_path


def _deploying(clone: Path, overrides: str, environment: str = "budget") -> None:
    samconfig = clone / "samconfig.toml"
    samconfig.write_text(
        samconfig.read_text()
        + f'\n[{environment}.deploy.parameters]\nparameter_overrides = "{overrides}"\n'
    )


def test_the_worst_case_is_drains_times_lanes_plus_one_and_every_other_function() -> None:
    # Given 4 drains of 8 lanes, the other functions at their template's reserved concurrency
    values = {"DrainMaxConcurrency": "4", "DrainLanes": "8", "DatabaseMaxConnections": "0"}
    resources = {"RedriveFunction": {"Properties": {"ReservedConcurrentExecutions": 2}}}
    # When the budget is computed
    budget = connection_budget(values, resources)
    # Then it is 4 x (8 + 1) + watcher 2 + relay 2 + redrive 2 x 1 + prune 1 + operators 3
    assert dict(budget.terms) == {
        "drains DrainMaxConcurrency 4 x (DrainLanes 8 + 1)": 36,
        "the watcher": 2,
        "the outbox relay": 2,
        "redrive": 2,
        "prune": 1,
        "operators and the console": 3,
    }
    assert budget.worst_case == 46
    # And with no limit set, nothing is refused
    assert budget.limit is None
    assert budget.refusal() is None


def test_the_template_defaults_fit_and_are_not_checked(
    clone: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given the template as committed: 4 drains of 1 lane, DatabaseMaxConnections 0
    budget = budget_of(clone)
    assert budget.worst_case == 4 * (1 + 1) + 2 + 2 + 1 + 1 + 3
    # When make build's check runs, Then it passes and says what it did not check
    assert main(["--root", str(clone)]) == 0
    assert "not checked" in capsys.readouterr().out


def test_a_deploy_over_the_limit_stops_the_build_naming_each_term(
    clone: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given a deploy of 12 drains of 4 lanes against a database allowing 40 connections
    _deploying(clone, "DrainMaxConcurrency=12 DrainLanes=4 DatabaseMaxConnections=40")
    # When the check runs
    code = main(["--root", str(clone), "--config-env", "budget"])
    # Then the build stops with one line: the number, the limit and every term
    assert code == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert "worst case is 69 database connections" in line
    assert "above the 40 DatabaseMaxConnections=40 allows" in line
    for term in ("DrainMaxConcurrency 12 x (DrainLanes 4 + 1) 60", "the watcher 2", "prune 1"):
        assert term in line
    assert "`infrai-jobs docs configuration`" in line
    # And the default environment's build still goes on
    assert main(["--root", str(clone)]) == 0


def test_behind_rds_proxy_the_limit_is_the_share_the_proxy_may_open(clone: Path) -> None:
    # Given 100 connections on the database, the proxy allowed 50% of them, and 40 wanted
    _deploying(
        clone,
        "DrainMaxConcurrency=5 DrainLanes=5 DatabaseMaxConnections=100 DatabaseProxy=create "
        "DatabaseProxyMaxConnectionsPercent=50",
    )
    budget = budget_of(clone, "budget")
    # Then the check is against 50, not 100, and says why
    assert (budget.worst_case, budget.limit) == (39, 50)
    assert budget.refusal() is None
    # And 6 drains of 8 lanes (63) fit 100 directly; 7 of 12 (100) do not fit the proxy's 90%
    _deploying(clone, "DrainMaxConcurrency=6 DrainLanes=8 DatabaseMaxConnections=100", "direct")
    assert budget_of(clone, "direct").refusal() is None
    _deploying(
        clone,
        "DrainMaxConcurrency=7 DrainLanes=12 DatabaseMaxConnections=100 DatabaseProxy=create",
        "proxied",
    )
    refusal = budget_of(clone, "proxied").refusal()
    assert refusal is not None
    assert "above the 90 DatabaseMaxConnections=100 x DatabaseProxyMaxConnectionsPercent=90%" in (
        refusal
    )


def test_make_build_runs_the_budget_check_before_building() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^build: ca-bundle-check connection-budget-check ", makefile, re.M)
    assert "-m infrai_local.checks.connection_budget" in makefile


def test_the_module_runs_as_make_runs_it_without_a_traceback(clone: Path) -> None:
    _deploying(clone, "DrainMaxConcurrency=50 DrainLanes=16 DatabaseMaxConnections=413")
    module = [sys.executable, "-m", "infrai_local.checks.connection_budget"]
    completed = run_captured([*module, "--root", str(clone), "--config-env", "budget"])
    assert completed.returncode == 1
    assert "Traceback" not in completed.stderr
    assert completed.stderr.startswith("build-check: the fleet's worst case is 859 ")
