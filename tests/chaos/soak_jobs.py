"""The soak's own ``database`` job: its effect is a row in the ledger's database, so it can be
counted exactly, and its ``mode`` steers the outcome the soak expects.

Shared by the soak (to derive keys) and the drain processes (to run it).
"""

from __future__ import annotations

from typing import LiteralString

from infrai_jobs.errors import PermanentJobError
from infrai_jobs.jobs.registry import Effect, JobContext, JobRegistry, JsonValue, Payload

SOAK_JOB = "soak.db"

SOAK_EFFECTS_DDL: LiteralString = """
CREATE TABLE IF NOT EXISTS soak_effects (
    idem_key   text NOT NULL,
    message_id text NOT NULL,
    delivery   int NOT NULL
)
"""

_RECORD_EFFECT: LiteralString = """
INSERT INTO soak_effects (idem_key, message_id, delivery)
VALUES (%(key)s, %(message_id)s, %(delivery)s)
"""

# ok: succeeds; flaky: fails (transiently) on a message's first delivery; permanent: always
# raises PermanentJobError. The effect row is written first in every mode, so a failure must
# roll it back.
MODES = ("ok", "flaky", "permanent")


def run_soak_job(payload: Payload, ctx: JobContext) -> JsonValue:
    if ctx.db is None:  # pragma: no cover - the drain always passes it for database jobs
        raise RuntimeError("soak.db needs the batch transaction's connection")
    ctx.db.execute(
        _RECORD_EFFECT,
        {"key": ctx.idem_key, "message_id": ctx.message_id, "delivery": ctx.delivery_count},
    )
    mode = payload.get("mode", "ok")
    if mode == "permanent":
        raise PermanentJobError(f"soak job {payload['id']} fails permanently by design")
    if mode == "flaky" and ctx.delivery_count == 1:
        raise RuntimeError(f"soak job {payload['id']} fails on a first delivery by design")
    return {"id": payload["id"], "delivery": ctx.delivery_count}


# The soak's flow-control policies (JOB_POLICIES, the shape): digest.build retries up to
# six times (1, 2, then 3 s apart; its last three attempts run from the ledger, deferred) and
# runs one job per tenant at a time; receipt.send starts at most RECEIPTS_PER_SECOND a second.
RECEIPTS_PER_SECOND = 50
DIGEST_ATTEMPTS = 6
JOB_POLICIES = {
    "digest.build": {
        "retry": {
            "attempts": DIGEST_ATTEMPTS,
            "first_delay_seconds": 1,
            "factor": 2,
            "max_delay_seconds": 3,
        },
        "concurrency": {"key": ["tenant_id"], "max_running": 1},
    },
    "receipt.send": {"rate": {"per_second": RECEIPTS_PER_SECOND}},
}

# A digest.build payload field: the provider refuses this job's calls (HTTP 503, nothing
# built), during an outage of its first three attempts (OUTAGE: deferred after its third
# delivery, done by a deferred run) or always (REFUSED: failed for good once its retry policy
# is out of attempts, its dead letter held by the ledger).
REFUSE_FIELD = "soak_refuse"
OUTAGE = "outage"
REFUSED = "always"
OUTAGE_ATTEMPTS = 3


def provider_refuses(payload: Payload, attempt: int) -> bool:
    """Whether the soak's provider refuses this run (``attempt``: the message's delivery, or
    the ledger's attempt count for a deferred run)."""
    mode = payload.get(REFUSE_FIELD)
    return mode == REFUSED or (mode == OUTAGE and attempt <= OUTAGE_ATTEMPTS)


def register_soak_jobs(registry: JobRegistry) -> JobRegistry:
    registry.job(SOAK_JOB, effect=Effect.DATABASE, identity=("id",))(run_soak_job)
    return registry
