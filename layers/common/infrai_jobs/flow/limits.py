"""Rate limits and concurrency keys in the ledger's database, on its clock. A run's slot and its
start are taken together, in one transaction that is one round trip (``admit``). A rate limit
spaces the starts of every drain (a generic cell rate algorithm with no burst); a concurrency
slot ends with its run: the statement settling the run's claim frees it (``work.statements``),
and a killed run's slot frees itself when its lease ends."""

from __future__ import annotations

import uuid
from typing import Any, Final, LiteralString, NamedTuple

import psycopg

from infrai_jobs.jobs.policy import RateLimit
from infrai_jobs.ledger.postgres import ledger_errors

# Classes of two-key advisory locks (the first key), apart from the migrations' one-key lock.
RATE_LOCK_CLASS: Final = 0x1F0A_7C40
CONCURRENCY_LOCK_CLASS: Final = 0x1F0A_7C41
# Rate-limit starts are kept this long past their window: evidence for operators and tests.
RATE_STARTS_KEPT_SECONDS: Final = 300.0

# Each lock is a statement of its own, before the one that reads what it guards: a statement's
# snapshot is taken when it starts, so it sees what the lock's previous holder committed. The
# statements of one message run as one transaction (PostgreSQL's rule for a multi-statement
# query), which ends after the last: an error rolls all of it back. Always the key's lock, then
# the job's: two drains never wait for each other in a circle.
_CONCURRENCY_LOCK: LiteralString = (
    "SELECT pg_advisory_xact_lock(%(key_class)s, hashtext(%(job)s || chr(31) || %(value)s));\n"
)
_RATE_LOCK: LiteralString = "SELECT pg_advisory_xact_lock(%(rate_class)s, hashtext(%(job)s));\n"

# Under the locks, on one clock read after them. The rate's next start is the later of now and
# the last reserved start plus the spacing (200 ms for 5 a second): starts are spaced, never
# counted in a window, which would let N through at its end and N more at the next one's start
# (2N in one second at the provider). A slot is free when fewer than ``max`` others are live; its
# lease is read from the run's own row (the claim holding ``token``), so it ends exactly when the
# run's does, and a row no longer holding ``token`` takes nothing. Both are taken, or neither: a
# start more than ``max_wait`` seconds away takes no slot, a full key reserves no start. Taking a
# slot again with the same token renews it to that lease. Expired slots and old starts go.
_ADMIT: LiteralString = """
WITH judged AS (
    SELECT clock.now, next_start.at, held.lease_until,
           coalesce(%(value)s IS NULL OR (live.n < %(max)s AND held.lease_until > clock.now),
                    false) AS slot_free,
           next_start.at <= clock.now + make_interval(secs => %(max_wait)s) AS start_fits
    FROM (SELECT clock_timestamp() AS now) AS clock,
    LATERAL (SELECT greatest(clock.now, max(started_at) + make_interval(secs => %(spacing)s))
             AS at FROM flow_rate_starts WHERE job = %(job)s) AS next_start,
    LATERAL (SELECT count(*) AS n FROM flow_concurrency_slots
             WHERE job = %(job)s AND key_value = %(value)s AND lease_until > clock.now
               AND token <> %(token)s) AS live,
    LATERAL (SELECT max(lease_until) AS lease_until FROM job_claims
             WHERE idem_key = %(key)s AND claim_token = %(token)s AND state = 'running') AS held
),
taken AS (
    INSERT INTO flow_concurrency_slots (token, job, key_value, holder, lease_until)
    SELECT %(token)s, %(job)s, %(value)s, %(holder)s, lease_until FROM judged
    WHERE %(value)s IS NOT NULL AND slot_free AND start_fits
    ON CONFLICT (token) DO UPDATE SET lease_until = EXCLUDED.lease_until
),
started AS (
    INSERT INTO flow_rate_starts (job, started_at)
    SELECT %(job)s, at FROM judged WHERE %(spacing)s IS NOT NULL AND slot_free AND start_fits
),
expired AS (
    DELETE FROM flow_concurrency_slots AS s USING judged
    WHERE s.job = %(job)s AND s.key_value = %(value)s AND s.lease_until <= judged.now
),
pruned AS (
    DELETE FROM flow_rate_starts USING judged
    WHERE %(spacing)s IS NOT NULL AND job = %(job)s
      AND started_at < judged.now - make_interval(secs => %(kept)s)
)
SELECT slot_free, start_fits, extract(epoch FROM at - now)::float8 FROM judged
"""


class Admission(NamedTuple):
    """``admit``'s answer: the run starts in ``wait`` seconds when both hold; else ``wait`` is
    how long until the rate's next free start."""

    slot_free: bool  # False: every slot of its concurrency key's value is taken
    start_fits: bool  # False: its rate's next start is further away than it may wait
    wait: float


def admit(
    conn: psycopg.Connection[Any],
    job: str,
    *,
    token: uuid.UUID,
    idem_key: str,
    holder: str,
    concurrency: tuple[str, int] | None = None,
    rate: RateLimit | None = None,
    max_wait: float = 0.0,
) -> Admission:
    """Take, for the run of ``idem_key`` holding ``token``, one of the slots of
    ``concurrency`` (its key value and max running) and the next start ``rate`` allows, when
    that start is at most ``max_wait`` seconds away: both or neither. Call the provider when
    the wait is over, not before. Run outside any transaction (autocommit): the message is one."""
    value, most = concurrency if concurrency is not None else (None, None)
    params: dict[str, Any] = {"job": job, "value": value, "max": most, "key": idem_key}
    params["holder"] = holder
    params |= {"token": token, "spacing": None, "max_wait": 0.0, "kept": None}
    params |= {"key_class": CONCURRENCY_LOCK_CLASS, "rate_class": RATE_LOCK_CLASS}
    if rate is not None:
        params |= {"spacing": rate.spacing_seconds, "max_wait": max(float(max_wait), 0.0)}
        params["kept"] = rate.window_seconds + RATE_STARTS_KEPT_SECONDS
    query = (_CONCURRENCY_LOCK if concurrency else "") + (_RATE_LOCK if rate else "") + _ADMIT
    with ledger_errors(f"cannot apply the limits of {job!r}"), psycopg.ClientCursor(conn) as cur:
        cur.execute(query, params)
        while cur.nextset():
            pass
        slot_free, fits, wait = cur.fetchone() or (False, False, 0.0)
    # Microseconds are the clock's grain: a refused start always has a wait, however short.
    return Admission(bool(slot_free), bool(fits), max(float(wait), 0.0 if fits else 1e-6))
