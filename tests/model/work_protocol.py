"""An executable model of the work protocol, explored over every interleaving within bounds.

What it models, per idempotency key: the ``job_claims`` row (state, token, lease, the flag for a
human, whether the ledger owns the work, attempts, began), the queue's copies of the key's
messages (their deliveries; three, then the DLQ), Infrai's DLQ and the ledger's dead letters,
and what the work did outside the ledger (how often its external effect ran, or its database
effect committed). The actors that race: drain lanes delivering copies (claim, run, settle, ack),
drains running deferred work (take due, begin, run, finish/postpone/fail), the field notes' Node
worker (a claim with a NULL lease, unfenced settles), a reconcile probe (ask, then write), an
operator with every verb, and the clock. Any actor may be killed at any step.

Time is abstract. A *tick* ends every lease whose holder is gone and every visibility window of a
copy whose lane is gone (a lease outlives its invocation, and never its message's window), and
makes deferred work due. A NULL lease (the notes' worker writes one) is live until its claim time
plus the visibility timeout, so it too ends only at a tick, once its worker is gone.

Each transition is a small function with its guard, naming the production rule it mirrors. The
rules are the target ones: nobody but the run holding a live lease changes its work; a NULL lease
is live until claimed_at + visibility for every reader; a human's ``resolve --failed`` is reopened
only by an explicit reopen (``redrive --reopen-failed``, or ``claims release`` of that row).

Run it: ``python -m tests.model.work_protocol --keys 2 --actors 3 --steps 16`` (``--help``;
``--all`` explores the broken variants too, ``make model MODEL_ARGS=...`` the same).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, NamedTuple, TypeVar

# --- Vocabulary ---------------------------------------------------------------------------------

# Row states (work.states.WORK_STATES); a key without a row has ``row = None``.
RUNNING: Final = "running"
DEFERRED: Final = "deferred"
DONE: Final = "done"
FAILED: Final = "failed"
CANCELLED: Final = "cancelled"

# Leases of a running row. A row that is not running holds none.
LIVE: Final = "live"
OVER: Final = "over"
NULL_LIVE: Final = "null_live"  # NULL lease_until, before claimed_at + visibility
NULL_OVER: Final = "null_over"  # NULL lease_until, after it
NO_LEASE: Final = "-"

# The kinds of job a key can belong to: the three effect classes, and an irreversible and a
# key-passing job with a retry policy of more attempts than the queue has deliveries (flow
# control defers them).
DATABASE: Final = "database"
EXTERNAL: Final = "external"
IDEMPOTENT: Final = "external_idempotent"
RETRY: Final = "retry"  # external, with a retry policy
IDEMPOTENT_RETRY: Final = "idempotent_retry"  # external_idempotent, with a retry policy
KINDS: Final = (DATABASE, EXTERNAL, IDEMPOTENT, RETRY, IDEMPOTENT_RETRY)
IRREVERSIBLE: Final = (EXTERNAL, RETRY)  # effect class external: at most once
KEY_PASSING: Final = (IDEMPOTENT, IDEMPOTENT_RETRY)  # effect class external_idempotent
RETRIED: Final = (RETRY, IDEMPOTENT_RETRY)  # a retry policy: deferred, taken back
PROBED: Final = (EXTERNAL, RETRY)  # declares a reconcile probe
NODE_JOBS: Final = (EXTERNAL,)  # what the notes' worker knows how to run

MAX_DELIVERIES: Final = 3  # queue_contract.MAX_RECEIVE_COUNT
RETRY_ATTEMPTS: Final = 4  # the retry job's policy: more than MAX_DELIVERIES
EFFECT_CAP: Final = 2  # effects are counted up to "more than once"

# Actors and their stages.
LANE: Final = "lane"  # a drain lane delivering one copy
DEFERRED_RUN: Final = "deferred_run"  # a drain running work the ledger owns
NODE: Final = "node"  # the field notes' Node worker
PROBE: Final = "probe"  # a reconcile pass asking a provider about one claim
RECEIVED: Final = "received"
CLAIMED: Final = "claimed"
RAN: Final = "ran"
ACKING: Final = "acking"
TAKEN: Final = "taken"
BEGUN: Final = "begun"
ASKED: Final = "asked"
HOLDING_STAGES: Final = (CLAIMED, RAN, TAKEN, BEGUN)  # between winning work and settling it

# What a run of a handler can do. Only two outcomes leave an effect behind, so only those stop
# between the call and its settle (a kill there differs from a kill before the call).
SUCCESS: Final = "success"
TRANSIENT: Final = "transient"
PERMANENT: Final = "permanent"
UNCERTAIN_AFTER: Final = "uncertain_after_effect"
UNCERTAIN_BEFORE: Final = "uncertain_before_effect"
RUN_OUTCOMES: Final = (SUCCESS, TRANSIENT, PERMANENT, UNCERTAIN_AFTER, UNCERTAIN_BEFORE)
EFFECT_OUTCOMES: Final = (SUCCESS, UNCERTAIN_AFTER)

# Invariant names (what a counterexample reports).
ONE_LIVE_HOLDER: Final = "one_live_holder"
EXTERNAL_ONCE: Final = "external_effect_at_most_once"
DATABASE_ONCE: Final = "database_effect_exactly_once_when_done"
OWNED_NOT_DEAD_LETTERED: Final = "owned_work_not_dead_lettered"
NO_VERB_UNDER_LIVE_LEASE: Final = "no_verb_under_live_lease"
HUMAN_VERDICT_STANDS: Final = "human_verdict_stands"
QUIET_MEANS_SETTLED: Final = "quiet_means_settled"
INVARIANTS: Final = (
    ONE_LIVE_HOLDER,
    EXTERNAL_ONCE,
    DATABASE_ONCE,
    OWNED_NOT_DEAD_LETTERED,
    NO_VERB_UNDER_LIVE_LEASE,
    HUMAN_VERDICT_STANDS,
    QUIET_MEANS_SETTLED,
)

# The verbs an explicit reopen of a human's failed verdict is made with.
EXPLICIT_REOPENS: Final = ("claims release", "redrive --reopen-failed")
# Every other verb names a transition of ``work.states.WORK_TRANSITIONS``, except these steps
# of the queue, the clock and the effects, which change no row; ``prune`` is not modelled.
MODEL_ONLY_STEPS: Final = ("receive", "run", "ack", "kill", "tick", "probe", "dlq", "redrive")
FLAG_UNCERTAIN_DEFERRED: Final = "flag uncertain (deferred run)"
NOT_MODELLED: Final = ("prune",)


# --- State ---------------------------------------------------------------------------------------
# Plain tuples, so a state hashes, compares and sorts; only what can change a future is kept
# (a settled row keeps no token or lease), so equal futures are one state.


class Row(NamedTuple):
    """A ``job_claims`` row (work.states.ClaimRow), reduced to what decides its future."""

    state: str
    lease: str
    flagged: bool  # error set on a running row: flagged for a human
    owned: bool  # run_after set: the ledger owns the work
    attempts: int  # work the ledger owns only
    began: bool  # began_at set: an external deferred run called its handler
    due: bool  # a deferred row whose run_after has passed
    human: bool  # a failed row a human resolved as failed
    node: bool  # written by the notes' worker: no token, effect class or fingerprint


class Copy(NamedTuple):
    """One message of the key on the queue, not held by a live actor."""

    deliveries: int
    held: bool  # received by a lane that is gone: hidden until its visibility window ends
    mine: bool  # the row's message_id is this message's


class Actor(NamedTuple):
    role: str
    stage: str
    current: bool  # its token (a probe: the token it read) is still the row's
    deliveries: int  # of the copy it holds (lanes and the notes' worker)
    mine: bool  # the row's message_id is its copy's
    note: str  # a pending outcome, a probe's answer


# Where an unresolved dead letter came from (``dead_letters.dlq``).
FROM_DLQ: Final = "dlq"  # moved out of Infrai's DLQ
LEDGER_HELD: Final = "ledger"  # LEDGER_HELD_DLQ: deferred work a drain failed (out of attempts)
RESOLVED_FAILED: Final = "resolved"  # RESOLVED_FAILED_DLQ: deferred work a human resolved failed


class Letter(NamedTuple):
    """An unresolved row of the ledger's ``dead_letters``."""

    source: str


class Key(NamedTuple):
    kind: str
    row: Row | None
    copies: tuple[Copy, ...]
    actors: tuple[Actor, ...]
    dlq: int  # messages in Infrai's DLQ, not yet moved into the ledger
    letters: tuple[Letter, ...]
    effects: int  # external effect calls made, or database effects committed (capped)
    # The notes' worker acked a copy of failed or stuck work (its "already claimed: skip"
    # path), so that message never reaches the DLQ: a hazard of running it beside the drain,
    # outside the protocol's control (see ``Bounds.strict_node``).
    node_dropped: bool = False
    # A human (or a probe) handed back work that had stopped for one (a stuck or failed claim
    # released, a failed claim reopened): the retry policy's promise that no single death spends
    # the last delivery starts again only with a fresh message.
    handed_back: bool = False


class State(NamedTuple):
    keys: tuple[Key, ...]
    kills: int


class Act(NamedTuple):
    """One transition: the verb (the production transition or step it mirrors), whether the
    actor making it holds the key's claim, and a line for a trace."""

    verb: str
    holder: bool
    text: str
    final: bool = False  # a failure for good (``PermanentJobError``), not spent attempts


class Move(NamedTuple):
    act: Act
    before: Key | None  # the key it changed, as it was; None for the clock
    after: Key | None
    state: State


@dataclass(frozen=True, slots=True)
class Bounds:
    kinds: tuple[str, ...] = (EXTERNAL, RETRY)  # one key of each
    actors: int = 3  # actors alive at once (lanes, deferred runs, the notes' worker, a probe)
    steps: int = 14  # transitions from the initial state
    kills: int = 1  # actor deaths along one path
    copies: int = 1  # messages published per key at the start (2: a producer's retry)
    node: bool = True  # the notes' worker consumes the same queue
    probe: bool = True
    operator: bool = True
    # Count work whose failed copy the notes' worker acked as *not* settled (the hazard shows
    # as a counterexample); by default it is accepted as settled and counted apart.
    strict_node: bool = False

    def describe(self) -> str:
        return (
            f"keys={len(self.kinds)} ({', '.join(self.kinds)}), actors={self.actors}, "
            f"steps={self.steps}, kills={self.kills}, copies={self.copies}, "
            f"node={'on' if self.node else 'off'}, probe={'on' if self.probe else 'off'}, "
            f"operator={'on' if self.operator else 'off'}"
        )


# --- Row rules, pure, each naming the production rule it mirrors --------------------------------


def lease_live(row: Row | None) -> bool:
    """The one lease rule, for every reader (``work.statements.lease_end``: ``coalesce(
    lease_until, claimed_at + visibility)``): a NULL lease is live until claim time
    plus the visibility timeout."""
    return row is not None and row.state == RUNNING and row.lease in (LIVE, NULL_LIVE)


def running_row(*, owned: bool = False, attempts: int = 0, node: bool = False) -> Row:
    lease = NULL_LIVE if node else LIVE
    return Row(RUNNING, lease, False, owned, attempts, False, False, False, node)


def waiting_row(attempts: int, *, due: bool) -> Row:
    """A deferred row: no token, no lease (``statements.DEFER``, ``POSTPONE``,
    ``RELEASE_OWNED``)."""
    return Row(DEFERRED, NO_LEASE, False, True, attempts, False, due, False, False)


def settled_row(state: str, *, human: bool = False) -> Row:
    """done, failed or cancelled: nothing about its last run decides anything any more."""
    return Row(state, NO_LEASE, False, False, 0, False, False, human, False)


def takes_over(row: Row, kind: str, mine: bool) -> bool:
    """``statements.CLAIM``'s ON CONFLICT ... WHERE: cancelled work is free; a running claim is
    taken over only by a key-passing job, for the same work (a row of the notes' worker has no
    effect class), never flagged, never ledger-owned, and only by ``TAKEOVER`` (its lease over)
    or by its own message (whose earlier delivery is certainly gone)."""
    if row.state == CANCELLED:
        return True
    return (
        row.state == RUNNING
        and not row.owned
        and kind in KEY_PASSING
        and not row.node
        and not row.flagged
        and (row.lease == OVER or mine)
    )


def claim_decision(row: Row | None, kind: str, mine: bool) -> str:
    """``work.states.decide`` after the claim statement: won, or why not."""
    if row is None or takes_over(row, kind, mine):
        return "won"
    if row.state == DONE:
        return "done"
    if row.state == FAILED:
        return "failed"
    if row.state == DEFERRED or row.owned:
        return "deferred"
    if row.flagged or mine or not lease_live(row):
        return "stuck"
    return "live"


ACKED_DECISIONS: Final = ("done", "deferred", "live")  # work.outcomes: acked outcomes


def claimed_row() -> Row:
    """The row a won claim leaves (``statements.CLAIM``): running, a new token and a live lease, the
    attempts of a delivery's claim no longer deciding anything."""
    return running_row()


def flag_stuck(row: Row | None) -> Row | None:
    """``statements.FLAG_STUCK``: annotate a running row no one flagged yet (not fenced: no
    state change)."""
    if row is None or row.state != RUNNING or row.flagged:
        return row
    return row._replace(flagged=True)


def flag_uncertain(row: Row) -> Row:
    """``statements.MARK_UNCERTAIN`` / ``FLAG_UNCERTAIN``: flagged, and the lease ends now."""
    lease = NULL_OVER if row.lease in (NULL_LIVE, NULL_OVER) else OVER
    return row._replace(flagged=True, lease=lease)


def due_for_a_drain(row: Row | None, kind: str) -> bool:
    """``statements.TAKE_DUE``: ledger-owned work that waits and is due, or a run of it that
    ``TAKEOVER`` allows (lease over, not flagged, not an external run that began its call)."""
    if row is None or not row.owned:
        return False
    if row.state == DEFERRED:
        return row.due
    external_began = kind in IRREVERSIBLE and row.began
    return row.state == RUNNING and row.lease == OVER and not row.flagged and not external_began


def for_a_human(row: Row | None, kind: str) -> bool:
    """``statements.STUCK_CLAIM`` (what ``claims stuck`` lists and the watcher pages on): a
    running row whose lease is over and that is flagged, a delivery's claim untouched past the
    threshold (here: any whose lease is over), or an external deferred run that began."""
    if row is None or row.state != RUNNING or lease_live(row):
        return False
    if row.flagged or not row.owned:
        return True
    return kind in IRREVERSIBLE and row.began


def dead_lettered(key: Key) -> bool:
    return key.dlq > 0 or bool(key.letters)


# --- Tuple helpers --------------------------------------------------------------------------------


T = TypeVar("T")
Tup = TypeVar("Tup", bound=tuple[Any, ...])


def _without(items: tuple[T, ...], item: T) -> tuple[T, ...]:
    at = items.index(item)
    return items[:at] + items[at + 1 :]


def _with(items: tuple[Tup, ...], item: Tup) -> tuple[Tup, ...]:
    return tuple(sorted((*items, item)))


def _distinct(items: Iterable[T]) -> list[T]:
    return list(dict.fromkeys(items))


def _key_order(key: Key) -> tuple[object, ...]:
    """Keys sort by everything they hold (no row first): two keys of one kind are
    interchangeable, so a state lists them in this order (symmetry reduction)."""
    return (key.kind, key.row or (), *key[2:])


# --- The protocol ---------------------------------------------------------------------------------

KeyMove = tuple[Act, Key]


class Protocol:
    """The correct target rules. A broken variant overrides one guard below."""

    name = "correct"

    def __init__(self, bounds: Bounds) -> None:
        self.bounds = bounds
        self._steps: dict[tuple[str, str], Callable[[Key, Actor], Iterator[KeyMove]]] = {
            (LANE, RECEIVED): self.lane_claim,
            (LANE, CLAIMED): self.lane_run,
            (LANE, RAN): self.lane_settle,
            (LANE, ACKING): self.ack,
            (NODE, RECEIVED): self.node_claim,
            (NODE, CLAIMED): self.node_run,
            (NODE, RAN): self.node_settle,
            (NODE, ACKING): self.ack,
            (DEFERRED_RUN, TAKEN): self.deferred_begin,
            (DEFERRED_RUN, BEGUN): self.deferred_run,
            (DEFERRED_RUN, RAN): self.deferred_settle,
            (PROBE, ASKED): self.probe_write,
        }

    # -- The guards the variants swap ---------------------------------------------------------

    def operator_sees_lease_over(self, row: Row) -> bool:
        """``work.admin.refusal`` and ``statements.SETTLE_AS_OTHER``/``RELEASE_*``'s
        ``lease_over``: a NULL lease is live until claimed_at + visibility."""
        return not lease_live(row)

    def probe_may_release(self, row: Row) -> bool:
        """``work.store.release`` for a probe's ``not_done``: only once the lease is over, for
        a delivery's claim and for a deferred run alike."""
        return not lease_live(row)

    def defers_now(self, deliveries: int) -> bool:
        """``drain.flow.FlowControl.around_handler``: at the first transient failure with
        attempts left, so no single death can spend the message's last delivery."""
        return deliveries < RETRY_ATTEMPTS

    def probe_may_ask(self, row: Row) -> bool:
        """A probe asks only about a claim its answer may act on: one whose lease is already
        over, so no run can make the call between the answer and its write (the watcher's
        candidates, ``STUCK_CLAIM``, are all such claims)."""
        return not lease_live(row) or self.probe_may_release(row)

    def plain_redrive_reopens(self, letter: Letter, row: Row) -> bool:
        """``redrive.redrive`` without ``--reopen-failed``: a letter the ledger holds for a
        drain's failure reopens the failed claim, unless the claim's failure is a human's verdict
        (held back, for deferred work too, and for a letter older than that verdict)."""
        return letter.source == LEDGER_HELD and not row.human

    # -- The initial state and the moves ------------------------------------------------------

    def initial(self) -> State:
        fresh = tuple(Copy(0, False, False) for _ in range(self.bounds.copies))
        keys = (Key(kind, None, fresh, (), 0, (), 0) for kind in self.bounds.kinds)
        return State(tuple(sorted(keys, key=_key_order)), 0)

    def successors(self, state: State) -> Iterator[Move]:
        actors = [a for k in state.keys for a in k.actors]
        room = len(actors) < self.bounds.actors
        node_idle = self.bounds.node and all(a.role != NODE for a in actors)
        probe_idle = self.bounds.probe and all(a.role != PROBE for a in actors)
        may_kill = state.kills < self.bounds.kills
        for index, key in enumerate(state.keys):
            for act, after in self.key_moves(key, room=room, node_idle=node_idle):
                yield _move(state, index, act, after, 0)
            if room and probe_idle and key.kind in PROBED:
                for act, after in self.probe_asks(key):
                    yield _move(state, index, act, after, 0)
            if may_kill:
                for act, after in self.kills(key):
                    yield _move(state, index, act, after, 1)
            if self.bounds.operator:
                for act, after in self.operator_moves(key):
                    yield _move(state, index, act, after, 0)
        ticked = tick(state)
        if ticked != state:
            clock = Act("tick", False, "clock: leases and visibility windows end")
            yield Move(clock, None, None, ticked)

    def key_moves(self, key: Key, *, room: bool, node_idle: bool) -> Iterator[KeyMove]:
        """What the automatic actors can do on this key: each live actor's next step, and new
        actors starting (a delivery, the notes' worker, a drain taking due work)."""
        for actor in _distinct(key.actors):
            yield from self.actor_step(key, actor)
        if not room:
            return
        for copy in _distinct(c for c in key.copies if not c.held):
            yield self.receive(key, copy, LANE)
            if node_idle and key.kind in NODE_JOBS:
                yield self.receive(key, copy, NODE)
        if due_for_a_drain(key.row, key.kind):
            yield self.take_due(key)

    def automatic_moves(self, state: State) -> bool:
        """Whether anything but the clock, a probe or an operator can move."""
        if any(k.actors for k in state.keys):
            return True
        return any(
            any(not c.held for c in k.copies) or due_for_a_drain(k.row, k.kind) for k in state.keys
        )

    def at_rest(self, state: State) -> State | None:
        """When nothing moves on its own now, nor once the clock runs (only a human can help):
        the state after the clock; otherwise None."""
        if self.automatic_moves(state):
            return None
        later = tick(state)
        return None if self.automatic_moves(later) else later

    # -- Actors: steps ------------------------------------------------------------------------
    # Each step gets the key without its actor (``rest``) and puts it back, changed, or ends it.

    def actor_step(self, key: Key, actor: Actor) -> Iterator[KeyMove]:
        rest = key._replace(actors=_without(key.actors, actor))
        yield from self._steps[(actor.role, actor.stage)](rest, actor)

    def receive(self, key: Key, copy: Copy, role: str) -> KeyMove:
        """Infrai's consume: one of the copy's deliveries is spent as it is received."""
        actor = Actor(role, RECEIVED, False, copy.deliveries + 1, copy.mine, "")
        after = _attach(key._replace(copies=_without(key.copies, copy)), actor)
        who = "the notes' worker" if role == NODE else "lane"
        return Act("receive", False, f"{who} receives a copy (delivery {actor.deliveries})"), after

    def lane_claim(self, rest: Key, actor: Actor) -> Iterator[KeyMove]:
        if rest.kind == DATABASE:
            yield from self.database_batch(rest, actor)
            return
        decision = claim_decision(rest.row, rest.kind, actor.mine)
        text = f"lane claims (delivery {actor.deliveries}): {decision}"
        if decision == "won":
            # statements.CLAIM: claim, claim (new work), claim (takeover)
            verbs = {None: "claim", CANCELLED: "claim (new work)"}
            verb = verbs.get(None if rest.row is None else rest.row.state, "claim (takeover)")
            yield Act(verb, False, text), _hand_over(rest, actor, claimed_row(), CLAIMED)
        elif decision in ACKED_DECISIONS:
            yield Act("claim", False, text), _attach(rest, _acking(actor))
        elif decision == "stuck":
            # not acked; flagged for a human (drain.batch, statements.FLAG_STUCK)
            flagged = _set_row(rest, flag_stuck(rest.row))
            yield Act("flag stuck", False, text), _end(flagged, actor, acked=False)
        else:
            yield Act("claim", False, text), _end(rest, actor, acked=False)

    def database_batch(self, rest: Key, actor: Actor) -> Iterator[KeyMove]:
        """``work.ledger.PostgresLedger.run_database_batch``: claim, run and settle in one
        transaction, so
        no running row is ever committed; a failure rolls the effect back."""
        decision = claim_decision(rest.row, rest.kind, actor.mine)
        text = f"lane claims a database job: {decision}"
        if decision in ACKED_DECISIONS:
            yield Act("claim", False, text), _attach(rest, _acking(actor))
        elif decision != "won":
            yield Act("claim", False, text), _end(rest, actor, acked=False)
        else:
            done = _attach(_effect(_settle(rest, settled_row(DONE))), _acking(actor))
            yield Act("settle done", False, "lane runs a database job: done, committed"), done
            rolled_back = _end(rest, actor, acked=False)
            yield Act("claim", False, "lane's database job raises: rolled back"), rolled_back
            failed = _end(_settle(rest, settled_row(FAILED)), actor, acked=False)
            yield Act("settle failed", False, "lane's database job fails for good"), failed

    def lane_run(self, rest: Key, actor: Actor) -> Iterator[KeyMove]:
        """``drain.batch.run_handler``, then its settle."""
        yield from self._run_handler(
            rest, actor, "lane runs the handler", self._lane_settle_without_effect
        )

    def _run_handler(
        self,
        rest: Key,
        actor: Actor,
        who: str,
        settle_without_effect: Callable[[Key, Actor, str, str], KeyMove],
    ) -> Iterator[KeyMove]:
        """Each outcome of one run of the handler. An outcome with an effect stops after the
        call; any other settles in the same step: a kill between the two equals a kill before
        the call."""
        for outcome in RUN_OUTCOMES:
            text = f"{who}: {outcome}"
            if outcome in EFFECT_OUTCOMES:
                ran = _attach(_effect(rest), actor._replace(stage=RAN, note=outcome))
                yield Act("run", True, text), ran
            else:
                yield settle_without_effect(rest, actor, outcome, text)

    def _lane_settle_without_effect(
        self, rest: Key, actor: Actor, outcome: str, text: str
    ) -> KeyMove:
        if outcome == TRANSIENT and rest.kind in RETRIED and self.defers_now(actor.deliveries):
            return self.defer(rest, actor, text)
        if outcome == TRANSIENT:
            return self.fenced(rest, actor, "release (transient)", None, text)
        if outcome == PERMANENT:
            return self.fenced(rest, actor, "settle failed", settled_row(FAILED), text)
        return self.fenced(rest, actor, "flag uncertain", _uncertain(rest.row), text)

    def lane_settle(self, rest: Key, actor: Actor) -> Iterator[KeyMove]:
        if actor.note == SUCCESS:
            text = "lane settles done"
            yield self.fenced(rest, actor, "settle done", settled_row(DONE), text, acked=True)
        else:
            text = "lane flags its outcome uncertain"
            yield self.fenced(rest, actor, "flag uncertain", _uncertain(rest.row), text)

    def fenced(
        self,
        rest: Key,
        actor: Actor,
        verb: str,
        row: Row | None,
        text: str,
        *,
        acked: bool = False,
    ) -> KeyMove:
        """A settle fenced by the run's token (``statements._FENCED``: ``claim_token = $t AND
        state = 'running'``); zero rows is ``claim_lost``: not acked. A flag keeps the token."""
        if not _holds(rest, actor):
            return Act(verb, True, f"{text}; fenced out (claim lost)"), _end(rest, actor, False)
        after = _set_row(rest, row) if verb == "flag uncertain" else _settle(rest, row)
        if acked:
            return Act(verb, True, text), _attach(after, _acking(actor))
        return Act(verb, True, text), _end(after, actor, acked=False)

    def defer(self, rest: Key, actor: Actor, text: str) -> KeyMove:
        """``work.store.defer`` with the run's token (``DEFER``): the ledger owns the work
        from here, and the message is acked. A lost claim is released instead (its fallback),
        which matches nothing either: not acked."""
        if not _holds(rest, actor):
            return Act("defer", True, f"{text}; defer fenced out"), _end(rest, actor, False)
        after = _settle(rest, waiting_row(actor.deliveries, due=False))
        return Act("defer", True, f"{text}; deferred"), _attach(after, _acking(actor))

    def ack(self, rest: Key, actor: Actor) -> Iterator[KeyMove]:
        yield Act("ack", False, f"{actor.role} acks its copy"), _end(rest, actor, acked=True)

    # -- The field notes' Node worker -------------------------------------------------------

    def node_claim(self, rest: Key, actor: Actor) -> Iterator[KeyMove]:
        """``INSERT (idem_key, state, message_id) ON CONFLICT DO NOTHING``: a row without a
        token, a lease, an effect class or a fingerprint; a conflict is skipped and acked."""
        if rest.row is None:
            text = "the notes' worker inserts its claim (NULL lease)"
            yield (
                Act("claim", False, text),
                _hand_over(rest, actor, running_row(node=True), CLAIMED),
            )
        else:
            text = "the notes' worker finds a row: skip, ack"
            stopped = rest.row.state == FAILED or for_a_human(rest.row, rest.kind)
            skipped = rest._replace(node_dropped=True) if stopped else rest
            yield Act("claim", False, text), _attach(skipped, _acking(actor))

    def node_run(self, rest: Key, actor: Actor) -> Iterator[KeyMove]:
        ran = _attach(_effect(rest), actor._replace(stage=RAN))
        yield Act("run", True, "the notes' worker runs the job"), ran
        # It throws: ``DELETE ... WHERE idem_key = $1 AND state = 'running'``, by key alone.
        row = None if rest.row is not None and rest.row.state == RUNNING else rest.row
        thrown = _end(_settle(rest, row) if row != rest.row else rest, actor, acked=False)
        yield Act("release (transient)", actor.current, "the notes' worker's job throws"), thrown

    def node_settle(self, rest: Key, actor: Actor) -> Iterator[KeyMove]:
        """``UPDATE job_claims SET state = 'done' WHERE idem_key = $1``: by key alone."""
        after = _settle(rest, settled_row(DONE)) if rest.row is not None else rest
        text = "the notes' worker marks done (by key alone)"
        yield Act("settle done", actor.current, text), _attach(after, _acking(actor))

    # -- Deferred work (drain.flow and work.store: take due, begin, run, finish/postpone/fail) --

    def take_due(self, key: Key) -> KeyMove:
        """``work.store.take_due``: a new token and lease on the same row, its attempt
        counted."""
        assert key.row is not None
        verb = "take due" if key.row.state == DEFERRED else "take due (takeover)"
        row = running_row(owned=True, attempts=key.row.attempts + 1)
        actor = Actor(DEFERRED_RUN, TAKEN, False, 0, False, "")
        text = f"a drain takes the due work (attempt {row.attempts})"
        return Act(verb, False, text), _hand_over(key, actor, row, TAKEN)

    def deferred_begin(self, rest: Key, actor: Actor) -> Iterator[KeyMove]:
        """``work.store.begin`` (external runs only): from here it is never taken again."""
        if rest.kind not in IRREVERSIBLE:
            yield Act("begin", True, "deferred run starts"), _attach(rest, _stage(actor, BEGUN))
        elif not _holds(rest, actor):
            yield Act("begin", True, "deferred run's begin fenced out"), _end(rest, actor, True)
        else:
            assert rest.row is not None
            began = _set_row(rest, rest.row._replace(began=True))
            yield Act("begin", True, "deferred run begins"), _attach(began, _stage(actor, BEGUN))

    def deferred_run(self, rest: Key, actor: Actor) -> Iterator[KeyMove]:
        yield from self._run_handler(
            rest, actor, "deferred run's handler", self._deferred_settle_without_effect
        )

    def _deferred_settle_without_effect(
        self, rest: Key, actor: Actor, outcome: str, text: str
    ) -> KeyMove:
        """``FlowControl._settle``: permanent fails it, an external run's uncertain outcome is
        flagged, anything else is postponed until its attempts are spent, then failed."""
        if not _holds(rest, actor):
            return Act("postpone", True, f"{text}; fenced out"), _end(rest, actor, True)
        assert rest.row is not None
        if outcome == UNCERTAIN_BEFORE and rest.kind in IRREVERSIBLE:
            flagged = _set_row(rest, _uncertain(rest.row))
            return Act(FLAG_UNCERTAIN_DEFERRED, True, text), _end(flagged, actor, True)
        if outcome == PERMANENT or rest.row.attempts >= RETRY_ATTEMPTS:
            return self.deferred_fail(rest, actor, text, final=outcome == PERMANENT)
        waiting = _settle(rest, waiting_row(rest.row.attempts, due=False))
        return Act("postpone", True, f"{text}; postponed"), _end(waiting, actor, True)

    def deferred_fail(self, rest: Key, actor: Actor, text: str, *, final: bool) -> KeyMove:
        """``work.store.fail``: failed, and a dead letter the ledger holds (its message was
        acked long ago)."""
        failed = _settle(rest, settled_row(FAILED))
        failed = failed._replace(letters=_with(failed.letters, Letter(LEDGER_HELD)))
        act = Act("fail (and hold a dead letter)", True, f"{text}; failed", final)
        return act, _end(failed, actor, acked=True)

    def deferred_settle(self, rest: Key, actor: Actor) -> Iterator[KeyMove]:
        if not _holds(rest, actor):
            yield Act("finish", True, "deferred run's settle fenced out"), _end(rest, actor, True)
        elif actor.note == SUCCESS:
            done = _settle(rest, settled_row(DONE))
            yield Act("finish", True, "deferred run finishes: done"), _end(done, actor, True)
        elif rest.kind in IRREVERSIBLE:
            flagged = _set_row(rest, _uncertain(rest.row))
            text = "deferred run flags its outcome uncertain"
            yield Act(FLAG_UNCERTAIN_DEFERRED, True, text), _end(flagged, actor, True)
        else:
            yield self.deferred_postpone_after_effect(rest, actor)

    def deferred_postpone_after_effect(self, rest: Key, actor: Actor) -> KeyMove:
        assert rest.row is not None
        if rest.row.attempts >= RETRY_ATTEMPTS:
            text = "deferred run: uncertain, attempts spent"
            return self.deferred_fail(rest, actor, text, final=False)
        waiting = _settle(rest, waiting_row(rest.row.attempts, due=False))
        text = "deferred run: uncertain; postponed (the downstream takes our key)"
        return Act("postpone", True, text), _end(waiting, actor, True)

    # -- A probe (operations.reconcile, work.admin: ask, then write fenced by the token read) --

    def probe_asks(self, key: Key) -> Iterator[KeyMove]:
        """``Reconciler.reconcile``: a provider answers truthfully about a running claim
        (``unknown`` changes nothing, so it is not a move)."""
        if key.row is None or key.row.state != RUNNING or not self.probe_may_ask(key.row):
            return
        answer = "done" if key.effects else "not_done"
        probe = Actor(PROBE, ASKED, True, 0, False, answer)
        yield Act("probe", False, f"probe asks the provider: {answer}"), _attach(key, probe)

    def probe_write(self, rest: Key, actor: Actor) -> Iterator[KeyMove]:
        """``WorkStore.apply_probe_answer``: nothing unless the row is still running under the
        token as read (``IS NOT DISTINCT FROM``: a NULL token too); done settles it
        (``store.settle_as_other``), not done releases it (``store.release``), once the lease
        is over."""
        row = rest.row
        if row is None or row.state != RUNNING or not actor.current:
            yield Act("probe", False, "probe's answer is fenced out (changed)"), rest
        elif actor.note == "done" and not lease_live(row):
            yield (
                Act("reconcile done", False, "probe settles done"),
                _settle(rest, settled_row(DONE)),
            )
        elif actor.note == "not_done" and self.probe_may_release(row):
            released = _settle(rest, _released(row))._replace(handed_back=True)
            yield Act("reconcile not done", False, "probe releases the claim"), released
        else:
            text = "probe's write meets a live lease: unchanged"
            yield Act("probe", False, text), rest

    # -- Kills ---------------------------------------------------------------------------------

    def kills(self, key: Key) -> Iterator[KeyMove]:
        """Any actor dies at any step (a probe's death changes nothing, so it is left out)."""
        for actor in _distinct(a for a in key.actors if a.role != PROBE):
            rest = key._replace(actors=_without(key.actors, actor))
            text = f"{actor.role} killed at {actor.stage}"
            yield Act("kill", False, text), _end(rest, actor, acked=False)

    # -- The operator (work.admin.WorkStore, operations.redrive, operations.dead_letters) ------
    # Truthful: a human checks the provider first, so releases and ``--failed`` verdicts are
    # given only where an irreversible effect did not happen, ``--done`` only where it did.

    def operator_moves(self, key: Key) -> Iterator[KeyMove]:
        yield from self.resolve(key)
        yield from self.release(key)
        yield from self.steer_deferred(key)
        for letter in _distinct(key.letters):
            yield from self.redrive(key, letter, reopen=False)
            yield from self.redrive(key, letter, reopen=True)
        if key.dlq:
            yield self.collect(key)

    def resolve(self, key: Key) -> Iterator[KeyMove]:
        """``claims resolve --done|--failed`` (``WorkStore.resolve``): a running row whose lease
        is over, through ``store.settle_as_other`` (fenced by the token as read, NULL too); failed
        work the ledger owns gets a dead letter that is a human's verdict."""
        row = key.row
        if row is None or row.state != RUNNING:
            return
        if not self.operator_sees_lease_over(row):
            return
        effect = key.effects > 0 or key.kind not in IRREVERSIBLE
        if effect:
            yield (
                Act("claims resolve --done", False, "operator resolves --done"),
                _settle(key, settled_row(DONE)),
            )
        if not key.effects:
            failed = _settle(key, settled_row(FAILED, human=True))
            if row.owned:
                failed = failed._replace(letters=_with(failed.letters, Letter(RESOLVED_FAILED)))
            yield Act("claims resolve --failed", False, "operator resolves --failed"), failed

    def release(self, key: Key) -> Iterator[KeyMove]:
        """``claims release`` (``WorkStore.release``): a running row whose lease is over (owned
        work waits again, due now; a delivery's claim is deleted), or a failed row (deleted)."""
        row = key.row
        if row is None or (key.effects and key.kind in IRREVERSIBLE):
            return
        if row.state == FAILED:
            reopened = _settle(key, None)._replace(handed_back=True)
            yield Act("claims release", False, "operator releases the failed claim"), reopened
        elif row.state == RUNNING and self.operator_sees_lease_over(row):
            released = _settle(key, _released(row))._replace(handed_back=True)
            yield Act("claims release", False, "operator releases the claim"), released

    def steer_deferred(self, key: Key) -> Iterator[KeyMove]:
        """``claims run-now`` and ``claims cancel`` (``STEER_DEFERRED``): waiting work only."""
        row = key.row
        if row is None or row.state != DEFERRED or not row.owned:
            return
        if not row.due:
            yield (
                Act("claims run-now", False, "operator: run now"),
                _set_row(key, row._replace(due=True)),
            )
        cancelled = _settle(key, settled_row(CANCELLED))
        yield Act("claims cancel", False, "operator cancels the deferred work"), cancelled

    def redrive(self, key: Key, letter: Letter, *, reopen: bool) -> Iterator[KeyMove]:
        """``operations.redrive.redrive``: publish a copy of a dead letter whose copy would run
        (``forecast``), reopening its failed claim when asked or when the ledger holds it."""
        row, verb = key.row, "redrive --reopen-failed" if reopen else "redrive"
        reopens = row is not None and row.state == FAILED
        if row is not None and reopens and not (reopen or self.plain_redrive_reopens(letter, row)):
            return  # held back: the copy would meet a failure
        if not reopens and reopen:
            return  # the same as a plain redrive
        if row is not None and not reopens and not self._redrive_runs(row, key.kind):
            return  # held back: skip (done, deferred) or bounce (stuck)
        after = key._replace(
            letters=_without(key.letters, letter),
            copies=_with(key.copies, Copy(0, False, False)),
        )
        if reopens:
            after = _settle(after, None)._replace(handed_back=True)
        text = f"operator: {verb} ({letter.source} letter)"
        yield Act(verb, False, text), after

    @staticmethod
    def _redrive_runs(row: Row, kind: str) -> bool:
        """``redrive._against_claim``'s RUN verdicts for a row that is not failed."""
        if row.state == DONE or (row.owned and row.state in (DEFERRED, RUNNING)):
            return False
        if row.state == CANCELLED:
            return True
        return not (row.flagged or not lease_live(row))

    def collect(self, key: Key) -> KeyMove:
        """``dead_letters.collect`` (``dlq``, ``redrive``): move one dead letter out of Infrai's
        DLQ; a job with retry attempts left is taken back as deferred work (``_take_back``): a
        stale copy of work the ledger owns is dropped, a key-passing job's own claim is taken
        over by ``TAKEOVER`` (``store.release_for_take_back``); the rest are recorded."""
        row, after = key.row, key._replace(dlq=key.dlq - 1)
        taken_back = Act("take back a dead letter", False, "dlq: taken back as deferred")
        if key.kind in RETRIED and row is not None and row.owned:
            if row.state in (DEFERRED, RUNNING):
                return taken_back._replace(text="dlq: a stale copy of owned work"), after
        elif key.kind in RETRIED and row is None:
            return taken_back, _settle(after, waiting_row(MAX_DELIVERIES, due=False))
        elif key.kind in RETRIED and _taken_back_over(row, key.kind):
            takeover = Act("take back a dead letter (takeover)", False, taken_back.text)
            return takeover, _settle(after, waiting_row(MAX_DELIVERIES, due=False))
        recorded = after._replace(letters=_with(after.letters, Letter(FROM_DLQ)))
        return Act("dlq", False, "dlq: recorded as a dead letter"), recorded


# --- Key edits (the bookkeeping every move shares) --------------------------------------------


def _move(state: State, index: int, act: Act, key: Key, killed: int) -> Move:
    keys = (*state.keys[:index], key, *state.keys[index + 1 :])
    after = State(tuple(sorted(keys, key=_key_order)), state.kills + killed)
    return Move(act, state.keys[index], key, after)


def _taken_back_over(row: Row | None, kind: str) -> bool:
    """``statements.RELEASE_FOR_TAKE_BACK``: a key-passing job's own claim, not owned, by the
    takeover rule (running, not flagged, its lease over)."""
    return (
        row is not None
        and kind in KEY_PASSING
        and row.state == RUNNING
        and not row.owned
        and not row.flagged
        and row.lease == OVER
    )


def _released(row: Row) -> Row | None:
    """``work.store.release``: owned work waits again, due now; a delivery's claim is
    deleted."""
    return waiting_row(row.attempts, due=True) if row.owned else None


def _effect(key: Key) -> Key:
    return key._replace(effects=min(key.effects + 1, EFFECT_CAP))


def _set_row(key: Key, row: Row | None) -> Key:
    return key._replace(row=row)


def _settle(key: Key, row: Row | None) -> Key:
    """A new row, or none: every reference to the old token is stale (a settled row keeps its
    token, but nothing fenced by it applies to a row that is not running), and a row that is not
    running names no message a claim could be redelivered for."""
    actors = tuple(sorted(a._replace(current=False) if a.current else a for a in key.actors))
    if row is None or row.state != RUNNING:
        actors = tuple(sorted(a._replace(mine=False) if a.mine else a for a in actors))
        copies = tuple(sorted(c._replace(mine=False) if c.mine else c for c in key.copies))
        key = key._replace(copies=copies)
    return key._replace(row=row, actors=actors)


def _hand_over(rest: Key, actor: Actor, row: Row, stage: str) -> Key:
    """``actor`` now holds the row (a claim, a take): every other reference is stale, and the
    row's message is the actor's copy (a take keeps the message; it no longer decides)."""
    others = tuple(sorted(a._replace(current=False, mine=False) for a in rest.actors))
    copies = tuple(sorted(c._replace(mine=False) for c in rest.copies))
    holder = actor._replace(stage=stage, current=True, mine=actor.role in (LANE, NODE))
    return rest._replace(row=row, actors=_with(others, holder), copies=copies)


def _holds(rest: Key, actor: Actor) -> bool:
    """Whether a statement fenced by the actor's token (``claim_token = $t AND state =
    'running'``) would match."""
    return actor.current and rest.row is not None and rest.row.state == RUNNING


def _uncertain(row: Row | None) -> Row | None:
    return None if row is None else flag_uncertain(row)


def _attach(key: Key, actor: Actor) -> Key:
    return key._replace(actors=_with(key.actors, actor))


def _stage(actor: Actor, stage: str) -> Actor:
    return actor._replace(stage=stage)


def _acking(actor: Actor) -> Actor:
    """Settled, its copy to ack: it holds nothing any more."""
    return actor._replace(stage=ACKING, current=False, mine=False, note="")


def _end(rest: Key, actor: Actor, acked: bool) -> Key:
    """The actor is gone. A copy it held and did not ack stays hidden until its visibility
    window ends (the next tick)."""
    if acked or actor.role not in (LANE, NODE):
        return rest
    mine = actor.mine and rest.row is not None and rest.row.state == RUNNING
    return rest._replace(copies=_with(rest.copies, Copy(actor.deliveries, True, mine)))


def tick(state: State) -> State:
    """The clock: a lease ends once its holder is gone (it outlives its invocation), a NULL
    lease at claimed_at + visibility (its worker gone by then), a hidden copy whose lane is gone
    comes back or, after its last delivery, moves to Infrai's DLQ; waiting work becomes due."""
    return State(tuple(sorted((_tick_key(k) for k in state.keys), key=_key_order)), state.kills)


def _tick_key(key: Key) -> Key:
    row = key.row
    held = any(a.current and a.role in (LANE, NODE, DEFERRED_RUN) for a in key.actors)
    if row is not None and row.state == RUNNING and not held:
        row = row._replace(lease={LIVE: OVER, NULL_LIVE: NULL_OVER}.get(row.lease, row.lease))
    elif row is not None and row.state == DEFERRED and not row.due:
        row = row._replace(due=True)
    back = (c._replace(held=False) for c in key.copies if c.deliveries < MAX_DELIVERIES)
    copies = tuple(sorted(back))
    dead = sum(1 for c in key.copies if c.deliveries >= MAX_DELIVERIES)
    return key._replace(row=row, copies=copies, dlq=key.dlq + dead)


# --- Invariants -----------------------------------------------------------------------------------


def state_violations(state: State, *, at_rest: State | None, strict_node: bool) -> list[str]:
    """The invariants a single state must satisfy; ``at_rest``: when only a human can move it,
    the state once the clock has run out (hidden copies dead-lettered, leases over)."""
    found: list[str] = []
    for key in state.keys:
        holders = [a for a in key.actors if a.role != PROBE and a.stage in HOLDING_STAGES]
        if len(holders) > 1:
            found.append(ONE_LIVE_HOLDER)
        if key.kind in IRREVERSIBLE and key.effects > 1:
            found.append(EXTERNAL_ONCE)
        done = key.row is not None and key.row.state == DONE
        if key.kind == DATABASE and (key.effects > 1 or done != (key.effects == 1)):
            found.append(DATABASE_ONCE)
    if at_rest is not None and not all(settled(k, strict_node=strict_node) for k in at_rest.keys):
        found.append(QUIET_MEANS_SETTLED)
    return _distinct(found)


def settled(key: Key, *, strict_node: bool = False) -> bool:
    """Done, dead-lettered, flagged for a human, or decided by one (cancelled, resolved failed);
    unless strict, also work the notes' worker acked a copy of while it was stuck or failed."""
    row = key.row
    if row is not None and (row.state in (DONE, CANCELLED) or row.human):
        return True
    if dead_lettered(key) or for_a_human(row, key.kind):
        return True
    stopped = row is None or row.state == FAILED
    return not strict_node and key.node_dropped and stopped


def move_violations(move: Move) -> list[str]:
    """The invariants about a transition: who may change what."""
    old, new = move.before, move.after
    if old is None or new is None:
        return []  # the clock
    found: list[str] = []
    changed = new.row != old.row
    if changed and lease_live(old.row) and not move.act.holder:
        found.append(NO_VERB_UNDER_LIVE_LEASE)
    human_failed = old.row is not None and old.row.state == FAILED and old.row.human
    if changed and human_failed and move.act.verb not in EXPLICIT_REOPENS:
        found.append(HUMAN_VERDICT_STANDS)
    single_death = move.state.kills <= 1 and not new.handed_back
    if old.kind in RETRIED and single_death and _dooms_retry_work(old, new):
        found.append(OWNED_NOT_DEAD_LETTERED)
    spent = old.row is not None and old.row.attempts >= RETRY_ATTEMPTS
    if move.act.verb == "fail (and hold a dead letter)" and not (move.act.final or spent):
        found.append(OWNED_NOT_DEAD_LETTERED)
    return found


def _dooms_retry_work(old: Key, new: Key) -> bool:
    """A move that leaves a message of a job with retry attempts on its last delivery, held by
    no one and not acked (the next tick moves it to the DLQ), while the ledger neither owns the
    work nor has settled it or flagged it for a human: one death spent its last delivery."""
    doomed_before = sum(1 for c in old.copies if c.held and c.deliveries >= MAX_DELIVERIES)
    doomed_after = sum(1 for c in new.copies if c.held and c.deliveries >= MAX_DELIVERIES)
    if doomed_after <= doomed_before:
        return False
    row = new.row
    if row is None:
        return True
    if row.state in (DONE, FAILED, CANCELLED) or row.owned:
        return False
    return not for_a_human(row, new.kind)


# --- The explorer ---------------------------------------------------------------------------------


@dataclass
class Report:
    protocol: str
    bounds: Bounds
    states: int = 0
    transitions: int = 0
    quiet_states: int = 0
    depth: int = 0
    seconds: float = 0.0
    per_depth: list[int] = field(default_factory=list)
    verbs: Counter[str] = field(default_factory=Counter)  # transitions explored, by verb
    violation: str = ""
    violated: list[str] = field(default_factory=list)
    trace: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violation

    def summary(self) -> str:
        verdict = "no violation" if self.ok else f"VIOLATION {', '.join(self.violated)}"
        return (
            f"{self.protocol}: {self.states:,} states, {self.transitions:,} transitions, "
            f"{self.quiet_states:,} quiet, depth {self.depth}, {self.seconds:.1f} s: {verdict} "
            f"[{self.bounds.describe()}]"
        )


def explore(
    protocol: Protocol, checked: Sequence[str] = INVARIANTS, *, stop_at_first: bool = True
) -> Report:
    """Breadth first over every interleaving up to ``bounds.steps`` transitions, checking the
    ``checked`` invariants in every reachable state and on every transition; the first
    violation (on a shortest path) stops it, with its trace."""
    started = time.perf_counter()
    report = Report(protocol.name, protocol.bounds)
    initial = protocol.initial()
    parents: dict[State, tuple[State | None, str]] = {initial: (None, "initial state")}
    frontier = [initial]
    report.per_depth.append(1)
    wanted = set(checked)
    for depth in range(protocol.bounds.steps):
        upcoming: list[State] = []
        for state in frontier:
            for move in protocol.successors(state):
                report.transitions += 1
                report.verbs[move.act.verb] += 1
                bad = [v for v in move_violations(move) if v in wanted]
                if move.state not in parents:
                    parents[move.state] = (state, move.act.text)
                    upcoming.append(move.state)
                    at_rest = protocol.at_rest(move.state)
                    report.quiet_states += at_rest is not None
                    found = state_violations(
                        move.state, at_rest=at_rest, strict_node=protocol.bounds.strict_node
                    )
                    bad += [v for v in found if v in wanted]
                if bad and not report.violation:
                    report.violation, report.violated = bad[0], _distinct(bad)
                    report.trace = _trace(parents, state, move)
                    if stop_at_first:
                        return _finish(report, parents, depth + 1, started)
        if not upcoming:
            break
        report.per_depth.append(len(upcoming))
        frontier = upcoming
        report.depth = depth + 1
    return _finish(report, parents, report.depth, started)


def _finish(report: Report, parents: dict[State, Any], depth: int, started: float) -> Report:
    report.states = len(parents)
    report.depth = depth
    report.seconds = time.perf_counter() - started
    return report


def _trace(parents: dict[State, tuple[State | None, str]], before: State, move: Move) -> list[str]:
    steps = [f"{move.act.text}  =>  {render(move.state)}"]
    state: State | None = before
    while state is not None:
        parent, text = parents[state]
        steps.append(f"{text}  =>  {render(state)}")
        state = parent
    return [f"{n:2d}. {line}" for n, line in enumerate(reversed(steps))]


def render(state: State) -> str:
    """One line per state: each key's row, copies, actors, dead letters and effects."""
    return " | ".join(_render_key(k) for k in state.keys) + f" | kills {state.kills}"


def _render_key(key: Key) -> str:
    row = key.row
    if row is None:
        text = "(none)"
    else:
        marks = [row.state]
        if row.state == RUNNING:
            marks.append(f"lease {row.lease}" + (", no token" if row.node else ""))
        marks += [m for m, on in (("flagged", row.flagged), ("owned", row.owned)) if on]
        marks += [m for m, on in (("began", row.began), ("due", row.due)) if on]
        marks += [m for m, on in (("by a human", row.human), ("notes' worker", row.node)) if on]
        if row.owned:
            marks.append(f"attempt {row.attempts}")
        text = ", ".join(marks)
    copies = ",".join(f"{'h' if c.held else 'v'}{c.deliveries}" for c in key.copies) or "-"
    actors = ",".join(f"{a.role}:{a.stage}{'' if a.current else '~'}" for a in key.actors)
    dead = f" dlq {key.dlq}" if key.dlq else ""
    letters = f" letters {len(key.letters)}" if key.letters else ""
    return (
        f"{key.kind}[{text}; copies {copies}; actors {actors or '-'};{dead}{letters} "
        f"effects {key.effects}]"
    )


# --- Broken variants: each swaps one guard, and the checker must catch it -----------------------


class ReconcileReleasesLiveDeferredRun(Protocol):
    """(a) A probe's ``not_done`` releases ledger-owned work whatever its lease: a deferred run
    inside its call is made due again, and a second drain runs it."""

    name = "broken (a): reconcile releases a live deferred run"

    def probe_may_release(self, row: Row) -> bool:
        return row.owned or not lease_live(row)


class DefersOnlyAtLastDelivery(Protocol):
    """(b) Flow control defers a transient failure only on the message's last delivery, so one
    death there spends the delivery the ledger needed."""

    name = "broken (b): deferral only at the last delivery"

    def defers_now(self, deliveries: int) -> bool:
        return deliveries >= MAX_DELIVERIES


class OperatorReadsNullLeaseAsOver(Protocol):
    """(c) The operator's commands read a running row without a lease (the notes' worker writes
    them) as over, and release it while the worker is still inside its call."""

    name = "broken (c): operator reads a NULL lease as over"

    def operator_sees_lease_over(self, row: Row) -> bool:
        return row.lease != LIVE


class PlainRedriveReopensHumanVerdict(Protocol):
    """(d) A plain redrive reopens every failed claim whose dead letter the ledger holds, a
    human's ``resolve --failed`` of deferred work included (both letters alike)."""

    name = "broken (d): plain redrive reopens a human's verdict on deferred work"

    def plain_redrive_reopens(self, letter: Letter, row: Row) -> bool:
        return letter.source in (LEDGER_HELD, RESOLVED_FAILED)


class PlainRedriveJudgesTheLetter(Protocol):
    """(f) A plain redrive tells a drain's failure from a human's by the dead letter alone: a
    letter the ledger held for an earlier failure reopens the claim a human has since resolved
    failed (the work was reopened and claimed again in between)."""

    name = "broken (f): plain redrive judges the letter, not the claim"

    def plain_redrive_reopens(self, letter: Letter, row: Row) -> bool:
        return letter.source == LEDGER_HELD


class ProbeAsksUnderLiveLease(Protocol):
    """(e) ``claims reconcile KEY`` probes a running claim whatever its lease, and the write is
    fenced by the token and a lease over *at the write*: an answer from before the lease ended
    can release a claim whose run made the call in between."""

    name = "broken (e): probe answers about a claim under a live lease"

    def probe_may_ask(self, row: Row) -> bool:
        return True


VARIANTS: Final[dict[str, type[Protocol]]] = {
    "correct": Protocol,
    "a": ReconcileReleasesLiveDeferredRun,
    "b": DefersOnlyAtLastDelivery,
    "c": OperatorReadsNullLeaseAsOver,
    "d": PlainRedriveReopensHumanVerdict,
    "e": ProbeAsksUnderLiveLease,
    "f": PlainRedriveJudgesTheLetter,
}


# --- Command line ---------------------------------------------------------------------------------


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tests.model.work_protocol",
        description="Explore every interleaving of the work protocol within bounds.",
    )
    parser.add_argument("--keys", type=int, default=2, help="keys (their kinds cycle --kinds)")
    parser.add_argument(
        "--kinds",
        default=f"{EXTERNAL},{RETRY}",
        help=f"comma-separated kinds, cycled over the keys (of {', '.join(KINDS)})",
    )
    parser.add_argument("--actors", type=int, default=3, help="actors alive at once")
    parser.add_argument("--steps", type=int, default=14, help="transitions from the start")
    parser.add_argument("--kills", type=int, default=1, help="actor deaths along one path")
    parser.add_argument("--copies", type=int, default=1, help="messages per key at the start")
    parser.add_argument("--no-node", action="store_true", help="without the notes' worker")
    parser.add_argument(
        "--variant",
        choices=sorted(VARIANTS),
        action="append",
        help="the model to explore (repeatable; default: correct)",
    )
    parser.add_argument("--all", action="store_true", help="every variant, the correct first")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    cycle = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = sorted(set(cycle) - set(KINDS))
    if unknown or not cycle:
        print(f"unknown kinds: {', '.join(unknown) or '(none given)'}", file=sys.stderr)
        return 2
    kinds = tuple(cycle[i % len(cycle)] for i in range(args.keys))
    bounds = Bounds(
        kinds=kinds,
        actors=args.actors,
        steps=args.steps,
        kills=args.kills,
        copies=args.copies,
        node=not args.no_node,
    )
    names = list(VARIANTS) if args.all else args.variant or ["correct"]
    status = 0
    for name in names:
        report = explore(VARIANTS[name](bounds))
        print(report.summary())
        print("  states per depth: " + ", ".join(f"{n:,}" for n in report.per_depth))
        if not report.ok:
            print(f"  counterexample ({len(report.trace) - 1} steps):")
            print("\n".join(f"    {line}" for line in report.trace))
            status = status or (1 if name == "correct" else 0)
        elif name != "correct":
            print("  the checker did NOT catch this variant within these bounds")
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
