"""Each function reads its own settings, once, at its edge; one secret source serves them all."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
from fixture_jobs import build_registry
from function_apps import load_function_app

from infrai_jobs.aws.secrets import SecretSource
from infrai_jobs.config.settings import (
    JOB_SETTINGS_ENV,
    AlertSettings,
    CommonSettings,
    DrainSettings,
    JobSettings,
    OutboxRelaySettings,
    PruneSettings,
    RedriveSettings,
)
from infrai_jobs.config.table import settings_table
from infrai_jobs.errors import ConfigurationError
from infrai_local.sam_template import load_template, resolve_function

ROOT = Path(__file__).resolve().parents[2]


class _Recording(Mapping[str, str]):
    """An environment that remembers every variable asked for."""

    def __init__(self, values: Mapping[str, str]) -> None:
        self.values = dict(values)
        self.read: set[str] = set()

    def __getitem__(self, name: str) -> str:
        self.read.add(name)
        return self.values[name]

    def get(self, name: str, default: Any = None) -> Any:
        self.read.add(name)
        return self.values.get(name, default)

    def __iter__(self) -> Iterator[str]:
        raise AssertionError("settings name the variables they read; they never list them all")

    def __len__(self) -> int:
        return len(self.values)


def _read_by(function: str) -> set[str]:
    environ = _Recording({})
    registry = build_registry()
    if function == "DrainFunction":
        DrainSettings.from_env(environ, job_settings=registry.declared_settings())
    elif function == "DlqAlertFunction":
        AlertSettings.from_env(environ, job_settings=registry.declared_settings(probes_only=True))
    elif function == "RedriveFunction":
        RedriveSettings.from_env(environ)
    else:
        PruneSettings.from_env(environ)
    return environ.read


FUNCTIONS = ("DrainFunction", "DlqAlertFunction", "RedriveFunction", "PruneFunction")


def test_importing_the_settings_leaves_the_database_driver_unloaded() -> None:
    # Given a fresh interpreter
    # When it imports the settings module
    probe = "import sys, infrai_jobs.config.settings; print('psycopg' in sys.modules)"
    finished = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    # Then psycopg was not imported along with it
    assert finished.stdout.strip() == "False", finished.stderr


@pytest.mark.parametrize("function", FUNCTIONS)
def test_a_function_reads_no_variable_the_template_gives_only_to_others(function: str) -> None:
    # Given the template's environment, function by function (Globals included)
    template = load_template(ROOT / "template.yaml")
    given = {name: set(resolve_function(template, name, ROOT).environment) for name in FUNCTIONS}
    set_somewhere = set().union(*given.values())
    # When the function's settings are read
    read = _read_by(function)
    # Then every variable it reads that the template sets at all is set for this function, so
    # none silently falls back to its default in AWS
    assert (read & set_somewhere) - given[function] == set()


def test_each_function_reads_only_its_own_variables() -> None:
    # Given the variables of the drain, of the watcher and of the prune
    drain_only = {"DRAIN_LANES", "JOB_POLICIES", "AWS_LAMBDA_FUNCTION_NAME"}
    # The second layer's: the drain guards effects with it, the watcher forgets released keys.
    second_layer = {"IDEMPOTENCY_BACKEND", "IDEMPOTENCY_TABLE", "REDIS_URL", "REDIS_SECRET_ARN"}
    alert_only = {"WATCHED_QUEUES", "ALERT_TOPIC_ARN", "STUCK_CLAIM_SECONDS"}
    # When each function's settings are read
    read = {function: _read_by(function) for function in FUNCTIONS}
    # Then each reads its own and none of the others'
    assert drain_only <= read["DrainFunction"]
    assert not drain_only & (read["DlqAlertFunction"] | read["RedriveFunction"])
    assert second_layer <= read["DrainFunction"] & read["DlqAlertFunction"]
    assert not second_layer & (read["RedriveFunction"] | read["PruneFunction"])
    assert alert_only <= read["DlqAlertFunction"]
    assert not alert_only & (read["DrainFunction"] | read["PruneFunction"])
    assert read["PruneFunction"] - read["RedriveFunction"] == {"LEDGER_RETENTION_DAYS"}
    # The jobs' settings: in JOB_SETTINGS (the JobSettings parameter), or a variable of their own
    job_settings = {"JOB_SETTINGS", "MAIL_PROVIDER_URL"}
    assert job_settings <= read["DrainFunction"] & read["DlqAlertFunction"]
    assert not job_settings & (read["PruneFunction"] | read["RedriveFunction"])


def test_a_bad_value_fails_only_the_function_that_reads_it() -> None:
    # Given a drain setting out of range
    environ = {"DRAIN_LANES": "99", "STUCK_CLAIM_SECONDS": "soon"}
    # When the drain reads its settings, Then it fails naming the variable, as before
    with pytest.raises(ConfigurationError, match="DRAIN_LANES=99 is above 16"):
        DrainSettings.from_env(environ)
    # And the watcher fails on its own variable only
    with pytest.raises(ConfigurationError, match="STUCK_CLAIM_SECONDS='soon' is not an integer"):
        AlertSettings.from_env(environ)
    # And the prune, which reads neither, is unaffected
    assert PruneSettings.from_env(environ).retention_days == 30


SETTINGS_KINDS = (
    CommonSettings,
    DrainSettings,
    AlertSettings,
    RedriveSettings,
    PruneSettings,
    OutboxRelaySettings,
)


@pytest.mark.parametrize("kind", SETTINGS_KINDS, ids=lambda kind: kind.__name__)
def test_a_settings_class_reads_exactly_the_variables_of_its_table(
    kind: type[CommonSettings],
) -> None:
    # Given a settings class's table
    table = settings_table(kind)
    # When its settings are read from an empty environment
    environ = _Recording({})
    kind.from_env(environ)
    # Then every field but the jobs' declared settings is a row, each variable once
    fields_not_rows = {f.name for f in fields(kind)} - {row.field_name for row in table}
    assert fields_not_rows <= {
        "job_settings",
        "job_setting_owners",
        "job_secret_arns",
        "job_secrets",
        "job_secret_owners",
    }
    variables = [row.variable for row in table]
    assert len(variables) == len(set(variables))
    # And it read the rows' variables and nothing else (bar where Lambda puts the code, and
    # for the functions that run jobs the map of the jobs' settings)
    jobs_map = {"JOB_SETTINGS"} if issubclass(kind, JobSettings) else set()
    assert environ.read - {"LAMBDA_TASK_ROOT"} == set(variables) | jobs_map


def test_every_variable_a_function_reads_is_in_the_configuration_doc() -> None:
    # Given the environment variables section of docs/configuration.md
    doc = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    section = doc.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"`([A-Z][A-Z0-9_]*)`", section))
    # When listing every variable the functions' settings tables read
    read = {row.variable for kind in SETTINGS_KINDS for row in settings_table(kind)}
    read.add(JOB_SETTINGS_ENV)
    # Then each is documented there
    assert read - documented == set()


def test_the_watcher_watches_the_drained_queue_unless_told_otherwise() -> None:
    assert AlertSettings.from_env({"INFRAI_QUEUE": "mail"}).watched_queues == ("mail",)
    chosen = AlertSettings.from_env({"WATCHED_QUEUES": "a, b,a"})
    assert chosen.watched_queues == ("a", "b")


def test_the_secret_source_refreshes_only_secrets_fetched_by_name() -> None:
    # Given values set directly (locally), and the same settings naming their secrets (AWS)
    direct = CommonSettings(infrai_api_key="k", database_url="postgresql://u@127.0.0.1/jobs")
    named = CommonSettings(api_key_parameter="/p", database_secret_arn="arn:secret")
    # When each gets its secret source
    # Then a direct value is used as it is and never fetched again
    assert SecretSource(direct).resolve() == direct
    assert SecretSource(direct).refresh.api_key is None
    assert SecretSource(direct).refresh.database_url is None
    # And a named one can be fetched again on rotation, the key only by a function that uses it
    assert SecretSource(named).refresh.api_key is not None
    assert SecretSource(named).refresh.database_url is not None
    assert SecretSource(named, api_key=False).refresh.api_key is None


def test_redrive_reads_its_environment_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # Given RedriveFunction's environment, and a count of the settings it reads
    for name, value in {
        "INFRAI_BASE_URL": "http://127.0.0.1:9",
        "INFRAI_API_KEY": "k",
        "DATABASE_URL": "postgresql://u@127.0.0.1:9/jobs",
    }.items():
        monkeypatch.setenv(name, value)
    reads: list[RedriveSettings] = []
    real = RedriveSettings.from_env.__func__  # type: ignore[attr-defined]

    def counted(cls: type[RedriveSettings], environ: Mapping[str, str] | None = None) -> Any:
        reads.append(real(cls, environ))
        return reads[-1]

    monkeypatch.setattr(RedriveSettings, "from_env", classmethod(counted))
    app = load_function_app("redrive")
    # When it builds its queue client and its ledger (nothing connects yet)
    settings, queue, _, _ = app.dependencies()
    queue.close()
    # Then its environment was read once, into RedriveFunction's own settings
    assert len(reads) == 1
    assert settings.queue == "billing-jobs"


@pytest.mark.parametrize("function", ["drain", "dlq_alert", "redrive", "prune"])
def test_no_handler_reads_the_environment_itself(function: str) -> None:
    handlers = ROOT / "layers" / "common" / "infrai_jobs" / "handlers"
    source = (handlers / f"{function}.py").read_text()
    assert "os.environ" not in source
    assert "getenv" not in source
    assert "with_secrets" in source or function == "drain"
