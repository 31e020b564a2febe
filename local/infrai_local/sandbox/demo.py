"""``make demo``: the field notes' story, told through the real DrainFunction, on loopback.

1. A producer retry publishes ``inv_8812`` twice: one claim, the invoice finalized once, both
   messages acked.
2. A drain commits and dies before acking: the redelivery (``delivery_count`` 2, after the
   emulator's clock passes the visibility timeout) is recognised and skipped.
3. A poison message (an invoice that does not exist) fails three deliveries and lands in the DLQ;
   DlqAlertFunction pages with the delta and the commands to run.
4. The fix ships (the invoice exists now): RedriveFunction moves the dead letter back, the drain
   completes it, the DLQ returns to zero and the alert resolves.
5. An irreversible receipt whose outcome is unknown (the mail provider answers 503) stays
   ``running`` and is flagged for a human instead of being sent twice.
6. A producer enqueues ``inv_8814`` in its own transaction through the outbox and retries it
   twice: one outbox row, one publish. The producer then "dies" right after its commit, before
   anything was published: OutboxRelayFunction publishes it anyway, and the drain finalizes it.

Every step drains through ``infrai-jobs invoke DrainFunction`` (the handler in a child process,
as Lambda would run it). The story's facts are returned as a ``DemoReport`` so a test can assert
on exactly what the demo prints.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import urllib3

from infrai_jobs import outbox
from infrai_jobs.queue.client import InfraiClient
from infrai_local.jobs_package import load_registry, project_root
from infrai_local.migrations import apply_migrations, jobs_migrations_folder, read_migrations
from infrai_local.sandbox import emulator, provider_sink
from infrai_local.sandbox.embedded_db import (
    configured_database_url,
    describe_database_url,
    ensure_database_url,
    scratch_database,
)
from infrai_local.sandbox.example_data import refuse_without_example_jobs
from infrai_local.sandbox.invoke import invoke, resolve
from infrai_local.sandbox.provider_sink import sink_settings
from infrai_local.sandbox.queues import ensure_queue

# The framework repository's example jobs the story runs.
STORY_JOBS = ("invoice.finalize", "receipt.send")
QUEUE = "billing-jobs"
DLQ = "billing-jobs-dlq"
API_KEY = "demo-key"
NOTES_PAYLOAD = {"job": "invoice.finalize", "invoice_id": "inv_8812", "amount_cents": 4900}

# Counts every UPDATE of an invoice, so the demo can show "finalized once".
COUNT_INVOICE_UPDATES = """
CREATE TABLE IF NOT EXISTS demo_invoice_updates (invoice_id text, at timestamptz DEFAULT now());
CREATE OR REPLACE FUNCTION demo_count_update() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN INSERT INTO demo_invoice_updates (invoice_id) VALUES (NEW.id); RETURN NEW; END $$;
DROP TRIGGER IF EXISTS demo_count_update ON invoices;
CREATE TRIGGER demo_count_update AFTER UPDATE ON invoices
    FOR EACH ROW EXECUTE FUNCTION demo_count_update();
"""

# A drain that commits and is killed at its first ack: the second source of duplicates.
_CRASH_BEFORE_ACK = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, sys.argv[4])
    from infrai_jobs.drain.model import DrainConfig
    from infrai_jobs.drain.loop import drain
    from infrai_jobs.work.ledger import PostgresLedger
    from infrai_jobs.queue.client import InfraiClient
    from jobs import build_registry

    base_url, database_url, sink_url = sys.argv[1:4]
    client = InfraiClient(base_url, "demo-key")
    client.send_ack = lambda queue, handle: os.kill(os.getpid(), signal.SIGKILL)
    registry = build_registry()
    registry.bind_settings(dict.fromkeys(registry.declared_settings(), sink_url))
    drain(client, PostgresLedger(database_url), registry,
          DrainConfig(queue="billing-jobs"), lambda: 60_000)
    """
)


@dataclass
class DemoReport:
    facts: dict[str, Any] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)

    def say(self, text: str) -> None:
        self.lines.append(text)
        print(text, flush=True)


@dataclass
class _Stage:
    root: Path
    database_url: str
    client: InfraiClient
    emulator_url: str
    sink_url: str
    log: io.StringIO

    def sql(self, query: str, params: Any = None) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.database_url, autocommit=True) as conn:
            cursor = conn.execute(query, params)
            return cursor.fetchall() if cursor.description else []

    def drain_function(self) -> dict[str, Any]:
        return self.function("DrainFunction", "drain-schedule.json")

    def function(self, name: str, event: str) -> dict[str, Any]:
        spec = resolve(name, root=self.root)
        extra = {
            "INFRAI_BASE_URL": self.emulator_url,
            "INFRAI_API_KEY": API_KEY,
            "INFRAI_API_KEY_PARAMETER": "",
            "DATABASE_URL": self.database_url,
            "DATABASE_SECRET_ARN": "",
            **sink_settings(self.sink_url, str(self.root / "functions")),
            "INFRAI_QUEUE": QUEUE,
            "INFRAI_DLQ": DLQ,
            "POWERTOOLS_METRICS_NAMESPACE": "InfraiJobsDemo",
        }
        # Locally there is no SNS topic: the alerter prints, and the report carries the text.
        extra["ALERT_TOPIC_ARN"] = ""
        extra["WATCHED_QUEUES"] = QUEUE
        result = invoke(spec, self.root / "events" / event, log_stream=self.log, extra_env=extra)
        if not result.ok:
            raise RuntimeError(f"{name} failed: {result.payload}\n{self.log.getvalue()}")
        payload: dict[str, Any] = result.payload
        return payload

    def advance_clock(self, seconds: float) -> None:
        urllib3.request(
            "POST", f"{self.emulator_url}/_emulator/clock", json={"advance_seconds": seconds}
        )

    def claim(self, key: str) -> tuple[Any, ...] | None:
        rows = self.sql(
            "SELECT state, attempts, coalesce(error, '') FROM job_claims WHERE idem_key = %s",
            (key,),
        )
        return rows[0] if rows else None

    def claim_text(self, key: str) -> str:
        """The claim as a person reads it: ``done (attempt 1)``, ``running (attempt 1): the
        error``, or ``none``."""
        return claim_words(self.claim(key))


def claim_words(claim: Sequence[Any] | None) -> str:
    if claim is None:
        return "none"
    state, attempts, error = claim
    return f"{state} (attempt {attempts})" + (f": {error}" if error else "")


def outcome_words(outcomes: Mapping[str, int]) -> str:
    """``1 duplicate_done, 1 done``: a drain's outcomes, by the labels its summary uses."""
    return ", ".join(f"{count} {name}" for name, count in sorted(outcomes.items())) or "none"


def run_story(root: Path, report: DemoReport) -> DemoReport:
    started = time.monotonic()
    with _stage(root) as stage:
        _chapter_producer_retry(stage, report)
        _chapter_crash_before_ack(stage, report)
        _chapter_poison_to_dlq(stage, report)
        _chapter_redrive_after_fix(stage, report)
        _chapter_unknown_outcome(stage, report)
        _chapter_outbox(stage, report)
    report.facts["seconds"] = round(time.monotonic() - started, 1)
    report.say(f"\ndone in {report.facts['seconds']} s; everything started was stopped")
    return report


def _chapter_producer_retry(stage: _Stage, report: DemoReport) -> None:
    client = stage.client
    report.say("== 1. A producer retry: the same invoice published twice ==")
    ids = [client.publish(QUEUE, NOTES_PAYLOAD) for _ in range(2)]
    report.say(f"published inv_8812 twice: {ids[0]}, {ids[1]} (no producer-side dedupe)")
    summary = stage.drain_function()
    claims = stage.sql("SELECT idem_key, state FROM job_claims")
    updates = stage.sql("SELECT count(*) FROM demo_invoice_updates")[0][0]
    status = stage.sql("SELECT status, total_cents FROM invoices WHERE id = 'inv_8812'")[0]
    report.facts["retry"] = {
        "summary": summary,
        "claims": claims,
        "invoice_updates": updates,
        "invoice": status,
        "queue_after": client.stats(QUEUE).message_count,
    }
    report.say(
        f"DrainFunction: consumed {summary['consumed']}, outcomes "
        f"{outcome_words(summary['outcomes'])}, acked {summary['acked']}"
    )
    report.say(
        "ledger: "
        + ", ".join(f"{key} {state}" for key, state in claims)
        + f"; invoice {status[0]} at {status[1]} cents, "
        f"updated {updates} time(s); messages left: {client.stats(QUEUE).message_count}"
    )


def _chapter_crash_before_ack(stage: _Stage, report: DemoReport) -> None:
    client = stage.client
    report.say("\n== 2. A worker commits, then dies before acking ==")
    payload = {"job": "invoice.finalize", "invoice_id": "inv_8813", "amount_cents": 1200}
    client.publish(QUEUE, payload)
    crashed = subprocess.run(  # noqa: S603 - our interpreter, our script
        [
            sys.executable,
            "-c",
            _CRASH_BEFORE_ACK,
            stage.emulator_url,
            stage.database_url,
            stage.sink_url,
            str(stage.root / "functions"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    report.say(
        f"drain process killed at its first ack (exit {crashed.returncode}); "
        f"claim: {stage.claim_text('invoice.finalize:inv_8813')}"
    )
    stage.advance_clock(301)
    redelivered = client.stats(QUEUE).available_count
    summary = stage.drain_function()
    updates = stage.sql("SELECT count(*) FROM demo_invoice_updates WHERE invoice_id = 'inv_8813'")[
        0
    ][0]
    report.facts["crash"] = {
        "exit_code": crashed.returncode,
        "redelivered": redelivered,
        "summary": summary,
        "invoice_updates": updates,
    }
    report.say(
        f"after the visibility timeout: {redelivered} message back (delivery 2); "
        f"DrainFunction outcomes {outcome_words(summary['outcomes'])}, acked {summary['acked']}; "
        f"inv_8813 updated {updates} time(s)"
    )


def _chapter_poison_to_dlq(stage: _Stage, report: DemoReport) -> None:
    client = stage.client
    report.say("\n== 3. A poison message walks to the dead-letter queue ==")
    client.publish(QUEUE, {"job": "invoice.finalize", "invoice_id": "inv_404", "amount_cents": 100})
    for delivery in (1, 2, 3):
        summary = stage.drain_function()
        report.say(
            f"delivery {delivery}: outcomes {outcome_words(summary['outcomes'])} (not acked)"
        )
        stage.advance_clock(301)
    stats = client.stats(QUEUE)
    report.facts["poison"] = {
        "dlq_count": stats.dlq_count,
        "claim": stage.claim("invoice.finalize:inv_404"),
    }
    report.say(
        f"dlq_count is now {stats.dlq_count}; the ledger holds no claim for it "
        f"(claim: {stage.claim_text('invoice.finalize:inv_404')}), so a redrive after the fix "
        "will run it"
    )
    alerts = stage.function("DlqAlertFunction", "dlq-alert-schedule.json")
    report.facts["alert"] = alerts["alerts"]
    for alert in alerts["alerts"]:
        report.say(f"DlqAlertFunction -> SNS: {alert['subject']}")
        report.say(textwrap.indent(alert["message"], "    | "))


def _chapter_redrive_after_fix(stage: _Stage, report: DemoReport) -> None:
    client = stage.client
    report.say("\n== 4. The fix ships; a redrive completes the poison job ==")
    stage.sql("INSERT INTO invoices (id) VALUES ('inv_404')")
    moved = stage.function("RedriveFunction", "redrive.json")
    summary = stage.drain_function()
    after = client.stats(QUEUE)
    resolved = stage.function("DlqAlertFunction", "dlq-alert-schedule.json")["alerts"]
    report.facts["redrive"] = {
        "moved": moved,
        "drain": summary,
        "claim": stage.claim("invoice.finalize:inv_404"),
        "dlq_count": after.dlq_count,
        "alerts": resolved,
    }
    report.say(
        f"RedriveFunction: published {moved['published']}, acked {moved['acked']}, cost "
        f"${moved['cost_usd']} (price from {moved['price_source']}); the drain: "
        f"{outcome_words(summary['outcomes'])}; claim now "
        f"{stage.claim_text('invoice.finalize:inv_404')}"
    )
    report.say(
        f"dlq_count back to {after.dlq_count}; DlqAlertFunction: "
        + ", ".join(a["subject"] for a in resolved)
    )


def _chapter_unknown_outcome(stage: _Stage, report: DemoReport) -> None:
    client = stage.client
    report.say("\n== 5. An irreversible effect with an unknown outcome ==")
    urllib3.request("POST", f"{stage.sink_url}/_sink/faults", json={"fail_rate": 1.0})
    client.publish(
        QUEUE, {"job": "receipt.send", "invoice_id": "inv_8812", "email": "billing@example.com"}
    )
    summary = stage.drain_function()
    claim = stage.claim("receipt.send:inv_8812")
    report.facts["uncertain"] = {"summary": summary, "claim": claim}
    report.say(
        f"mail provider answered 503: outcomes {outcome_words(summary['outcomes'])}; "
        f"claim {claim_words(claim)}"
    )
    alerts = stage.function("DlqAlertFunction", "dlq-alert-schedule.json")["alerts"]
    report.facts["uncertain"]["alerts"] = alerts
    for alert in alerts:
        report.say(f"DlqAlertFunction -> SNS: {alert['subject']}")
    report.say(
        "it stays running and flagged; after checking the mailbox a human runs "
        "`infrai-jobs claims resolve receipt.send:inv_8812 --done` (or --failed)"
    )


def _chapter_outbox(stage: _Stage, report: DemoReport) -> None:
    report.say("\n== 6. A producer with the outbox: a retry, then a crash after its commit ==")
    registry = load_registry(str(stage.root / "functions"))
    payload = {"job": "invoice.finalize", "invoice_id": "inv_8814", "amount_cents": 4100}
    queued_at_start = stage.client.stats(QUEUE).message_count
    # The API handler's business write and its job commit together; its HTTP client retries
    # the whole request twice (a stalled connection), and the process dies right after the
    # last commit, before it could publish anything itself.
    for _ in range(3):
        with psycopg.connect(stage.database_url) as conn, conn.transaction():
            conn.execute(
                "INSERT INTO invoices (id) VALUES ('inv_8814') ON CONFLICT (id) DO NOTHING"
            )
            outbox.enqueue(conn, payload, registry=registry)
    rows = stage.sql("SELECT count(*) FROM outbox WHERE idem_key = 'invoice.finalize:inv_8814'")
    published_by_producer = stage.client.stats(QUEUE).message_count - queued_at_start
    relayed = stage.function("OutboxRelayFunction", "outbox-relay-schedule.json")
    summary = stage.drain_function()
    claim = stage.claim("invoice.finalize:inv_8814")
    report.facts["outbox"] = {
        "outbox_rows": rows[0][0],
        "published_by_producer": published_by_producer,
        "relay": relayed,
        "summary": summary,
        "claim": claim,
    }
    report.say(
        f"enqueued 3 times in 3 committed transactions: {rows[0][0]} outbox row; "
        f"{published_by_producer} new message(s) in the queue before the relay ran"
    )
    report.say(
        f"OutboxRelayFunction: published {relayed.get('published')}; DrainFunction: outcomes "
        f"{outcome_words(summary['outcomes'])}; claim {claim_words(claim)}"
    )


@contextlib.contextmanager
def _demo_database() -> Iterator[str]:
    """A database of the demo's own: a scratch one on DATABASE_URL's server (dropped after),
    else the embedded server. The demo never writes into a database someone else uses."""
    server_url = configured_database_url()
    if server_url is None:
        yield ensure_database_url()
        return
    with scratch_database(server_url, prefix="infrai_demo_") as url:
        print(
            f"database: a scratch database on {describe_database_url(server_url)}, "
            "dropped at the end",
            file=sys.stderr,
        )
        yield url


@contextlib.contextmanager
def _stage(root: Path) -> Iterator[_Stage]:
    with contextlib.ExitStack() as stack:
        database_url = stack.enter_context(_demo_database())
        with psycopg.connect(database_url, autocommit=True) as conn:
            # The ledger's tables, then the jobs' own (invoices), as `infrai-jobs migrate` does.
            apply_migrations(conn, read_migrations(jobs_migrations_folder(root / "functions")))
            conn.execute(COUNT_INVOICE_UPDATES)
            conn.execute(
                "INSERT INTO invoices (id) VALUES ('inv_8812'), ('inv_8813')"
                " ON CONFLICT (id) DO NOTHING"
            )
        server = emulator.start_in_thread()
        stack.callback(server.stop)
        sink = provider_sink.start_in_thread()
        stack.callback(sink.stop)
        client = InfraiClient(server.url, API_KEY)
        stack.callback(client.close)
        ensure_queue(client, QUEUE, dlq=DLQ)
        yield _Stage(root, database_url, client, server.url, sink.url, io.StringIO())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="infrai-jobs demo", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--root",
        type=Path,
        default=None,
        help="the project folder (default: the one whose jobs package is installed)",
    )
    parser.add_argument("--json", action="store_true", help="print the facts as JSON at the end")
    args = parser.parse_args(argv)
    root = args.root.resolve() if args.root is not None else project_root()
    # Before anything starts: a team's project has its own jobs, and none of these.
    refuse_without_example_jobs(
        load_registry(None if args.root is None else str(root / "functions")),
        STORY_JOBS,
        "infrai-jobs demo tells the field notes' story with",
    )
    report = run_story(root, DemoReport())
    if args.json:
        print(json.dumps(report.facts, default=str))
    return 0
