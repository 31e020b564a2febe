"""Settings are read once and validated; secrets parse the shapes AWS stores them in."""

from __future__ import annotations

from dataclasses import MISSING, fields

import pytest
from psycopg.conninfo import conninfo_to_dict

from infrai_jobs.aws.secrets import database_url_from_secret
from infrai_jobs.config.settings import DrainSettings
from infrai_jobs.config.table import settings_table
from infrai_jobs.drain.model import DrainConfig
from infrai_jobs.errors import ConfigurationError


def test_defaults_name_the_notes_queue_and_hide_secrets_from_repr() -> None:
    settings = DrainSettings.from_env(
        {"INFRAI_API_KEY": "sk_secret", "DATABASE_URL": "postgresql://u:pw@h/db"}
    )
    assert (settings.queue, settings.dlq) == ("billing-jobs", "billing-jobs-dlq")
    assert "sk_secret" not in repr(settings)
    assert "pw@" not in repr(settings)


def test_the_visibility_window_and_the_answer_limit_are_configuration() -> None:
    default = DrainSettings.from_env({})
    assert (default.visibility_timeout_seconds, default.max_answer_bytes) == (300, 16 * 1024**2)
    chosen = DrainSettings.from_env(
        {"INFRAI_VISIBILITY_TIMEOUT_SECONDS": "900", "INFRAI_MAX_ANSWER_BYTES": "1048576"}
    )
    assert (chosen.visibility_timeout_seconds, chosen.max_answer_bytes) == (900, 1_048_576)


def test_a_drain_config_built_without_settings_keeps_the_settings_tables_defaults() -> None:
    # Given the settings table's defaults, and the defaults of DrainConfig's fields
    table = {row.field_name: row.default for row in settings_table(DrainSettings)}
    config = {f.name: f.default for f in fields(DrainConfig) if f.default is not MISSING}
    # Then every field both declare has one default: the table's (a drain built in a test or a
    # benchmark runs as one whose settings are unset)
    shared = sorted(set(table) & set(config))
    assert shared == ["batch_budget_ms", "lease_grace_seconds", "visibility_timeout_seconds"]
    assert {name: config[name] for name in shared} == {name: table[name] for name in shared}


def test_the_dlq_follows_the_queue_unless_set() -> None:
    assert DrainSettings.from_env({"INFRAI_QUEUE": "mail"}).dlq == "mail-dlq"
    assert DrainSettings.from_env({"INFRAI_QUEUE": "mail", "INFRAI_DLQ": "dead"}).dlq == "dead"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"DRAIN_BATCH_BUDGET_MS": "soon"}, "DRAIN_BATCH_BUDGET_MS='soon' is not an integer"),
        ({"DRAIN_BATCH_BUDGET_MS": "5"}, "below the minimum"),
        ({"INFRAI_PUBLISH_RETRIES": "maybe"}, "not a boolean"),
        ({"INFRAI_QUEUE": "q", "INFRAI_DLQ": "q"}, "must differ"),
        ({"INFRAI_VISIBILITY_TIMEOUT_SECONDS": "0"}, "INFRAI_VISIBILITY_TIMEOUT_SECONDS"),
        ({"INFRAI_MAX_ANSWER_BYTES": "1024"}, "INFRAI_MAX_ANSWER_BYTES"),
    ],
)
def test_bad_settings_fail_with_the_setting_named(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        DrainSettings.from_env(env)


def test_missing_required_values_say_how_to_fix_them() -> None:
    settings = DrainSettings.from_env({})
    with pytest.raises(ConfigurationError, match="INFRAI_API_KEY is not set"):
        settings.require_api_key()
    with pytest.raises(ConfigurationError, match="DATABASE_URL is not set"):
        settings.require_database_url()
    with pytest.raises(ConfigurationError, match="INFRAI_BASE_URL is not set"):
        settings.require_base_url()


def test_an_rds_secret_becomes_a_url_with_escaped_credentials() -> None:
    secret = (
        '{"engine": "postgres", "host": "db.internal", "port": 5433, "username": "jobs",'
        ' "password": "p@ss/word", "dbname": "ledger"}'
    )
    assert conninfo_to_dict(database_url_from_secret(secret, sslmode="require")) == {
        "user": "jobs",
        "password": "p@ss/word",
        "host": "db.internal",
        "port": "5433",
        "dbname": "ledger",
        "sslmode": "require",
    }


def test_a_plain_url_secret_gets_tls_required_when_verification_is_opted_out() -> None:
    assert conninfo_to_dict(
        database_url_from_secret(" postgresql://a@b/c\n", sslmode="require")
    ) == {
        "user": "a",
        "host": "b",
        "dbname": "c",
        "sslmode": "require",
    }


def test_a_secret_that_brings_its_own_root_certificate_keeps_it() -> None:
    verified = "postgresql://a@b/c?sslmode=verify-full&sslrootcert=/opt/ca.pem"
    assert database_url_from_secret(verified) == verified


@pytest.mark.parametrize(
    ("secret", "message"),
    [("not json", "neither"), ("[1]", "not an object"), ('{"host": "h"}', "lacks username")],
)
def test_unusable_database_secrets_fail_clearly(secret: str, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        database_url_from_secret(secret)
