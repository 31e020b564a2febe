"""Secrets never reach an exception's text, its chained causes, or a repr.

What Lambda logs for a failed invocation is the exception with its whole chain
(``traceback.format_exception``), so the chain is what is checked. The full chaos run's output is
scanned by tests/chaos/test_chaos_soak.py.
"""

from __future__ import annotations

import traceback
from collections.abc import Iterator

import pytest
from fixture_project import fixture_jobs_as_jobs
from ledger_entry_points import entry_points

from infrai_jobs.config.settings import DrainSettings
from infrai_jobs.errors import InfraiError, LedgerError
from infrai_jobs.jobs.registry import JobRegistry
from infrai_jobs.queue.client import HttpRetryPolicy, InfraiClient
from infrai_jobs.runtime.drain_service import DrainService
from infrai_jobs.work.ledger import PostgresLedger
from infrai_local.sandbox.emulator import RunningEmulator, start_in_thread

PASSWORD = "pw_do_not_print_8c1e77"
API_KEY = "sk_live_do_not_print_51d0aa"


def everything_logged(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc))


@pytest.fixture(scope="module")
def emulator() -> Iterator[RunningEmulator]:
    server = start_in_thread(api_key="the-right-key")
    yield server
    server.stop()


def test_an_unreachable_database_error_never_holds_the_password() -> None:
    # Given a ledger whose URL carries a password, pointing at a closed port
    ledger = PostgresLedger(f"postgresql://infrai:{PASSWORD}@127.0.0.1:1/jobs", connect_timeout=1)
    # When it is used
    with pytest.raises(LedgerError) as raised:
        ledger.get("any")
    # Then neither the error nor anything chained to it shows the password
    assert "cannot connect" in str(raised.value)
    assert PASSWORD not in everything_logged(raised.value)


def test_a_malformed_database_url_error_never_holds_the_password() -> None:
    # Given a database URL with a typo (an unclosed IPv6 bracket) and a password
    ledger = PostgresLedger(f"postgresql://infrai:{PASSWORD}@[::1/jobs", connect_timeout=1)
    # When the ledger is used
    with pytest.raises(LedgerError) as raised:
        ledger.get("any")
    # Then the password appears nowhere in what Lambda would log
    assert PASSWORD not in everything_logged(raised.value)


def test_every_place_that_connects_keeps_a_malformed_urls_password_out_of_its_error() -> None:
    # (``migrate`` runs in this process: its jobs package is the fixture jobs')
    with fixture_jobs_as_jobs():
        _every_place_keeps_the_password_out()


def _every_place_keeps_the_password_out() -> None:
    # Given a database URL with a typo (an unclosed IPv6 bracket) and a password, which the
    # driver quotes whole in its own error
    url = f"postgresql://infrai:{PASSWORD}@[::1/jobs"
    for name, call in entry_points(url).items():
        # When each is used
        with pytest.raises(LedgerError) as raised:
            call()
        # Then it fails as the ledger being unavailable, and the password is nowhere in what
        # would be logged
        assert "malformed" in str(raised.value), (name, str(raised.value))
        assert PASSWORD not in everything_logged(raised.value), name


def test_a_rejected_api_key_never_appears_in_the_error(emulator: RunningEmulator) -> None:
    # Given a client whose API key the service rejects
    client = InfraiClient(emulator.url, API_KEY, retry=HttpRetryPolicy(max_attempts=1))
    # When it calls, Then the 401 error and its chain do not show the key
    with pytest.raises(InfraiError) as raised:
        client.stats("billing-jobs")
    assert raised.value.status == 401
    assert API_KEY not in everything_logged(raised.value)
    assert API_KEY not in repr(client)
    client.close()


def test_an_unreachable_service_error_never_holds_the_api_key() -> None:
    # Given a client pointed at a closed port
    client = InfraiClient("http://127.0.0.1:1", API_KEY, retry=HttpRetryPolicy(max_attempts=1))
    # When it calls, Then the connection error does not show the key
    with pytest.raises(InfraiError) as raised:
        client.stats("billing-jobs")
    assert raised.value.code == "CONNECTION_ERROR"
    assert API_KEY not in everything_logged(raised.value)
    client.close()


def test_the_objects_a_handler_holds_never_print_a_secret(emulator: RunningEmulator) -> None:
    # Given settings carrying every secret, and the service built from them
    settings = DrainSettings(
        infrai_base_url=emulator.url,
        infrai_api_key=API_KEY,
        database_url=f"postgresql://infrai:{PASSWORD}@127.0.0.1:1/jobs",
        redis_url=f"rediss://:{PASSWORD}@cache.example:6379/0",
    )
    service = DrainService.from_settings(settings, JobRegistry())
    # When they are printed (a log line, an assertion message, a debugger)
    printed = " ".join([repr(settings), repr(service), str(service), repr(service.ledger)])
    # Then no secret shows
    assert "InfraiClient" in printed
    assert API_KEY not in printed
    assert PASSWORD not in printed
