"""A local Infrai queue: the contract in docs/infrai-api.md, served over HTTP on loopback.

By concern: ``infrai_local.sandbox.queue_model`` holds the queue semantics (shared with the
in-memory fake), ``state`` adds the emulator's clock, faults and counters, ``parsing`` reads request
bodies, ``routes`` maps each call to the state, ``http`` serves it, ``cli`` is the command line.

Tests, the demo and the benchmarks run against this instead of api.infrai.cc, so it must be
faithful to every line of the contract (envelopes, id shapes, timestamps, the consume cap,
visibility, delivery counts, max_receive_count 3, dead-lettering, stats, discovery, error
codes). It adds a control surface under ``/_emulator/`` that the real service does not have:
a clock that can jump forward, fault injection, reset and a state dump.

Choices where the contract is silent (the client must not depend on any of them):

- Expiry is lazy: every request first moves lapsed in-flight and delayed messages on.
- A message whose third delivery lapses goes to the queue's DLQ; in the DLQ (or in a queue
  without a DLQ) a lapsed message simply becomes available again and ``delivery_count`` keeps
  counting (4, 5, ...): nothing is ever dropped silently.
- "Oldest first" means the order in which messages entered the queue (publish order; a
  dead-lettered message enters its DLQ when it is moved there).
- An ack succeeds for any message the queue holds in any state, including one never consumed
  (the handle is the message id, which the producer also knows).
- ``oldest_message_age_seconds`` is an integer (whole seconds, rounded down) over every message
  the queue holds, whatever its state; 0 on an empty queue.
- ``create`` accepts only ``type: "standard"``; names are 1-80 characters of letters, digits,
  ``.``, ``_`` and ``-``. A ``dlq`` naming an existing queue reuses it.
- ``delay_seconds`` is an integer from 0 to 86400. Unknown fields in /v1 bodies are ignored;
  unknown fields in /_emulator bodies are rejected (they are typos).
- A request body over 11 MiB answers 413 ``PAYLOAD_TOO_LARGE``; a chunked body answers 411
  ``LENGTH_REQUIRED``. Unknown routes answer 404 ``NOT_FOUND``, a wrong method 405
  ``METHOD_NOT_ALLOWED``. Auth is checked before routing on every /v1 path.
- Injected faults apply only to /v1 routes, after auth: latency first, then at most one of
  500 ``INTERNAL`` / 429 ``RATE_LIMITED`` (neither applies the call), and a dropped response
  (the call is applied, the connection is closed without an answer). Only a call that succeeded
  has its response dropped: an error answer applied nothing, so it is delivered (a retried ack
  then learns ``QUEUE_MESSAGE_NOT_FOUND``). ``Retry-After`` is a whole number of seconds (0
  allowed) because that is what HTTP allows.

The control surface (no auth, never faulted, answers in the same envelope):

- ``POST /_emulator/clock {"advance_seconds": N}`` -> ``{"offset_seconds", "now"}`` (GET reads it)
- ``POST /_emulator/faults {"latency_ms", "error_rate", "rate_limit_rate",
  "drop_response_rate", "retry_after_seconds", "seed", "routes"}``: replaces the faults in
  effect (every field optional; ``{}`` clears; ``routes`` is a list of ``API_ROUTES`` names,
  absent or null for all) and echoes them (GET reads them)
- ``POST /_emulator/price {"publish_price_usd": "0.00001"}``: the price discovery reports
- ``POST /_emulator/reset``: forget queues, faults, counters, price changes and clock jumps
- ``GET /_emulator/state`` -> ``{"clock", "queues": {name: {type, dlq,
  visibility_timeout_default, message_count, available, in_flight, delayed}}, "requests":
  {route: n}, "connections_accepted", "faults", "faults_injected":
  {"latency"|"error"|"rate_limited"|"drop_response": n}, "publish_price_usd", "auth"}``
"""

from infrai_local.sandbox.emulator.cli import build_parser, main, serve
from infrai_local.sandbox.emulator.http import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    MAX_BODY_BYTES,
    EmulatorHTTPServer,
    RunningEmulator,
    start_in_thread,
)
from infrai_local.sandbox.emulator.parsing import parse_json_object
from infrai_local.sandbox.emulator.routes import bearer_token, match_api_route
from infrai_local.sandbox.emulator.state import (
    API_ROUTES,
    DEFAULT_VISIBILITY_TIMEOUT,
    Emulator,
    EmulatorClock,
    FaultConfig,
    FaultDecision,
)
from infrai_local.sandbox.queue_model import (
    MAX_BODY_DEPTH,
    MAX_SERVED_BODY_BYTES,
    ApiError,
    encode_answer,
    format_timestamp,
    new_message_id,
)

__all__ = [
    "API_ROUTES",
    "DEFAULT_HOST",
    "DEFAULT_PORT",
    "DEFAULT_VISIBILITY_TIMEOUT",
    "MAX_BODY_BYTES",
    "MAX_BODY_DEPTH",
    "MAX_SERVED_BODY_BYTES",
    "ApiError",
    "Emulator",
    "EmulatorClock",
    "EmulatorHTTPServer",
    "FaultConfig",
    "FaultDecision",
    "RunningEmulator",
    "bearer_token",
    "build_parser",
    "encode_answer",
    "format_timestamp",
    "main",
    "match_api_route",
    "new_message_id",
    "parse_json_object",
    "serve",
    "start_in_thread",
]
