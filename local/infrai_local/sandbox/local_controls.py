"""The stand-ins' control surfaces as commands: the emulator's clock and faults, the sink's.

``infrai-jobs emulator clock|faults|state|reset`` talk to a running emulator's ``/_emulator/``
routes (``--url``, else INFRAI_BASE_URL, else http://127.0.0.1:8765); ``infrai-jobs
provider-sink state|faults|reset`` to a running sink's ``/_sink/`` routes (``--url``, else
PROVIDER_SINK_URL). Each prints the JSON answer.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from typing import Any

import urllib3

from infrai_jobs.errors import ConfigurationError, InfraiJobsError

EMULATOR_ACTIONS = frozenset({"clock", "faults", "state", "reset"})
SINK_ACTIONS = frozenset({"state", "faults", "reset"})
DEFAULT_EMULATOR_URL = "http://127.0.0.1:8765"


class ControlFailed(InfraiJobsError):
    """A stand-in's control route could not be reached or refused the change."""


def _call(url: str, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    try:
        answer = urllib3.request(
            method,
            url.rstrip("/") + path,
            body=None if body is None else json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            timeout=urllib3.Timeout(connect=2.0, read=10.0),
            retries=False,
        )
    except urllib3.exceptions.HTTPError as exc:
        raise ControlFailed(f"cannot reach {url}: {exc}") from None
    text = answer.data.decode("utf-8", "replace")
    if answer.status >= 400:
        raise ControlFailed(f"{method} {path} answered {answer.status}: {text.strip()}")
    return json.loads(text) if text.strip() else {}


def _url_option() -> argparse.ArgumentParser:
    """``--url`` after the action too (``clock --advance 5 --url ...``), not only before it."""
    option = argparse.ArgumentParser(add_help=False)
    option.add_argument("--url", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return option


def _emulator_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="infrai-jobs emulator",
        description="Control a running emulator (`infrai-jobs emulator --port N` serves one).",
    )
    parser.add_argument("--url", help=f"default: INFRAI_BASE_URL, else {DEFAULT_EMULATOR_URL}")
    sub = parser.add_subparsers(dest="action", required=True)
    url = _url_option()
    clock = sub.add_parser(
        "clock", parents=[url], help="move the emulator's clock forward (visibility, delays)"
    )
    clock.add_argument("--advance", type=float, required=True, metavar="SECONDS")
    faults = sub.add_parser(
        "faults", parents=[url], help="replace the injected faults (no option clears them)"
    )
    faults.add_argument("--error-rate", type=float, help="answer 500 to this share of calls")
    faults.add_argument("--rate-limit-rate", type=float, help="answer 429 to this share")
    faults.add_argument(
        "--drop-response-rate", type=float, help="apply the call, then drop its answer"
    )
    faults.add_argument("--latency-ms", type=int, help="delay every call")
    faults.add_argument("--seed", type=int, help="make the faults repeatable")
    faults.add_argument("--routes", help="comma-separated API routes (default: all)")
    sub.add_parser("state", parents=[url], help="queues, request counts, faults, the clock")
    sub.add_parser("reset", parents=[url], help="forget queues, faults, counters, clock jumps")
    return parser


def emulator_main(argv: Sequence[str]) -> int:
    args = _emulator_parser().parse_args(argv)
    url = args.url or os.environ.get("INFRAI_BASE_URL") or DEFAULT_EMULATOR_URL
    if args.action == "clock":
        answer = _call(url, "POST", "/_emulator/clock", {"advance_seconds": args.advance})
    elif args.action == "faults":
        names = ("error_rate", "rate_limit_rate", "drop_response_rate", "latency_ms", "seed")
        body = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
        if args.routes:
            body["routes"] = [route.strip() for route in args.routes.split(",") if route.strip()]
        answer = _call(url, "POST", "/_emulator/faults", body)
    elif args.action == "state":
        answer = _call(url, "GET", "/_emulator/state")
    else:
        answer = _call(url, "POST", "/_emulator/reset", {})
    print(json.dumps(answer, indent=2))
    return 0


def _sink_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="infrai-jobs provider-sink",
        description="Control a running provider sink (`infrai-jobs provider-sink --port N`).",
    )
    parser.add_argument("--url", help="default: PROVIDER_SINK_URL")
    sub = parser.add_subparsers(dest="action", required=True)
    url = _url_option()
    sub.add_parser("state", parents=[url], help="calls and effects per route and per key")
    faults = sub.add_parser(
        "faults", parents=[url], help="replace the injected faults (no option clears them)"
    )
    faults.add_argument("--fail-rate", type=float, help="answer 503 without the effect")
    faults.add_argument("--hang-rate", type=float, help="perform the effect, then hang")
    faults.add_argument("--hang-seconds", type=float, help="how long a hang lasts")
    faults.add_argument("--seed", type=int, help="make the faults repeatable")
    sub.add_parser("reset", parents=[url], help="forget calls, effects and faults")
    return parser


def sink_main(argv: Sequence[str]) -> int:
    args = _sink_parser().parse_args(argv)
    url = args.url or os.environ.get("PROVIDER_SINK_URL")
    if not url:
        raise ConfigurationError("no provider sink named: pass --url or set PROVIDER_SINK_URL")
    if args.action == "state":
        answer = _call(url, "GET", "/_sink/state")
    elif args.action == "faults":
        names = ("fail_rate", "hang_rate", "hang_seconds", "seed")
        body = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
        answer = _call(url, "POST", "/_sink/faults", body)
    else:
        answer = _call(url, "POST", "/_sink/reset", {})
    print(json.dumps(answer, indent=2))
    return 0
