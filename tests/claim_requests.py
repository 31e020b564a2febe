"""A delivery's claim as the drain asks the ledger for it, built one way by every test of the
claim rules (the ledger contract, the fakes, the state machine). Importable from every test
folder (pytest puts ``tests/`` on the path for its ``conftest.py``)."""

from __future__ import annotations

from infrai_jobs.jobs.registry import Effect
from infrai_jobs.work.states import ClaimRequest

KEY = "job:1"
# The payload's fingerprint (a SHA-256, in hex) a request carries unless told otherwise.
FP = "a" * 64
# Shorter than any visibility timeout these tests give a ledger, so the lease is kept whole.
LEASE_SECONDS = 20.0


def claim_request(
    key: str = KEY,
    *,
    message_id: str = "qmsg_me",
    job: str = "job",
    effect: Effect = Effect.EXTERNAL,
    fingerprint: str = FP,
    lease_seconds: float = LEASE_SECONDS,
    visibility_left: float | None = None,
) -> ClaimRequest:
    """``message_id``'s claim of ``key``, with a fresh token. A database job's claim is never
    committed, so it carries no lease."""
    return ClaimRequest(
        idem_key=key,
        message_id=message_id,
        job=job,
        effect=effect,
        fingerprint=fingerprint,
        lease_seconds=None if effect is Effect.DATABASE else lease_seconds,
        visibility_left=visibility_left,
    )
