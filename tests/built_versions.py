"""Versions of the framework built as a team gets them, and virtualenvs that run them.

``source_copy`` copies what a clean clone holds, symbolic links kept as links (the shipped
``framework.yaml`` and ``CHANGELOG.md`` are links to the repository's own files, and a copy
that followed them would prove nothing about the build). ``build_wheel`` runs ``python -m
build`` as ``make dist`` does, into a folder of its own. ``fresh_venv`` makes a virtualenv
without pip and installs one wheel into it (``install_wheel``) with this virtualenv's pip
(``--python``), offline and without dependencies: a ``.pth`` line names this virtualenv's
site-packages for those, as
tests/e2e/test_dist.py explains (a ``.pth`` line adds a folder, whose own ``.pth`` files, the
editable install's and the one naming this repository's functions/, are not read, so the fresh
interpreter imports the wheel and no ``jobs`` package). ``run_cli`` and ``team_make`` run a
virtualenv's ``infrai-jobs`` and a project's Makefile as a team would. Importable from every
test folder.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from child_process import clean_env, run_captured
from git_files import ROOT, git_files


def builder_env() -> dict[str, str]:
    """This environment (the package index's settings included), minus what would point the
    build or a child interpreter at this checkout's code."""
    return {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "INFRAI_JOBS_PATH"}}


def source_copy(destination: Path) -> Path:
    """The files git tracks or would track, copied to ``destination``, links kept."""
    for path in git_files():
        copy = destination / path.relative_to(ROOT)
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, copy, follow_symlinks=False)
    return destination


def build_wheel(source: Path, out: Path) -> Path:
    """The wheel of the tree at ``source``, built in ``out``."""
    shutil.rmtree(source / "infrai_jobs.egg-info", ignore_errors=True)
    built = run_captured(
        [sys.executable, "-m", "build", "--wheel", "--outdir", str(out), str(source)],
        env=builder_env(),
        timeout=240,
    )
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (wheel,) = out.glob("infrai_jobs-*.whl")
    return wheel


def fresh_venv(folder: Path, wheel: Path) -> Path:
    """A virtualenv at ``folder`` without pip, ``wheel`` installed in it; its ``bin`` folder."""
    made = run_captured([sys.executable, "-m", "venv", "--without-pip", str(folder)])
    assert made.returncode == 0, made.stderr
    install_wheel(folder / "bin", wheel)
    return folder / "bin"


def install_wheel(bin_dir: Path, wheel: Path) -> None:
    """Install ``wheel``'s version in the virtualenv of ``bin_dir`` (over the one it has), by
    name and version from the wheel's folder, as ``pip install --find-links`` would; then name
    this virtualenv's site-packages for its dependencies. The name is left out while pip runs,
    or pip would take this virtualenv's editable install for an installed version."""
    site = run_captured(
        [str(bin_dir / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]
    )
    dependencies = Path(site.stdout.strip()) / "project_dependencies.pth"
    dependencies.unlink(missing_ok=True)
    version = wheel.name.split("-")[1]
    installed = run_captured(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(bin_dir / "python"),
            "install",
            "--quiet",
            "--no-deps",
            "--no-index",
            "--find-links",
            str(wheel.parent),
            f"infrai-jobs[local]=={version}",
        ],
        env=builder_env(),
        timeout=120,
    )
    assert installed.returncode == 0, installed.stdout + installed.stderr
    dependencies.write_text(sysconfig.get_path("purelib") + "\n")


# The two jobs: a database one, and an external one with a setting, a retry policy, a
# rate limit and a concurrency key.
TWO_JOBS = (
    ("ledger.entry", "--effect", "database", "--identity", "entry_id"),
    (
        "payout.send",
        "--effect",
        "external",
        "--identity",
        "payout_id",
        "--setting",
        "PAYOUT_URL",
        "--retry-attempts",
        "5",
        "--rate-per-second",
        "10",
        "--concurrency-key",
        "account_id",
    ),
)


def team_project(bin_dir: Path, folder: Path, stack: str) -> Path:
    """``infrai-jobs init folder --name stack`` with the virtualenv of ``bin_dir``, whose
    ``make venv`` is then taken as done (the project's functions/ on its path, its stamp), and
    the two jobs added with ``new-job``."""
    made = run_captured([str(bin_dir / "infrai-jobs"), "init", str(folder), "--name", stack])
    assert made.returncode == 0, made.stderr
    mark_venv_installed(bin_dir, folder)
    for job in TWO_JOBS:
        added = run_captured(
            [str(bin_dir / "infrai-jobs"), "new-job", *job], env=clean_env(), cwd=folder
        )
        assert added.returncode == 0, added.stdout + added.stderr
    return folder


def mark_venv_installed(bin_dir: Path, project: Path) -> None:
    """What the project's ``make venv`` does after pip: the functions' code root on the
    virtualenv's path, and its stamp for the pinned version."""
    site = run_captured(
        [str(bin_dir / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]
    )
    (Path(site.stdout.strip()) / "team_jobs.pth").write_text(f"{project / 'functions'}\n")
    pin = (project / "layers" / "common" / "requirements.txt").read_text()
    version = pin.rsplit("infrai-jobs==", 1)[1].strip()
    (bin_dir.parent / f".installed-{version}").touch()


def run_cli(
    bin_dir: Path, *args: str, cwd: Path, timeout: float = 180, **env: str
) -> tuple[int, str, str]:
    """``infrai-jobs args`` of the virtualenv of ``bin_dir``, in ``cwd``, with only ``env``
    beyond the bare environment: its exit code, stdout and stderr."""
    ran = run_captured(
        [str(bin_dir / "infrai-jobs"), *args], env=clean_env(**env), cwd=cwd, timeout=timeout
    )
    return ran.returncode, ran.stdout, ran.stderr


def team_make(bin_dir: Path, project: Path, target: str) -> subprocess.CompletedProcess[str]:
    """``make target`` in ``project`` with the virtualenv of ``bin_dir`` as its own, which must
    pass."""
    ran = run_captured(
        ["make", target, f"VENV={bin_dir.parent}"], env=clean_env(), cwd=project, timeout=300
    )
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    return ran
