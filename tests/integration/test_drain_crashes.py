"""Crash windows: a drain killed between commit and ack, a connection killed mid-batch."""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from typing import Any

import psycopg
from drainkit import QUEUE, Harness, run_until_killed

from infrai_jobs.drain.batch import process_batch
from infrai_jobs.drain.model import DrainConfig, DrainSummary
from infrai_jobs.jobs.registry import Effect, JobContext, JsonValue, Payload

# A drain process that SIGKILLs itself at its first ack: after the ledger committed, before
# Infrai heard about it. The kill is real; only the moment is chosen.
KILL_AT_ACK = textwrap.dedent(
    """
    import os, signal, sys
    from drainkit import QUEUE, add_test_jobs
    from infrai_jobs.drain.model import DrainConfig
    from infrai_jobs.drain.loop import drain
    from infrai_jobs.work.ledger import PostgresLedger
    from infrai_jobs.queue.client import InfraiClient
    from fixture_jobs import build_registry

    base_url, database_url, provider_url = sys.argv[1:4]
    client = InfraiClient(base_url, "test-key")
    client.send_ack = lambda queue, handle: os.kill(os.getpid(), signal.SIGKILL)
    registry = build_registry()
    add_test_jobs(registry, database_url)
    registry.bind_settings(dict.fromkeys(registry.declared_settings(), provider_url))
    drain(client, PostgresLedger(database_url), registry, DrainConfig(queue=QUEUE),
          lambda: 120_000)
    """
)


def _terminate(kit: Harness, conn: psycopg.Connection[Any]) -> None:
    """Have the server terminate ``conn``'s backend, as an operator or a failover would."""
    with psycopg.connect(kit.database_url, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (conn.info.backend_pid,))


def _publish_with_a_neighbour(
    kit: Harness, job: str, handler: Callable[[Payload, JobContext], JsonValue]
) -> None:
    """Register ``handler`` as the database job ``job``, then publish one of it (id "1") and an
    ordinary ``test.db`` neighbour, for one batch."""
    kit.registry.job(job, effect=Effect.DATABASE, identity=("id",))(handler)
    kit.publish({"job": job, "id": "1"})
    kit.publish({"job": "test.db", "id": "neighbour"})


def _killing_its_connection(
    kit: Harness, *, at_run: int, writes_effect: bool, fails: bool
) -> tuple[Callable[[Payload, JobContext], JsonValue], list[int]]:
    """A database job whose run number ``at_run`` has the server terminate the ledger's
    connection under it (after writing its effect row, if it ``writes_effect``); every run then
    fails, or answers. Also the backend pid of each run so far."""
    runs: list[int] = []

    def handler(payload: Payload, ctx: JobContext) -> JsonValue:
        assert ctx.db is not None
        runs.append(ctx.db.info.backend_pid)
        if writes_effect:
            ctx.db.execute(
                "INSERT INTO test_effects VALUES (%s, %s)", (ctx.idem_key, ctx.message_id)
            )
        if len(runs) == at_run:
            _terminate(kit, ctx.db)
        if fails:
            raise RuntimeError("the job failed")
        return {"ok": True}

    return handler, runs


def _assert_nothing_committed_or_acked(kit: Harness, summary: DrainSummary) -> None:
    assert summary.outcomes == {"ledger_unavailable": 2}
    assert summary.acked == 0
    assert kit.sql("SELECT count(*) FROM job_claims") == [(0,)]
    assert kit.sql("SELECT count(*) FROM test_effects") == [(0,)]


def test_killed_after_commit_before_ack_the_redelivery_is_skipped(kit: Harness) -> None:
    # Given a database job and an external job in one batch
    kit.publish({"job": "test.db", "id": "crash"})
    kit.publish({"job": "receipt.send", "invoice_id": "inv_9", "email": "x@example.com"})
    # When a drain process commits both and is killed at its first ack
    run_until_killed(KILL_AT_ACK, kit.server.url, kit.database_url, kit.sink.url)
    assert kit.row("test.db:crash") is not None
    # Then after the visibility timeout both come back as delivery 2 ...
    kit.advance()
    redelivered = kit.client.stats(QUEUE)
    assert redelivered.available_count == 2
    summary = kit.drain()
    # ... are recognised as done, skipped, and acked; no effect ran twice
    assert summary.outcomes == {"duplicate_done": 2}
    assert summary.acked == 2
    assert kit.effects("test.db:crash") == 1
    assert kit.sink.state.snapshot()["mails"] == {"inv_9": 1}
    assert kit.client.stats(QUEUE).message_count == 0


def test_connection_terminated_mid_batch_commits_nothing_and_retries_cleanly(
    kit: Harness,
) -> None:
    # Given a database job during which the server terminates the ledger's connection
    killer, _ = _killing_its_connection(kit, at_run=1, writes_effect=True, fails=False)
    _publish_with_a_neighbour(kit, "test.killer", killer)
    # When the batch runs, nothing of it commits and nothing is acked
    _assert_nothing_committed_or_acked(kit, kit.drain())
    # Then the redelivery, on a fresh connection, runs each job exactly once
    kit.advance()
    second = kit.drain()
    assert second.outcomes == {"done": 2}
    assert kit.effects("test.killer:1") == 1
    assert kit.effects("test.db:neighbour") == 1


def test_connection_terminated_while_a_savepoint_rolls_back_is_ledger_unavailable(
    kit: Harness,
) -> None:
    # Given a database job that fails twice: in the batch's one-go attempt, then in its own
    # savepoint, where the server terminates the connection just before the savepoint's rollback
    failing_killer, calls = _killing_its_connection(kit, at_run=2, writes_effect=False, fails=True)
    _publish_with_a_neighbour(kit, "test.failing_killer", failing_killer)
    # When the batch runs, the drain reports the ledger unavailable (psycopg's own Rollback
    # exception used to escape here), commits nothing and acks nothing
    first = kit.drain()
    assert len(calls) == 2
    assert first.stopped == "ledger_unavailable"
    _assert_nothing_committed_or_acked(kit, first)
    # Then the redelivery, on a fresh connection, runs the neighbour once and retries the job
    kit.advance()
    second = kit.drain()
    assert second.outcomes == {"done": 1, "retry": 1}
    assert kit.effects("test.db:neighbour") == 1


def test_external_claims_are_given_back_when_the_claim_answer_is_lost(kit: Harness) -> None:
    # Given a received batch, and the ledger's connection killed after the drain's ping, just
    # before the claim statement
    kit.publish({"job": "receipt.send", "invoice_id": "inv_5", "email": "y@example.com"})
    kit.drain()  # the first job runs normally and opens the ledger connection
    kit.publish({"job": "receipt.send", "invoice_id": "inv_6", "email": "z@example.com"})
    batch = kit.client.consume(QUEUE)
    conn: Any = kit.ledger._conn  # the test reaches in to break the live connection
    assert conn is not None
    _terminate(kit, conn)
    # When the batch meets the dead connection
    (result,) = process_batch(batch, kit.ledger, kit.registry, 2e9, DrainConfig(queue=QUEUE))
    # Then nothing ran and no running row was left behind
    assert result.outcome.value == "ledger_unavailable"
    assert kit.row("receipt.send:inv_6") is None
    # And the redelivery, on a fresh connection, sends exactly once
    kit.advance()
    second = kit.drain()
    assert second.outcomes == {"done": 1}
    assert kit.sink.state.snapshot()["mails"] == {"inv_5": 1, "inv_6": 1}


# A drain whose irreversible call for id "2" kills the process mid-call.
KILL_MID_CALL = textwrap.dedent(
    """
    import os, signal, sys
    import psycopg
    from drainkit import QUEUE
    from infrai_jobs.drain.model import DrainConfig
    from infrai_jobs.drain.loop import drain
    from infrai_jobs.jobs.registry import Effect, JobRegistry
    from infrai_jobs.work.ledger import PostgresLedger
    from infrai_jobs.queue.client import InfraiClient

    base_url, database_url = sys.argv[1:3]
    registry = JobRegistry()

    def send(payload, ctx):
        if payload["id"] == "2":
            os.kill(os.getpid(), signal.SIGKILL)
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute("INSERT INTO test_external_effects VALUES (%s)", (ctx.idem_key,))
        return {"sent": payload["id"]}

    registry.job("test.mail", effect=Effect.EXTERNAL, identity=("id",))(send)
    drain(InfraiClient(base_url, "test-key"), PostgresLedger(database_url), registry,
          DrainConfig(queue=QUEUE), lambda: 120_000)
    """
)


def test_a_crash_mid_call_leaves_only_that_irreversible_claim_for_a_human(kit: Harness) -> None:
    # Given three irreversible jobs in one batch, and a drain killed during the second call
    for n in ("1", "2", "3"):
        kit.publish({"job": "test.mail", "id": n})

    def send(payload: Payload, ctx: JobContext) -> JsonValue:
        with psycopg.connect(kit.database_url, autocommit=True) as conn:
            conn.execute("INSERT INTO test_external_effects VALUES (%s)", (ctx.idem_key,))
        return {"sent": payload["id"]}

    kit.registry.job("test.mail", effect=Effect.EXTERNAL, identity=("id",))(send)
    run_until_killed(KILL_MID_CALL, kit.server.url, kit.database_url)
    # When the batch is redelivered
    kit.advance()
    summary = kit.drain()
    # Then the first is a duplicate of done, the second (its call had begun) is stuck, and the
    # third, never claimed before the crash, runs now: each effect at most once
    assert summary.outcomes == {"duplicate_done": 1, "stuck": 1, "done": 1}
    assert [kit.external_effects(f"test.mail:{n}") for n in ("1", "2", "3")] == [1, 0, 1]
    stuck = kit.row("test.mail:2")
    assert stuck is not None
    assert stuck.state == "running"
