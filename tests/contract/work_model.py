"""A small, pure model of ``job_claims`` for tests/contract/test_work_store_stateful.py: per key
the row docs/design.md predicts after each change, and what the change answers.

Time is the test's clock, in whole seconds from the start of a sequence. The test moves the
database's times back instead of waiting, so a time here stands for a stored time minus the
seconds the clock has jumped since it was stored. All the seconds the test uses are multiples of
thirty and a sequence runs for much less than that in real time, so "over" here is exactly the
database's ``lease_end < now()``: an end at or before the test's now is over (real time has
moved on a little since it was stored), an end after it is at least thirty seconds away.

A schedule (``run_after``, ``deferred_at``) is a stamp: its second and the order of the
statement that set it, which is how the database breaks a tie between two equal seconds (the
later statement stored the later real time).

Nothing here reads the database or calls the store: each rule below is the design's wording
(the state machine table, the outcome table, the lease rule, the takeover rule) written out.
Where the design says nothing (a column a change does not mention, the order in which a claim
that did not win is told why), the model keeps what the statement does, and says so.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field, replace
from typing import Final

# The queue's visibility timeout: a running row without a lease (the field notes' worker's) is
# held until its claim time plus this.
VISIBILITY: Final = 300

RUNNING, DEFERRED, DONE, FAILED, CANCELLED = "running", "deferred", "done", "failed", "cancelled"
DATABASE, EXTERNAL, IDEMPOTENT = "database", "external", "external_idempotent"

# A handler's run, as the drain reports it to the ledger.
SUCCEEDED, PERMANENT, UNCERTAIN, TRANSIENT = "succeeded", "permanent", "uncertain", "transient"

Stamp = tuple[int, int]  # (second on the test's clock, order of the statement that set it)


@dataclass(frozen=True, slots=True)
class Row:
    state: str
    message_id: str
    job: str | None
    effect: str | None
    fingerprint: str | None
    token: uuid.UUID | None
    attempts: int | None
    error: str | None
    claimed_at: int
    lease_until: int | None = None
    run_after: Stamp | None = None
    deferred_at: Stamp | None = None
    began: bool = False
    # Which attempt at the work this is: a new one for each claim, takeover, take and notes'
    # row. Not a column: what a probe's read is about (see ``probe_answer``).
    attempt: int = 0

    @property
    def owned(self) -> bool:
        return self.run_after is not None

    @property
    def flagged(self) -> bool:
        return self.error is not None

    def lease_end(self, visibility: int) -> int:
        """A stored lease, else the claim time plus the visibility timeout (the notes' rows)."""
        return self.claimed_at + visibility if self.lease_until is None else self.lease_until


@dataclass(frozen=True, slots=True)
class Work:
    """What a message brings to a new row: its id, the job, its effect class and fingerprint."""

    message_id: str
    job: str
    effect: str
    fingerprint: str


@dataclass(frozen=True, slots=True)
class Claimed:
    """What a delivery's claim attempt is told."""

    status: str  # a ClaimStatus value
    takeover: bool = False


@dataclass
class WorkModel:
    now: int = 0
    visibility: int = VISIBILITY
    rows: dict[str, Row] = field(default_factory=dict)
    _order: int = 0
    _attempts: int = 0

    # --- The rules every change shares ----------------------------------------------------------

    def _stamp(self, delay: int = 0) -> Stamp:
        self._order += 1
        return (self.now + delay, self._order)

    def _attempt(self) -> int:
        self._attempts += 1
        return self._attempts

    def attempt_of(self, key: str) -> int:
        return self.rows[key].attempt

    def over(self, row: Row) -> bool:
        return row.lease_end(self.visibility) <= self.now

    def live(self, row: Row) -> bool:
        """Held by a run right now: nobody but that run may change it."""
        return row.state == RUNNING and not self.over(row)

    def may_take_over(self, row: Row) -> bool:
        """The takeover rule: running, its lease over, not flagged for a human, and its effect
        may be repeated (an external run only if the ledger owns it and it never began)."""
        return (
            row.state == RUNNING
            and row.error is None
            and self.over(row)
            and (row.effect != EXTERNAL or (row.owned and not row.began))
        )

    def lease_for(self, lease_seconds: int, visibility_left: int | None) -> int:
        """A claim's lease never outlives its message's visibility window."""
        left = self.visibility if visibility_left is None else visibility_left
        return min(lease_seconds, max(left, 0), self.visibility)

    def _cut(self, row: Row) -> int:
        """The lease a run that gives up its hold leaves: ended now, unless it ended already."""
        return self.now if row.lease_until is None else min(row.lease_until, self.now)

    def _held_by(self, key: str, token: uuid.UUID) -> Row | None:
        row = self.rows.get(key)
        if row is None or row.state != RUNNING or row.token != token:
            return None
        return row

    # --- The clock ------------------------------------------------------------------------------

    def advance(self, seconds: int) -> None:
        self.now += seconds

    def end_lease(self, key: str) -> None:
        """The test kit's END_LEASE: the lease ended a second ago, whatever the state."""
        row = self.rows.get(key)
        if row is not None:
            self.rows[key] = replace(row, lease_until=self.now - 1)

    # --- A delivery ----------------------------------------------------------------------------

    def _new_row(
        self, state: str, work: Work, token: uuid.UUID | None, attempts: int, claimed_at: int
    ) -> Row:
        """A row for ``work`` as a claim or a deferral writes it: unflagged, a new attempt."""
        return Row(
            state, work.message_id, work.job, work.effect, work.fingerprint, token, attempts,
            None, claimed_at, attempt=self._attempt(),
        )  # fmt: skip

    def claim(self, key: str, work: Work, *, token: uuid.UUID, lease: int | None) -> Claimed:
        """A delivery claims ``key``: a new row, new work on a cancelled one, or a takeover of a
        key-passing job's own claim that the ledger does not own (by the takeover rule, or when
        its holder is this very message); anything else is told why not."""
        row = self.rows.get(key)
        lease_until = None if lease is None else self.now + lease
        if row is None or row.state == CANCELLED:
            new = self._new_row(RUNNING, work, token, 1, self.now)
            self.rows[key] = replace(new, lease_until=lease_until)
            return Claimed("won")
        if (
            not row.owned
            and row.effect == IDEMPOTENT
            and work.effect == IDEMPOTENT
            and row.fingerprint is not None
            and row.fingerprint == work.fingerprint
            and row.state == RUNNING
            and row.error is None
            and (self.may_take_over(row) or row.message_id == work.message_id)
        ):
            taken = self._new_row(RUNNING, work, token, (row.attempts or 1) + 1, row.claimed_at)
            self.rows[key] = replace(taken, lease_until=lease_until)
            return Claimed("won", takeover=True)
        return Claimed(self._not_won(row, work.message_id, work.fingerprint))

    def _not_won(self, row: Row, message_id: str, fingerprint: str) -> str:
        """The outcome table's rows, in ``states.decide``'s order (the design gives none)."""
        if row.fingerprint is not None and row.fingerprint != fingerprint:
            return "conflict"
        if row.state in (DONE, FAILED):
            return row.state
        if row.state == DEFERRED or row.owned:
            return "deferred"
        if row.error is not None or row.message_id == message_id or self.over(row):
            return "stuck"
        return "live"

    def flag_stuck(self, key: str, reason: str) -> None:
        """A delivery that cannot run its copy flags the running claim, once."""
        row = self.rows.get(key)
        if row is not None and row.state == RUNNING and row.error is None:
            self.rows[key] = replace(row, error=reason)

    def settle(self, key: str, token: uuid.UUID, kind: str, error: str) -> str:
        """The holder settles its run, whatever its lease; a settle its token no longer
        matches is lost. Answers a SettleStatus value."""
        row = self._held_by(key, token)
        if row is None:
            return "lost"
        if kind == SUCCEEDED:
            self.rows[key] = replace(row, state=DONE, error=None)
            return "done"
        if kind == PERMANENT:
            self.rows[key] = replace(row, state=FAILED, error=error)
            return "failed"
        if kind == UNCERTAIN:
            self.rows[key] = replace(row, error=error, lease_until=self._cut(row))
            return "stuck"
        del self.rows[key]
        return "released"

    def database_batch(
        self, key: str, work: Work, *, token: uuid.UUID, kind: str
    ) -> tuple[Claimed, str | None]:
        """A database job claims, runs and settles in one transaction: nothing of it stays
        ``running``; an uncertain run rolled back with its savepoint, so it is released."""
        claimed = self.claim(key, replace(work, effect=DATABASE), token=token, lease=None)
        if claimed.status != "won":
            return claimed, None
        return claimed, self.settle(key, token, TRANSIENT if kind == UNCERTAIN else kind, "E")

    # --- Deferred work: the holder, and the drains ------------------------------------------

    def defer(
        self, key: str, token: uuid.UUID, *, message_id: str, attempts: int, delay: int
    ) -> str:
        """The holder makes its claim wait; the ledger owns the work from here."""
        row = self._held_by(key, token)
        if row is None:
            return "claim_lost"
        stamp = self._stamp(delay)
        self.rows[key] = replace(
            row,
            state=DEFERRED,
            message_id=message_id,
            attempts=max(attempts, 0),
            error=None,
            run_after=stamp,
            deferred_at=row.deferred_at or (self.now, stamp[1]),
            token=None,
            lease_until=None,
            began=False,
        )
        return "deferred"

    def defer_new(self, key: str, work: Work, *, attempts: int, delay: int) -> str:
        """A dead letter taken back: new waiting work, only where no row holds the key."""
        if key in self.rows:
            return "already_held"
        stamp = self._stamp(delay)
        new = self._new_row(DEFERRED, work, None, attempts, self.now)
        self.rows[key] = replace(new, run_after=stamp, deferred_at=(self.now, stamp[1]))
        return "deferred"

    def release_for_take_back(self, key: str, token: uuid.UUID | None) -> bool:
        """A key-passing job's own claim, as read, released by the takeover rule."""
        row = self.rows.get(key)
        if (
            row is None
            or token is None
            or row.token != token
            or row.effect != IDEMPOTENT
            or row.owned
            or not self.may_take_over(row)
        ):
            return False
        del self.rows[key]
        return True

    def take_due(self, limit: int, lease: int) -> list[str]:
        """Due waiting work, or a run the ledger owns that may be taken over: the first
        ``limit`` of them (due first, then the oldest deferral, then the key), each running
        under a new lease with its attempt counted. Their tokens are bound by ``bind``."""
        due = [
            key
            for key, row in self.rows.items()
            if row.owned
            and (
                (
                    row.state == DEFERRED
                    and row.run_after is not None
                    and row.run_after[0] <= self.now
                )
                or self.may_take_over(row)
            )
        ]

        def order(key: str) -> tuple[Stamp, bool, Stamp, str]:
            row = self.rows[key]
            assert row.run_after is not None
            return (row.run_after, row.deferred_at is None, row.deferred_at or (0, 0), key)

        taken = sorted(due, key=order)[: max(limit, 0)]
        # A flag stays (the design does not say): only a deferral or a release clears it.
        for key in taken:
            row = self.rows[key]
            self.rows[key] = replace(
                row,
                state=RUNNING,
                attempts=(row.attempts or 0) + 1,
                token=None,
                lease_until=self.now + lease,
                began=False,
                attempt=self._attempt(),
            )
        return taken

    def bind(self, key: str, token: uuid.UUID) -> None:
        """The token a drain's ``take_due`` minted for ``key`` (the model cannot guess it)."""
        self.rows[key] = replace(self.rows[key], token=token)

    def begin(self, key: str, token: uuid.UUID) -> bool:
        row = self._held_by(key, token)
        if row is None:
            return False
        self.rows[key] = replace(row, began=True)
        return True

    def flag_uncertain(self, key: str, token: uuid.UUID, error: str) -> bool:
        """The holder does not know whether its effect happened: flagged, its lease ended."""
        row = self._held_by(key, token)
        if row is None:
            return False
        self.rows[key] = replace(row, error=error, lease_until=self._cut(row))
        return True

    def postpone(self, key: str, token: uuid.UUID, *, delay: int, ran: bool) -> bool:
        """The holder of a run the ledger owns makes it wait again (an attempt that did not
        run is given back)."""
        row = self._held_by(key, token)
        if row is None or not row.owned:
            return False
        # Its flag stays, as in take_due (the design does not say).
        self.rows[key] = replace(
            row,
            state=DEFERRED,
            attempts=(row.attempts or 0) - (0 if ran else 1),
            token=None,
            lease_until=None,
            began=False,
            run_after=self._stamp(delay),
        )
        return True

    def finish_or_fail(self, key: str, token: uuid.UUID, state: str, error: str | None) -> bool:
        """``store.finish`` / ``store.fail``: the holder settles, whatever its lease."""
        row = self._held_by(key, token)
        if row is None:
            return False
        self.rows[key] = replace(row, state=state, error=error if state == FAILED else None)
        return True

    # --- Anyone else: operators, probes, redrives ---------------------------------------------

    def refusal(self, key: str, allowed: tuple[str, ...], expected: uuid.UUID | None) -> str | None:
        """Why an operator's change is refused ("not_found", or a Refusal value), or None."""
        row = self.rows.get(key)
        if row is None:
            return "not_found"
        if row.state not in allowed:
            return "state"
        if self.live(row):
            return "lease_live"
        if expected is not None and row.token != expected:
            return "moved"
        return None

    def resolve(self, key: str, *, done: bool, expected: uuid.UUID | None) -> str | None:
        """``claims resolve --done/--failed``: a running claim whose lease is over."""
        refused = self.refusal(key, (RUNNING,), expected)
        if refused is None:
            self._settle_as_other(key, self.rows[key].token, DONE if done else FAILED)
        return refused

    def release(self, key: str, *, expected: uuid.UUID | None) -> str | None:
        """``claims release``: a running claim whose lease is over, or a failed one."""
        refused = self.refusal(key, (RUNNING, FAILED), expected)
        if refused is None:
            self._release(key, self.rows[key].token)
        return refused

    def _settle_as_other(self, key: str, token: uuid.UUID | None, state: str) -> bool:
        """Anyone but the holder settles the run ``token`` held when read (NULL on the notes'
        rows), only once its lease is over."""
        row = self.rows.get(key)
        if row is None or row.state != RUNNING or row.token != token or not self.over(row):
            return False
        error = "resolved as failed" if state == FAILED else None
        self.rows[key] = replace(row, state=state, error=error)
        return True

    def _release(self, key: str, token: uuid.UUID | None) -> bool:
        """A run whose effect did not happen, released by anyone but its holder once its lease
        is over (owned work waits again, due now; a message's claim is deleted), or a failed
        claim deleted to run again; only the row ``token`` held when read."""
        row = self.rows.get(key)
        if row is None or row.token != token:
            return False
        if row.owned and row.state == RUNNING:
            if not self.over(row):
                return False
            self.rows[key] = replace(
                row,
                state=DEFERRED,
                token=None,
                lease_until=None,
                began=False,
                error=None,
                run_after=self._stamp(),
            )
            return True
        if row.state == FAILED or (row.state == RUNNING and self.over(row)):
            del self.rows[key]
            return True
        return False

    def probe_answer(
        self, key: str, probed_token: uuid.UUID | None, probed_attempt: int, answer: str
    ) -> str:
        """A probe's answer about the attempt it read: a ReconcileWrite value. docs/design.md:
        "A probe asked about an attempt that has moved on (another delivery took the claim
        over, or an operator acted) is fenced out and changes nothing." The token read fences
        it, and on the notes' rows, which have none, so does the attempt itself: a row the
        notes' worker wrote again after an operator released the one probed is another
        attempt."""
        row = self.rows.get(key)
        if (
            row is None
            or row.state != RUNNING
            or row.token != probed_token
            or row.attempt != probed_attempt
        ):
            return "changed"
        if answer == "done":
            settled = self._settle_as_other(key, probed_token, DONE)
            return "settled_done" if settled else "lease_live"
        if answer == "not_done":
            return "released" if self._release(key, probed_token) else "lease_live"
        return "unchanged"

    def steer(self, key: str, state: str) -> str | None:
        """``claims run-now`` (state deferred: due now) and ``claims cancel`` on waiting work:
        "not_found" or "changed" when refused, else None."""
        row = self.rows.get(key)
        if row is None or not row.owned:
            return "not_found"
        if row.state != DEFERRED:
            return "changed"
        assert row.run_after is not None
        run_after = min(row.run_after, self._stamp()) if state == DEFERRED else row.run_after
        self.rows[key] = replace(row, state=state, run_after=run_after)
        return None

    def reopen_failed(self, message_id: str, fingerprint: str | None) -> list[str]:
        """A redrive deletes the failed claims of one piece of work."""
        reopened = sorted(
            key
            for key, row in self.rows.items()
            if row.state == FAILED
            and (
                row.message_id == message_id
                or (fingerprint is not None and row.fingerprint == fingerprint)
            )
        )
        for key in reopened:
            del self.rows[key]
        return reopened

    def notes_worker_claims(self, key: str, message_id: str) -> bool:
        """The field notes' worker: ``INSERT (idem_key, state, message_id) ... DO NOTHING``."""
        if key in self.rows:
            return False
        self.rows[key] = Row(
            RUNNING, message_id, None, None, None, None, 1, None, self.now,
            attempt=self._attempt(),
        )  # fmt: skip
        return True
