"""The files of this checkout that git tracks or would track (new ones, not the ignored):
what a clean clone would hold. Importable from every test folder, as ``child_process`` is."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def git_files() -> list[Path]:
    """Those files, as paths under ``ROOT``; ``OSError`` or ``subprocess.SubprocessError``
    where git is missing or this is not a git checkout."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
        timeout=30,
    ).stdout.decode()
    paths = [ROOT / name for name in listed.split("\0") if name]
    # A link is one entry to git, even a link to a folder (the tools package's docs/).
    return [path for path in paths if path.is_file() or path.is_symlink()]
