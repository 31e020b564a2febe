"""checkov on framework.yaml (the resources template.yaml nests), over every parameter set it
offers: no failed check, and every skip says why, offline.

A Condition that checkov cannot decide (an ``Fn::If`` on a parameter) would let a check pass on
the branch the default deployment never takes, so each parameter set (``parameter_sets``) is
rendered into a template of its own, its Conditions decided, and one checkov process scans the
folder of them.

checkov pins boto3 and packaging below this project's pins, so it lives in its own virtualenv
(``make checkov``, version in the Makefile), run here as a subprocess. It must never reach the
network: its downloads and update check are turned off, and a ``sitecustomize`` loaded into its
interpreter records (and refuses) every attempt to resolve a host or open an internet socket.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "e2e"))

from parameter_sets import PARAMETER_SETS, Rendering  # noqa: E402
from test_template import load_template  # noqa: E402

CHECKOV = ROOT / ".tools" / "checkov" / "bin" / "checkov"
# What checkov reports for a skip written without a comment.
NO_COMMENT = "No comment provided"

# Loaded by checkov's interpreter at startup (PYTHONPATH): name lookups and internet sockets are
# written to NETWORK_LOG and refused; Unix sockets (multiprocessing) stay allowed.
NETWORK_GUARD = textwrap.dedent(
    """
    import os
    import socket

    _log = os.environ["NETWORK_LOG"]
    open(os.environ["NETWORK_GUARD_LOADED"], "w").close()

    def _refuse(what):
        with open(_log, "a", encoding="utf-8") as f:
            f.write(repr(what) + "\\n")
        raise OSError("network access refused by the test: " + repr(what))

    def _getaddrinfo(host, *args, **kwargs):
        _refuse(("getaddrinfo", host))

    _connect = socket.socket.connect

    def _guarded_connect(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6):
            _refuse(("connect", address))
        return _connect(self, address)

    socket.getaddrinfo = _getaddrinfo
    socket.socket.connect = _guarded_connect
    """
)


@pytest.fixture(scope="module")
def checkov_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if not CHECKOV.is_file():
        pytest.fail(f"checkov is not installed at {CHECKOV.relative_to(ROOT)}: run `make checkov`")
    guard = tmp_path_factory.mktemp("network-guard")
    (guard / "sitecustomize.py").write_text(NETWORK_GUARD)
    network_log = guard / "attempts.log"
    # No platform key, no mapping download, no update check: only what the package ships.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BC_", "CKV_", "PRISMA_"))}
    env |= {
        "BC_SKIP_MAPPING": "TRUE",
        "CKV_SKIP_PACKAGE_UPDATE_CHECK": "TRUE",
        "PYTHONPATH": str(guard),
        "NETWORK_LOG": str(network_log),
        "NETWORK_GUARD_LOADED": str(guard / "loaded"),
    }
    rendered = tmp_path_factory.mktemp("parameter-sets")
    template = load_template()
    renderings = {}
    for name, overrides in PARAMETER_SETS.items():
        renderings[name] = Rendering(template, overrides).template
        (rendered / f"{name}.json").write_text(json.dumps(renderings[name], indent=1))
    completed = subprocess.run(
        [
            str(CHECKOV),
            "--directory",
            str(rendered),
            "--framework",
            "cloudformation",
            "--skip-download",
            "--compact",
            "--output",
            "json",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=240,
        check=False,
    )
    report = json.loads(completed.stdout)
    return {
        "report": report[0] if isinstance(report, list) else report,
        "renderings": renderings,
        "returncode": completed.returncode,
        "stderr": completed.stderr,
        "network": network_log.read_text() if network_log.exists() else "",
        "guarded": (guard / "loaded").exists(),
    }


def test_checkov_finds_no_failed_check_in_the_template(checkov_run: dict[str, Any]) -> None:
    # Given checkov's report on template.yaml
    report = checkov_run["report"]
    summary = report["summary"]
    # Then it parsed the template and looked at its resources
    assert summary["parsing_errors"] == 0, checkov_run["stderr"]
    renderings = checkov_run["renderings"]
    assert summary["resource_count"] >= sum(len(r["Resources"]) for r in renderings.values())
    assert summary["passed"] > 0
    # And it scanned every parameter set
    scanned = {_set_of(c) for c in report["results"]["passed_checks"]}
    assert scanned == set(PARAMETER_SETS)
    # And it is the version the Makefile pins
    pinned = re.search(r"^CHECKOV_VERSION := (\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert pinned, "the Makefile pins no CHECKOV_VERSION"
    assert summary["checkov_version"] == pinned.group(1)
    # And no check failed
    failed = [
        (_set_of(c), c["check_id"], c["resource"], c["check_name"])
        for c in report["results"]["failed_checks"]
    ]
    assert failed == []
    assert summary["failed"] == 0
    assert checkov_run["returncode"] == 0, checkov_run["stderr"]


def test_every_skip_is_declared_in_the_template_with_its_reason(
    checkov_run: dict[str, Any],
) -> None:
    # Given the skips checkov applied in each parameter set, and the ones the template declares
    # in its Metadata
    applied: dict[str, dict[tuple[str, str], str]] = {name: {} for name in PARAMETER_SETS}
    for c in checkov_run["report"]["results"].get("skipped_checks", []):
        key = (c["resource"].split(".", 1)[1], c["check_id"])
        applied[_set_of(c)][key] = c["check_result"]["suppress_comment"]
    declared = {
        (name, skip.get("id")): skip.get("comment")
        for name, resource in load_template()["Resources"].items()
        for skip in resource.get("Metadata", {}).get("checkov", {}).get("skip", [])
    }
    assert declared
    for parameter_set, rendering in checkov_run["renderings"].items():
        # Then in each set checkov skipped exactly what the Metadata of the resources that set
        # deploys declares (no inline or unknown skip)
        deployed = {key: why for key, why in declared.items() if key[0] in rendering["Resources"]}
        assert set(applied[parameter_set]) == set(deployed), parameter_set
        # And each skip gives a reason of its own, not checkov's placeholder
        for key, comment in applied[parameter_set].items():
            assert comment, (parameter_set, key)
            assert comment.strip() not in ("", NO_COMMENT), (parameter_set, key)
            assert comment == declared[key], (parameter_set, key)
    assert checkov_run["report"]["summary"]["skipped"] == sum(map(len, applied.values()))


def test_the_parameter_sets_cover_each_switch_both_ways() -> None:
    # Given the parameter sets checkov scans, rendered
    template = load_template()
    renderings = [Rendering(template, overrides) for overrides in PARAMETER_SETS.values()]
    # Then every Condition of the template holds in one set and fails in another
    for condition in template["Conditions"]:
        assert {r.condition(condition) for r in renderings} == {True, False}, condition
    # And every backend of the second layer is crossed with a VPC, tracing and an alert e-mail
    switches = ("InVpc", "TracingEnabled", "HasAlertEmail")
    crossed = {
        (r.values["IdempotencyBackend"], *(r.condition(c) for c in switches)) for r in renderings
    }
    assert len(crossed) == 3 * 2 * 2 * 2
    # And a rendering holds no Condition left to decide
    for rendering in renderings:
        assert '"Fn::If"' not in json.dumps(rendering.template)
        assert not [n for n, r in rendering.template["Resources"].items() if "Condition" in r]


def _set_of(check: dict[str, Any]) -> str:
    """The parameter set a checkov result belongs to: its rendered file's name."""
    return Path(check["file_path"]).stem


def test_checkov_never_tried_the_network(checkov_run: dict[str, Any]) -> None:
    # Given the guard, loaded into checkov's interpreter before checkov itself
    assert checkov_run["guarded"]
    # Then it recorded no host lookup and no internet connection
    assert checkov_run["network"] == ""
