"""`infrai-jobs build-check` reads the project once before its checks, and `infrai-jobs docs`
serves the pages the messages name (a page docs/ holds is `infrai-jobs docs` and its name) and
the changelog the package ships, whose pages link only to what the package holds."""

from __future__ import annotations

import posixpath
import re
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import pytest

from infrai_local import cli, project

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def made(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "p"
    project.init(folder, "payments-jobs")
    monkeypatch.chdir(folder)
    return folder


def test_an_unreadable_samconfig_is_one_line_not_one_per_check(
    made: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given a samconfig.toml broken by an edit
    with (made / "samconfig.toml").open("a") as samconfig:
        samconfig.write("garbage [[\n")
    # When the build's checks run
    code = cli.main(["build-check"])
    # Then one line says why, exit 2, and no check ran
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1, err
    assert err[0].startswith("error: cannot read ")
    assert "samconfig.toml" in err[0]


def test_an_environment_samconfig_lacks_is_refused_not_judged_on_defaults(
    made: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # When the checks run for a misspelt environment
    code = cli.main(["build-check", "--config-env", "prd"])
    # Then it is refused, naming the environments there are
    out = capsys.readouterr()
    assert code == 2
    assert out.err.strip() == (
        "error: samconfig.toml has no [prd] environment (it has default): its deploy would "
        "take only the template's defaults"
    )
    assert out.out == ""


def test_build_check_run_by_hand_speaks_as_build_check_not_as_make_build(
    made: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given a new project, whose deploy verifies the ledger's server with a CA bundle it lacks
    # When its checks are run by hand, not by `make build`
    code = cli.main(["build-check", "--skip", "job-settings"])
    # Then the refusal is the command's own line, naming no make target that did not run
    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith("build-check: DatabaseSslMode=verify-full needs the ledger's CA bundle")
    assert "make build" not in err


def test_docs_lists_every_page_and_prints_one_by_any_spelling(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["docs"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()[:-1]]
    assert listed == sorted([*(page.stem for page in (ROOT / "docs").glob("*.md")), "changelog"])
    expected = (ROOT / "docs" / "jobs.md").read_text()
    for spelling in ("jobs", "jobs.md", "docs/jobs.md"):
        assert cli.main(["docs", spelling]) == 0
        assert capsys.readouterr().out == expected


def test_an_unknown_page_is_refused_naming_the_pages(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["docs", "nope"]) == 2
    assert capsys.readouterr().err.startswith("error: no documentation page 'nope': the pages are ")


def test_every_page_a_check_names_is_served() -> None:
    # Given the pages the build checks' messages send a team to
    checks = (ROOT / "local" / "infrai_local" / "checks").glob("*.py")
    named = {
        m for path in checks for m in re.findall(r"infrai-jobs docs ([a-z-]+)", path.read_text())
    }
    # Then each is a page `infrai-jobs docs` serves
    assert named
    assert named <= set(project.docs_pages())


def test_docs_changelog_prints_the_changelog_the_package_ships(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Given the changelog the package ships (the one `upgrade` quotes from)
    expected = (ROOT / "local" / "infrai_local" / "CHANGELOG.md").read_text()
    # When it is asked for by its page name or its file's
    for spelling in ("changelog", "CHANGELOG.md"):
        assert cli.main(["docs", spelling]) == 0
        # Then it is printed whole
        assert capsys.readouterr().out == expected
    # And the list of pages names it, with its title
    assert cli.main(["docs"]) == 0
    assert re.search(r"^changelog +Changelog$", capsys.readouterr().out, re.M)


def shipped_links(page: Path) -> list[str]:
    """The relative links of a page, outside code blocks and code spans."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return [
        target
        for target in re.findall(r"\]\(\s*<?([^)\s>]+)", text)
        if not re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) and not target.startswith("#")
    ]


def test_every_link_of_a_shipped_page_reaches_a_file_the_package_ships() -> None:
    # Given what the package ships beside its pages, and the pages (the changelog one of them)
    # as `infrai-jobs docs` prints them in a team's project, which has none of this
    # repository's other files
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    shipped = setuptools["package-data"]["infrai_local"]
    package = ROOT / "local" / "infrai_local"
    pages = {f"docs/{page.name}": page for page in sorted((ROOT / "docs").glob("*.md"))}
    leaving = []
    for name, page in {**pages, "CHANGELOG.md": ROOT / "CHANGELOG.md"}.items():
        for target in shipped_links(page):
            # When a link is followed from the page's place in the package
            path = posixpath.normpath(
                posixpath.join(posixpath.dirname(name), target.split("#", 1)[0])
            )
            # Then it reaches a file the package ships, not one only this repository has
            if (
                not any(fnmatch(path, pattern) for pattern in shipped)
                or not (package / path).is_file()
            ):
                leaving.append(f"{name}: ({target})")
    assert leaving == [], "links the package cannot follow:\n" + "\n".join(leaving)
