"""Where the CLI looks for the drain's jobs package, and how it refuses a wrong one."""

from __future__ import annotations

from pathlib import Path

import pytest

from infrai_jobs.errors import ConfigurationError
from infrai_local import jobs_package
from infrai_local.jobs_package import find_jobs_folder, load_registry


def project(root: Path) -> Path:
    """A project tree holding functions/drain/jobs; returns its functions/drain."""
    folder = root / "functions" / "drain"
    (folder / "jobs").mkdir(parents=True)
    (folder / "jobs" / "__init__.py").write_text("")
    return folder


@pytest.fixture(autouse=True)
def no_jobs_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(jobs_package.JOBS_PATH_ENV, raising=False)


def test_the_project_is_found_from_a_folder_below_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = project(tmp_path / "proj")
    below = tmp_path / "proj" / "docs" / "runbooks"
    below.mkdir(parents=True)
    monkeypatch.chdir(below)
    assert find_jobs_folder() == folder.resolve()


def test_the_option_comes_before_the_variable_and_the_variable_before_the_project(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    option, variable = project(tmp_path / "a"), project(tmp_path / "b")
    monkeypatch.chdir(project(tmp_path / "c").parents[1])
    monkeypatch.setenv(jobs_package.JOBS_PATH_ENV, str(variable))
    assert find_jobs_folder(str(option)) == option.resolve()
    assert find_jobs_folder() == variable.resolve()


def test_a_named_folder_without_jobs_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match=r"--jobs-path .* holds no jobs package"):
        find_jobs_folder(str(tmp_path))


def test_with_nothing_anywhere_the_error_says_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(jobs_package, "_INSTALLED_FROM", tmp_path / "elsewhere")
    with pytest.raises(ConfigurationError, match="pass --jobs-path FOLDER or set INFRAI_JOBS_PATH"):
        find_jobs_folder()


def test_a_jobs_module_already_imported_from_elsewhere_is_not_taken_for_this_one(
    tmp_path: Path,
) -> None:
    # The test path already imported functions/drain's jobs; another folder's must not be
    # answered with it.
    import jobs  # noqa: PLC0415, F401 - the project's, on the test path

    with pytest.raises(ConfigurationError, match="another module named jobs"):
        load_registry(project(tmp_path).resolve(), "")
