"""One redaction for connection strings: hostile passwords, malformed URLs, keyword DSNs.

The table below is checked against ``redaction`` itself, then against every place that connects
(the ledger, the watcher, the operator tools, migrate, redrive's reopen), the CLI commands an
operator types, and DrainFunction's JSON logs: no piece of a password reaches any of them.
"""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import fixture_jobs
import pytest
from child_process import clean_env, run_captured
from fixture_project import fixture_jobs_as_jobs, running_services
from ledger_entry_points import entry_points

from infrai_jobs.aws.secrets import database_url_from_secret
from infrai_jobs.config.settings import DrainSettings, PruneSettings
from infrai_jobs.errors import ConfigurationError, LedgerError
from infrai_jobs.ledger.postgres import MASK, describe, malformed_reason, redact, secrets_of
from infrai_jobs.runtime.factory import make_claims_admin, make_ledger, with_secrets
from infrai_local.jobs_package import JOBS_PATH_ENV
from infrai_local.sandbox.invoke import invoke, resolve

ROOT = Path(__file__).resolve().parents[2]
CLI = str(Path(sys.executable).parent / "infrai-jobs")


@dataclass(frozen=True)
class Hostile:
    conninfo: str
    # What must never be shown: the password as meant, and every piece of it a parser could
    # take for a host, a port or a database name.
    secrets: tuple[str, ...]
    malformed: bool


# Every password here is what its writer meant; libpq reads several of them differently.
HOSTILE = {
    "unescaped @ (the issue's)": Hostile(
        "postgresql://u:Hu@nter2/x@127.0.0.1:1/jobs", ("Hu@nter2/x", "nter2"), True
    ),
    "two @": Hostile("postgresql://u:se@cr@et99@127.0.0.1:1/jobs", ("se@cr@et99", "et99"), True),
    "unescaped /": Hostile("postgresql://u:pass/word99@127.0.0.1:1/jobs", ("pass/word99",), True),
    "stray %": Hostile("postgresql://u:100%sure@127.0.0.1:1/jobs", ("100%sure",), True),
    "unescaped #": Hostile("postgresql://u:hash#tag77@127.0.0.1:1/jobs", ("hash#tag77",), False),
    "colons": Hostile("postgresql://u:a:b:c:secret1@127.0.0.1:1/jobs", ("a:b:c:secret1",), False),
    "question mark": Hostile("postgresql://u:why?not77@127.0.0.1:1/jobs", ("why?not77",), False),
    "percent-encoded @ and /": Hostile(
        "postgresql://u:p%40ss%2Fw0rd@127.0.0.1:1/jobs", ("p%40ss%2Fw0rd", "p@ss/w0rd"), False
    ),
    "unclosed IPv6 bracket": Hostile("postgresql://u:brack3t99@[::1/jobs", ("brack3t99",), True),
    "another scheme": Hostile("mysql://u:my5ql-pw@127.0.0.1:1/jobs", ("my5ql-pw",), True),
    "keyword form, quoted": Hostile(
        "host=127.0.0.1 port=1 user=u password='p@ss w:rd/x?y' dbname=jobs",
        ("p@ss w:rd/x?y",),
        False,
    ),
    "keyword form, unquoted space": Hostile(
        "host=127.0.0.1 port=1 user=u password=open sesame77 dbname=jobs",
        ("open sesame77", "sesame77"),
        True,
    ),
    "keyword form, unterminated quote": Hostile(
        "host=127.0.0.1 port=1 user=u password='never closed", ("never closed",), True
    ),
}


def driver_errors(conninfo: str, secrets: tuple[str, ...]) -> list[str]:
    """Texts shaped like libpq's, each quoting a part of the connection string."""
    texts = [f'invalid connection string "{conninfo}"']
    for secret in secrets:
        texts.append(f'could not translate host name "{secret}" to address')
        texts.append(f"failed to resolve host '{secret}': Name or service not known")
        texts.append(f'database "{secret}/db" does not exist')
    return texts


@pytest.mark.parametrize("case", HOSTILE.values(), ids=HOSTILE.keys())
def test_redact_removes_every_piece_of_a_hostile_password(case: Hostile) -> None:
    # Given a connection string whose password is hostile, and errors quoting parts of it
    for text in driver_errors(case.conninfo, case.secrets):
        # When the text is redacted
        redacted = redact(text, case.conninfo)
        # Then no part of the password is left, and the mask shows where it was
        for secret in case.secrets:
            assert secret not in redacted, (text, redacted)
        assert MASK in redacted


@pytest.mark.parametrize("case", HOSTILE.values(), ids=HOSTILE.keys())
def test_malformed_strings_are_told_apart_without_quoting_them(case: Hostile) -> None:
    # Given a hostile connection string
    # When it is checked
    reason = malformed_reason(case.conninfo)
    # Then it is malformed exactly when libpq would read it otherwise than meant, and the reason
    # quotes none of it
    assert bool(reason) is case.malformed, reason
    for secret in case.secrets:
        assert secret not in reason


@pytest.mark.parametrize("case", HOSTILE.values(), ids=HOSTILE.keys())
def test_describe_names_the_database_and_never_a_password(case: Hostile) -> None:
    # Given a hostile connection string
    # When it is described for a message
    shown = describe(case.conninfo)
    # Then a malformed one is not described at all, a well-formed one by host and database
    if case.malformed:
        assert shown == "a malformed database URL"
    else:
        assert "127.0.0.1" in shown
    for secret in case.secrets:
        assert secret not in shown


def test_a_well_formed_url_keeps_its_host_and_database_in_messages() -> None:
    # Given a plain URL and a driver error naming its host
    url = "postgresql://app:s3cr3t-pw@db.internal:5432/jobs"
    text = 'connection to server at "db.internal" (10.0.0.5), port 5432 failed: s3cr3t-pw'
    # When the text is redacted
    # Then the host stays (it is what the operator must check), the password goes
    assert redact(text, url) == (
        'connection to server at "db.internal" (10.0.0.5), port 5432 failed: ***'
    )
    assert secrets_of(url) == ["s3cr3t-pw"]
    assert describe(url) == "app@db.internal:5432/jobs"


@pytest.mark.parametrize(
    "conninfo",
    [
        "mysql://u:s3cret-pw@127.0.0.1/jobs",
        "postgresql+psycopg://u:s3cret-pw@127.0.0.1/jobs",
        "postgresql//u:s3cret-pw@127.0.0.1/jobs",
    ],
)
def test_a_url_that_is_no_postgresql_url_is_told_by_its_scheme(conninfo: str) -> None:
    # Given a URL of another database, a driver's dialect, or one missing its scheme's colon
    # When it is checked
    reason = malformed_reason(conninfo)
    # Then the reason is the scheme, which must be PostgreSQL's, not a stray character of a
    # password; and it quotes none of the string
    assert "postgresql://" in reason, reason
    assert "postgres://" in reason, reason
    assert "'%'" not in reason, reason
    assert "s3cret" not in reason
    assert "mysql" not in reason
    assert "psycopg" not in reason


def test_an_at_sign_only_in_a_query_value_is_not_taken_for_a_password() -> None:
    # Given a password-less URL with an @ only in a query value
    # When it is checked
    # Then it is well-formed (nothing after the host can be a password)
    assert malformed_reason("postgresql://u@127.0.0.1:1/jobs?application_name=a@b") == ""


@pytest.mark.parametrize("case", [c for c in HOSTILE.values() if c.malformed])
def test_the_edge_refuses_a_malformed_database_url_naming_the_variable_only(case: Hostile) -> None:
    # Given a malformed DATABASE_URL in the environment, read into a function's settings
    drain = DrainSettings.from_env({"DATABASE_URL": case.conninfo})
    prune = PruneSettings.from_env({"DATABASE_URL": case.conninfo})
    for name, build in {
        "a handler's edge": lambda: with_secrets(prune, api_key=False),
        "the drain's ledger": lambda: make_ledger(drain),
        "the operator's ledger": lambda: make_claims_admin(prune),
    }.items():
        # When the handler's edge, or a ledger connector, is built from them
        with pytest.raises(ConfigurationError) as raised:
            build()
        # Then it is refused before any connection, the error naming the variable and showing
        # no part of the value
        message = str(raised.value)
        assert message.startswith("DATABASE_URL is malformed"), (name, message)
        for secret in case.secrets:
            assert secret not in message, (name, secret)


# --- every place that connects, every command, the drain's logs --------------------------------


def everything_logged(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc))


@pytest.fixture(autouse=True)
def fixture_jobs_imported() -> Iterator[None]:
    """``migrate`` runs in this process too: its jobs package is the fixture jobs'."""
    with fixture_jobs_as_jobs():
        yield


@pytest.mark.parametrize("case", HOSTILE.values(), ids=HOSTILE.keys())
def test_no_place_that_connects_lets_a_piece_of_the_password_out(case: Hostile) -> None:
    # Given a hostile connection string (malformed, or well-formed on a closed port)
    for name, call in entry_points(case.conninfo).items():
        # When each place that connects uses it
        with pytest.raises(LedgerError) as raised:
            call()
        # Then it fails as a ledger error, and nothing Lambda would log holds the password
        logged = everything_logged(raised.value)
        assert "cannot connect" in logged, (name, logged)
        for secret in case.secrets:
            assert secret not in logged, (name, secret, logged)


@pytest.mark.parametrize("case", HOSTILE.values(), ids=HOSTILE.keys())
def test_no_operator_command_prints_a_piece_of_the_password(case: Hostile) -> None:
    for command in (["migrate"], ["claims", "list"], ["claims", "stuck"]):
        # When an operator runs the command with the hostile DATABASE_URL
        finished = run_captured(
            [CLI, *command],
            env=clean_env(
                DATABASE_URL=case.conninfo, **{JOBS_PATH_ENV: str(fixture_jobs.CODE_ROOT)}
            ),
            cwd=ROOT,
            timeout=60,
        )
        # Then it fails in one line (2: malformed configuration, 1: cannot connect) and shows
        # no piece of the password
        output = finished.stdout + finished.stderr
        assert finished.returncode == (2 if case.malformed else 1), (command, output)
        assert "Traceback" not in output
        assert len(finished.stderr.splitlines()) == 1, output
        for secret in case.secrets:
            assert secret not in output, (command, secret, output)


@pytest.fixture(scope="module")
def services() -> Iterator[dict[str, str]]:
    with running_services("k") as running:
        yield running


class _Lines:
    def __init__(self) -> None:
        self.text = ""

    def write(self, line: str) -> None:
        self.text += line


@pytest.mark.parametrize("case", HOSTILE.values(), ids=HOSTILE.keys())
def test_drain_function_logs_no_piece_of_the_password(
    case: Hostile, services: dict[str, str], project: Path
) -> None:
    # Given DrainFunction configured with the hostile DATABASE_URL
    spec = resolve("DrainFunction", root=project)
    logs = _Lines()
    extra = {**services, "DATABASE_URL": case.conninfo, "INFRAI_API_KEY_PARAMETER": ""}
    # When it is invoked
    result = invoke(spec, ROOT / "events" / "drain-schedule.json", log_stream=logs, extra_env=extra)
    # Then it fails, and neither its JSON logs nor its error hold any piece of the password
    assert not result.ok
    logged = logs.text + json.dumps(result.payload)
    assert ("malformed" if case.malformed else "cannot connect") in logged
    for secret in case.secrets:
        assert secret not in logged, (secret, logged)


@pytest.mark.parametrize("case", [c for c in HOSTILE.values() if c.malformed])
def test_a_malformed_database_secret_is_refused_before_it_is_rewritten(case: Hostile) -> None:
    # Given a database secret holding a malformed connection string (in AWS it is rewritten
    # with sslmode=require, which would hide where its password ends)
    # When it is read
    with pytest.raises(ConfigurationError) as raised:
        database_url_from_secret(case.conninfo)
    # Then it is refused, and the error holds no piece of the password
    logged = everything_logged(raised.value)
    assert "database secret" in str(raised.value)
    for secret in case.secrets:
        assert secret not in logged
