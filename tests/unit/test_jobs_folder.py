"""How the CLI imports the team's jobs package: as every function does, ``import jobs`` from the
functions' code root, with ``--jobs-path`` / ``INFRAI_JOBS_PATH`` as the one explicit override."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from infrai_jobs.errors import ConfigurationError
from infrai_local import jobs_package
from infrai_local.jobs_package import code_root, import_jobs, project_root

ROOT = Path(__file__).resolve().parents[2]

_WHICH_JOBS = (
    "import sys; from infrai_local.jobs_package import import_jobs, load_registry; "
    "print(import_jobs(sys.argv[1] if len(sys.argv) > 1 else None).__file__); "
    "print(sorted(job.name for job in load_registry('')))"
)


def code_root_with_jobs(root: Path, job: str) -> Path:
    """A code root laid out like functions/, whose jobs package registers one job."""
    (root / "jobs").mkdir(parents=True)
    (root / "jobs" / "__init__.py").write_text(
        "from infrai_jobs.jobs.registry import Effect, JobRegistry\n"
        "def build_registry():\n"
        "    registry = JobRegistry()\n"
        f"    registry.job({job!r}, effect=Effect.DATABASE, identity=('id',))(lambda p, c: None)\n"
        "    return registry\n"
    )
    return root


def which_jobs(cwd: Path, *argv: str, **env: str) -> list[str]:
    """What a fresh process started in ``cwd`` imports as ``jobs``: its file, its job names."""
    finished = subprocess.run(
        [sys.executable, "-c", _WHICH_JOBS, *argv],
        cwd=cwd,
        env={"PATH": "/usr/bin:/bin", **env},
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert finished.returncode == 0, finished.stderr
    return finished.stdout.splitlines()


@pytest.fixture(autouse=True)
def no_jobs_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(jobs_package.JOBS_PATH_ENV, raising=False)


def test_away_from_the_project_the_installed_package_is_the_functions_own(tmp_path: Path) -> None:
    # Given a process started in a folder that is not the project
    # When it imports the jobs package the way the CLI does
    origin, names = which_jobs(tmp_path)
    # Then it is functions/jobs, the package every function imports, whichever jobs it holds
    assert Path(origin) == ROOT / "functions" / "jobs" / "__init__.py"
    assert names.startswith("[")


def test_the_code_root_and_project_are_where_lambda_and_the_template_expect_them() -> None:
    assert code_root() == ROOT / "functions"
    assert project_root() == ROOT
    assert (project_root() / "template.yaml").is_file()


def test_a_jobs_path_is_imported_ahead_of_the_installed_package(tmp_path: Path) -> None:
    # Given another code root whose jobs package registers its own job
    other = code_root_with_jobs(tmp_path / "other", "other.job")
    # When a process imports jobs with --jobs-path naming it, or with INFRAI_JOBS_PATH
    by_option = which_jobs(tmp_path, str(other))
    by_variable = which_jobs(tmp_path, INFRAI_JOBS_PATH=str(other))
    # Then that package is the one imported, in both cases
    for origin, names in (by_option, by_variable):
        assert Path(origin) == other / "jobs" / "__init__.py"
        assert names == "['other.job']"


def test_a_named_folder_without_jobs_is_refused_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ConfigurationError, match=r"--jobs-path .* holds no jobs package"):
        import_jobs(str(tmp_path))
    monkeypatch.setenv(jobs_package.JOBS_PATH_ENV, str(tmp_path))
    with pytest.raises(ConfigurationError, match=r"INFRAI_JOBS_PATH .* holds no jobs package"):
        import_jobs()
