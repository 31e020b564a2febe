"""What ``infrai-jobs drain`` tells the person at the terminal while it drains.

One line per message that did not simply end well (its outcome, key, message id, delivery and
reason), one per Infrai call that is being retried, one per other warning, and at the end a
summary that tells transient retries from permanent failures. The lines are made from the
package's own log records, the ones DrainFunction writes as JSON, so the terminal and the logs
say the same things.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO

from infrai_jobs.drain.model import DrainSummary
from infrai_jobs.work.outcomes import OUTCOME_RULES

# The layer package's logger (observability.PACKAGE_LOGGER, not imported: it loads Powertools).
PACKAGE_LOGGER = "infrai_jobs"

# Printed first, in this order and under these names; any other field of a record follows.
_LEADING_FIELDS = (
    ("idem_key", "key"),
    ("message_id", "message_id"),
    ("delivery_count", "delivery"),
)
# Printed last, since it is free text; under the name the brief line uses.
_REASON_FIELDS = ("detail", "reason")
# Facts the line says already (the outcome's own ack column, the job inside the key).
_LEFT_OUT = frozenset({"acked", "action", "job"})
_STANDARD_ATTRIBUTES = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {
    "message",
    "asctime",
    "taskName",
}
_REASON_LIMIT = 500
# The drain's per-message log lines (drain._log, drain._log_ack).
_OUTCOME_MESSAGES = frozenset({"message %s", "ack %s"})


class DrainReport(logging.Handler):
    """A logging handler that writes the report's lines to ``stream``."""

    def __init__(self, stream: TextIO) -> None:
        # WARNING and up: what needs a look (drain.OUTCOME_RULES), retried calls included.
        super().__init__(logging.WARNING)
        self._stream = stream

    def emit(self, record: logging.LogRecord) -> None:
        self._stream.write(report_line(record) + "\n")
        self._stream.flush()

    def handleError(self, record: logging.LogRecord) -> None:
        # A closed terminal or pipe: there is nobody left to tell, and no traceback for it.
        return

    @contextmanager
    def attached(self) -> Iterator[None]:
        """Receive the package's records (WARNING and up) while the block runs."""
        with handler_attached(logging.getLogger(PACKAGE_LOGGER), self):
            yield


@contextmanager
def handler_attached(logger: logging.Logger, handler: logging.Handler) -> Iterator[None]:
    """``handler`` receives ``logger``'s records at the handler's own level while the block
    runs: a logger set to pass less is lowered to that level, and put back afterwards."""
    level = logger.level
    if logger.getEffectiveLevel() > handler.level:
        logger.setLevel(handler.level)
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def report_line(record: logging.LogRecord) -> str:
    """``retry  key=... message_id=... delivery=1 reason=...``; fields the record lacks are left
    out, fields the report does not know come before the reason."""
    fields: dict[str, Any] = {
        name: value
        for name, value in record.__dict__.items()
        if name not in _STANDARD_ATTRIBUTES and name not in _LEFT_OUT
    }
    action = getattr(record, "action", None) or record.levelname.lower()
    parts = [f"{action:<18}"]
    for name, label in _LEADING_FIELDS:
        if name in fields:
            parts.append(f"{label}={_value(fields.pop(name))}")
    reasons = [fields.pop(name) for name in _REASON_FIELDS if name in fields]
    for name, value in fields.items():
        parts.append(f"{name}={_value(value)}")
    if record.msg not in _OUTCOME_MESSAGES:
        # Not a message's outcome ("message retry", "ack ack_failed"), whose action word says
        # it all: the record's sentence says what happened.
        parts.append(f"({_one_line(record.getMessage())})")
    for reason in reasons:
        parts.append(f"reason={_value(reason, limit=_REASON_LIMIT)}")
    return " ".join(parts).rstrip()


def _value(value: Any, *, limit: int = 200) -> str:
    if value is None or value == "":
        return "-"
    if isinstance(value, list | tuple | set | frozenset):
        text = ",".join(str(v) for v in value) or "-"
    else:
        text = str(value)
    text = _one_line(text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _by_outcome(summary: DrainSummary, bucket: str) -> str:
    """`` (1 duplicate_in_flight)``: the outcomes a summary total is made of, under the labels
    the JSON's ``outcomes`` and the log lines use; "" when the total is 0."""
    parts = [
        f"{summary.outcomes[outcome.value]} {outcome.value}"
        for outcome, rule in OUTCOME_RULES.items()
        if rule.bucket == bucket and summary.outcomes.get(outcome.value)
    ]
    return f" ({', '.join(parts)})" if parts else ""


def summary_lines(summary: DrainSummary) -> list[str]:
    """The summary in words: what ran, what comes back by itself, what waits for a human."""
    duplicates, parked = _by_outcome(summary, "duplicates"), _by_outcome(summary, "parked")
    # Deferral is shown only when there was some: a drain without flow control reads as before.
    deferred = f", {summary.deferred} deferred" if summary.deferred else ""
    lines = [
        f"drained {summary.consumed} message(s) in {summary.batches} batch(es): "
        f"{summary.done} done, {summary.duplicates} duplicate(s){duplicates}, "
        f"{summary.retried} retried, {summary.failed} failed, "
        f"{summary.parked} parked{parked}{deferred}; {summary.acked} acked "
        f"({summary.ack_lost} ack_lost, {summary.ack_failed} ack_failed); "
        f"stopped: {summary.stopped or '-'}"
    ]
    if summary.answers_lost:
        lines.append(
            f"  {summary.answers_lost} consume answer(s) lost or unreadable, "
            f"{summary.unreadable} of them a message received alone: it walks to the DLQ by "
            "itself, the messages received with the others come back after the visibility "
            "timeout"
        )
    lines.extend(_deferred_lines(summary))
    if summary.retried:
        lines.append(
            f"  {summary.retried} retried: the handler raised; the message comes back after the "
            "visibility timeout and runs again (the third unacked delivery goes to the DLQ)"
        )
    if summary.failed or summary.parked:
        lines.append(
            f"  {summary.failed + summary.parked} failed or parked: not acked, they walk to the "
            "DLQ for a human; see `infrai-jobs dlq` and `infrai-jobs claims stuck`"
        )
    return lines


def _deferred_lines(summary: DrainSummary) -> list[str]:
    """Flow control's share of the drain: messages it deferred, deferred jobs it ran from the
    ledger (they were consumed by an earlier drain, so no total above counts them), waits."""
    lines = []
    if summary.deferred:
        lines.append(
            f"  {summary.deferred} deferred: the ledger holds them (acked) and a later drain runs "
            "each when it is due; see `infrai-jobs claims list --state deferred`"
        )
    ran = summary.counters["deferred_ran"]
    if ran:
        lines.append(
            f"  {ran} deferred job(s) run from the ledger: {summary.counters['deferred_done']} "
            f"done, {summary.counters['deferred_failed']} failed for good (those are dead "
            "letters: `infrai-jobs dlq`); the rest wait for their next attempt"
        )
    waits = summary.counters["rate_limit_waits"]
    if waits:
        lines.append(f"  {waits} rate-limit wait(s): handler starts held back by a job's rate")
    return lines
