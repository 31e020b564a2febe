"""What preparing nothing on the server costs on a direct connection (DATABASE_PREPARED_STATEMENTS).

    .venv/bin/python bench/prepared_statements_bench.py [--messages 3000] [--rounds 5] [--json]

The ledger's connections prepare no statement on the server unless DATABASE_PREPARED_STATEMENTS
is true, so that they work behind a transaction pooler (docs/configuration.md, "Behind a
connection pooler"). Behind one there is no choice; on a direct connection this is what the safe
default costs.

Against PostgreSQL (``DATABASE_URL`` when set, else an embedded server; a scratch database
migrated as ``infrai-jobs migrate`` migrates it), the ledger's statements for a batch of external
jobs as the drain runs them through ``PostgresLedger``: one claim of ten keys, then each key
settled done. Each round runs ``--messages`` messages through each of two connections: one with
psycopg's server-side preparing (its default: a statement run five times on a connection is
prepared), one without (``prepare_threshold=None``: every run is parsed and planned), taking
turns batch by batch, so that both meet the same load from the rest of the machine. The figures
are messages per second of wall time and this process's CPU per message, the median over
``--rounds``; the ratio without/with is the cost. The load average (/proc/loadavg) is printed
before and after: on a shared machine, read the ratio, not the absolute figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import psycopg

from infrai_jobs.jobs.registry import Effect
from infrai_jobs.work.ledger import PostgresLedger
from infrai_jobs.work.states import ClaimRequest, JobRun, RunKind
from infrai_local.migrations import apply_migrations
from infrai_local.sandbox.embedded_db import postgres_server_url, scratch_database

BATCH = 10
VARIANTS = {"prepared": True, "unprepared": False}


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text(encoding="utf-8").split()[:3])


def _batch(tag: str, start: int, end: int) -> list[ClaimRequest]:
    return [
        ClaimRequest(
            idem_key=f"bench:{tag}:{n}",
            message_id=f"m-{tag}-{n}",
            job="bench.external",
            effect=Effect.EXTERNAL,
            fingerprint="f",
            lease_seconds=60,
        )
        for n in range(start, end)
    ]


def one_round(database_url: str, messages: int, number: int) -> dict[str, dict[str, float]]:
    """``messages`` claimed ten at a time and settled one by one, on each variant's ledger
    connection, the variants taking turns batch by batch (which goes first alternating), so
    that both meet the same load from the rest of the machine."""
    ledgers = {
        name: PostgresLedger(database_url, prepared_statements=on) for name, on in VARIANTS.items()
    }
    done = JobRun(RunKind.SUCCEEDED, result={"ok": True})
    wall = dict.fromkeys(VARIANTS, 0.0)
    cpu = dict.fromkeys(VARIANTS, 0.0)
    try:
        for ledger in ledgers.values():
            ledger.ping()  # connected and schema-checked before any clock starts
        for turn, start in enumerate(range(0, messages, BATCH)):
            order = list(VARIANTS) if turn % 2 == 0 else list(reversed(VARIANTS))
            for name in order:
                requests = _batch(f"{number}-{name}", start, min(start + BATCH, messages))
                began, began_cpu = time.perf_counter(), time.process_time()
                for decision in ledgers[name].claim(requests):
                    ledgers[name].settle(decision.request, done)
                wall[name] += time.perf_counter() - began
                cpu[name] += time.process_time() - began_cpu
    finally:
        for ledger in ledgers.values():
            ledger.close()
    return {
        name: {
            "messages_per_second": messages / wall[name],
            "cpu_us_per_message": cpu[name] / messages * 1e6,
        }
        for name in VARIANTS
    }


def measure(database_url: str, messages: int, rounds: int) -> dict[str, Any]:
    figures: dict[str, list[dict[str, float]]] = {name: [] for name in VARIANTS}
    for number in range(rounds):
        for name, figure in one_round(database_url, messages, number).items():
            figures[name].append(figure)
    medians = {
        name: {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        for name, runs in figures.items()
    }
    rate = [
        u["messages_per_second"] / p["messages_per_second"]
        for u, p in zip(figures["unprepared"], figures["prepared"], strict=True)
    ]
    return {
        "messages": messages,
        "rounds": rounds,
        "medians": medians,
        "throughput_ratio": statistics.median(rate),
        "throughput_ratio_per_round": [round(r, 3) for r in rate],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    load_before = load()
    with postgres_server_url() as server, scratch_database(server, prefix="infrai_bench") as url:
        with psycopg.connect(url, autocommit=True) as conn:
            apply_migrations(conn, [])
        result = measure(url, args.messages, args.rounds)
    result["load_average"] = {"before": load_before, "after": load()}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"load average before: {load_before}")
    for name, median in result["medians"].items():
        print(
            f"{name:>10}: {median['messages_per_second']:8.0f} msg/s, "
            f"{median['cpu_us_per_message']:6.0f} µs CPU/msg (median of {args.rounds})"
        )
    ratio, per_round = (result[f"throughput_ratio{part}"] for part in ("", "_per_round"))
    print(f"unprepared / prepared throughput: {ratio:.3f} (per round {per_round})")
    print(f"load average after: {result['load_average']['after']}")


if __name__ == "__main__":
    main()
