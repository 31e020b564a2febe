"""`infrai-jobs init` stopped half-way (Ctrl-C while it writes) leaves nothing behind, so the
same command run again makes the whole project."""

from __future__ import annotations

from pathlib import Path

import pytest

from infrai_jobs.errors import ConfigurationError
from infrai_local import project


def test_an_init_stopped_while_writing_leaves_no_folder_and_runs_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given an init that is interrupted at its fifth file
    real_write = Path.write_text
    calls = []

    def interrupted(self: Path, text: str, *args: object, **kwargs: object) -> int:
        calls.append(self)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real_write(self, text, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "write_text", interrupted)
    with pytest.raises(KeyboardInterrupt):
        project.init(tmp_path / "p", "payments-jobs")
    monkeypatch.undo()
    # Then neither the project's folder nor a half-written one is there
    assert list(tmp_path.iterdir()) == []
    # And init run again writes the whole project, readable as the user's umask allows
    written = project.init(tmp_path / "p", "payments-jobs")
    assert all(path.is_file() for path in written)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p"]
    assert (tmp_path / "p").stat().st_mode & 0o755 == 0o755


def test_init_into_an_empty_folder_that_exists_still_works(tmp_path: Path) -> None:
    (tmp_path / "p").mkdir()
    written = project.init(tmp_path / "p", "payments-jobs")
    assert (tmp_path / "p" / "template.yaml") in written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p"]


def test_a_folder_filled_meanwhile_is_refused_and_left_as_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given another init (or anything) filling the folder while this one writes its own
    target = tmp_path / "p"
    real_chmod = Path.chmod

    def meanwhile(self: Path, mode: int) -> None:
        real_chmod(self, mode)
        target.mkdir(exist_ok=True)
        (target / "theirs.txt").write_text("theirs")

    monkeypatch.setattr(Path, "chmod", meanwhile)
    # When init puts its project in place, then it refuses, naming the folder
    with pytest.raises(ConfigurationError, match="filled by something else meanwhile"):
        project.init(target, "payments-jobs")
    # And the other's folder is as it left it, with nothing of this init beside it
    assert [path.name for path in tmp_path.iterdir()] == ["p"]
    assert [path.name for path in target.iterdir()] == ["theirs.txt"]
