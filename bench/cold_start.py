"""DrainFunction's cold start, measured in fresh processes.

Each run is a new ``python -S`` with only the function's code (``functions/``), its layer
(``layers/common``) and the virtualenv's site-packages on the path, in the function's environment
from ``template.yaml``, as ``infrai-jobs invoke`` runs a handler. It times ``import app`` (the
handler module) and the first ``app.service()`` (settings, secrets, HTTP client, ledger, job
registry), and prints the median of N runs. Nothing may touch the network: every URL points at a
listening socket of ours that no one answers, and a run that connected to it is reported.

``-X importtime`` runs give the per-module breakdown of the same work. Tracing is measured with
``POWERTOOLS_TRACE_DISABLED`` true and false; tracing on needs ``aws-xray-sdk`` (Powertools'
Tracer), and when that is not installed it is reported as n/a with the reason.

    .venv/bin/python bench/cold_start.py [--runs 10] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from infrai_local.sandbox.invoke import dependency_path, resolve

from instruments import sample_busy_percent
from results_file import add_output_options, update_results

ROOT = Path(__file__).resolve().parents[1]
FUNCTION = "DrainFunction"

# The child imports only built-in modules before the clock starts, so every import the handler
# causes is inside the measurement.
_HANDLER_CHILD = r"""
import sys, time
sys.stderr.write("--- cold start ---\n")
t0 = time.perf_counter()
from infrai_jobs.handlers import drain as app
t1 = time.perf_counter()
app.service()
t2 = time.perf_counter()
m = sys.modules
sys.stdout.write("%.3f %.3f %d %d %d\n" % (
    (t1 - t0) * 1e3, (t2 - t1) * 1e3, len(m), "boto3" in m, "botocore" in m))
"""

# What fetching secrets by name (INFRAI_API_KEY_PARAMETER, DATABASE_SECRET_ARN) adds before the
# first call: the Parameters utility and its two boto3 clients (no request is sent).
_SECRETS_CHILD = r"""
import sys, time
t0 = time.perf_counter()
from aws_lambda_powertools.utilities import parameters
parameters.SSMProvider()
parameters.SecretsProvider()
t1 = time.perf_counter()
sys.stdout.write("%.3f 0 %d 1 1\n" % ((t1 - t0) * 1e3, len(sys.modules)))
"""


# The floor under any drain handler: its dependencies' own imports (psycopg, and Powertools'
# Logger and Metrics, built once), in the same kind of process. The handler's cold start is
# reported as a ratio against it, measured in the same run, so a busy machine skews both alike.
_FLOOR_CHILD = r"""
import sys, time
t0 = time.perf_counter()
import psycopg
from aws_lambda_powertools import Logger, Metrics
Logger()
Metrics()
t1 = time.perf_counter()
m = sys.modules
sys.stdout.write("%.3f 0 %d %d %d\n" % ((t1 - t0) * 1e3, len(m), "boto3" in m, "botocore" in m))
"""


class _Sink:
    """A listening socket nobody answers: every URL of the child points here."""

    def __init__(self) -> None:
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.bind(("127.0.0.1", 0))
        self._socket.listen(64)
        self._socket.setblocking(False)
        self.port = self._socket.getsockname()[1]

    def connections(self) -> int:
        """Connections that arrived since the last call (the kernel accepts them for us)."""
        count = 0
        while True:
            try:
                conn, _ = self._socket.accept()
            except BlockingIOError:
                return count
            conn.close()
            count += 1

    def close(self) -> None:
        self._socket.close()


def child_environment(port: int, *, tracing: bool) -> dict[str, str]:
    spec = resolve(FUNCTION, root=ROOT)
    env = {name: os.environ[name] for name in ("PATH", "HOME", "LANG", "TZ") if name in os.environ}
    python_path = [str(spec.code_uri), *map(str, spec.layer_dirs), *dependency_path()]
    env.update(
        {
            "PYTHONPATH": os.pathsep.join(python_path),
            "PYTHONDONTWRITEBYTECODE": "1",
            "AWS_LAMBDA_FUNCTION_NAME": spec.logical_id,
            "AWS_LAMBDA_FUNCTION_MEMORY_SIZE": str(spec.memory_mb),
            "AWS_LAMBDA_FUNCTION_VERSION": "$LATEST",
            "AWS_REGION": "us-east-1",
            "AWS_DEFAULT_REGION": "us-east-1",
            "_HANDLER": spec.handler,
        }
    )
    env.update(spec.environment)
    unreachable = f"http://127.0.0.1:{port}"
    env.update(
        {
            "INFRAI_BASE_URL": unreachable,
            "INFRAI_API_KEY": "cold-start-key",
            "DATABASE_URL": f"postgresql://bench@127.0.0.1:{port}/bench?connect_timeout=1",
            "MAIL_PROVIDER_URL": unreachable,
            "DIGEST_PROVIDER_URL": unreachable,
            "POWERTOOLS_TRACE_DISABLED": "false" if tracing else "true",
        }
    )
    return env


def _run_child(
    code: str, env: Mapping[str, str], *, importtime: bool = False
) -> tuple[list[float], str, float]:
    command = [sys.executable, "-S", *(["-X", "importtime"] if importtime else []), "-c", code]
    started = time.perf_counter()
    done = subprocess.run(
        command,
        cwd=ROOT / "functions",
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    wall_ms = (time.perf_counter() - started) * 1000
    if done.returncode != 0:
        raise RuntimeError(f"cold start child failed: {done.stderr[-2000:]}")
    return [float(v) for v in done.stdout.split()], done.stderr, wall_ms


def _series(code: str, env: Mapping[str, str], runs: int, sink: _Sink) -> dict[str, Any]:
    # Not counted: warms the OS page cache and writes bytecode for sources edited since their
    # last .pyc (the measured runs, like `infrai-jobs invoke`, write none).
    _run_child(code, {k: v for k, v in env.items() if k != "PYTHONDONTWRITEBYTECODE"})
    sink.connections()
    totals: list[float] = []
    imports: list[float] = []
    setups: list[float] = []
    walls: list[float] = []
    flags: list[float] = []
    for _ in range(runs):
        values, _, wall_ms = _run_child(code, env)
        imports.append(values[0])
        setups.append(values[1])
        totals.append(values[0] + values[1])
        walls.append(wall_ms)
        flags = values[2:]
    return {
        "runs": runs,
        "median_ms": round(statistics.median(totals), 1),
        "import_ms": round(statistics.median(imports), 1),
        "setup_ms": round(statistics.median(setups), 1),
        "min_ms": round(min(totals), 1),
        "max_ms": round(max(totals), 1),
        "process_wall_ms": round(statistics.median(walls), 1),
        "modules_loaded": int(flags[0]) if flags else None,
        "boto3_imported": bool(flags[1]) if len(flags) > 1 else None,
        "botocore_imported": bool(flags[2]) if len(flags) > 2 else None,
        "network_connections": sink.connections(),
    }


def importtime_breakdown(env: Mapping[str, str], runs: int, top: int = 15) -> dict[str, Any]:
    """Median ``-X importtime`` figures per module over ``runs`` children."""
    cumulative: dict[str, list[float]] = defaultdict(list)
    self_times: dict[str, list[float]] = defaultdict(list)
    depth: dict[str, int] = {}
    packages: dict[str, list[float]] = defaultdict(list)
    for _ in range(runs):
        _, stderr, _ = _run_child(_HANDLER_CHILD, env, importtime=True)
        lines = stderr.split("--- cold start ---\n", 1)[-1].splitlines()
        per_package: dict[str, float] = defaultdict(float)
        for line in lines:
            if not line.startswith("import time:") or "imported package" in line:
                continue
            # "import time:    self_us | cumulative_us | <2 spaces per level>name"
            self_us, cumulative_us, raw_name = line.split(":", 1)[1].split("|", 2)
            name = raw_name.strip()
            indent = len(raw_name) - len(raw_name.lstrip()) - 1
            cumulative[name].append(int(cumulative_us) / 1000)
            self_times[name].append(int(self_us) / 1000)
            depth.setdefault(name, indent // 2)
            per_package[name.split(".")[0]] += int(self_us) / 1000
        for package, ms in per_package.items():
            packages[package].append(ms)
    by_cumulative = sorted(cumulative, key=lambda name: -statistics.median(cumulative[name]))
    modules = [
        {
            "module": name,
            "depth": depth[name],
            "cumulative_ms": round(statistics.median(cumulative[name]), 2),
            "self_ms": round(statistics.median(self_times[name]), 2),
        }
        for name in by_cumulative
    ]
    by_self = sorted(packages, key=lambda package: -statistics.median(packages[package]))
    by_package = [
        {"package": package, "self_ms": round(statistics.median(packages[package]), 2)}
        for package in by_self
    ]
    return {
        "runs": runs,
        "modules_imported": len(cumulative),
        "top_by_cumulative": modules[:top],
        "top_packages_by_self": by_package[:12],
    }


def _tracer_missing(env: Mapping[str, str]) -> str | None:
    """None when Powertools' Tracer can be built here, else why not."""
    try:
        _run_child("import aws_xray_sdk", env)
    except RuntimeError:
        return (
            "aws-xray-sdk is not installed, so Powertools' Tracer cannot be built and tracing "
            "cannot be turned on"
        )
    return None


def measure(runs: int = 10, importtime_runs: int = 5) -> dict[str, Any]:
    background = sample_busy_percent(1.0)
    sink = _Sink()
    try:
        off_env = child_environment(sink.port, tracing=False)
        on_env = child_environment(sink.port, tracing=True)
        missing = _tracer_missing(on_env)
        result: dict[str, Any] = {
            "method": (
                f"median of {runs} fresh `python -S` processes per figure, each timing "
                "`import app` plus the first `app.service()`; bytecode caches and the OS page "
                "cache warm (one unmeasured run first); no network (every URL points at a "
                "socket that never answers, and connections to it are counted)"
            ),
            "background_busy_pct": background,
            "tracing_off": _series(_HANDLER_CHILD, off_env, runs, sink),
            "tracing_on": (
                {"status": "n/a", "reason": missing}
                if missing
                else _series(_HANDLER_CHILD, on_env, runs, sink)
            ),
            "secrets_by_name_extra": _series(_SECRETS_CHILD, off_env, runs, sink),
            "dependency_floor": _series(_FLOOR_CHILD, off_env, runs, sink),
            "importtime_tracing_off": importtime_breakdown(off_env, importtime_runs),
            "importtime_tracing_on": (
                None if missing else importtime_breakdown(on_env, importtime_runs)
            ),
        }
    finally:
        sink.close()
    floor = result["dependency_floor"]["median_ms"]
    result["ratio_to_floor"] = (
        round(result["tracing_off"]["median_ms"] / floor, 2) if floor else None
    )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--importtime-runs", type=int, default=5)
    add_output_options(
        parser,
        update_help="replace the cold start in these results files (e.g. "
        "bench/results/latest.json), re-evaluate the targets and regenerate the chart and "
        "docs/performance.md from the first",
    )
    args = parser.parse_args(argv)
    result = measure(args.runs, args.importtime_runs)
    if args.update:
        _update_results(args.update, result)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    off = result["tracing_off"]
    print(
        f"DrainFunction cold start (tracing off): median {off['median_ms']} ms "
        f"(import {off['import_ms']} ms + setup {off['setup_ms']} ms), "
        f"boto3 imported: {off['boto3_imported']}, connections: {off['network_connections']}"
    )
    for row in result["importtime_tracing_off"]["top_by_cumulative"]:
        print(f"  {row['cumulative_ms']:8.1f} ms  {'  ' * row['depth']}{row['module']}")
    return 0


def _update_results(paths: list[Path], result: dict[str, Any]) -> None:
    import report  # noqa: PLC0415 - only --update needs it

    measured_at = datetime.now(UTC).isoformat(timespec="seconds")

    def with_cold_start(path: Path, document: dict[str, Any]) -> None:
        document["cold_start"] = {**result, "measured_at": measured_at}
        document["targets"] = report.evaluate_targets(document)

    update_results(paths, with_cold_start)


if __name__ == "__main__":
    sys.exit(main())
