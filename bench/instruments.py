"""What the benchmark counts, and how.

HTTP: ``TimedQueue`` wraps the queue port both variants use and records each call and each batch
(from the start of the consume that returned it to the end of the last ack of its messages, read
when the drain reads the answer). The
orchestrator also reads the emulator's own per-route request counters; those are the figures
reported, the wrapper's are the cross-check.

Database: ``ProtocolTrace`` turns on libpq's protocol trace (``PQtrace``) for every connection the
process opens after the handshake, and ``count_round_trips`` reads it back. One round trip is one
run of frontend messages answered by backend messages: the client sent something and then read
the server's answer. That counts every ``execute``, ``BEGIN``/``COMMIT``/``SAVEPOINT``/``RELEASE``/
``ROLLBACK TO``, psycopg's own ``DEALLOCATE ALL`` and the extra ``Parse`` when psycopg prepares a
statement, and a whole pipeline flush as one, whatever the code that caused it.

Memory and CPU: ``VmHWM``/``VmRSS`` of the process itself (``ru_maxrss`` would include the parent's
pages when the child was started by vfork), ``getrusage`` for CPU time, ``/proc/stat`` for how busy
the whole machine was.
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import re
import resource
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from infrai_jobs.queue.models import Pending, QueueMessage
from infrai_jobs.queue.ports import ForwardingQueue, QueuePort

# --- HTTP: the queue port, timed -----------------------------------------------------------------


class BatchRecorder:
    """Batches and calls seen by one or more ``TimedQueue`` wrappers (thread-safe)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._spans: list[list[float]] = []
        self._batch_of: dict[str, int] = {}
        self._durations: dict[str, list[float]] = {"consume": [], "ack": []}
        # Per lane: when its last consume returned, and the gaps until its next one.
        self._last_return: dict[int, float] = {}
        self._gaps: list[float] = []
        # A consume sent ahead: the lane's work until it asked for the answer, and its wait.
        self._ahead_work: list[float] = []
        self._ahead_wait: list[float] = []
        self.calls: Counter[str] = Counter()

    def now(self) -> float:
        return self._clock()

    def consumed(
        self,
        started: float,
        handles: Sequence[str],
        lane: int = 0,
        read_from: float | None = None,
    ) -> None:
        """A consume returned; ``read_from`` is when a consume sent ahead was asked for its
        answer (the lane's work in between overlapped the round trip)."""
        returned = self._clock()
        with self._lock:
            self.calls["consume"] += 1
            if read_from is not None:
                self._ahead_work.append((read_from - started) * 1000)
                self._ahead_wait.append((returned - read_from) * 1000)
            self._durations["consume"].append((returned - started) * 1000)
            if lane in self._last_return:
                self._gaps.append((started - self._last_return[lane]) * 1000)
            self._last_return[lane] = returned
            if not handles:
                return
            index = len(self._spans)
            self._spans.append([started, returned])
            for handle in handles:
                self._batch_of[handle] = index

    def acked(self, handle: str, started: float) -> None:
        finished = self._clock()
        with self._lock:
            self.calls["ack"] += 1
            self._durations["ack"].append((finished - started) * 1000)
            index = self._batch_of.pop(handle, None)
            if index is not None:
                span = self._spans[index]
                span[1] = max(span[1], finished)

    def batch_latencies_ms(self) -> list[float]:
        with self._lock:
            return [(end - start) * 1000 for start, end in self._spans]

    def between_consumes_ms(self) -> list[float]:
        """From one consume's answer to the next consume of the same lane: the loop's own work
        per batch, which the next consume waits for."""
        with self._lock:
            return list(self._gaps)

    def consume_ahead_ms(self) -> tuple[list[float], list[float]]:
        """For consumes sent ahead: the lane's work from the send until it read the answer, and
        how long it then waited. Work beyond the round trip means the lane, not the latency,
        set its pace."""
        with self._lock:
            return list(self._ahead_work), list(self._ahead_wait)

    def call_durations_ms(self) -> dict[str, list[float]]:
        """How long each consume and ack call took, as the client saw it."""
        with self._lock:
            return {call: list(values) for call, values in self._durations.items()}


class TimedQueue(ForwardingQueue):
    """A ``QueuePort`` that reports its consumes and acks to a ``BatchRecorder``."""

    def __init__(self, inner: QueuePort, recorder: BatchRecorder) -> None:
        super().__init__(inner)
        self._recorder = recorder

    def consume(self, queue: str, max_messages: int = 10) -> list[QueueMessage]:
        started = self._recorder.now()
        messages = self._inner.consume(queue, max_messages)
        # One TimedQueue per lane, whichever thread of the lane consumes.
        self._recorder.consumed(started, [m.receipt_handle for m in messages], lane=id(self))
        return messages

    def send_consume(self, queue: str, max_messages: int = 10) -> Pending[list[QueueMessage]]:
        started = self._recorder.now()
        pending = self._inner.send_consume(queue, max_messages)

        def finish() -> list[QueueMessage]:
            read_from = self._recorder.now()
            messages = pending.wait()
            handles = [m.receipt_handle for m in messages]
            self._recorder.consumed(started, handles, lane=id(self), read_from=read_from)
            return messages

        return Pending(finish)

    def ack(self, queue: str, receipt_handle: str) -> None:
        started = self._recorder.now()
        try:
            self._inner.ack(queue, receipt_handle)
        finally:
            self._recorder.acked(receipt_handle, started)

    def send_ack(self, queue: str, receipt_handle: str) -> Pending[None]:
        # Timed from the send to when the drain reads the answer: a batch's acks are read
        # after the next batch is processed, so this may exceed the round trip by that much.
        started = self._recorder.now()
        pending = self._inner.send_ack(queue, receipt_handle)

        def finish() -> None:
            try:
                pending.wait()
            finally:
                self._recorder.acked(receipt_handle, started)

        return Pending(finish)


def latency_summary(values_ms: Iterable[float]) -> dict[str, float | int]:
    ordered = sorted(values_ms)
    if not ordered:
        return {"count": 0, "p50": 0.0, "p99": 0.0, "mean": 0.0, "max": 0.0}
    return {
        "count": len(ordered),
        "p50": round(percentile(ordered, 50), 2),
        "p99": round(percentile(ordered, 99), 2),
        "mean": round(sum(ordered) / len(ordered), 2),
        "max": round(ordered[-1], 2),
    }


def percentile(ordered: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default) on sorted values."""
    if not ordered:
        return 0.0
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


# --- Database: libpq's protocol trace ------------------------------------------------------------

_TRACE_FLAGS = psycopg.pq.Trace.SUPPRESS_TIMESTAMPS | psycopg.pq.Trace.REGRESS_MODE


@dataclass
class _TracedConnection:
    conn: psycopg.Connection[Any]
    fd: int
    path: Path
    finished: bool = False


class ProtocolTrace:
    """Traces every psycopg connection this process opens from ``install()`` on.

    ``psycopg.connect`` is replaced in this (benchmark) process only, so the code under test is
    unchanged: the ledger and the notes' loop both call it. The handshake happens before the trace
    starts and is not counted; ``connections`` says how many were opened.
    """

    def __init__(self, directory: Path) -> None:
        self._directory = directory
        self._traced: list[_TracedConnection] = []
        self._lock = threading.Lock()
        self._original: Any = None

    @property
    def connections(self) -> int:
        return len(self._traced)

    def install(self) -> None:
        original = psycopg.connect
        self._original = original

        def connect(*args: Any, **kwargs: Any) -> Any:
            conn = original(*args, **kwargs)
            self.attach(conn)
            return conn

        psycopg.connect = connect

    def attach(self, conn: psycopg.Connection[Any]) -> None:
        with self._lock:
            path = self._directory / f"conn-{len(self._traced)}.trace"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            conn.pgconn.trace(fd)
            conn.pgconn.set_trace_flags(_TRACE_FLAGS)
            self._traced.append(_TracedConnection(conn, fd, path))

    def finish(self) -> list[Path]:
        """Flush and stop every trace (before the connections close: libpq flushes on untrace)."""
        with self._lock:
            for traced in self._traced:
                if traced.finished:
                    continue
                if not traced.conn.closed:
                    traced.conn.pgconn.untrace()
                os.close(traced.fd)
                traced.finished = True
            if self._original is not None:
                psycopg.connect = self._original
                self._original = None
            return [t.path for t in self._traced]

    def paths_of(self, conns: Iterable[psycopg.Connection[Any]]) -> list[Path]:
        """The trace files of these connections (opened after ``install()``), e.g. one feature's
        own, to count its round trips apart."""
        wanted = {id(conn) for conn in conns}
        with self._lock:
            return [t.path for t in self._traced if id(t.conn) in wanted]


_MESSAGE = re.compile(r"^([FB])\t(\d+)\t(\w+)(?:\t ?(.*))?$")
_PARSE = re.compile(r'^"(?P<name>[^"]*)" "(?P<sql>.*)" \d+(?: \S+)*$', re.DOTALL)
_BIND = re.compile(r'^"[^"]*" "(?P<name>[^"]*)"')
_TABLE = re.compile(r"\b(?:FROM|INTO|UPDATE|JOIN)\s+([A-Za-z_][A-Za-z0-9_.]*)", re.IGNORECASE)


@dataclass
class _Turn:
    statements: list[str] = field(default_factory=list)
    prepared: list[str] = field(default_factory=list)


@dataclass
class RoundTrips:
    """Round trips read from protocol traces, split into the job's and everything else."""

    total: int = 0
    job: int = 0
    statements: int = 0
    by_label: Counter[str] = field(default_factory=Counter)

    @property
    def ledger(self) -> int:
        return self.total - self.job

    def add(self, other: RoundTrips) -> None:
        self.total += other.total
        self.job += other.job
        self.statements += other.statements
        self.by_label.update(other.by_label)


def count_round_trips(paths: Iterable[Path], job_statement: re.Pattern[str]) -> RoundTrips:
    """Count round trips in libpq trace files, one file per connection.

    A round trip belongs to the job when one of its statements matches ``job_statement`` (the
    job's own SQL, e.g. ``^UPDATE invoices``, matched per statement): ledger statements pipelined
    with it cost nothing extra. Every other round trip is the ledger's (claim, settle,
    transaction control, psycopg's prepares and ``DEALLOCATE``, the schema check).
    """
    counts = RoundTrips()
    for path in paths:
        for turn in _turns(_messages(path.read_text(errors="replace"))):
            counts.total += 1
            counts.statements += len(turn.statements)
            sqls = turn.statements or turn.prepared
            if any(is_job_statement(sql, job_statement) for sql in sqls):
                counts.job += 1
            counts.by_label[_turn_label(turn, job_statement)] += 1
    return counts


def labels_per_message(runs: Iterable[dict[str, Any]]) -> dict[str, float]:
    """The ledger's round trips per message consumed, by label, over worker results that hold
    ``db.round_trips_by_label`` (most frequent first; none when nothing was consumed)."""
    counts: Counter[str] = Counter()
    consumed = 0
    for run in runs:
        counts.update(run["db"]["round_trips_by_label"])
        consumed += run["consumed"]
    return {label: n / consumed for label, n in counts.most_common()} if consumed else {}


def _messages(text: str) -> list[tuple[str, str, str]]:
    """(direction, type, text) per message; SQL with newlines spans several trace lines."""
    messages: list[tuple[str, str, str]] = []
    for line in text.split("\n"):
        match = _MESSAGE.match(line)
        if match:
            messages.append((match[1], match[3], match[4] or ""))
        elif messages and line:
            direction, kind, body = messages[-1]
            messages[-1] = (direction, kind, f"{body}\n{line}")
    return messages


def _turns(messages: Sequence[tuple[str, str, str]]) -> list[_Turn]:
    named: dict[str, str] = {}
    turns: list[_Turn] = []
    current: _Turn | None = None
    bound = ""
    for direction, kind, body in messages:
        if direction == "B":
            if current is not None:
                turns.append(current)
                current = None
            continue
        if current is None:
            current = _Turn()
        if kind == "Query":
            current.statements.append(_unquote(body))
        elif kind == "Parse":
            match = _PARSE.match(body)
            if match:
                named[match["name"]] = match["sql"]
                current.prepared.append(match["sql"])
        elif kind == "Bind":
            match = _BIND.match(body)
            bound = named.get(match["name"], "") if match else ""
        elif kind == "Execute":
            current.statements.append(bound)
    # A trailing run of frontend messages never answered (e.g. Terminate) is no round trip.
    return turns


def _unquote(body: str) -> str:
    body = body.strip()
    return body[1:-1] if len(body) >= 2 and body[0] == body[-1] == '"' else body


def _turn_label(turn: _Turn, job_statement: re.Pattern[str]) -> str:
    if turn.statements:
        labels = [statement_label(sql, job_statement) for sql in turn.statements]
    else:
        labels = ["prepare " + statement_label(sql, job_statement) for sql in turn.prepared]
    return " + ".join(dict.fromkeys(labels)) or "(empty)"


# A simple-protocol message may carry several statements ("BEGIN; <claim>"); parameters bound
# client-side are JSON without newlines, so a semicolon that ends a line ends a statement.
_STATEMENT_END = re.compile(r";[ \t]*(?:\n|$)")
_CONTROL = ("BEGIN", "COMMIT", "ROLLBACK", "SAVEPOINT", "RELEASE", "DEALLOCATE", "END", "ABORT")


def split_statements(sql: str) -> list[str]:
    return [part for part in _STATEMENT_END.split(sql) if part.strip()]


def is_job_statement(sql: str, job_statement: re.Pattern[str]) -> bool:
    return any(job_statement.search(part) for part in split_statements(sql))


def statement_label(sql: str, job_statement: re.Pattern[str]) -> str:
    """A short, stable name for what one message ran: each statement's verb and first table."""
    return "; ".join(_one_label(part, job_statement) for part in split_statements(sql)) or "(empty)"


def _one_label(sql: str, job_statement: re.Pattern[str]) -> str:
    words = sql.split()
    verb = words[0].upper().rstrip(";")
    if verb in _CONTROL:
        return " ".join(w.upper() for w in words[:2]) if verb == "ROLLBACK" else verb
    text = " ".join(words)
    prefix = "job: " if job_statement.search(sql) else ""
    if verb == "WITH":
        # A data-modifying CTE is named after what it modifies.
        modifying = re.search(r"\b(INSERT|UPDATE|DELETE)\b", text, re.IGNORECASE)
        verb = modifying[1].upper() if modifying else verb
    table = _TABLE.search(text)
    return f"{prefix}{verb} {table[1] if table else ''}".strip()


# --- Memory and CPU ------------------------------------------------------------------------------


def memory_mb() -> dict[str, float]:
    """This process image's resident set now and at its peak, in MiB."""
    fields: dict[str, float] = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                fields[name] = int(value.split()[0]) / 1024
    except OSError:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        return {"rss_mb": peak, "peak_rss_mb": peak}
    return {"rss_mb": round(fields["VmRSS"], 1), "peak_rss_mb": round(fields["VmHWM"], 1)}


def process_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def cpu_use(seconds: float, elapsed: float) -> dict[str, float]:
    """A result's ``cpu``: the seconds a drain used, and that as a share of one core."""
    return {
        "process_s": round(seconds, 2),
        "process_pct_of_one_core": round(100 * seconds / elapsed, 1) if elapsed else 0,
    }


def pid_cpu_seconds(pid: int) -> float | None:
    """CPU seconds (user and system) another process has used so far, or None off Linux."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int | str) -> list[str] | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()


def server_cpu_seconds(pid: int) -> float | None:
    """CPU seconds a server process and its children have used so far, ended children included
    (the parent has reaped them into its own ``cutime``/``cstime``): PostgreSQL's postmaster and
    its backends, which come and go with connections. A child that ended and is not reaped yet
    shows no CPU at all, so this waits (up to a second) until there is none. None off Linux."""
    deadline = time.monotonic() + 1.0
    while True:
        own = _stat_fields(pid)
        if own is None:
            return None
        ticks = sum(int(v) for v in own[11:15])
        unreaped = False
        for entry in Path("/proc").iterdir():
            fields = _stat_fields(entry.name) if entry.name.isdigit() else None
            if fields is not None and int(fields[1]) == pid:
                ticks += sum(int(v) for v in fields[11:15])
                unreaped = unreaped or fields[0] == "Z"
        if not unreaped or time.monotonic() > deadline:
            return ticks / os.sysconf("SC_CLK_TCK")
        time.sleep(0.01)


def postmaster_pid(server_url: str) -> int | None:
    """The process id of the PostgreSQL server at ``server_url`` when it runs on this machine
    and its data directory is readable here (an embedded server), else None."""
    try:
        with psycopg.connect(server_url, autocommit=True) as conn:
            row = conn.execute("SHOW data_directory").fetchone()
        first_line = (Path(row[0]) / "postmaster.pid").read_text().split("\n", 1)[0]
    except (psycopg.Error, OSError, TypeError):
        return None
    pid = int(first_line)
    return pid if Path(f"/proc/{pid}").exists() else None


def machine_cpu_ticks() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs from /proc/stat, or None off Linux."""
    try:
        first = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    values = [int(v) for v in first[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    total = sum(values[:8])
    return total - idle, total


def busy_percent(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    if before is None or after is None or after[1] == before[1]:
        return None
    return round(100 * (after[0] - before[0]) / (after[1] - before[1]), 1)


def sample_busy_percent(seconds: float = 1.0) -> float | None:
    """How busy the machine is over ``seconds`` (other sessions' work shows up here)."""
    before = machine_cpu_ticks()
    time.sleep(seconds)
    return busy_percent(before, machine_cpu_ticks())


class ThreadProfiles:
    """cProfile in every thread (every lane's): one profile per thread, merged.

    Python 3.11 has no profiler for all threads; ``threading.setprofile`` runs a hook once in
    each new thread, which swaps itself for that thread's own ``cProfile.Profile``. The timer is
    the thread's CPU time, so waiting (network, database, another thread holding the GIL) is not
    counted: what is left is where the worker burns CPU.
    """

    def __init__(self) -> None:
        self._profiles: list[cProfile.Profile] = []
        self._lock = threading.Lock()

    def _start_in_thread(self, *_args: object) -> None:
        profile = cProfile.Profile(time.thread_time)
        with self._lock:
            self._profiles.append(profile)
        sys.setprofile(None)
        profile.enable()

    def start(self) -> None:
        threading.setprofile(self._start_in_thread)
        self._start_in_thread()

    def stop(self) -> None:
        threading.setprofile(None)
        with self._lock:
            self._profiles[0].disable()  # this thread's; finished threads stopped on their own

    def report(self, path: Path, *, top: int = 40) -> list[dict[str, Any]]:
        """Write the merged profile to ``path``; return the ``top`` functions by self time."""
        with self._lock:
            profiles = list(self._profiles)
        stream = io.StringIO()
        stats = pstats.Stats(profiles[0], stream=stream)
        for profile in profiles[1:]:
            stats.add(profile)
        stats.strip_dirs()
        stream.write(f"cProfile (thread CPU time) over {len(profiles)} threads, by self time\n")
        stats.sort_stats(pstats.SortKey.TIME).print_stats(top)
        stream.write("\nby cumulative time\n")
        stats.sort_stats(pstats.SortKey.CUMULATIVE).print_stats(top)
        path.write_text(stream.getvalue())
        table: dict[tuple[str, int, str], tuple[int, int, float, float, Any]]
        table = stats.stats  # type: ignore[attr-defined]
        rows = sorted(table.items(), key=lambda item: -item[1][2])[:15]
        return [
            {
                "function": f"{name} ({file}:{line})",
                "calls": calls,
                "self_s": round(self_s, 3),
                "cumulative_s": round(cumulative_s, 3),
            }
            for (file, line, name), (_, calls, self_s, cumulative_s, _) in rows
        ]
