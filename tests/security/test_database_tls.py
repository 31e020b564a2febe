"""TLS to PostgreSQL in AWS: the URL built from the database secret must require encryption.

libpq's own default is ``sslmode=prefer``: it tries TLS, verifies nothing, and silently falls back
to plain text, so anyone on the path can downgrade or read the ledger's traffic (and the
password). In AWS the URL comes from Secrets Manager (``secrets.database_url_from_secret``); see
docs/reliability.md for the default and how to go further (``verify-full``).
"""

from __future__ import annotations

import json

import pytest
from psycopg.conninfo import conninfo_to_dict

from infrai_jobs.errors import ConfigurationError
from infrai_jobs.secrets import database_url_from_secret

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


def test_an_rds_secret_becomes_a_url_that_requires_tls() -> None:
    # Given the JSON an RDS-managed secret holds
    # When it is turned into a connection URL
    url = database_url_from_secret(json.dumps(RDS_SECRET))
    params = conninfo_to_dict(url)
    # Then TLS is required, and every credential survives quoting unchanged
    assert params["sslmode"] == "require"
    assert params["password"] == RDS_SECRET["password"]
    assert params["user"] == "infrai"
    assert params["host"] == RDS_SECRET["host"]
    assert params["dbname"] == "jobs"


@pytest.mark.parametrize("secret", PLAIN_SECRETS.values(), ids=PLAIN_SECRETS.keys())
def test_every_secret_shape_requires_tls(secret: str) -> None:
    # Given a database secret in another accepted shape, without an sslmode
    # When it is turned into a connection string
    params = conninfo_to_dict(database_url_from_secret(secret))
    # Then TLS is required all the same
    assert params.get("sslmode") in {"require", "verify-ca", "verify-full"}


@pytest.mark.parametrize("mode", WEAK_SSLMODES)
def test_a_secret_that_weakens_tls_is_refused(mode: str) -> None:
    # Given a secret whose URL asks for a mode that allows plain text
    secret = f"postgresql://infrai:pw@ledger.example.com/jobs?sslmode={mode}"
    # When it is read, Then it is refused with the setting named, not the password
    with pytest.raises(ConfigurationError, match="sslmode") as raised:
        database_url_from_secret(secret)
    assert "pw@" not in str(raised.value)


def test_an_rds_secret_with_a_malformed_port_is_a_configuration_error() -> None:
    # Given an RDS secret whose port is not a number
    secret = json.dumps({**RDS_SECRET, "port": "five-four-three-two"})
    # When it is read, Then the error is the package's, naming the field
    with pytest.raises(ConfigurationError, match="port"):
        database_url_from_secret(secret)
