"""Reconcile probes: an external job's way of asking its provider "did this happen?" about a
stuck claim (``operations.reconcile`` acts on a clear answer only; docs/jobs.md). The ledger keeps
no payload: a probe gets ``job`` and the identity fields read back from a natural key, and
``ctx.idem_key``."""

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
# The most JSON a Done result may take in the claim; a reference needs a few dozen bytes.
MAX_PROBE_RESULT_BYTES: Final = 4096
# How much of a cut result's JSON text is kept, so a human can see what it was.
_KEPT_START_CHARS: Final = 1024


@dataclass(frozen=True, slots=True)
class Done:
    """The provider has this claim's effect (not merely something like it); ``result`` is what
    the claim stores, a reference. One whose JSON exceeds ``MAX_PROBE_RESULT_BYTES`` is replaced
    by a small object saying it was cut, with its size, its SHA-256 and its start."""

    result: Any = None
    answer: ClassVar[str] = DONE

    def __post_init__(self) -> None:
        text = json.dumps(self.result, default=str, ensure_ascii=False)
        data = text.encode("utf-8")
        if len(data) <= MAX_PROBE_RESULT_BYTES:
            return
        cut = {
            "truncated": True,
            "note": (
                f"the probe's result was {len(data)} bytes of JSON, above the "
                f"{MAX_PROBE_RESULT_BYTES}-byte bound: only its start is kept; store a reference "
                "(an id), not the answer"
            ),
            "size_bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
            "start": text[:_KEPT_START_CHARS],
        }
        object.__setattr__(self, "result", cut)


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
