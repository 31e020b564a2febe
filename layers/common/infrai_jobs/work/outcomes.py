"""The outcome table of docs/design.md as data: every way one message can end, in one place. The
drain, its summary, the logs and the metrics derive from ``OUTCOME_RULES``; a test keeps the
table in docs/design.md equal to it."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from infrai_jobs.work.states import ClaimStatus, SettleStatus


class Outcome(StrEnum):
    DONE = "done"
    # Both count under the summary's ``duplicates``, and say so (as their metrics do).
    DUPLICATE = "duplicate_done"
    IN_FLIGHT = "duplicate_in_flight"
    BATCH_DUPLICATE = "batch_duplicate"
    RETRY = "retry"
    FAILED = "failed"
    DUPLICATE_FAILED = "duplicate_failed"
    STUCK = "stuck"
    CONFLICT = "conflict"
    REJECTED = "rejected"
    CLAIM_LOST = "claim_lost"
    LEDGER_UNAVAILABLE = "ledger_unavailable"
    DEFERRED = "deferred"


@dataclass(frozen=True, slots=True)
class OutcomeRule:
    ack: bool  # whether the message is acked (else it comes back, and reaches the DLQ)
    bucket: str  # the DrainSummary total it adds to
    level: int  # its log line's level: WARNING or ERROR when a human may have to act
    metric: str  # the EMF metric that counts it
    meaning: str  # when it happens
    ledger: str  # what the claim ledger shows afterwards


# Transient retries are WARNING (they fix themselves, unless they keep coming); what needs a
# human's fix is ERROR. Laid out as the table it is (docs/design.md shows it).
_INFO, _WARNING, _ERROR = logging.INFO, logging.WARNING, logging.ERROR
OUTCOME_RULES: Final[dict[Outcome, OutcomeRule]] = {
    Outcome.DONE: OutcomeRule(True, "done", _INFO, "OutcomeDone",
        "ran now, succeeded", "`done`, result stored"),
    Outcome.DUPLICATE: OutcomeRule(True, "duplicates", _INFO, "OutcomeDuplicateDone",
        "duplicate of `done`", "unchanged"),
    Outcome.IN_FLIGHT: OutcomeRule(True, "duplicates", _INFO, "OutcomeDuplicateInFlight",
        "another delivery holds a live claim (its message drives the retries)", "unchanged"),
    Outcome.BATCH_DUPLICATE: OutcomeRule(False, "parked", _WARNING, "OutcomeBatchDuplicate",
        "a second copy in the same batch, whose first copy was not acked", "unchanged"),
    Outcome.RETRY: OutcomeRule(False, "retried", _WARNING, "OutcomeRetry",
        "handler raised: redelivered, dead-lettered after 3", "claim released"),
    Outcome.FAILED: OutcomeRule(False, "failed", _ERROR, "OutcomeFailed",
        "handler raised `PermanentJobError`: goes to the DLQ", "`failed`, error stored"),
    Outcome.DUPLICATE_FAILED: OutcomeRule(False, "parked", _WARNING, "OutcomeDuplicateFailed",
        "duplicate of `failed`", "unchanged"),
    Outcome.STUCK: OutcomeRule(False, "parked", _ERROR, "OutcomeStuck",
        "an irreversible effect's outcome is unknown: `EffectUncertain`, our own redelivery "
        "finds our `running` row, or an `external` claim's lease expired",
        "stays `running`, flagged stuck"),
    Outcome.CONFLICT: OutcomeRule(False, "parked", _ERROR, "OutcomePayloadMismatch",
        "same key, different work (payload fingerprint)", "unchanged"),
    Outcome.REJECTED: OutcomeRule(False, "parked", _ERROR, "OutcomeRejected",
        "no key derivable: not an object, unknown job, missing field", "none"),
    Outcome.CLAIM_LOST: OutcomeRule(False, "parked", _ERROR, "OutcomeClaimLost",
        "a fenced settle matched no row (the claim was lost)", "unchanged"),
    Outcome.LEDGER_UNAVAILABLE: OutcomeRule(False, "parked", _ERROR, "OutcomeLedgerUnavailable",
        "the database failed before the outcome settled", "unchanged (rolled back)"),
    Outcome.DEFERRED: OutcomeRule(True, "deferred", _INFO, "OutcomeDeferred",
        "flow control holds the job back (a transient failure with retry attempts left, a "
        "rate limit or a concurrency key), or it is a copy of work deferred already",
        "the claim waits as `deferred` (payload, attempts, next run); a drain runs it later"),
}  # fmt: skip

ACKED_OUTCOMES: Final = frozenset(o for o, rule in OUTCOME_RULES.items() if rule.ack)
OUTCOME_METRICS: Final = {o.value: rule.metric for o, rule in OUTCOME_RULES.items()}

# A claim attempt that did not win ends its message here; one that won is decided by its settlement.
CLAIM_OUTCOMES: Final = {
    ClaimStatus.DONE: Outcome.DUPLICATE,
    ClaimStatus.LIVE: Outcome.IN_FLIGHT,
    ClaimStatus.FAILED: Outcome.DUPLICATE_FAILED,
    ClaimStatus.STUCK: Outcome.STUCK,
    ClaimStatus.CONFLICT: Outcome.CONFLICT,
    ClaimStatus.DEFERRED: Outcome.DEFERRED,
}
SETTLE_OUTCOMES: Final = {
    SettleStatus.DONE: Outcome.DONE,
    SettleStatus.FAILED: Outcome.FAILED,
    SettleStatus.RELEASED: Outcome.RETRY,
    SettleStatus.STUCK: Outcome.STUCK,
    SettleStatus.LOST: Outcome.CLAIM_LOST,
    SettleStatus.DEFERRED: Outcome.DEFERRED,
}
