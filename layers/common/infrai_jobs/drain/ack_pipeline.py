"""Acks sent together and their answers read later, so they overlap the next batch's work."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from infrai_jobs.drain.batch import MessageResult, describe_error, log_message
from infrai_jobs.errors import InfraiError, InfraiUnavailable, QueueMessageNotFound
from infrai_jobs.queue.models import Pending
from infrai_jobs.queue.ports import QueuePort
from infrai_jobs.queue_contract import CONSUME_CAP

if TYPE_CHECKING:
    from infrai_jobs.drain.model import DrainSummary

logger = logging.getLogger(__name__)

# Batches whose acks may still be travelling when the next batch's are sent.
ACKS_IN_FLIGHT_BATCHES = 2
# Connections a lane may hold open to Infrai: one per ack travelling and the consume sent ahead.
# The client's pool keeps this many per lane, or lanes would reconnect (TCP and TLS) for more.
HTTP_CONNECTIONS_PER_LANE = ACKS_IN_FLIGHT_BATCHES * CONSUME_CAP + 1


class AckPipeline:
    """Once a batch's acks are sent, the answers of the batch before it are read (by then they
    have usually arrived): at most ``ACKS_IN_FLIGHT_BATCHES`` batches of acks travel at once."""

    def __init__(self, queue: QueuePort, queue_name: str, summary: DrainSummary) -> None:
        self._queue = queue
        self._queue_name = queue_name
        self.summary = summary
        self._pending: list[list[tuple[MessageResult, Pending[None]]]] = []

    def send(self, results: Sequence[MessageResult]) -> None:
        batch: list[tuple[MessageResult, Pending[None]]] = []
        # Appended before sending: if a send raises, what was sent is still waited for.
        self._pending.append(batch)
        for r in results:
            if r.ack:
                batch.append((r, self._queue.send_ack(self._queue_name, r.message.receipt_handle)))
        while len(self._pending) > ACKS_IN_FLIGHT_BATCHES - 1:
            self._collect(self._pending.pop(0))

    def wait_all(self) -> None:
        """Read every answer still due; an unexpected error is raised after all are read."""
        first_error: Exception | None = None
        while self._pending:
            try:
                self._collect(self._pending.pop(0))
            except Exception as exc:  # noqa: BLE001 - raised below, once the rest are read
                first_error = first_error or exc
        if first_error is not None:
            raise first_error

    def _collect(self, batch: list[tuple[MessageResult, Pending[None]]]) -> None:
        summary = self.summary
        # Once Infrai failed one ack through all its retries, the rest of the batch get their sent
        # request's answer only: an outage costs one ack's retries per batch, not ten in a row.
        retry = True
        unexpected: Exception | None = None
        for result, pending in batch:
            try:
                pending.wait(retry=retry)
            except QueueMessageNotFound:
                summary.ack_lost += 1
                log_message(logger, logging.WARNING, "ack %s", result, "ack_lost", detail="")
            except Exception as exc:  # noqa: BLE001 - the other answers are read first
                # Infrai's error is harmless: the redelivery finds the claim settled, and is acked
                # then. Any other (a refreshed API key that cannot be used, a bug) is raised once
                # the rest of the batch is read, so no connection is left half-used.
                infrai = isinstance(exc, InfraiError)
                retry = retry and not isinstance(exc, InfraiUnavailable)
                summary.ack_failed += 1
                detail = str(exc) if infrai else describe_error(exc)
                log_message(logger, logging.WARNING, "ack %s", result, "ack_failed", detail=detail)
                if not infrai:
                    unexpected = unexpected or exc
            else:
                summary.acked += 1
        if unexpected is not None:
            raise unexpected
