"""make build's first step: a deploy that verifies the ledger needs its CA bundle in functions/.

The parameters are read as ``sam deploy --config-env ENV`` takes them: samconfig.toml's deploy
and global sections over the template's defaults. A clean clone has no bundle, so its build
stops with one line saying where to get it.
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import pytest
from child_process import run_captured

from infrai_local.checks.ca_bundle_check import main, missing_bundle

ROOT = Path(__file__).resolve().parents[2]
BUNDLE = "certs/rds-global-bundle.pem"


@pytest.fixture
def clone(tmp_path: Path) -> Path:
    """The template and samconfig.toml of this repository, with no CA bundle."""
    shutil.copy(ROOT / "template.yaml", tmp_path / "template.yaml")
    shutil.copy(ROOT / "framework.yaml", tmp_path / "framework.yaml")
    shutil.copy(ROOT / "samconfig.toml", tmp_path / "samconfig.toml")
    (tmp_path / "functions").mkdir()
    return tmp_path


def test_a_clean_clone_stops_with_one_line_that_says_where_to_get_the_bundle(
    clone: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given a clone without functions/certs/rds-global-bundle.pem, deployed with the defaults
    # When the check runs, Then it fails with one line naming the file, the mode and the doc
    assert main(["--root", str(clone)]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1
    assert f"functions/{BUNDLE}" in lines[0]
    assert "DatabaseSslMode=verify-full" in lines[0]
    assert "`infrai-jobs docs configuration`" in lines[0]


def test_the_bundle_in_place_lets_the_build_go_on(clone: Path) -> None:
    (clone / "functions" / "certs").mkdir()
    (clone / "functions" / BUNDLE).write_text("-----BEGIN CERTIFICATE-----\n")
    assert missing_bundle(clone) is None


def test_a_deploy_section_that_opts_out_of_verification_needs_no_bundle(clone: Path) -> None:
    # Given a config environment whose deploy overrides DatabaseSslMode to require
    samconfig = clone / "samconfig.toml"
    samconfig.write_text(
        samconfig.read_text()
        + '\n[nocheck.deploy.parameters]\nparameter_overrides = "DatabaseSslMode=require"\n'
    )
    # Then that environment's build needs no bundle, and the default one still does
    assert missing_bundle(clone, "nocheck") is None
    assert missing_bundle(clone) is not None


def test_a_deploy_section_naming_another_bundle_is_checked_for_that_file(clone: Path) -> None:
    samconfig = clone / "samconfig.toml"
    samconfig.write_text(
        samconfig.read_text()
        + '\n[own.deploy.parameters]\nparameter_overrides = "DatabaseCaBundle=certs/our-ca.pem"\n'
    )
    line = missing_bundle(clone, "own")
    assert line is not None
    assert "functions/certs/our-ca.pem" in line


def test_make_build_runs_the_check_first_and_ci_turns_it_off() -> None:
    # Given the Makefile and CI's script
    makefile = (ROOT / "Makefile").read_text()
    # Then build's first prerequisite is the check, and CI's build (never deployed) skips it
    assert re.search(r"^build: ca-bundle-check ", makefile, re.M)
    assert "-m infrai_local.checks.ca_bundle_check" in makefile
    assert "make build CA_BUNDLE_CHECK=off" in (ROOT / ".ci" / "run").read_text()


def test_the_module_runs_as_make_runs_it(clone: Path) -> None:
    completed = run_captured(
        [sys.executable, "-m", "infrai_local.checks.ca_bundle_check", "--root", str(clone)]
    )
    assert completed.returncode == 1
    assert "Traceback" not in completed.stderr
    assert completed.stderr.startswith("build-check: DatabaseSslMode=verify-full")


def test_a_failed_download_that_left_an_empty_file_stops_the_build(clone: Path) -> None:
    # Given what `curl --create-dirs -o` leaves when the download fails: the folder, and an
    # empty file or one without a certificate (an error page)
    (clone / "functions" / "certs").mkdir()
    for text in ("", "<html>404</html>\n"):
        (clone / "functions" / BUNDLE).write_text(text)
        # When the check runs, Then it stops the build and says what it found
        found = missing_bundle(clone)
        assert found is not None
        assert "is empty or holds no certificate" in found
