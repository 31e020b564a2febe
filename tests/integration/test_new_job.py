"""``infrai-jobs new-job``: a scaffolded job runs out of the box, through the real CLI.

Each test works on a copy of the project's code root (``functions/``) in a folder of its own,
named with ``--jobs-path`` / ``INFRAI_JOBS_PATH``, so the repository is never written to. Its
jobs package is the fixture code root's (the framework tests' jobs, laid out as a team's), never
the team's own: what the tests scaffold beside holds whichever jobs a team has.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest
from child_process import run_captured
from drainkit import INFRAI_JOBS, QUEUE, ROOT, TEST_JOBS_CODE, Harness, run_cli
from fixture_project import write_fixture_env_vars

from infrai_local.public_imports import refused_imports

RUFF = str(Path(sys.executable).parent / "ruff")
# Names no team would give a job of its own, so the tests hold in any checkout (the issue's
# walkthrough scaffolds refund.issue into the project itself).
WALK_JOB, WALK_MODULE = "newjob_check.refund", "newjob_check_refund"
# new-job's arguments for the walkthrough's database job.
WALK_DATABASE_JOB = (WALK_JOB, "--effect", "database", "--identity", "refund_id")
LINT_JOB, LINT_MODULE = "newjob_check.report", "newjob_check_report"
PYTEST = str(Path(sys.executable).parent / "pytest")


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A copy of the project's code root and tests' shared files, as a team's checkout, whose
    jobs package holds the fixture jobs."""
    functions = tmp_path / "functions"
    functions.mkdir()
    for package in ("jobs", "fixture_jobs"):
        shutil.copytree(
            TEST_JOBS_CODE / package,
            functions / package,
            ignore=shutil.ignore_patterns("__pycache__"),
        )
    (tmp_path / "tests" / "integration").mkdir(parents=True)
    copied_from_the_repository(
        tmp_path, "tests/conftest.py", "pyproject.toml", "template.yaml", "framework.yaml"
    )
    return tmp_path


def copied_from_the_repository(project: Path, *paths: str) -> None:
    """The repository's files at ``paths`` copied into ``project``, each at the same place;
    ``events/env.json`` with the fixture jobs' settings in place of the team's jobs'."""
    for path in paths:
        (project / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / path, project / path)
        if path == "events/env.json":
            write_fixture_env_vars(project / path)


def next_version(project: Path) -> int:
    """The version the next jobs migration of the project gets."""
    migrations = (project / "functions" / "jobs" / "migrations").glob("*.sql")
    return max((int(p.name[:4]) for p in migrations), default=0) + 1


def new_job(
    kit: Harness, project: Path, *args: str, code_root: Path | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """``infrai-jobs new-job ARGS --jobs-path`` the project's code root (or ``code_root``), run
    in the project (or in ``cwd``)."""
    jobs_path = code_root or project / "functions"
    return run_cli(kit, "new-job", *args, "--jobs-path", str(jobs_path), cwd=cwd or project)


def scaffold(kit: Harness, project: Path, *args: str, cwd: Path | None = None) -> str:
    """``new_job`` that succeeds; what it printed."""
    made = new_job(kit, project, *args, cwd=cwd)
    assert made.returncode == 0, made.stderr
    return made.stdout


def scaffold_external(kit: Harness, project: Path, job: str, identity: str, *options: str) -> str:
    """``scaffold`` of an ``external`` job keyed by ``identity``, with more ``options``."""
    return scaffold(kit, project, job, "--effect", "external", "--identity", identity, *options)


def job_module(project: Path, module: str = LINT_MODULE) -> Path:
    """The module new-job writes for ``module``'s job."""
    return project / "functions" / "jobs" / f"{module}.py"


def job_tests(project: Path, module: str = LINT_MODULE) -> Path:
    """The kit tests new-job writes for ``module``'s job."""
    return project / "tests" / "integration" / f"test_job_{module}.py"


def test_a_scaffolded_database_job_runs_once_from_migrate_to_drain(
    kit: Harness, project: Path
) -> None:
    # Given a new database job scaffolded into the project
    printed = scaffold(kit, project, *WALK_DATABASE_JOB)
    assert "infrai-jobs migrate" in printed
    sample = project / "events" / "jobs" / f"{WALK_JOB}.json"
    payload = json.loads(sample.read_text())
    assert payload == {"job": WALK_JOB, "refund_id": "refund_id_1"}
    version = next_version(project)
    jobs_path = {"INFRAI_JOBS_PATH": str(project / "functions")}
    # When the user migrates, publishes the same refund twice and drains
    migrated = run_cli(kit, "migrate", **jobs_path)
    assert migrated.returncode == 0, migrated.stderr
    assert f"applied jobs {version - 1:04d}: {WALK_MODULE}" in migrated.stdout
    published = run_cli(kit, "publish", "--count", "2", sample.read_text(), **jobs_path)
    assert published.returncode == 0, published.stderr
    drained = run_cli(kit, "drain", **jobs_path)
    assert drained.returncode == 0, drained.stderr
    # Then the job's own table holds one row and its claim is done, the queue empty
    assert kit.sql(f"SELECT refund_id, payload->>'job' FROM {WALK_MODULE}") == [
        ("refund_id_1", WALK_JOB)
    ]
    claim = kit.row(f"{WALK_JOB}:refund_id_1")
    assert claim is not None
    assert claim.state == "done"
    assert kit.client.stats(QUEUE).message_count == 0
    # And a payload that does not fit its schema is refused before it is published
    refused = run_cli(kit, "publish", json.dumps({"job": WALK_JOB, "refund_id": 7}), **jobs_path)
    assert refused.returncode == 2
    assert "refund_id" in refused.stderr


@pytest.mark.parametrize("effect", ["database", "external", "external_idempotent"])
def test_what_is_scaffolded_passes_lint_and_its_own_tests(
    kit: Harness, project: Path, effect: str, pg_server_url: str
) -> None:
    # Given a job of each effect class scaffolded with two identity fields
    version = next_version(project)
    scaffold(kit, project, LINT_JOB, "--effect", effect, "--identity", "tenant,month")
    written = [
        job_module(project),
        project / "functions" / "jobs" / "__init__.py",
        job_tests(project),
    ]
    # When the project's linters read it, Then they find nothing to change
    for command in (["check"], ["format", "--check"]):
        linted = run_captured([RUFF, *command, *map(str, written)], cwd=project)
        assert linted.returncode == 0, linted.stdout + linted.stderr
    # And the job module imports only the public job API
    assert refused_imports([written[0]]) == []
    migration = f"{version:04d}_{LINT_MODULE}.sql"
    assert (project / "functions" / "jobs" / "migrations" / migration).is_file()
    # And the scaffolded test, written with the test kit, passes on a real PostgreSQL (an
    # external job's two more: its probe's answers)
    passed = {"database": 3, "external": 6, "external_idempotent": 4}[effect]
    scaffolded_tests_pass(project, pg_server_url, passed=passed)


def server_env(server_url: str) -> dict[str, str]:
    """This environment without the shell's endpoints, the tests' database server given."""
    keep = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("INFRAI_", "DATABASE_", "PROVIDER_", "PYTEST_"))
    }
    return {**keep, "DATABASE_URL": server_url}


def test_new_job_refuses_what_it_cannot_write_and_writes_nothing(
    kit: Harness, project: Path
) -> None:
    before = sorted(p.relative_to(project) for p in project.rglob("*"))
    refusals = {
        ("invoice.finalize", "database", "invoice_id"): "already exists",
        ("Refund Issue", "database", "refund_id"): "lower-case words",
        (WALK_JOB, "database", ""): "at least one payload field",
        (WALK_JOB, "database", "job"): "'job'",
        (WALK_JOB, "database", "a,a"): "names a field twice",
    }
    for (name, effect, identity), says in refusals.items():
        # When new-job is asked for something it must refuse
        refused = new_job(kit, project, name, "--effect", effect, "--identity", identity)
        # Then it exits 2 with one line saying why, and no traceback
        assert refused.returncode == 2, (name, refused.stdout, refused.stderr)
        assert says in refused.stderr, refused.stderr
        assert "Traceback" not in refused.stderr
    # And an effect class it does not know is a usage error
    unknown = new_job(kit, project, WALK_JOB, "--effect", "email", "--identity", "r")
    assert unknown.returncode == 2
    # And nothing was written
    assert sorted(p.relative_to(project) for p in project.rglob("*")) == before


def test_new_job_runs_from_any_folder_with_the_installed_jobs_package(tmp_path: Path) -> None:
    # Given the installed console script, run outside the project with a bad request
    finished = run_captured(
        [INFRAI_JOBS, "new-job", "x.y", "--effect", "database", "--identity", "Bad"],
        cwd=tmp_path,
    )
    # Then the request is checked before anything is looked up or written
    assert finished.returncode == 2
    assert "--identity field 'Bad'" in finished.stderr
    assert list(tmp_path.iterdir()) == []


def _tree(folder: Path) -> list[Path]:
    return sorted(p.relative_to(folder) for p in folder.rglob("*"))


def test_new_job_writes_every_file_in_the_project_of_the_jobs_package_from_any_folder(
    kit: Harness, project: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # Given an operator in a folder outside the project, naming its code root
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    # When they scaffold a job there
    scaffold(kit, project, *WALK_DATABASE_JOB, cwd=elsewhere)
    # Then the module, its migration, its test and its sample event are all in that project
    assert job_module(project, WALK_MODULE).is_file()
    assert job_tests(project, WALK_MODULE).is_file()
    assert (project / "events" / "jobs" / f"{WALK_JOB}.json").is_file()
    # And nothing in the folder it ran from
    assert _tree(elsewhere) == []


def test_new_job_refuses_a_jobs_package_outside_any_project(kit: Harness, tmp_path: Path) -> None:
    # Given a code root that no project (template.yaml) holds
    shutil.copytree(
        TEST_JOBS_CODE, tmp_path / "loose", ignore=shutil.ignore_patterns("__pycache__")
    )
    before = _tree(tmp_path)
    # When new-job is pointed at it
    refused = new_job(kit, tmp_path, *WALK_DATABASE_JOB, code_root=tmp_path / "loose")
    # Then it exits 2 saying why, and writes nothing
    assert refused.returncode == 2, refused.stdout
    assert "template.yaml" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert _tree(tmp_path) == before


def test_new_job_dry_run_lists_the_files_and_writes_nothing(kit: Harness, project: Path) -> None:
    before = _tree(project)
    # When new-job runs with --dry-run
    looked = new_job(
        kit, project, WALK_JOB, "--effect", "external", "--identity", "refund_id", "--dry-run"
    )
    # Then it lists each file it would write or edit, relative to the project
    assert looked.returncode == 0, looked.stderr
    version = next_version(project)
    for path in (
        f"functions/jobs/{WALK_MODULE}.py",
        f"functions/jobs/migrations/{version:04d}_{WALK_MODULE}.sql",
        f"tests/integration/test_job_{WALK_MODULE}.py",
        f"events/jobs/{WALK_JOB}.json",
        "functions/jobs/__init__.py",
    ):
        assert path in looked.stdout
    assert "nothing was written" in looked.stdout
    # And the project is as it was
    assert _tree(project) == before


SETTING = "NEWJOB_CHECK_PROVIDER_URL"


def _job_settings(env: dict[str, Any], function: str) -> dict[str, str]:
    """The JOB_SETTINGS map events/env.json gives ``function``."""
    mapped: dict[str, str] = json.loads(env[function]["JOB_SETTINGS"])
    return mapped


def test_a_new_jobs_setting_reaches_samconfig_the_env_file_and_invoke_and_no_template(
    kit: Harness, project: Path
) -> None:
    # Given a project with its samconfig.toml and env-vars file (and the layer, read-only)
    (project / "layers").symlink_to(ROOT / "layers")
    copied_from_the_repository(
        project, "samconfig.toml", "events/env.json", "events/drain-schedule.json"
    )
    template = (project / "template.yaml").read_bytes()
    # When an external job with a setting of its own is scaffolded
    scaffold_external(kit, project, WALK_JOB, "refund_id", "--setting", SETTING)
    # Then the template is as it was: the framework's, whatever the jobs
    assert (project / "template.yaml").read_bytes() == template
    # And every deploying section's JobSettings holds its placeholder, beside the others
    from infrai_local.sam_template import samconfig_overrides  # noqa: PLC0415

    samconfig = project / "samconfig.toml"
    for environment, command in (("default", "deploy"), ("default", "sync"), ("prod", "deploy")):
        given = json.loads(samconfig_overrides(samconfig, environment, command)["JobSettings"])
        assert given[SETTING] == "SET-ME"
    # And events/env.json gives it, empty, in both functions' JOB_SETTINGS
    env = json.loads((project / "events" / "env.json").read_text())
    assert _job_settings(env, "DrainFunction")[SETTING] == ""
    assert _job_settings(env, "DlqAlertFunction")[SETTING] == ""
    # When the setting is put in events/env.json and DrainFunction is invoked on a job
    from infrai_local.migrations import apply_migrations, read_migrations  # noqa: PLC0415
    from infrai_local.sandbox.invoke import invoke, resolve  # noqa: PLC0415

    mapped = dict.fromkeys(_job_settings(env, "DrainFunction"), kit.sink.url)
    env["DrainFunction"]["JOB_SETTINGS"] = json.dumps(mapped)
    (project / "events" / "env.json").write_text(json.dumps(env, indent=2))
    with psycopg.connect(kit.database_url, autocommit=True) as conn:
        apply_migrations(conn, read_migrations(project / "functions" / "jobs" / "migrations"))
    kit.publish({"job": WALK_JOB, "refund_id": "r1"})
    spec = resolve("DrainFunction", root=project, env_vars=project / "events" / "env.json")
    assert SETTING not in spec.environment
    result = invoke(spec, project / "events" / "drain-schedule.json", extra_env=kit.services)
    # Then the job ran, calling the URL its setting names in JOB_SETTINGS
    assert result.ok, result.payload
    assert result.payload["done"] == 1
    effects = kit.sink.state.snapshot()["effects"]
    assert (
        sum(n for route, n in effects.items() if route.startswith(f"/v1/effects/{WALK_JOB}")) == 1
    )


def test_a_job_scaffolded_with_a_retry_policy_tests_its_deferral_and_passes(
    kit: Harness, project: Path, pg_server_url: str
) -> None:
    # Given an external job scaffolded with a setting and a retry policy past Infrai's three
    # deliveries
    scaffold_external(
        kit, project, LINT_JOB, "report_id", "--setting", SETTING, "--retry-attempts", "5"
    )
    module = job_module(project).read_text()
    assert "retry=RetryPolicy(attempts=5" in module
    test = job_tests(project).read_text()
    # Then its test asserts deferral, not a walk to the DLQ
    assert "assert_deferred_then_done" in test
    assert "assert_retried_then_dead_lettered" not in test
    # And that test passes with the test kit, which runs the drain DrainFunction runs
    scaffolded_tests_pass(project, pg_server_url, passed=6)


def test_a_retry_policy_is_refused_where_the_drain_would_refuse_it(
    kit: Harness, project: Path
) -> None:
    before = _tree(project)
    for effect, attempts, says in (
        ("database", "5", "external jobs only"),
        ("external", "3", "more than 3"),
    ):
        refused = new_job(
            kit, project, LINT_JOB, "--effect", effect, "--identity", "report_id",
            "--retry-attempts", attempts,
        )  # fmt: skip
        assert refused.returncode == 2, refused.stdout
        assert says in refused.stderr
    assert _tree(project) == before


def test_a_job_scaffolded_with_a_rate_limit_and_a_concurrency_key_tests_both_and_passes(
    kit: Harness, project: Path, pg_server_url: str
) -> None:
    # Given an external job scaffolded with a rate limit and a concurrency key on its tenant
    scaffold(
        kit, project, LINT_JOB, "--effect", "external_idempotent",
        "--identity", "tenant_id,report_id", "--setting", SETTING,
        "--rate-per-second", "20", "--concurrency-key", "tenant_id", "--max-running", "2",
    )  # fmt: skip
    module = job_module(project).read_text()
    assert "rate=RateLimit(per_second=20)" in module
    assert 'concurrency=ConcurrencyLimit(key=("tenant_id",), max_running=2)' in module
    assert "prepare=_http.warm" in module
    test = job_tests(project).read_text()
    # Then its tests assert the limit's spacing and the wait for a free slot
    assert "assert_rate_limited" in test
    assert "assert_held_back_by_concurrency" in test
    # And they pass with the test kit, which runs the drain DrainFunction runs
    scaffolded_tests_pass(project, pg_server_url, passed=6)


def test_limits_are_refused_where_the_drain_would_refuse_them(kit: Harness, project: Path) -> None:
    before = _tree(project)
    for effect, options, says in (
        ("database", ["--rate-per-second", "5"], "external jobs only"),
        ("external", ["--rate-per-second", "0"], "rate.per_second"),
        ("external", ["--concurrency-key", "Tenant"], "--concurrency-key field 'Tenant'"),
        ("external", ["--concurrency-key", " , "], "name one or more payload fields"),
        ("external", ["--max-running", "3"], "--max-running needs --concurrency-key"),
        ("external", ["--concurrency-key", "report_id", "--max-running", "0"], "max_running"),
    ):
        refused = new_job(
            kit, project, LINT_JOB, "--effect", effect, "--identity", "report_id", *options
        )
        assert refused.returncode == 2, refused.stdout
        assert says in refused.stderr, refused.stderr
        assert "Traceback" not in refused.stderr
    assert _tree(project) == before


SECRET = "NEWJOB_CHECK_API_TOKEN"


def test_a_new_jobs_secret_gets_placeholders_for_its_arn_and_its_tests_pass(
    kit: Harness, project: Path, pg_server_url: str
) -> None:
    # Given a project with its samconfig.toml and env-vars file
    copied_from_the_repository(project, "samconfig.toml", "events/env.json")
    template = (project / "template.yaml").read_bytes()
    # When an external job with a secret is scaffolded
    printed = scaffold_external(kit, project, LINT_JOB, "refund_id", "--secret", SECRET)
    # Then no template changed: the roles read what JobSecretArns lists
    assert (project / "template.yaml").read_bytes() == template
    # And each deploy names the secret's ARN in JobSettings and lists it in JobSecretArns,
    # both placeholders that make build refuses until the team gives the real ARN
    from infrai_local.checks.job_settings_check import job_settings_problems  # noqa: PLC0415
    from infrai_local.sam_template import samconfig_overrides  # noqa: PLC0415

    for environment in ("default", "prod"):
        overrides = samconfig_overrides(project / "samconfig.toml", environment, "deploy")
        assert json.loads(overrides["JobSettings"])[f"{SECRET}_SECRET_ARN"] == "SET-ME"
        assert overrides["JobSecretArns"] == f"SET-ME-{SECRET}_SECRET_ARN"
        problems = job_settings_problems(overrides, {}, {SECRET: (LINT_JOB,)}, environment)
        assert len(problems) == 2
        assert f"{SECRET}_SECRET_ARN (for {LINT_JOB}) still holds SET-ME" in problems[0]
    assert "JobSecretArns" in printed
    # And events/env.json gives its ARN, empty, in both functions' JOB_SETTINGS, never the secret
    env = json.loads((project / "events" / "env.json").read_text())
    for function in ("DrainFunction", "DlqAlertFunction"):
        assert _job_settings(env, function)[f"{SECRET}_SECRET_ARN"] == ""
        assert SECRET not in _job_settings(env, function)
    # And the job's own tests, written with the test kit, pass with the secret stood in
    scaffolded_tests_pass(project, pg_server_url, passed=6)


def test_invoke_passes_a_jobs_secret_from_the_shell_where_no_arn_is_named(
    kit: Harness, project: Path
) -> None:
    # Given a project whose external job declares a secret, its ARN left empty in env.json
    (project / "layers").symlink_to(ROOT / "layers")
    copied_from_the_repository(project, "events/env.json", "events/drain-schedule.json")
    scaffold_external(kit, project, WALK_JOB, "refund_id", "--setting", SETTING, "--secret", SECRET)
    env = json.loads((project / "events" / "env.json").read_text())
    assert _job_settings(env, "DrainFunction")[f"{SECRET}_SECRET_ARN"] == ""
    # (every job's setting points at the provider stand-in)
    mapped = {
        name: "" if name.endswith("_SECRET_ARN") else kit.sink.url
        for name in _job_settings(env, "DrainFunction")
    }
    env["DrainFunction"]["JOB_SETTINGS"] = json.dumps(mapped)
    (project / "events" / "env.json").write_text(json.dumps(env, indent=2))
    from infrai_local.migrations import apply_migrations, read_migrations  # noqa: PLC0415

    with psycopg.connect(kit.database_url, autocommit=True) as conn:
        apply_migrations(conn, read_migrations(project / "functions" / "jobs" / "migrations"))
    kit.publish({"job": WALK_JOB, "refund_id": "r-secret"})
    # When DrainFunction is invoked with the plain secret exported in the shell (what
    # `sam local invoke` would not pass: its template declares only JOB_SETTINGS)
    token = "tok-only-in-the-shell-7d1f"
    shell = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("INFRAI_", "DATABASE_", "AWS_"))
    }
    invoked = run_captured(
        [
            INFRAI_JOBS, "invoke", "DrainFunction",
            "--event", "events/drain-schedule.json", "--env-vars", "events/env.json",
        ],
        cwd=project,
        env={
            **shell,
            **kit.services,
            SECRET: token,
        },
    )  # fmt: skip
    # Then the job ran once and sent the secret as its bearer token, which no output shows
    assert invoked.returncode == 0, invoked.stdout + invoked.stderr
    assert json.loads(invoked.stdout)["done"] == 1
    assert f"{SECRET}: from your shell (not shown)" in invoked.stderr
    assert token not in invoked.stdout + invoked.stderr
    authorized = kit.sink.state.snapshot()["authorized"]
    expected = hashlib.sha256(f"Bearer {token}".encode()).hexdigest()
    assert authorized == {f"/v1/effects/{WALK_JOB}": expected}


def scaffolded_tests_pass(project: Path, pg_server_url: str, *, passed: int) -> None:
    """The scaffolded job's own test file passes with the test kit, every test of it."""
    tested = run_captured(
        [PYTEST, "-q", "-p", "no:cacheprovider", f"tests/integration/test_job_{LINT_MODULE}.py"],
        cwd=project,
        env={
            **server_env(pg_server_url),
            "INFRAI_JOBS_PATH": str(project / "functions"),
            "PYTHONPATH": str(ROOT / "tests" / "integration"),
        },
    )
    assert tested.returncode == 0, tested.stdout[-3000:]
    assert f"{passed} passed" in tested.stdout


HOOK_SETTING = "HOOK_URL"
# The webhook both tests below scaffold: keyed by its delivery, held back per subscriber (a
# field that is not its identity), its provider's URL a setting of its own.
WEBHOOK = ("delivery_id", "--setting", HOOK_SETTING, "--concurrency-key", "subscriber_id")


def test_a_webhook_with_its_own_url_path_and_probe_lookup_passes_its_scaffolded_tests(
    kit: Harness, project: Path, pg_server_url: str
) -> None:
    # Given an external webhook job scaffolded with a per-subscriber concurrency key (a field
    # that is not its identity) and a setting of its own
    scaffold_external(kit, project, LINT_JOB, *WEBHOOK)
    module_file = job_module(project)
    test_file = job_tests(project)
    module, test = module_file.read_text(), test_file.read_text()
    assert 'concurrency=ConcurrencyLimit(key=("subscriber_id",), max_running=1)' in module
    assert '"subscriber_id": str' in module
    assert "probe=find_call" in module
    # When the team points the handler at its provider's own path (POST /hooks/<subscriber>)
    # and the probe at its lookup (GET /deliveries/<id>), and gives the stand-in those routes,
    # as the scaffolded test's fixture and docs/jobs.md show
    effect_path = f"/v1/effects/{LINT_JOB}"
    module = module.replace(f'{effect_path}"', "/hooks/{payload['subscriber_id']}\"")
    module = module.replace(f"{effect_path}/{{key}}", "/deliveries/{key}")
    test = test.replace(f'"{effect_path}/{{key}}"', '"/deliveries/{id}"')
    test = test.replace(f'"{effect_path}"', '"/hooks/{subscriber}"')
    assert effect_path not in module + test
    module_file.write_text(module)
    test_file.write_text(test)
    # Then every scaffolded kit test passes: runs once, retried, held back per subscriber, a
    # conflict, stuck, and both of its probe's answers
    scaffolded_tests_pass(project, pg_server_url, passed=7)


def test_a_scaffolded_setting_is_refused_by_make_build_until_it_is_an_https_url(
    kit: Harness, project: Path
) -> None:
    # Given a project with its samconfig.toml
    copied_from_the_repository(project, "samconfig.toml", "events/env.json")
    # When new-job adds a job with HOOK_URL and a concurrency key on a non-identity field
    printed = scaffold_external(kit, project, WALK_JOB, *WEBHOOK)
    # Then every environment's deploy carries the placeholder, not the local invocation
    from infrai_local.checks.job_settings_check import job_settings_problems  # noqa: PLC0415
    from infrai_local.sam_template import samconfig_overrides  # noqa: PLC0415

    samconfig = project / "samconfig.toml"
    declared = {HOOK_SETTING: (WALK_JOB,)}
    for environment in ("default", "prod"):
        overrides = samconfig_overrides(samconfig, environment, "deploy")
        assert json.loads(overrides["JobSettings"])[HOOK_SETTING] == "SET-ME"
        # And make build refuses it there, naming the environment, the setting and the job
        (problem,) = job_settings_problems(overrides, declared, {}, environment)
        assert f"[{environment}] JobSettings: {HOOK_SETTING} (for {WALK_JOB}) still holds" in (
            problem
        )
    assert "JobSettings" not in samconfig_overrides(samconfig, "default")
    # And plain HTTP, credentials and nothing at all are refused too; HTTPS passes
    for refused in ("http://hooks.example.com", "https://u:p@hooks.example.com", ""):
        values = {"JobSettings": json.dumps({HOOK_SETTING: refused})}
        assert job_settings_problems(values, declared, {}, "prod"), refused
    values = {"JobSettings": json.dumps({HOOK_SETTING: "https://hooks.example.com/v1"})}
    assert job_settings_problems(values, declared, {}, "prod") == []
    # And the next steps finish their sentences: each paragraph of prose ends with a full stop
    prose = printed.split("next:\n", 1)[1].split("  infrai-jobs migrate", 1)[0]
    lines = prose.rstrip().split("\n")
    for line, following in zip(lines, [*lines[1:], "  (the end)"], strict=True):
        if not following.strip()[0].islower():  # a new sentence, or the end, follows
            assert line.rstrip().endswith("."), prose
    assert "replace its SET-ME in JobSettings in samconfig.toml" in printed
    # And the sample payload names the key's field
    sample = json.loads((project / "events" / "jobs" / f"{WALK_JOB}.json").read_text())
    assert sample["subscriber_id"] == "subscriber_id_1"


def test_the_back_off_is_scaffolded_as_given_and_refused_as_the_policy_refuses_it(
    kit: Harness, project: Path
) -> None:
    before = _tree(project)
    for options, says in (
        (["--first-delay-seconds", "2"], "give --retry-attempts too"),
        (["--retry-attempts", "5", "--first-delay-seconds", "0"], "retry.first_delay_seconds"),
        (["--retry-attempts", "5", "--first-delay-seconds", "9", "--max-delay-seconds", "3"],
         "below retry.first_delay_seconds"),
        (["--retry-attempts", "5", "--max-delay-seconds", "nan"], "retry.max_delay_seconds"),
    ):  # fmt: skip
        refused = new_job(
            kit, project, LINT_JOB, "--effect", "external", "--identity", "report_id", *options
        )
        assert refused.returncode == 2, refused.stdout
        assert says in refused.stderr, refused.stderr
        assert "Traceback" not in refused.stderr
    assert _tree(project) == before
    scaffold_external(
        kit, project, LINT_JOB, "report_id",
        "--retry-attempts", "6", "--first-delay-seconds", "0.5", "--max-delay-seconds", "120",
    )  # fmt: skip
    module = job_module(project).read_text()
    assert "RetryPolicy(attempts=6, first_delay_seconds=0.5, max_delay_seconds=120.0)" in module


def test_the_projects_own_imports_test_refuses_an_internal_import(
    kit: Harness, project: Path, pg_server_url: str
) -> None:
    # Given a project's first job, scaffolded
    scaffold(kit, project, LINT_JOB, "--effect", "database", "--identity", "tenant")
    imports_test = project / "tests" / "unit" / "test_jobs_import_public_api.py"

    def imports_test_run() -> subprocess.CompletedProcess[str]:
        return run_captured(
            [PYTEST, "-q", "-p", "no:cacheprovider", str(imports_test)],
            cwd=project,
            env={**server_env(pg_server_url), "INFRAI_JOBS_PATH": str(project / "functions")},
        )

    # When the team's own imports test runs, Then it passes: the scaffold imports public names
    passed = imports_test_run()
    assert passed.returncode == 0, passed.stdout[-2000:]
    assert "1 passed" in passed.stdout
    # And once the job imports an internal module, it fails naming the line and the way back
    module = job_module(project)
    scaffolded = module.read_text()
    module.write_text(scaffolded + "\nfrom infrai_jobs.jobs.registry import LazyPool\n")
    refused = imports_test_run()
    assert refused.returncode == 1
    assert f"{module}:" in refused.stdout
    assert "use `from infrai_jobs.jobs.http_pool import LazyPool`" in refused.stdout
    # And a second job keeps the test the team may have edited
    module.write_text(scaffolded)
    imports_test.write_text(imports_test.read_text() + "# ours now\n", encoding="utf-8")
    again = new_job(kit, project, "lint.second", "--effect", "database", "--identity", "tenant")
    assert again.returncode == 0, again.stderr
    assert imports_test.read_text().endswith("# ours now\n")
