"""Ctrl-C while ``infrai-jobs`` is still loading its modules is one line and exit 130.

The console script installed from ``[project.scripts]`` runs ``from MODULE import FUNCTION;
sys.exit(FUNCTION())``. Each command spends its first few hundred milliseconds importing
(psycopg, the framework): an interrupt there used to come before ``cli.main``'s own handler
existed, and the user saw a KeyboardInterrupt traceback. The child below runs the script's two
lines with an import hook that raises KeyboardInterrupt when ``infrai_local.cli`` is loaded,
which is where a Ctrl-C lands in that window.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_CHILD = """
import importlib.abc
import sys


class CtrlCWhileLoading(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "infrai_local.cli":
            raise KeyboardInterrupt
        return None


sys.meta_path.insert(0, CtrlCWhileLoading())
from {module} import {function}
sys.exit({function}())
"""


def test_ctrl_c_while_the_command_loads_is_one_line_and_exit_130() -> None:
    # Given the console script pyproject.toml installs
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, function = scripts["infrai-jobs"].split(":")
    # When a Ctrl-C arrives while it imports the command line
    child = subprocess.run(
        [sys.executable, "-c", _CHILD.format(module=module, function=function), "claims", "list"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    # Then the user sees what any other interrupt shows: one line, exit 130, no traceback
    assert (child.returncode, child.stderr, child.stdout) == (130, "error: interrupted\n", "")


def test_without_an_interrupt_the_script_runs_the_command() -> None:
    # Given the console script, run as it is installed
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, function = scripts["infrai-jobs"].split(":")
    script = f"import sys\nfrom {module} import {function}\nsys.exit({function}())"
    # When it is asked for its version
    child = subprocess.run(
        [sys.executable, "-c", script, "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    # Then the command line answered, as it does when called directly
    assert child.returncode == 0, child.stderr
    assert child.stdout.startswith("infrai-jobs ")
