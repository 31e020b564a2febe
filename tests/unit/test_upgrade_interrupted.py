"""`infrai-jobs upgrade` stopped between its two files: the next run finishes it and names every
ledger migration, since framework.yaml no longer records the old version's."""

from __future__ import annotations

import re
from pathlib import Path

from infrai_jobs import __version__
from infrai_local import project
from infrai_local.migrations import LEDGER_MIGRATIONS

PIN = Path("layers/common/requirements.txt")


def _as_if_at(folder: Path, version: str, *, framework_version: str, known: int) -> None:
    """The project pinned at ``version``, its framework.yaml recording ``framework_version`` and
    the first ``known`` ledger migrations."""
    pin = folder / PIN
    pin.write_text(pin.read_text().replace(f"=={__version__}", f"=={version}"))
    framework = folder / "framework.yaml"
    text = framework.read_text()
    text = text.replace(f"# infrai-jobs {__version__}:", f"# infrai-jobs {framework_version}:", 1)
    migrations = " ".join(str(m.version) for m in LEDGER_MIGRATIONS[:known])
    text = re.sub(
        r"^# ledger migrations: .*$",
        f"# ledger migrations: {migrations}",
        text,
        count=1,
        flags=re.M,
    )
    framework.write_text(text)


def test_an_upgrade_names_the_migrations_the_old_version_lacked(tmp_path: Path) -> None:
    # Given a project whose pin and framework.yaml both say 0.1.0, with all migrations but one
    project.init(tmp_path / "p", "payments-jobs")
    _as_if_at(tmp_path / "p", "0.1.0", framework_version="0.1.0", known=len(LEDGER_MIGRATIONS) - 1)
    # When it is upgraded
    done = project.upgrade(tmp_path / "p")
    # Then exactly the last migration is named, and both files are at this version
    last = LEDGER_MIGRATIONS[-1]
    assert done.migrations == [f"ledger {last.version:04d}: {last.name}"]
    assert project.pinned_version(tmp_path / "p") == __version__
    assert (tmp_path / "p" / "framework.yaml").read_text() == project.framework_text()
    assert not list((tmp_path / "p").rglob("*.upgrading"))


def test_an_upgrade_stopped_after_framework_yaml_names_every_migration(tmp_path: Path) -> None:
    # Given an upgrade from 0.1.0 that rewrote framework.yaml and stopped before the pin
    project.init(tmp_path / "p", "payments-jobs")
    _as_if_at(tmp_path / "p", "0.1.0", framework_version=__version__, known=len(LEDGER_MIGRATIONS))
    # When upgrade runs again
    done = project.upgrade(tmp_path / "p")
    # Then it finishes (the pin moves) and names every ledger migration, not none: migrate
    # applies only the missing ones, and an upgrade report that said "nothing" would be wrong
    assert project.pinned_version(tmp_path / "p") == __version__
    assert len(done.migrations) == len(LEDGER_MIGRATIONS)
