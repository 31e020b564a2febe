"""The Infrai client's own HTTP transport against urllib3: process CPU per request.

    .venv/bin/python bench/transport_bench.py [--cycles 2000] [--rounds 5] [--json]

Why the client keeps ``infrai_jobs.queue.transport`` instead of urllib3: every ack is one
request, so the client's CPU per request bounds how many messages a lane can finish per second
(a thread-laned drain shares one GIL; a 512 MB Lambda has about a third of a vCPU). This
measures that CPU, nothing else.

Both clients send the same requests, with the same headers and bodies, to the emulator
(``python -m infrai_local.sandbox.emulator``, its own process on 127.0.0.1, no injected latency)
over one kept-alive connection each: per cycle a publish, a consume of one and the ack of what it
returned, on a queue of the client's own. A round runs ``--cycles`` cycles with each client,
their order alternating from round to round, after a warm-up that opens the connection. The
figure is this process's CPU time (``time.process_time``: user and system, all threads) over
the round, divided by its requests; the median over ``--rounds`` rounds is reported, with the
wall time per request and the emulator's CPU per request beside it. A ``User-Agent`` is given
(as the queue client gives one), so urllib3 adds none of its own and both send the same header
lines: Host, Accept-Encoding, the four below and Content-Length. Request bodies are encoded
once, and only the consume's answer is decoded (for its receipt handle), so
JSON work, the same for both, stays out of the figures.

The machine's load (``uptime``) is printed before and after: on a shared machine, read the
ratio, not the absolute figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import urllib3

from infrai_jobs.queue.transport import HttpPool, PoolOptions

from bench_env import API_KEY, EmulatorProcess
from instruments import pid_cpu_seconds

BENCH = Path(__file__).resolve().parent
HEADERS = {
    "User-Agent": "infrai-jobs-transport-bench",
    "Authorization": f"Bearer {API_KEY}",
    "Content-Type": "application/json",
    "Accept": "application/json",
}
PAYLOAD = {"job": "invoice.finalize", "invoice_id": "inv_8812", "amount_cents": 4900}

# One request: (method, path, body) -> (status, body bytes).
Send = Callable[[str, str, bytes | None], tuple[int, bytes]]


def ours(url: str) -> tuple[Send, Callable[[], None]]:
    pool = HttpPool(url, PoolOptions(connect_timeout=5.0, read_timeout=10.0, maxsize=1))

    def send(method: str, path: str, body: bytes | None) -> tuple[int, bytes]:
        response = pool.request(method, path, HEADERS, body)
        return response.status, response.body

    return send, pool.close


def with_urllib3(url: str) -> tuple[Send, Callable[[], None]]:
    pool = urllib3.connection_from_url(
        url, maxsize=1, block=True, retries=False, timeout=urllib3.Timeout(connect=5.0, read=10.0)
    )

    def send(method: str, path: str, body: bytes | None) -> tuple[int, bytes]:
        response = pool.urlopen(method, path, body=body, headers=HEADERS, preload_content=True)
        return response.status, response.data

    return send, pool.close


CLIENTS: dict[str, Callable[[str], tuple[Send, Callable[[], None]]]] = {
    "infrai transport": ours,
    "urllib3": with_urllib3,
}


def _call(send: Send, method: str, path: str, body: bytes) -> bytes:
    status, raw = send(method, path, body)
    if status != 200:
        raise RuntimeError(f"{method} {path} answered {status}: {raw[:200]!r}")
    return raw


def cycles(send: Send, queue: str, count: int) -> int:
    """``count`` x (publish, consume one, ack it); the number of requests sent.

    Bodies are encoded once, and only the consume's answer is decoded (for its receipt
    handle): JSON work is the same for both clients, so it is kept out of their figures.
    """
    publish = json.dumps({"queue": queue, "body": PAYLOAD}).encode()
    consume = json.dumps({"queue": queue, "max_messages": 1}).encode()
    ack_prefix = json.dumps({"queue": queue})[:-1].encode() + b', "receipt_handle": "'
    for _ in range(count):
        _call(send, "POST", "/v1/queue/publish", publish)
        answer = _call(send, "POST", "/v1/queue/consume", consume)
        (item,) = json.loads(answer)["data"]["items"]
        _call(send, "POST", "/v1/queue/ack", ack_prefix + item["receipt_handle"].encode() + b'"}')
    return 3 * count


def measure(name: str, emulator: EmulatorProcess, count: int, round_no: int) -> dict[str, float]:
    send, close = CLIENTS[name](emulator.url)
    try:
        queue = f"transport-bench-{name.split(maxsplit=1)[0]}-{round_no}"
        _call(send, "POST", "/v1/queue/create", json.dumps({"name": queue}).encode())
        cycles(send, queue, 20)  # warm-up: the connection is open and every path has run
        server0 = pid_cpu_seconds(emulator.pid)
        wall0, cpu0 = time.perf_counter(), time.process_time()
        requests = cycles(send, queue, count)
        cpu1, wall1 = time.process_time(), time.perf_counter()
        server1 = pid_cpu_seconds(emulator.pid)
    finally:
        close()
    server = (server1 - server0) if server0 is not None and server1 is not None else float("nan")
    return {
        "client_cpu_us": (cpu1 - cpu0) / requests * 1e6,
        "wall_us": (wall1 - wall0) / requests * 1e6,
        "emulator_cpu_us": server / requests * 1e6,
    }


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f}, {five:.2f}, {fifteen:.2f} ({os.cpu_count()} CPUs)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="transport_bench.py", description=__doc__.split("\n")[0])
    parser.add_argument("--cycles", type=int, default=2000, help="per client per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON too")
    args = parser.parse_args(argv)
    if args.cycles < 1 or args.rounds < 1:
        parser.error("--cycles and --rounds must be at least 1")
    load_before = load()
    emulator = EmulatorProcess()
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in CLIENTS}
    try:
        for round_no in range(args.rounds):
            order = list(CLIENTS) if round_no % 2 == 0 else list(reversed(CLIENTS))
            for name in order:
                runs[name].append(measure(name, emulator, args.cycles, round_no))
    finally:
        emulator.stop()
    load_after = load()
    medians = {
        name: {key: statistics.median(run[key] for run in results) for key in results[0]}
        for name, results in runs.items()
    }
    requests = 3 * args.cycles
    print(f"load average (1, 5, 15 min): before {load_before}; after {load_after}")
    print(f"{args.rounds} rounds x {requests} requests per client (publish, consume 1, ack)")
    columns = ("client CPU, us", "wall, us", "emulator CPU, us")
    print(f"{'median per request':<20} {columns[0]:>15} {columns[1]:>10} {columns[2]:>17}")
    for name, figures in medians.items():
        print(
            f"{name:<20} {figures['client_cpu_us']:>15.1f} {figures['wall_us']:>10.1f} "
            f"{figures['emulator_cpu_us']:>17.1f}"
        )
    ratio = medians["urllib3"]["client_cpu_us"] / medians["infrai transport"]["client_cpu_us"]
    print(f"urllib3 spends {ratio:.2f}x the client CPU per request of the infrai transport")
    if args.json:
        document = {
            "load_before": load_before,
            "load_after": load_after,
            "requests_per_round": requests,
            "rounds": runs,
            "medians": medians,
            "urllib3_over_ours": ratio,
        }
        json.dump(document, sys.stdout, indent=2)
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
