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

A probe settles what it checked: it answers ``Done`` only for the effect this claim stands for
(the invoice's receipt, the digest under this key), never for whatever the provider lists.
``Done``'s result is bounded (``MAX_PROBE_RESULT_BYTES`` of JSON): the claim and its history
store it, and a provider's whole answer can be megabytes. A larger one is replaced by a small
object that says so (``truncated``, a ``note``, its size and SHA-256, and its start).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, ClassVar, Final, TypeAlias

# The answers' names, as metrics, claim_history and the CLI spell them.
DONE: Final = "done"
NOT_DONE: Final = "not_done"
UNKNOWN: Final = "unknown"
ANSWERS: Final = (DONE, NOT_DONE, UNKNOWN)


# The most JSON a probe's Done result may take in the claim; a reference (an id, a digest)
# needs a few dozen bytes.
MAX_PROBE_RESULT_BYTES: Final = 4096
# How much of a cut result's JSON text is kept, so a human can see what it was.
_KEPT_START_CHARS: Final = 1024


@dataclass(frozen=True, slots=True)
class Done:
    """The provider has the effect; ``result`` is what the claim stores (its reference),
    bounded: see ``bounded_result``."""

    result: Any = None
    answer: ClassVar[str] = DONE

    def __post_init__(self) -> None:
        object.__setattr__(self, "result", bounded_result(self.result))


def bounded_result(result: Any) -> Any:
    """``result`` when its JSON fits ``MAX_PROBE_RESULT_BYTES``, else a small object saying it
    was cut, with its size, its SHA-256 and its start."""
    text = json.dumps(result, default=str, ensure_ascii=False)
    size = len(text.encode("utf-8"))
    if size <= MAX_PROBE_RESULT_BYTES:
        return result
    return {
        "truncated": True,
        "note": (
            f"the probe's result was {size} bytes of JSON, above the {MAX_PROBE_RESULT_BYTES}"
            "-byte bound: only its start is kept; store a reference (an id), not the answer"
        ),
        "size_bytes": size,
        "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
        "start": text[:_KEPT_START_CHARS],
    }


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
