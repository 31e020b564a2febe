"""A delivery's side of ``job_claims`` (the statements are ``work.statements``'): a batch's claims,
in one statement, and its runs' settles, on one reusable connection. Every change after a claim is
fenced by its token: an update that matches nothing means the claim was lost (taken over,
resolved by a human), and the caller must not ack. How each effect class commits, and why a lease
never outlives its message's visibility window: docs/design.md, "Effect classes"."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Final, LiteralString

import psycopg
from psycopg.rows import dict_row

from infrai_jobs.errors import LedgerError, LedgerUnavailable
from infrai_jobs.ledger.job_schema import JobMigrationName, check_schema
from infrai_jobs.ledger.postgres import (
    LedgerAdapter,
    array_literal,
    ledger_errors,
    savepoint_rollback_checked,
)
from infrai_jobs.queue_contract import DEFAULT_VISIBILITY_TIMEOUT_SECONDS
from infrai_jobs.work import statements as sql
from infrai_jobs.work import states
from infrai_jobs.work.store import claim_of

logger = logging.getLogger(__name__)

# Built once: json.dumps with any option builds a new encoder per call (about 1.5 µs).
_RESULT_JSON = json.JSONEncoder(allow_nan=False)

# How each kind of run settles its claim, fenced by its token (a deferral settled it already).
_SETTLE_STATEMENTS: Final[dict[states.RunKind, LiteralString]] = {
    states.RunKind.SUCCEEDED: sql.SETTLE_DONE,
    states.RunKind.PERMANENT: sql.SETTLE_FAILED,
    states.RunKind.UNCERTAIN: sql.MARK_UNCERTAIN,
    states.RunKind.TRANSIENT: sql.RELEASE_BATCH,
}
_FREEING_SLOTS: Final = {kind: sql.freeing_slots(s) for kind, s in _SETTLE_STATEMENTS.items()}

_ISOLATION_LEFT: LiteralString = """
SELECT greatest(extract(epoch FROM single_until - now()), 0)::float8
FROM consume_isolation WHERE queue = %(queue)s
"""

_ISOLATE: LiteralString = """
INSERT INTO consume_isolation AS i (queue, single_until, reason, updated_at)
VALUES (%(queue)s, now() + make_interval(secs => %(seconds)s), %(reason)s, now())
ON CONFLICT (queue) DO UPDATE
    SET single_until = greatest(i.single_until, EXCLUDED.single_until),
        reason = EXCLUDED.reason,
        updated_at = now()
RETURNING greatest(extract(epoch FROM single_until - now()), 0)::float8
"""

_IDLE = psycopg.pq.TransactionStatus.IDLE
# A handler that swallowed a database error: its work cannot commit.
_LEFT_ABORTED: Final = states.JobRun(
    states.RunKind.TRANSIENT, error="handler left the transaction aborted"
)


class _IsolateJobs(Exception):
    """A handler failed in the all-in-one attempt: run the batch again with savepoints."""


def _aborted(conn: psycopg.Connection[Any]) -> bool:
    return conn.info.transaction_status == psycopg.pq.TransactionStatus.INERROR


@contextmanager
def _batch_transaction(conn: psycopg.Connection[Any]) -> Iterator[None]:
    """A database-class batch's transaction on the autocommit connection, opened by its first
    statement (``BEGIN; <claim>``) and committed by its last (``<settle>; COMMIT``) or here; any
    failure rolls back the whole. ``conn.transaction()`` inside it is a savepoint."""
    try:
        yield
    except BaseException:
        if not conn.broken and conn.info.transaction_status != _IDLE:
            conn.execute("ROLLBACK")
        raise
    if conn.info.transaction_status != _IDLE:
        conn.execute("COMMIT")


_REQUEST_FIELDS: Final = tuple(states.ClaimRequest.__dataclass_fields__)
DatabaseRunner = Callable[[states.ClaimRequest, "psycopg.Connection[Any] | None"], states.JobRun]


class PostgresLedger(LedgerAdapter):
    """The claim ledger on one reusable connection, re-established when the server drops it."""

    def __init__(
        self,
        database_url: str,
        *,
        visibility_timeout: int = DEFAULT_VISIBILITY_TIMEOUT_SECONDS,
        job_migrations: Sequence[JobMigrationName] = (),
        **options: Any,
    ) -> None:
        # The queue's visibility timeout bounds every lease (``work.statements.CLAIM``); the
        # jobs package's migrations are checked with the ledger's schema on the first connection.
        super().__init__(database_url, **options)
        self._visibility, self._job_migrations = visibility_timeout, tuple(job_migrations)
        self._schema_checked = False

    def _opened(self, conn: psycopg.Connection[Any]) -> None:
        if self._schema_checked:
            return
        # Before the caller's error translation: say it as reading the schema version.
        with ledger_errors("cannot read the ledger's schema version", self._connector.url):
            check_schema(conn, self._job_migrations)
        self._schema_checked = True

    connection = LedgerAdapter._connection

    def ping(self) -> None:
        """Make sure the ledger answers before a drain receives anything: a connection the
        server closed while the environment was frozen is only found out by using it. Reconnects
        once if it was dead, so no delivery is spent on messages that could not be claimed."""
        for attempt in range(2):
            try:
                with self._translated() as conn:
                    conn.execute("SELECT 1")
            except LedgerUnavailable:
                if attempt:
                    raise
                logger.warning(
                    "the ledger connection was dead; reconnecting", extra={"action": "reconnect"}
                )
            else:
                return

    def claim(self, requests: Sequence[states.ClaimRequest]) -> list[states.ClaimDecision]:
        """Keys must be distinct."""
        if not requests:
            return []
        with self._translated(on_broken=lambda: self._release_after_lost_answer(requests)) as conn:
            return self._claim_on(conn, requests)

    def _release_after_lost_answer(self, requests: Sequence[states.ClaimRequest]) -> None:
        # The claim may have committed before the answer was lost. No effect has run yet, so
        # this invocation can still safely give its claims back; otherwise the redelivery would
        # find them running and (rightly, for an irreversible effect) flag them stuck.
        try:
            with ledger_errors(url=self._connector.url), self._connector.connect_once() as fresh:
                keys = array_literal(r.idem_key for r in requests)
                tokens = array_literal(r.claim_token for r in requests)
                fresh.execute(sql.RELEASE_BATCH, {"keys": keys, "tokens": tokens})
        except LedgerError:
            # The batch's own error follows; the claims expire with their leases.
            logger.warning(
                "could not release claims after a lost answer",
                extra={"action": "release_failed", "keys": [r.idem_key for r in requests]},
            )

    def _claim_on(
        self,
        conn: psycopg.Connection[Any],
        requests: Sequence[states.ClaimRequest],
        *,
        begin: bool = False,
    ) -> list[states.ClaimDecision]:
        ordered = sorted(requests, key=lambda r: r.idem_key)  # one lock order: no deadlocks
        params: dict[str, Any] = {"visibility": self._visibility}
        params |= {n: array_literal(getattr(r, n) for r in ordered) for n in _REQUEST_FIELDS}
        if begin:
            # BEGIN and the claim in one message: the second result set is the claim's.
            with psycopg.ClientCursor(conn, row_factory=dict_row) as client_cur:
                client_cur.execute(sql.BEGIN_AND_CLAIM, params)
                client_cur.nextset()
                claimed = client_cur.fetchall()
        else:
            with conn.cursor(row_factory=dict_row) as cur:
                claimed = cur.execute(sql.CLAIM, params).fetchall()
        rows = {row["idem_key"]: row for row in claimed}
        unseen = [k for k, row in rows.items() if row["won_token"] is None and not row["state"]]
        if unseen:
            reread = {"keys": array_literal(unseen), "visibility": self._visibility}
            with conn.cursor(row_factory=dict_row) as cur:
                rows.update((row["idem_key"], row) for row in cur.execute(sql.REREAD, reread))
        by_key = {r.idem_key: r for r in requests}
        return [states.decide(by_key[key], row) for key, row in rows.items()]

    def run_database_batch(
        self, requests: Sequence[states.ClaimRequest], runner: DatabaseRunner
    ) -> tuple[list[states.ClaimDecision], list[states.Settlement]]:
        """Claim, run and settle database jobs in one transaction (docs/design.md, "Effect
        classes"): every claim decision and the settlements of the jobs that ran, in two round
        trips (``BEGIN`` travels with the claim, ``COMMIT`` with the settle). If a handler fails,
        that attempt is rolled back whole and the batch runs again with a savepoint per job."""
        if not requests:
            return [], []
        with self._translated() as conn:
            try:
                return self._database_batch(conn, requests, runner, isolated=False)
            except _IsolateJobs:
                pass
            return self._database_batch(conn, requests, runner, isolated=True)

    def _database_batch(
        self,
        conn: psycopg.Connection[Any],
        requests: Sequence[states.ClaimRequest],
        runner: DatabaseRunner,
        *,
        isolated: bool,
    ) -> tuple[list[states.ClaimDecision], list[states.Settlement]]:
        with _batch_transaction(conn):
            decisions = self._claim_on(conn, requests, begin=True)
            runs: list[tuple[states.ClaimRequest, states.JobRun]] = []
            for request in [d.request for d in decisions if d.status is states.ClaimStatus.WON]:
                if isolated:
                    job = f"the savepoint of job {request.idem_key!r}"
                    with savepoint_rollback_checked(job), conn.transaction() as savepoint:
                        run = runner(request, conn)
                        if run.kind is states.RunKind.SUCCEEDED and _aborted(conn):
                            run = _LEFT_ABORTED
                        if run.kind is not states.RunKind.SUCCEEDED:
                            raise psycopg.Rollback(savepoint)
                else:
                    run = runner(request, conn)
                    if run.kind is not states.RunKind.SUCCEEDED or _aborted(conn):
                        raise _IsolateJobs
                runs.append((request, run))
            settlements = self._settle_on(conn, runs, uncertain_is_stuck=False, commit=not isolated)
        return decisions, settlements

    def settle(self, request: states.ClaimRequest, run: states.JobRun) -> states.Settlement:
        with self._translated() as conn:
            (settlement,) = self._settle_on(conn, [(request, run)], uncertain_is_stuck=True)
        return settlement

    def _settle_on(
        self,
        conn: psycopg.Connection[Any],
        runs: Sequence[tuple[states.ClaimRequest, states.JobRun]],
        *,
        uncertain_is_stuck: bool,
        commit: bool = False,
    ) -> list[states.Settlement]:
        """Settle ``runs``, one fenced statement per kind. ``commit``: only successes, settled
        by the batch transaction's last statement (bound client-side: one round trip)."""
        groups: dict[states.RunKind, list[tuple[states.ClaimRequest, states.JobRun]]] = {}
        for request, run in runs:
            groups.setdefault(states.settled_kind(run.kind, uncertain_is_stuck), []).append(
                (request, run)
            )
        settled: dict[str, states.SettleStatus] = {}  # by key; a key missing from it was LOST
        for kind, items in groups.items():
            slots = any(run.held_slot for _, run in items)
            statement = (_FREEING_SLOTS if slots else _SETTLE_STATEMENTS).get(kind)
            if statement is None:  # a deferral settled the claim itself, fenced by its token
                settled.update(
                    (request.idem_key, states.SETTLE_STATUS[kind]) for request, _ in items
                )
                continue
            done = kind is states.RunKind.SUCCEEDED
            params = {
                "keys": array_literal(r.idem_key for r, _ in items),
                "tokens": array_literal(r.claim_token for r, _ in items),
                "values": array_literal(
                    _RESULT_JSON.encode(run.result) if done else run.error for _, run in items
                ),
            }
            if commit:
                statement = sql.SETTLE_DONE_AND_COMMIT
            with psycopg.ClientCursor(conn) if commit else conn.cursor() as cur:
                matched = cur.execute(statement, params).fetchall()
            settled.update((row[0], states.SETTLE_STATUS[kind]) for row in matched)
        return [
            states.Settlement(request, settled.get(request.idem_key, states.SettleStatus.LOST), run)
            for request, run in runs
        ]

    def flag_stuck(self, reasons: dict[str, str]) -> None:
        if not reasons:
            return
        params = {"keys": array_literal(reasons), "reasons": array_literal(reasons.values())}
        with self._translated() as conn:
            conn.execute(sql.FLAG_STUCK, params)

    def consume_isolation(self, queue: str) -> float:
        with self._translated() as conn:
            row = conn.execute(_ISOLATION_LEFT, {"queue": queue}).fetchone()
        return float(row[0]) if row else 0.0

    def isolate_consumes(self, queue: str, seconds: float, reason: str) -> float:
        """Kept in the ledger, not in one process: the messages an unreadable answer served come
        back after the visibility timeout, to whichever drain consumes next."""
        params = {"queue": queue, "seconds": seconds, "reason": reason[:500]}
        with self._translated() as conn:
            row = conn.execute(_ISOLATE, params).fetchone()
        return float(row[0]) if row else seconds

    def get(self, idem_key: str) -> states.ClaimRow | None:
        with self._translated() as conn:
            return claim_of(conn, idem_key, visibility=self._visibility)
