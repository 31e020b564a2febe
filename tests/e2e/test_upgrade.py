"""The upgrade test: a team's project moves from one built version to the next, untouched.

Two versions are built from this tree as a team gets them (tests/built_versions.py): the base,
this tree as it is, and the next, a copy with the version bumped, a changelog section added, the
framework's template gaining a resource and a parameter, and the ledger gaining a migration. A
project is made by `init` at the base version with the issue's two jobs, its stack renamed and
its database migrated. Then the next version is installed over the base in the team's
virtualenv and `infrai-jobs upgrade` runs: every file the team owns stays byte-identical, the
framework's two files move, `migrate --status` shows the new migration pending, and after
`migrate` the team's tests, a drain and an invoke pass. The base version, in a virtualenv of
its own, still drains on the migrated schema (N-1 on schema N), and refuses, exit 2, having
consumed nothing, once the schema's floor is above it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
from built_versions import (
    build_wheel,
    fresh_venv,
    install_wheel,
    mark_venv_installed,
    run_cli,
    source_copy,
    team_make,
    team_project,
)

import infrai_jobs
from infrai_local.sandbox import emulator, provider_sink
from infrai_local.sandbox.embedded_db import scratch_database

ROOT = Path(__file__).resolve().parents[2]
BASE = infrai_jobs.__version__
_MAJOR, _MINOR, _ = (int(part) for part in BASE.split("."))
NEXT = f"{_MAJOR}.{_MINOR + 1}.0"
LEDGER_FOLDER = Path("layers/common/infrai_jobs/work/migrations")
NEW_MIGRATION = max(int(p.name[:4]) for p in (ROOT / LEDGER_FOLDER).glob("*.sql")) + 1
NEW_RESOURCE = "UpgradeCheckTopic"
NEW_PARAMETER = "UpgradeCheckRetention"
# The framework's two files in a project; everything else is the team's.
FRAMEWORK_FILES = {"framework.yaml", "layers/common/requirements.txt"}
QUEUE = "payments-jobs"


def next_version_tree(source: Path) -> Path:
    """``source`` changed into the next version, as a release would change it."""
    init = source / "layers/common/infrai_jobs/__init__.py"
    init.write_text(init.read_text().replace(f'"{BASE}"', f'"{NEXT}"'))
    changelog = source / "CHANGELOG.md"
    text = changelog.read_text()
    section = (
        f"## {NEXT} — 2027-01-04\n\n### Added\n- {NEW_RESOURCE}, for the upgrade test.\n"
        f"- Ledger migration {NEW_MIGRATION:04d}.\n\n"
    )
    at = text.index("\n## ") + 1
    changelog.write_text(text[:at] + section + text[at:])
    template = source / "framework.yaml"
    text = template.read_text()
    text = text.replace(
        "\nParameters:\n",
        f"\nParameters:\n  {NEW_PARAMETER}:\n    Type: Number\n    Default: 7\n"
        "    Description: Added by the next version.\n",
        1,
    )
    text = text.replace(
        "\nResources:\n", f"\nResources:\n  {NEW_RESOURCE}:\n    Type: AWS::SNS::Topic\n", 1
    )
    template.write_text(text)
    (source / LEDGER_FOLDER / f"{NEW_MIGRATION:04d}_upgrade_check.sql").write_text(
        "CREATE TABLE IF NOT EXISTS infrai_jobs_upgrade_check (id integer PRIMARY KEY);\n"
    )
    return source


@dataclass(frozen=True)
class Upgraded:
    project: Path
    team_bin: Path
    base_bin: Path
    database_url: str
    # The team's files before the upgrade, by path; what the first upgrade printed (--json).
    before: dict[str, bytes]
    report: dict[str, object]


def team_files(project: Path) -> dict[str, bytes]:
    """Every file of the project but the framework's two and what tools leave behind."""
    caches = {"__pycache__", ".pytest_cache", ".ruff_cache"}
    return {
        path.relative_to(project).as_posix(): path.read_bytes()
        for path in sorted(project.rglob("*"))
        if path.is_file()
        and not caches & set(path.relative_to(project).parts)
        and path.relative_to(project).as_posix() not in FRAMEWORK_FILES
    }


@pytest.fixture(scope="module")
def upgraded(
    wheel: Path, tmp_path_factory: pytest.TempPathFactory, pg_server_url: str
) -> Iterator[Upgraded]:
    work = tmp_path_factory.mktemp("upgrade")
    # Given the base version (this tree's wheel) and the next, built as wheels
    base_wheel = wheel
    next_wheel = build_wheel(next_version_tree(source_copy(work / "next")), work / "dist-next")
    assert next_wheel.name == f"infrai_jobs-{NEXT}-py3-none-any.whl"
    base_bin = fresh_venv(work / "venv-base", base_wheel)
    team_bin = fresh_venv(work / "venv-team", base_wheel)
    # And a project made at the base version with the two jobs, its stack renamed, its
    # database migrated
    project = team_project(team_bin, work / "payments", "payments-jobs")
    samconfig = project / "samconfig.toml"
    samconfig.write_text(
        samconfig.read_text().replace('stack_name = "payments-jobs"', 'stack_name = "payouts-eu"')
    )
    with scratch_database(pg_server_url) as database_url:
        code, out, err = run_cli(team_bin, "migrate", cwd=project, DATABASE_URL=database_url)
        assert code == 0, err
        before = team_files(project)
        # When the team installs the next version and runs upgrade
        install_wheel(team_bin, next_wheel)
        code, out, err = run_cli(team_bin, "upgrade", "--json", cwd=project)
        assert code == 0, err
        mark_venv_installed(team_bin, project)
        yield Upgraded(project, team_bin, base_bin, database_url, before, json.loads(out))


@pytest.mark.slow
def test_upgrade_moves_only_the_framework_files(upgraded: Upgraded) -> None:
    project = upgraded.project
    # Then every file the team owns is byte-identical
    assert team_files(project) == upgraded.before
    # And framework.yaml is the next version's, with its new resource; the pin is the next
    framework = (project / "framework.yaml").read_text()
    assert framework.startswith(f"# infrai-jobs {NEXT}: the framework's resources.")
    assert f"\n  {NEW_RESOURCE}:\n    Type: AWS::SNS::Topic\n" in framework
    pin = (project / "layers/common/requirements.txt").read_text().splitlines()
    assert f"infrai-jobs=={NEXT}" in pin
    assert f"infrai-jobs=={BASE}" not in pin


@pytest.mark.slow
def test_upgrade_says_what_changed(upgraded: Upgraded) -> None:
    report = upgraded.report
    assert (report["from"], report["to"], report["upgraded"]) == (BASE, NEXT, True)
    assert report["ledger_migrations_added"] == [f"ledger {NEW_MIGRATION:04d}: upgrade check"]
    assert report["parameters_added"] == [NEW_PARAMETER]
    assert report["parameters_removed"] == []
    changelog = report["changelog"]
    assert isinstance(changelog, list)
    assert changelog[0].startswith(f"## {NEXT} ")
    assert f"- {NEW_RESOURCE}, for the upgrade test." in changelog
    assert not any(line.startswith(f"## {BASE}") for line in changelog)
    # And a second run has nothing to do
    code, out, _ = run_cli(upgraded.team_bin, "upgrade", cwd=upgraded.project)
    assert (code, out) == (0, f"already at infrai-jobs {NEXT}: nothing to do\n")


@pytest.mark.slow
def test_upgrade_refuses_a_downgrade_and_a_folder_that_is_no_project(
    upgraded: Upgraded, tmp_path: Path
) -> None:
    before = (upgraded.project / "framework.yaml").read_bytes()
    code, _, err = run_cli(
        upgraded.base_bin, "upgrade", "--project", str(upgraded.project), cwd=tmp_path
    )
    assert code == 2
    assert f"the installed infrai-jobs {BASE} is older than the project's {NEXT}" in err
    assert (upgraded.project / "framework.yaml").read_bytes() == before
    code, _, err = run_cli(upgraded.team_bin, "upgrade", cwd=tmp_path)
    assert code == 2
    assert "is not an infrai-jobs project" in err
    assert "Traceback" not in err


@pytest.fixture(scope="module")
def migrated(upgraded: Upgraded) -> dict[str, object]:
    """``migrate --status --json`` after the upgrade, then ``migrate``: the status."""
    env = {"DATABASE_URL": upgraded.database_url}
    code, out, err = run_cli(
        upgraded.team_bin, "migrate", "--status", "--json", cwd=upgraded.project, **env
    )
    assert code == 0, err
    status: dict[str, object] = json.loads(out)
    code, out, err = run_cli(upgraded.team_bin, "migrate", cwd=upgraded.project, **env)
    assert code == 0, err
    assert out == f"applied ledger {NEW_MIGRATION:04d}: upgrade check\n"
    return status


@pytest.mark.slow
def test_migrate_status_shows_the_new_migration_pending(migrated: dict[str, object]) -> None:
    assert migrated["code_version"] == NEXT
    pending = [m for m in migrated["migrations"] if m["applied_at"] is None]  # type: ignore[attr-defined]
    assert [(m["owner"], m["version"]) for m in pending] == [("ledger", NEW_MIGRATION)]


@pytest.mark.slow
def test_the_teams_tests_pass_on_the_next_version(
    upgraded: Upgraded, migrated: dict[str, object]
) -> None:
    ran = team_make(upgraded.team_bin, upgraded.project, "test")
    assert " passed" in ran.stdout
    assert " failed" not in ran.stdout


def sample(project: Path, job: str, suffix: str) -> str:
    """The job's sample payload from events/jobs/, its identity made unique with ``suffix``."""
    body = json.loads((project / "events" / "jobs" / f"{job}.json").read_text())
    key = "entry_id" if job == "ledger.entry" else "payout_id"
    body[key] = f"{body[key]}_{suffix}"
    return json.dumps(body)


@pytest.fixture
def queue_env(upgraded: Upgraded) -> Iterator[dict[str, str]]:
    """A fresh emulator and provider sink, and the variables a drain of the project needs."""
    server = emulator.start_in_thread()
    sink = provider_sink.start_in_thread()
    try:
        yield {
            "DATABASE_URL": upgraded.database_url,
            "INFRAI_BASE_URL": server.url,
            "INFRAI_API_KEY": "upgrade-test",
            "INFRAI_QUEUE": QUEUE,
            "INFRAI_DLQ": f"{QUEUE}-dlq",
            "PAYOUT_URL": sink.url,
        }
    finally:
        sink.stop()
        server.stop()


def publish_both(upgraded: Upgraded, env: dict[str, str], suffix: str) -> None:
    for job in ("ledger.entry", "payout.send"):
        code, _, err = run_cli(
            upgraded.team_bin,
            "publish",
            "--create",
            sample(upgraded.project, job, suffix),
            cwd=upgraded.project,
            **env,
        )
        assert code == 0, err


def drained(out: str) -> dict[str, object]:
    summary: dict[str, object] = json.loads(out.strip().splitlines()[-1])
    return summary


@pytest.mark.slow
def test_the_next_version_drains_the_teams_jobs(
    upgraded: Upgraded, migrated: dict[str, object], queue_env: dict[str, str]
) -> None:
    publish_both(upgraded, queue_env, "next")
    code, out, err = run_cli(upgraded.team_bin, "drain", cwd=upgraded.project, **queue_env)
    assert code == 0, err
    summary = drained(out)
    assert (summary["consumed"], summary["done"], summary["acked"]) == (2, 2, 2)


@pytest.mark.slow
def test_the_next_version_invokes_the_drain_function(
    upgraded: Upgraded, migrated: dict[str, object], queue_env: dict[str, str]
) -> None:
    publish_both(upgraded, queue_env, "invoke")
    code, out, err = run_cli(
        upgraded.team_bin,
        "invoke",
        "DrainFunction",
        "--event",
        "events/drain-schedule.json",
        cwd=upgraded.project,
        **queue_env,
    )
    assert code == 0, out[-3000:] + err[-3000:]
    assert '"done": 2' in out


@pytest.mark.slow
def test_the_base_version_still_drains_on_the_migrated_schema(
    upgraded: Upgraded, migrated: dict[str, object], queue_env: dict[str, str]
) -> None:
    # Given the schema the next version migrated, and the base version's code
    publish_both(upgraded, queue_env, "base")
    functions = str(upgraded.project / "functions")
    # When the base version drains
    code, out, err = run_cli(
        upgraded.base_bin, "drain", cwd=upgraded.project, INFRAI_JOBS_PATH=functions, **queue_env
    )
    # Then it runs the team's jobs
    assert code == 0, err
    summary = drained(out)
    assert (summary["consumed"], summary["done"]) == (2, 2)


@pytest.mark.slow
def test_the_base_version_refuses_a_schema_whose_floor_is_above_it(
    upgraded: Upgraded, migrated: dict[str, object], queue_env: dict[str, str]
) -> None:
    # Given a schema whose floor is above the base version
    with psycopg.connect(upgraded.database_url, autocommit=True) as conn:
        (old_floor,) = conn.execute("SELECT floor FROM infrai_jobs_schema_floor").fetchone() or (
            "",
        )
        conn.execute("UPDATE infrai_jobs_schema_floor SET floor = '99.0.0'")
    try:
        publish_both(upgraded, queue_env, "floor")
        functions = str(upgraded.project / "functions")
        # When the base version drains
        code, out, err = run_cli(
            upgraded.base_bin,
            "drain",
            cwd=upgraded.project,
            INFRAI_JOBS_PATH=functions,
            **queue_env,
        )
        # Then it refuses, exit 2, naming both versions
        assert code == 2, out + err
        assert "99.0.0" in err
        assert BASE in err
        # And it consumed nothing: both messages wait, never received
        code, out, err = run_cli(
            upgraded.team_bin, "stats", "--json", cwd=upgraded.project, **queue_env
        )
        assert code == 0, err
        stats = json.loads(out)
        assert (stats["available_count"], stats["in_flight_count"]) == (2, 0)
    finally:
        with psycopg.connect(upgraded.database_url, autocommit=True) as conn:
            conn.execute("UPDATE infrai_jobs_schema_floor SET floor = %s", (old_floor,))


def test_the_next_versions_changes_fit_the_trees_template() -> None:
    # The edits next_version_tree makes find their places in this tree's files
    template = (ROOT / "framework.yaml").read_text()
    assert "\nParameters:\n" in template
    assert "\nResources:\n" in template
    assert re.search(
        rf'__version__ = "{re.escape(BASE)}"',
        (ROOT / "layers/common/infrai_jobs/__init__.py").read_text(),
    )
