"""The package's one exception tree; adapters raise these ``from`` the driver's or HTTP's error.
No message here ever contains the Infrai API key."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


class InfraiJobsError(Exception):
    """Base of every error this package raises on purpose."""


class ConfigurationError(InfraiJobsError):
    """A setting is missing or malformed; the message names the setting and the fix."""


def unset_for_jobs(
    owners: Mapping[str, Sequence[str]], values: Mapping[str, str], each: str = ""
) -> str:
    """ "NAME is not set, and job(s) ... need it" for each name of ``owners`` unset in ``values``,
    followed by ``each`` (``{name}``: that name); "" when every one is set."""
    return "; ".join(
        f"{name} is not set, and job(s) {', '.join(jobs)} need it" + each.format(name=name)
        for name, jobs in owners.items()
        if not values.get(name)
    )


class TransportError(InfraiJobsError):
    """The exchange failed below HTTP: connect, TLS, timeout, a dropped or malformed answer.
    Never leaves the queue client, which turns it into ``InfraiUnavailable``."""


class TlsVerificationFailed(TransportError):
    """The certificate or hostname did not verify, before anything was sent; never retried."""


class AnswerTooLarge(TransportError):
    """The answer is longer than the limit; ``size`` is its declared length, when it declared one.
    The wire reader raises it; the pool raises it again naming the host."""

    def __init__(self, message: str, size: int | None = None) -> None:
        super().__init__(message)
        self.size = size


class ProtocolError(InfraiJobsError):
    """Broken HTTP/1.1 framing or a broken limit; the pool raises it as a ``TransportError``."""


class InfraiError(InfraiJobsError):
    """Infrai answered with an error envelope, or could not be reached. ``code`` is Infrai's
    (``QUEUE_NOT_FOUND``, ...) or ours for transport failures (``CONNECTION_ERROR``, ...);
    ``status`` is the HTTP status, 0 when no answer arrived."""

    def __init__(self, code: str, message: str, status: int = 0, *, call: str = "") -> None:
        self.code, self.message, self.status, self.call = code, message, status, call
        where = f"{call}: " if call else ""
        super().__init__(f"{where}{code} (HTTP {status}): {message}")


class InfraiUnavailable(InfraiError):
    """A transport failure or a retryable answer (429, 5xx) that outlived the retries;
    ``retry_after``: the seconds the answer asked to wait, if it said."""

    retry_after: float | None = None


class UntrustedServer(InfraiError):
    """Infrai's server could not be verified, so nothing was sent; final, never retried."""


class InfraiInvalidResponse(InfraiError):
    """Infrai answered, but not in a shape the contract allows."""


class ConsumeAnswerLost(InfraiUnavailable):
    """A consume may have been served, but its answer was lost or could not be read (too
    large, not JSON, cut off, or a 5xx after the call may have applied): every message it served
    is now in flight and has spent one of its three deliveries, unseen. Callers isolate the
    cause by consuming one message at a time. ``message_ids``: those still readable, if any."""

    def __init__(
        self,
        code: str,
        message: str,
        status: int = 0,
        *,
        queue: str = "",
        max_messages: int = 0,
        size: int | None = None,
        message_ids: tuple[str, ...] = (),
    ) -> None:
        super().__init__(code, message, status, call="consume")
        self.queue, self.max_messages = queue, max_messages
        self.size, self.message_ids = size, message_ids


class QueueMessageNotFound(InfraiError):
    """An ack named a handle the queue no longer holds (already acked, or dead-lettered);
    harmless, since the claim already settled the work (counted as ``ack_lost``)."""


class KeyDerivationError(InfraiJobsError):
    """No idempotency key can be derived from the payload; left unacked, it reaches the DLQ."""


class UnknownJob(KeyDerivationError):
    """The payload names a job the registry lacks; the message says the closest name it has."""


class InvalidPayload(KeyDerivationError):
    """The payload does not match its job's declared fields (the message names every such
    field): rejected before a claim, and by a checked publish before it is sent."""


class PermanentJobError(InfraiJobsError):
    """Retrying cannot help: the claim is marked ``failed`` and the message goes to the DLQ."""


class EffectUncertain(InfraiJobsError):
    """An irreversible effect may or may not have happened; a human must reconcile it. The
    claim stays ``running`` and is flagged stuck; the message is not acked."""


class OutboxError(InfraiJobsError):
    """The outbox cannot take this intent as asked (not inside a transaction, a ``key=`` that
    contradicts the payload's own); nothing was written."""


class OutboxKeyConflict(OutboxError):
    """The outbox already holds this key with different work: a second intent under one key,
    never treated as a retry of the first."""


class LedgerError(InfraiJobsError):
    """The claim ledger (Postgres) failed or is unreachable."""


class LedgerUnavailable(LedgerError):
    """The database could not be reached or dropped the connection."""


class DatabaseBusy(LedgerUnavailable):
    """Up, but full: the database or a pooler before it refused a connection at its limit, or
    timed out waiting for one. The drain waits for its first connection or sheds a lane."""


class SchemaNotMigrated(LedgerError):
    """The ledger's tables are missing or older than this code: run ``infrai-jobs migrate``."""


class SchemaTooNew(SchemaNotMigrated):
    """The schema's floor is above this code's version; refused as a schema behind it is."""


class FanOutError(InfraiJobsError):
    """Another drain could not be started; the drain that asked goes on (the next check or tick
    tries again)."""


class FanOutThrottled(FanOutError):
    """Lambda throttled the invoke: expected under load, counted, never an error that pages."""


class ClaimNotFound(InfraiJobsError):
    """No claim has this key (and, for ``claims show``, no operator history either)."""


class ClaimChanged(InfraiJobsError):
    """The claim is no longer in the state (or held by the token) the operator saw. When the
    store refused a fenced change: ``row``, the claim as it read it, and ``refusal``, why."""

    def __init__(self, message: str, *, row: Any = None, refusal: str = "") -> None:
        super().__init__(message)
        self.row, self.refusal = row, refusal


class EffectInProgress(InfraiJobsError):
    """Another call for the same key is inside its effect right now. Transient: the drain
    releases the claim and the redelivery asks again once that call has finished."""


class SecondLayerUnavailable(InfraiJobsError):
    """The idempotency store failed before the effect ran. Transient: nothing happened."""
