"""Who is at the command line, and how the command line words a fenced change it refuses.

The layer records whatever actor its caller names and refuses a fenced change for a reason
(``claims_admin.Refusal``); the operator's identity and the commands to type instead are the
command line's own, so they live here, never in the deployed layer.
"""

from __future__ import annotations

import getpass
import os
import uuid

from infrai_jobs.ledger.claims import ClaimRow
from infrai_jobs.operations.claims_admin import Refusal, refusal


def default_actor() -> str:
    """Who is acting: OPERATOR if set, else the login name (recorded, never trusted)."""
    return os.environ.get("OPERATOR") or getpass.getuser()


# The command an operator types for each change recorded in claim_history: what error texts name.
COMMANDS = {
    "resolve_done": "claims resolve --done",
    "resolve_failed": "claims resolve --failed",
    "release": "claims release",
}


def change_refused(
    row: ClaimRow, *, command: str, allowed_states: tuple[str, ...], token: uuid.UUID | None
) -> str:
    """Why ``infrai-jobs COMMAND`` is refused for ``row``, or "" when it may go ahead."""
    why = refusal(row, allowed_states=allowed_states, token=token)
    key = row.idem_key
    if why is None:
        return ""
    if why is Refusal.STATE:
        return (
            f"claim {key!r} is {row.state}; `infrai-jobs {command}` needs a "
            f"{' or '.join(allowed_states)} claim"
        )
    if why is Refusal.LEASE_LIVE:
        until = row.lease_until.isoformat() if row.lease_until is not None else "?"
        return (
            f"claim {key!r} is running under a live lease until {until}; wait for it to end, "
            f"or run `infrai-jobs {command} {key} --token {row.claim_token}` to act on it anyway"
        )
    return (
        f"claim {key!r} is now held by token {row.claim_token}, not {token}: it changed "
        f"since you looked; run `infrai-jobs claims show {key}` again"
    )
