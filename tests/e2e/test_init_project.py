"""`infrai-jobs init` makes a team's own project, which works on the installed package alone.

The package is this tree's wheel in a fresh virtualenv (tests/built_versions.py says how, in a
few seconds and offline). In the project it makes, `new-job` adds the issue's two jobs, the
project's tests pass through its Makefile, `infrai-jobs invoke` sees the framework's functions
through the nested template, and cfn-lint passes on both templates.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from built_versions import (
    fresh_venv,
    mark_venv_installed,
    run_cli,
    team_make,
    team_project,
)
from child_process import run_captured

import infrai_jobs

ROOT = Path(__file__).resolve().parents[2]
VERSION = infrai_jobs.__version__


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This tree's wheel in a fresh virtualenv: its bin folder."""
    return fresh_venv(tmp_path_factory.mktemp("installed") / "venv", wheel)


@pytest.fixture(scope="module")
def project(installed: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return team_project(installed, tmp_path_factory.mktemp("team") / "payments", "payments-jobs")


@pytest.mark.slow
def test_init_writes_the_layout_and_no_framework_code(project: Path) -> None:
    # Then the project holds the team's files and the two the framework owns
    for name in (
        "template.yaml",
        "framework.yaml",
        "samconfig.toml",
        "layers/common/requirements.txt",
        "functions/jobs/__init__.py",
        "functions/jobs/ledger_entry.py",
        "functions/jobs/payout_send.py",
        "tests/conftest.py",
        "tests/unit/test_jobs_import_public_api.py",
        "events/drain-schedule.json",
        "events/redrive-dry-run.json",
        "events/redrive.json",
        "events/env.json",
        "Makefile",
        "README.md",
        ".gitignore",
    ):
        assert (project / name).is_file(), name
    # And no module of the framework: no infrai_jobs or infrai_local folder, no handler copy
    files = [p.relative_to(project).as_posix() for p in project.rglob("*") if p.is_file()]
    assert [f for f in files if "infrai_jobs" in f or "infrai_local" in f] == []
    assert sorted(f for f in files if f.startswith("layers/")) == ["layers/common/requirements.txt"]
    # And framework.yaml is the shipped template under its generated lines, the pin this version
    framework = (project / "framework.yaml").read_text()
    header, _, body = framework.partition("\n# ledger migrations: ")
    assert header.startswith(f"# infrai-jobs {VERSION}: the framework's resources.")
    assert body.split("\n", 1)[1] == (ROOT / "framework.yaml").read_text()
    pin = (project / "layers/common/requirements.txt").read_text().splitlines()
    assert f"infrai-jobs=={VERSION}" in pin
    # And samconfig.toml names the stack, with the nested application's capability
    samconfig = (project / "samconfig.toml").read_text()
    assert 'stack_name = "payments-jobs"' in samconfig
    assert "CAPABILITY_AUTO_EXPAND" in samconfig


@pytest.mark.slow
def test_init_refuses_a_folder_in_use_and_a_bad_stack_name(
    installed: Path, project: Path, tmp_path: Path
) -> None:
    # When init is pointed at a folder that holds files, or given a name CloudFormation refuses
    new = str(tmp_path / "new")
    used, _, used_err = run_cli(
        installed, "init", str(project), "--name", "payments-jobs", cwd=tmp_path
    )
    bad, _, bad_err = run_cli(installed, "init", new, "--name", "payments_jobs!", cwd=tmp_path)
    # Then each is one line on stderr, exit 2, and nothing is written
    assert (used, bad) == (2, 2)
    assert "is not an empty folder" in used_err
    assert "stack name 'payments_jobs!'" in bad_err
    assert "Traceback" not in used_err + bad_err
    assert not (tmp_path / "new").exists()


@pytest.mark.slow
def test_the_projects_own_tests_pass_through_its_makefile(installed: Path, project: Path) -> None:
    # When the team runs `make test` (its virtualenv already made)
    ran = team_make(installed, project, "test")
    # Then the scaffolded jobs' tests and the public-import check pass
    assert "test_jobs_import_public_api.py ." in ran.stdout
    assert "test_job_payout_send.py" in ran.stdout
    assert " failed" not in ran.stdout


@pytest.mark.slow
def test_the_projects_demo_runs_its_jobs_on_the_local_stand_ins(
    installed: Path, project: Path
) -> None:
    # When the team runs `make demo`
    ran = team_make(installed, project, "demo")
    # Then each sample payload was published once and drained done
    summary = json.loads(ran.stdout.strip().splitlines()[-1])
    assert (summary["consumed"], summary["done"], summary["acked"]) == (2, 2, 2)


@pytest.mark.slow
def test_the_projects_demo_before_any_job_says_there_is_none_yet(
    wheel: Path, tmp_path: Path
) -> None:
    # Given a project just made, with no job yet (in a virtualenv of its own: the module's
    # names the other project's jobs)
    bin_dir = fresh_venv(tmp_path / "venv", wheel)
    folder = tmp_path / "payments"
    code, _, err = run_cli(bin_dir, "init", str(folder), "--name", "payments-jobs", cwd=tmp_path)
    assert code == 0, err
    mark_venv_installed(bin_dir, folder)
    # When the team runs `make demo`
    ran = team_make(bin_dir, folder, "demo")
    # Then it says there is no job to run yet and how to add one, and drains nothing
    said = ran.stdout + ran.stderr
    assert "no jobs yet" in said
    assert "new-job" in said
    assert "QUEUE_NOT_FOUND" not in said


@pytest.mark.slow
def test_the_frameworks_demo_and_example_data_name_the_example_jobs_a_project_lacks(
    installed: Path, project: Path
) -> None:
    # When the team runs the commands that tell the framework's story with its example jobs
    for command in ("demo", "example-data"):
        code, out, err = run_cli(installed, command, cwd=project)
        # Then each says it needs the example jobs, which the project does not have, and points
        # at the project's own `make demo`, in one line, exit 2; no database was started
        assert code == 2, out + err
        assert err.startswith("error: "), err
        assert len(err.strip().splitlines()) == 1, err
        assert "example jobs" in err
        assert "invoice.finalize" in err
        assert "`make demo`" in err
        assert "migrate" not in err
        assert "database:" not in err


@pytest.mark.slow
def test_cfn_lint_passes_on_both_templates(project: Path) -> None:
    cfn_lint = Path(sys.executable).parent / "cfn-lint"
    linted = run_captured([str(cfn_lint), "template.yaml", "framework.yaml"], cwd=project)
    assert linted.returncode == 0, linted.stdout + linted.stderr


@pytest.mark.slow
def test_the_team_template_passes_the_framework_parameters_by_the_same_name(
    project: Path,
) -> None:
    # Given the team's template, read as invoke and the build checks read it
    from infrai_local.sam_template import function_names, load_template  # noqa: PLC0415

    template = load_template(project / "template.yaml")
    # Then the framework's functions are in one view with the team's parameters
    assert "DrainFunction" in function_names(template)
    assert template["Parameters"]["QueueName"]["Default"] == "payments-jobs"
    assert "Framework" not in template["Resources"]


@pytest.mark.slow
def test_invoke_runs_the_drain_function_of_the_nested_template(
    installed: Path, project: Path
) -> None:
    # When the team invokes DrainFunction with the schedule's event, nothing real configured
    code, out, err = run_cli(
        installed, "invoke", "DrainFunction", "--event", "events/drain-schedule.json", cwd=project
    )
    # Then the handler ran in the sandbox and returned its summary
    assert code == 0, out[-3000:] + err[-3000:]
    assert "errorType" not in out


@pytest.mark.slow
def test_build_check_refuses_the_placeholder_of_a_jobs_setting(
    installed: Path, project: Path
) -> None:
    # When the team runs the checks its `make build` runs, with new-job's placeholders in place
    code, out, err = run_cli(installed, "build-check", "--skip", "ca-bundle", cwd=project)
    # Then the build would stop, naming the setting and its job, and no traceback is shown
    assert code == 1, out + err
    assert "PAYOUT_URL (for payout.send)" in err
    assert "Traceback" not in err
    # And with that check left out too (a build never deployed) the rest pass
    code, out, err = run_cli(
        installed, "build-check", "--skip", "ca-bundle", "--skip", "job-settings", cwd=project
    )
    assert code == 0, out + err
