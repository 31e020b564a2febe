"""What ``infrai-jobs drain`` does when Ctrl-C (SIGINT) or SIGTERM arrives.

The drain is asked to stop before its next receive (``DrainService.run(stop_requested=...)``):
what it holds, the batch being processed and one received ahead, is still settled and acked.
That gets ``grace_seconds``; a handler that outlives it is left where it is. Either way the
person at the terminal is told the summary so far, the messages this drain received and did
not ack (with when the queue delivers them again), and the claims of those messages left
``running``, with the command that shows each. The exit code is 128 + the signal's number: 130
for SIGINT, 143 for SIGTERM.

A handler still running at its deadline ends the process too (``HandlerDeadlines``), as
Lambda's timeout ends DrainFunction: the claim's lease ends ``LEASE_GRACE_SECONDS`` after that
deadline (at it, near the message's visibility window), and a handler that outlived its lease
could run beside the work's next delivery, or after an operator released the claim. The report
names the handlers; the exit code is 1.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from types import FrameType
from typing import Any, Generic, TypeVar

from infrai_jobs.drain.model import DrainFeature
from infrai_jobs.errors import InfraiError, QueueMessageNotFound
from infrai_jobs.jobs.registry import JobContext, JsonValue
from infrai_jobs.queue.models import Pending, QueueMessage
from infrai_jobs.queue.ports import ForwardingQueue, QueuePort
from infrai_local.operator.drain_report import handler_attached

T = TypeVar("T")

# How long the batch in progress may take to settle after the signal, by default.
DEFAULT_GRACE_SECONDS = 10.0
# The ids printed in full; beyond, a count.
IDS_SHOWN = 50
_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@dataclass(frozen=True, slots=True)
class HeldMessage:
    message_id: str
    # When the queue may deliver it again: its receive plus the visibility timeout.
    back_at: datetime


class InFlightMessages(ForwardingQueue):
    """A ``QueuePort`` that remembers the messages it received and has not acked (or whose
    ack found the handle gone): what the queue hides until their visibility timeout ends."""

    def __init__(
        self,
        inner: QueuePort,
        *,
        visibility_timeout_seconds: float,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        super().__init__(inner)
        self._visibility = timedelta(seconds=visibility_timeout_seconds)
        self._now = now
        self._lock = threading.Lock()
        self._held: dict[str, HeldMessage] = {}
        self._received: set[str] = set()
        self._unread: list[_Unread] = []

    def held(self) -> list[HeldMessage]:
        """The messages received and not acked, the first to come back first."""
        with self._lock:
            return sorted(self._held.values(), key=lambda m: (m.back_at, m.message_id))

    def received_ids(self) -> set[str]:
        """Every message id this drain received."""
        with self._lock:
            return set(self._received)

    def consume(self, queue: str, max_messages: int = 10) -> list[QueueMessage]:
        return self._hold(self._inner.consume(queue, max_messages))

    def send_consume(self, queue: str, max_messages: int = 10) -> Pending[list[QueueMessage]]:
        sent = _Unread(self._inner.send_consume(queue, max_messages))
        with self._lock:
            self._unread.append(sent)
        return Pending(
            lambda: self._hold(sent.read(retry=True)),
            lambda: self._hold(sent.read(retry=False)),
        )

    def read_unread(self) -> int:
        """Read the answers of receives sent ahead that the drain has not read (it is stuck in
        a handler, and will never read them): their messages are held too. Returns how many
        such answers could not be read (each may hold up to a batch of messages)."""
        with self._lock:
            unread, self._unread = self._unread, []
        lost = 0
        for sent in unread:
            try:
                messages = sent.read(retry=False)
            except _AlreadyRead:
                continue
            except InfraiError:
                lost += 1
                continue
            self._hold(messages)
        return lost

    def ack(self, queue: str, receipt_handle: str) -> None:
        self._settled(lambda: self._inner.ack(queue, receipt_handle), receipt_handle)

    def send_ack(self, queue: str, receipt_handle: str) -> Pending[None]:
        sent = self._inner.send_ack(queue, receipt_handle)
        return Pending(
            lambda: self._settled(sent.wait, receipt_handle),
            lambda: self._settled(lambda: sent.wait(retry=False), receipt_handle),
        )

    def _hold(self, messages: list[QueueMessage]) -> list[QueueMessage]:
        back_at = self._now() + self._visibility
        with self._lock:
            for message in messages:
                self._received.add(message.message_id)
                self._held[message.receipt_handle] = HeldMessage(message.message_id, back_at)
        return messages

    def _settled(self, ack: Callable[[], None], receipt_handle: str) -> None:
        try:
            ack()
        except QueueMessageNotFound:
            # The queue no longer holds this delivery: nothing of it is hidden any more.
            self._forget(receipt_handle)
            raise
        self._forget(receipt_handle)

    def _forget(self, receipt_handle: str) -> None:
        with self._lock:
            self._held.pop(receipt_handle, None)


class _AlreadyRead(Exception):
    """The answer was read (or is being read) by another thread."""


class _Unread:
    """A receive sent ahead, whose answer one thread only reads."""

    def __init__(self, sent: Pending[list[QueueMessage]]) -> None:
        self._sent = sent
        self._lock = threading.Lock()
        self._taken = False

    def read(self, *, retry: bool) -> list[QueueMessage]:
        with self._lock:
            if self._taken:
                raise _AlreadyRead
            self._taken = True
        return self._sent.wait(retry=retry)


class OutcomeTally(logging.Handler):
    """Counts the drain's per-message outcome records as they are logged: the summary so far
    of a drain whose batch did not settle in time (its own summary is never returned)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.outcomes: Counter[str] = Counter()
        self._lock_tally = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg == "message %s":
            with self._lock_tally:
                self.outcomes[str(getattr(record, "action", "") or "unknown")] += 1

    @contextlib.contextmanager
    def attached(self, logger_name: str) -> Iterator[OutcomeTally]:
        with handler_attached(logging.getLogger(logger_name), self):
            yield self


class HandlerDeadlines(DrainFeature):
    """The external calls running now, each with its context: those past their deadline are
    what ``Interruption.run`` ends the process for (see the module's docstring). A database
    job is not watched: it holds no lease, and a process that ends rolls its work back."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._running: dict[int, JobContext] = {}
        self._ids = itertools.count()

    def around_effect(
        self, ctx: JobContext, fingerprint: str, call: Callable[[], JsonValue]
    ) -> JsonValue:
        number = next(self._ids)
        with self._lock:
            self._running[number] = ctx
        try:
            return call()
        finally:
            with self._lock:
                del self._running[number]

    def running(self) -> list[JobContext]:
        """The external calls running now, the earliest deadline first."""
        with self._lock:
            running = list(self._running.values())
        return sorted(running, key=lambda ctx: (ctx.deadline, ctx.idem_key))

    def overran(self) -> list[JobContext]:
        """The handlers still running at or past their deadline."""
        now = self._clock()
        return [ctx for ctx in self.running() if ctx.deadline <= now]


@dataclass
class Finished(Generic[T]):
    """What ``Interruption.run`` ended with: the work's result, or nothing when the grace ran
    out first (``settled`` False)."""

    result: T | None
    settled: bool


class Interruption:
    """SIGINT and SIGTERM, caught while ``handling()`` lasts: the first asks the work to stop;
    it then has ``grace_seconds`` to end; a second signal ends the wait at once."""

    def __init__(self, grace_seconds: float = DEFAULT_GRACE_SECONDS) -> None:
        self.grace_seconds = grace_seconds
        self.signal: signal.Signals | None = None
        self._requested = threading.Event()
        self._again = threading.Event()
        self._at = 0.0
        # The handlers that were still running at their deadline, when that ended the run.
        self.overran: list[JobContext] = []

    def requested(self) -> bool:
        return self._requested.is_set()

    @property
    def exit_code(self) -> int:
        """128 + the signal's number, as a shell reports a process the signal ended."""
        return 128 + int(self.signal) if self.signal is not None else 0

    @contextlib.contextmanager
    def handling(self) -> Iterator[Interruption]:
        previous = {number: signal.getsignal(number) for number in _SIGNALS}

        def caught(number: int, _frame: FrameType | None) -> None:
            if self._requested.is_set():
                self._again.set()
                return
            self.signal = signal.Signals(number)
            self._at = time.monotonic()
            self._requested.set()

        for number in _SIGNALS:
            signal.signal(number, caught)
        try:
            yield self
        finally:
            for number, handler in previous.items():
                signal.signal(number, handler)

    def run(
        self, work: Callable[[], T], overran: Callable[[], list[JobContext]] = list
    ) -> Finished[T]:
        """Run ``work`` on a thread of its own (the signals stay with this one) and wait for
        it, or, once interrupted, for at most ``grace_seconds``, or until ``overran`` names a
        handler past its deadline (kept in ``self.overran``). Its error is raised here."""
        outcome: list[Any] = []
        failure: list[BaseException] = []
        done = threading.Event()

        def target() -> None:
            try:
                outcome.append(work())
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                failure.append(exc)
            finally:
                done.set()

        worker = threading.Thread(target=target, name="drain", daemon=True)
        worker.start()
        while not done.wait(0.1):
            if late := overran():
                self.overran = late
                return Finished(None, settled=False)
            if self._requested.is_set() and (
                self._again.is_set() or time.monotonic() - self._at >= self.grace_seconds
            ):
                return Finished(None, settled=False)
        if failure:
            raise failure[0]
        return Finished(outcome[0], settled=True)


def interrupted_lines(
    interruption: Interruption,
    *,
    settled: bool,
    held: Sequence[HeldMessage],
    running_keys: Sequence[str],
    now: datetime | None = None,
) -> list[str]:
    """What an interrupted drain tells the terminal after its summary."""
    assert interruption.signal is not None
    name = interruption.signal.name
    grace = f"{interruption.grace_seconds:g} s"
    lines = [
        f"interrupted by {name}: stopped receiving; "
        + (
            f"what it held was settled within the {grace} grace"
            if settled
            else f"the batch in progress did not settle within the {grace} grace and was "
            "left as it was"
        )
    ]
    return lines + left_behind_lines(held=held, running_keys=running_keys, now=now)


def overran_lines(
    overran: Sequence[JobContext], *, held: Sequence[HeldMessage], running_keys: Sequence[str]
) -> list[str]:
    """What a drain ended at a handler's deadline tells the terminal after its summary so far."""
    at = datetime.fromtimestamp(overran[0].deadline, UTC)
    jobs = ", ".join(f"{ctx.job} ({ctx.idem_key})" for ctx in overran)
    return [
        f"stopped: a handler was still running at its deadline, {at:%H:%M:%S} UTC: {jobs}. "
        "The drain ends here, as DrainFunction's timeout would, before the claim's lease ends "
        "(LEASE_GRACE_SECONDS after the deadline); a handler must finish by `ctx.deadline`",
        *left_behind_lines(held=held, running_keys=running_keys),
    ]


def left_behind_lines(
    *, held: Sequence[HeldMessage], running_keys: Sequence[str], now: datetime | None = None
) -> list[str]:
    """The messages received and not acked, and the claims left ``running``."""
    lines: list[str] = []
    current = now or datetime.now(UTC)
    if held:
        first, last = held[0].back_at, held[-1].back_at
        soonest, latest = _seconds_until(first, current), _seconds_until(last, current)
        when = (
            f"at {first:%H:%M:%S} UTC (in {soonest} s)"
            if soonest == latest
            else f"from {first:%H:%M:%S} to {last:%H:%M:%S} UTC (in {soonest} to {latest} s)"
        )
        ids = [m.message_id for m in held]
        shown = ", ".join(ids[:IDS_SHOWN]) + (
            f" and {len(ids) - IDS_SHOWN} more" if len(ids) > IDS_SHOWN else ""
        )
        lines.append(
            f"in flight: {len(held)} message(s) received and not acked; the queue delivers "
            f"them again {when}, after its visibility timeout: {shown}"
        )
    else:
        lines.append("in flight: none; every message received was acked")
    if running_keys:
        lines.append(
            f"left running: {len(running_keys)} claim(s), each waiting for a human once its "
            "lease ends (`infrai-jobs claims stuck`); see each with `infrai-jobs claims show KEY`:"
        )
        lines.extend(f"  infrai-jobs claims show {key}" for key in running_keys)
    else:
        lines.append("left running: no claim")
    return lines


def _seconds_until(at: datetime, now: datetime) -> int:
    return max(0, round((at - now).total_seconds()))
