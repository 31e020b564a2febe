"""What a million jobs cost in AWS and at Infrai, from one benchmark run's own measurements.

Everything here is arithmetic over a results document (``bench/results/*.json``) and the
template's defaults: the drain's measured rate and CPU per lane count, DrainFunction's memory,
timeout and batch budget as template.yaml sets them, and prices given as parameters (the
defaults are the public list prices of Lambda in us-east-1 and Infrai's publish price from the
queue's docs, as of 2026-12; pass today's with the flags of ``report.py``).

The model, stated so it can be argued with:

- A backlog of a million messages is drained by invocations that each run to their timeout
  less one batch budget (the drain stops consuming when the time left would not cover a batch),
  so billed duration is the drain's wall time at the measured rate, and requests are that time
  divided by one invocation's useful length.
- Lambda gives CPU in proportion to memory (one vCPU at 1,769 MB). Where the run's worker used
  more of a core than the function's share, the rate is scaled down by the ratio: the bench
  machine's CPU is taken as equal to Lambda's per vCPU, which is an assumption, not a
  measurement.
- Infrai bills each publish; consume, ack and redeliveries are free. A producer that retries a
  share of its intents publishes each retry again without the outbox; with it (``enqueue`` in the
  producer's transaction, keyed) a retry is the same row and one publish. The drain's time for
  the duplicate deliveries it no longer receives is counted at the same per-message rate, which
  overstates it (a duplicate is cheaper than a first run: the ledger answers it).
- Fixed costs that do not grow with volume (the one-minute schedules of the drain, the DLQ
  watcher, the relay and prune; logs; the database) are left out: they are per month, not per
  job.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LAMBDA_FULL_VCPU_MB = 1769


# Prices in US dollars, each a flag of report.py (``--arm64-gb-s`` ...).
PRICES: dict[str, float] = {
    "arm64_gb_s": 0.0000133334,
    "x86_64_gb_s": 0.0000166667,
    "lambda_requests_per_million": 0.20,
    "infrai_publish": 0.00002,
    "producer_retry_rate": 0.05,
}


@dataclass(frozen=True)
class DrainShape:
    """DrainFunction's sizing as the template's defaults set it."""

    memory_mb: int
    timeout_s: int
    batch_budget_ms: int

    @classmethod
    def from_template(cls, path: Path = ROOT / "framework.yaml") -> DrainShape:
        text = path.read_text(encoding="utf-8")

        def default(parameter: str) -> int:
            found = re.search(rf"^  {parameter}:\n(?:    .*\n)*?    Default: (\d+)$", text, re.M)
            if found is None:
                raise ValueError(f"template.yaml: no numeric Default for {parameter}")
            return int(found.group(1))

        drain = text[text.index("\n  DrainFunction:\n") :]
        timeout = re.search(r"^      Timeout: (\d+)$", drain, re.M)
        if timeout is None:
            raise ValueError("template.yaml: DrainFunction has no Timeout")
        return cls(default("DrainMemorySize"), int(timeout.group(1)), default("DrainBatchBudgetMs"))


def per_million(
    document: dict[str, Any], shape: DrainShape, prices: dict[str, float] = PRICES
) -> dict[str, Any]:
    """The cost of 1,000,000 messages at each measured lane count, and what the outbox saves."""
    vcpu_share = shape.memory_mb / LAMBDA_FULL_VCPU_MB
    useful_s = shape.timeout_s - shape.batch_budget_ms / 1000
    gb = shape.memory_mb / 1024
    rows = []
    for measured in document.get("lanes", {}).get("scaling", []):
        rate = float(measured["messages_per_s"])
        cpu = float(measured.get("process_cpu_pct") or 0) / 100
        cpu_bound = cpu > vcpu_share
        if cpu_bound:
            rate *= vcpu_share / cpu
        seconds = 1_000_000 / rate
        gb_s = seconds * gb
        requests = math.ceil(seconds / useful_s)
        request_cost = requests * prices["lambda_requests_per_million"] / 1_000_000
        rows.append(
            {
                "lanes": measured["lanes"],
                "messages_per_s": round(rate, 1),
                "cpu_bound": cpu_bound,
                "gb_seconds": round(gb_s, 1),
                "requests": requests,
                "arm64_usd": round(gb_s * prices["arm64_gb_s"] + request_cost, 4),
                "x86_64_usd": round(gb_s * prices["x86_64_gb_s"] + request_cost, 4),
            }
        )
    publishes = 1_000_000 * prices["infrai_publish"]
    retried = 1_000_000 * prices["producer_retry_rate"]
    one_lane = rows[0] if rows else None
    drain_saved = (
        retried / one_lane["messages_per_s"] * gb * prices["arm64_gb_s"] if one_lane else 0.0
    )
    return {
        "shape": {
            "memory_mb": shape.memory_mb,
            "timeout_s": shape.timeout_s,
            "batch_budget_ms": shape.batch_budget_ms,
            "vcpu_share": round(vcpu_share, 3),
        },
        "prices": dict(prices),
        "lanes": rows,
        "infrai_publish_usd": round(publishes, 2),
        "outbox_saves": {
            "retried_intents": round(retried),
            "publish_usd": round(retried * prices["infrai_publish"], 2),
            "drain_arm64_usd": round(drain_saved, 4),
        },
    }


def markdown(cost: dict[str, Any], started_at: str, load: str) -> list[str]:
    shape, prices = cost["shape"], cost["prices"]
    lines = [
        "## What a million jobs cost",
        "",
        f"From this run ({started_at}; {load}), DrainFunction as the template sizes it "
        f"({shape['memory_mb']} MB, so {shape['vcpu_share']:g} of a vCPU; a {shape['timeout_s']} s "
        f"timeout less one {shape['batch_budget_ms']} ms batch budget per invocation), at "
        f"${_price(prices['arm64_gb_s'])}/GB-s on arm64, ${_price(prices['x86_64_gb_s'])}/GB-s "
        f"on x86_64 and ${prices['lambda_requests_per_million']:.2f} per million requests. The "
        "model and its assumptions are in `bench/cost.py`; `bench/report.py --help` takes "
        "today's prices. The one-minute schedules' own invocations, logs and the database are "
        "a cost per month, not per job, and are not in the table.",
        "",
        "| DrainLanes | msg/s in Lambda | CPU-bound at this memory | GB-seconds | requests "
        "| arm64 | x86_64 |",
        "| ---: | ---: | :---: | ---: | ---: | ---: | ---: |",
    ]
    for row in cost["lanes"]:
        lines.append(
            f"| {row['lanes']} | {row['messages_per_s']:,.1f} | "
            f"{'yes' if row['cpu_bound'] else 'no'} | {row['gb_seconds']:,.1f} | "
            f"{row['requests']:,} | ${row['arm64_usd']:.4f} | ${row['x86_64_usd']:.4f} |"
        )
    saves = cost["outbox_saves"]
    lines += [
        "",
        f"Infrai bills the million publishes themselves: **${cost['infrai_publish_usd']:,.2f}** "
        f"at ${_price(prices['infrai_publish'])} each, far more than the drain's Lambda time. At a "
        f"producer retry rate of {prices['producer_retry_rate']:.0%}, the outbox turns "
        f"{saves['retried_intents']:,} retries into rows that are already there: "
        f"**${saves['publish_usd']:,.2f}** of publishes per million intents, plus "
        f"${saves['drain_arm64_usd']:.4f} of drain time on arm64 (at one lane's rate).",
        "",
    ]
    return lines


def _price(value: float) -> str:
    return f"{value:.10f}".rstrip("0").rstrip(".")
