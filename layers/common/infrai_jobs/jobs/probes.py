"""Reconcile probes: an external job's way of asking its provider "did this happen?".

A job whose effect is ``external`` or ``external_idempotent`` may declare a probe
(``registry.job(..., probe=fn)``). When one of its claims is stuck (a ``running`` claim whose
outcome nobody knows), the reconcile pass (``infrai_jobs.operations.reconcile``) calls
``fn(payload, ctx)`` and acts on the answer:

* ``Done(result)``: the provider has the effect; the claim settles ``done`` with ``result``.
* ``NotDone()``: the provider has no trace of it; the claim is released, so the next delivery
  (or a redrive) runs the job once.
* ``Unknown(reason)``: the provider cannot tell; the claim stays stuck for a human.

A probe that raises, answers something else, or does not answer within its time limit counts
as ``Unknown``: a claim changes only on a clear answer.

The ledger keeps no payload (a receipt's holds an e-mail address), so ``payload`` is what the
claim's key names: ``job`` and the job's identity fields, as strings, read back from a natural
key. A claim keyed otherwise (a producer's ``_idempotency_key``, a content hash) gets ``job``
alone; ``ctx.idem_key`` is always there, and is what an idempotent provider is asked by.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Final, TypeAlias

# The answers' names, as metrics, claim_history and the CLI spell them.
DONE: Final = "done"
NOT_DONE: Final = "not_done"
UNKNOWN: Final = "unknown"
ANSWERS: Final = (DONE, NOT_DONE, UNKNOWN)


@dataclass(frozen=True, slots=True)
class Done:
    """The provider has the effect; ``result`` is what the claim stores (its reference)."""

    result: Any = None
    answer: ClassVar[str] = DONE


@dataclass(frozen=True, slots=True)
class NotDone:
    """The provider has no trace of the effect: running the job again does it once."""

    answer: ClassVar[str] = NOT_DONE


@dataclass(frozen=True, slots=True)
class Unknown:
    """The provider cannot say; ``reason`` tells the human who looks next why not."""

    reason: str = ""
    answer: ClassVar[str] = UNKNOWN


ProbeAnswer: TypeAlias = Done | NotDone | Unknown
