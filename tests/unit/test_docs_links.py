"""Every document the repository points at is in the repository.

Two checks, both on the files git tracks or would track (no sockets, no network):

* every relative link in a Markdown file resolves to a file, and its ``#anchor``, when it has
  one, to a heading of that file (GitHub's rule for heading anchors);
* every ``name.md`` a file cites (code, configuration, the Makefile, CI scripts and the
  Markdown itself) names a file that exists: a path relative to the project root when it has a
  folder, else any tracked file of that name.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

from git_files import ROOT, git_files

# Files whose text may cite documents: code, configuration, build and CI scripts, the docs.
CITING_SUFFIXES = (".py", ".yaml", ".yml", ".toml", ".md", ".cfg", ".ini", ".sh", ".json")
CITING_NAMES = ("Makefile",)
CITING_FOLDERS = (".ci",)
# Generated results, not prose: they quote whatever a past run printed.
SKIPPED_FOLDERS = ("bench/results",)

_FENCE = re.compile(r"^(```|~~~)")
_INLINE_CODE = re.compile(r"`+[^`]*`+")
# [text](target "title") and ![alt](target); the text may hold one level of brackets.
_INLINE_LINK = re.compile(
    r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)"
)
_REFERENCE_DEFINITION = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
_CITED_DOCUMENT = re.compile(r"(?<![\w./-])((?:\.{0,2}/)?(?:[\w.-]+/)*[\w-]+\.md)\b")


def tracked_files() -> list[Path]:
    """The files git tracks or would track (new, not ignored), or, outside a git checkout, every
    file not in a hidden folder; a symbolic link (the package's CHANGELOG.md) is checked where
    it points, from the folder of the file it names, not a second time from its own."""
    try:
        return [path for path in git_files() if not path.is_symlink()]
    except (OSError, subprocess.SubprocessError):
        return [
            path
            for path in ROOT.rglob("*")
            if path.is_file() and not any(part.startswith(".") for part in path.parts[-4:-1])
        ]


def relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def prose_lines(text: str) -> Iterator[tuple[int, str]]:
    """Markdown lines outside fenced code blocks, inline code removed."""
    fenced = False
    for number, line in enumerate(text.splitlines(), start=1):
        if _FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            yield number, _INLINE_CODE.sub("", line)


def github_anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, no punctuation, spaces as hyphens."""
    text = re.sub(r"<[^>]+>", "", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors_of(markdown: Path) -> set[str]:
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in markdown.read_text(encoding="utf-8").splitlines():
        if _FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if fenced:
            continue
        anchors.update(_HTML_ANCHOR.findall(line))
        heading = _HEADING.match(line)
        if heading:
            anchor = github_anchor(heading.group(2))
            count = seen.get(anchor, 0)
            seen[anchor] = count + 1
            anchors.add(anchor if count == 0 else f"{anchor}-{count}")
    return anchors


def links_of(markdown: Path) -> Iterator[tuple[int, str]]:
    for number, line in prose_lines(markdown.read_text(encoding="utf-8")):
        for target in _INLINE_LINK.findall(line):
            yield number, target
        definition = _REFERENCE_DEFINITION.match(line)
        if definition:
            yield number, definition.group(1)


def broken_link(markdown: Path, target: str) -> str | None:
    """Why ``target`` (a link in ``markdown``) leads nowhere, or None when it resolves."""
    if _SCHEME.match(target) or target.startswith("//"):
        return None
    path_part, _, anchor = target.partition("#")
    path_part = path_part.split("?", 1)[0]
    destination = (markdown.parent / path_part).resolve() if path_part else markdown
    if not destination.exists():
        return "no such file"
    if ROOT not in destination.parents and destination != ROOT:
        return "outside the repository"
    is_markdown = destination.is_file() and destination.suffix == ".md"
    if anchor and is_markdown and anchor not in anchors_of(destination):
        return f"no heading with anchor #{anchor} in {relative(destination)}"
    return None


def citing_files(files: list[Path]) -> list[Path]:
    chosen = []
    for path in files:
        name = relative(path)
        if any(name.startswith(folder + "/") for folder in SKIPPED_FOLDERS):
            continue
        if (
            path.suffix in CITING_SUFFIXES
            or path.name in CITING_NAMES
            or any(name.startswith(folder + "/") for folder in CITING_FOLDERS)
        ):
            chosen.append(path)
    return chosen


def missing_citation(cited: str, citing: Path, files: list[Path]) -> bool:
    """A name without a folder may be any tracked file of that name; a path is read from the
    project root or from the citing file's folder."""
    if "/" not in cited:
        return not any(path.name == cited for path in files)
    return not any((base / cited).resolve().is_file() for base in (ROOT, citing.parent))


def test_the_checks_see_the_project_documents() -> None:
    # Given the tracked files
    files = tracked_files()
    # Then the README and the docs are among them, so the checks below look at something
    names = {relative(path) for path in files}
    assert "README.md" in names
    assert any(name.startswith("docs/") and name.endswith(".md") for name in names)


def test_github_anchors_follow_githubs_rule() -> None:
    # Given headings with code, punctuation and capitals
    # Then their anchors are GitHub's
    assert github_anchor("Latency and scale") == "latency-and-scale"
    assert github_anchor("Second layer cost (`IDEMPOTENCY_BACKEND=dynamodb`)") == (
        "second-layer-cost-idempotency_backenddynamodb"
    )
    assert github_anchor("When the page comes: what to run") == "when-the-page-comes-what-to-run"


def test_every_relative_markdown_link_resolves() -> None:
    # Given every link of every tracked Markdown file
    files = tracked_files()
    broken = []
    for markdown in (path for path in files if path.suffix == ".md"):
        for number, target in links_of(markdown):
            # When it is followed from the file that holds it
            reason = broken_link(markdown, target)
            if reason:
                broken.append(f"{relative(markdown)}:{number}: ({target}) {reason}")
    # Then it reaches a file in the repository, and the heading its anchor names
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_every_cited_document_is_in_the_repository() -> None:
    # Given every `name.md` cited in code, configuration, build scripts and docs
    files = tracked_files()
    missing = []
    for path in citing_files(files):
        if path == Path(__file__).resolve():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        for number, line in enumerate(text.splitlines(), start=1):
            for cited in _CITED_DOCUMENT.findall(line):
                # Then the repository holds that document
                if missing_citation(cited, path, files):
                    missing.append(f"{relative(path)}:{number}: {cited}")
    assert not missing, "documents cited but not in the repository:\n" + "\n".join(missing)
