"""Rate limits and concurrency keys in the ledger's database, on its clock, each function in
``conn.transaction()`` of its own (a savepoint inside the caller's transaction). A rate limit
spaces the starts of every drain (a generic cell rate algorithm with no burst); a concurrency
slot ends with its run's lease, so a killed run's slot frees itself."""

from __future__ import annotations

import uuid
from typing import Any, Final, LiteralString

import psycopg

from infrai_jobs.jobs.policy import RateLimit
from infrai_jobs.ledger.postgres import ledger_errors

# Classes of two-key advisory locks (the first key), apart from the migrations' one-key lock.
RATE_LOCK_CLASS: Final = 0x1F0A_7C40
CONCURRENCY_LOCK_CLASS: Final = 0x1F0A_7C41
# Rate-limit starts are kept this long past their window: evidence for operators and tests.
RATE_STARTS_KEPT_SECONDS: Final = 300.0

_RATE_LOCK: LiteralString = "SELECT pg_advisory_xact_lock(%(class)s, hashtext(%(job)s))"

# Under the job's lock, the start reserved is the later of now (read after the lock) and the
# last reserved start plus the spacing (200 ms for 5 a second). Starts are spaced, never counted
# in a window: a window count lets N through at its end and N more at the next one's start,
# which a provider sees as 2N in one second. No reservation later than ``max_wait`` seconds
# from now is made (the caller defers the run instead). Old starts are pruned on the way.
_RATE_RESERVE: LiteralString = """
WITH clock AS (SELECT clock_timestamp() AS now),
slot AS (
    SELECT greatest(
        clock.now,
        (SELECT max(started_at) FROM flow_rate_starts WHERE job = %(job)s)
            + make_interval(secs => %(spacing)s)
    ) AS at
    FROM clock
),
started AS (
    INSERT INTO flow_rate_starts (job, started_at)
    SELECT %(job)s, slot.at FROM slot, clock
    WHERE slot.at <= clock.now + make_interval(secs => %(max_wait)s)
    RETURNING id
),
pruned AS (
    DELETE FROM flow_rate_starts USING clock
    WHERE job = %(job)s AND started_at < clock.now - make_interval(secs => %(kept)s)
)
SELECT EXISTS (SELECT 1 FROM started), extract(epoch FROM slot.at - clock.now)::float8
FROM slot, clock
"""

_CONCURRENCY_LOCK: LiteralString = (
    "SELECT pg_advisory_xact_lock(%(class)s, hashtext(%(job)s || chr(31) || %(value)s))"
)

# Under the key's lock: expired slots go, and a slot is taken when fewer than ``max`` others
# are live. Its lease is read from the run's own row (the claim holding ``token``), so it ends
# exactly when the run's does; a row no longer holding ``token`` takes nothing. Taking it again
# with the same token renews it to that lease.
_ACQUIRE: LiteralString = """
WITH clock AS (SELECT clock_timestamp() AS now),
held AS (
    SELECT (SELECT lease_until FROM job_claims
            WHERE idem_key = %(key)s AND claim_token = %(token)s AND state = 'running')
        AS lease_until
),
expired AS (
    DELETE FROM flow_concurrency_slots USING clock
    WHERE job = %(job)s AND key_value = %(value)s AND lease_until <= clock.now
),
live AS (
    SELECT count(*) AS n FROM flow_concurrency_slots, clock
    WHERE job = %(job)s AND key_value = %(value)s AND lease_until > clock.now
      AND token <> %(token)s
)
INSERT INTO flow_concurrency_slots (token, job, key_value, holder, lease_until)
SELECT %(token)s, %(job)s, %(value)s, %(holder)s, held.lease_until
FROM live, clock, held WHERE live.n < %(max)s AND held.lease_until > clock.now
ON CONFLICT (token) DO UPDATE SET lease_until = EXCLUDED.lease_until
RETURNING token
"""

_RELEASE_SLOT: LiteralString = "DELETE FROM flow_concurrency_slots WHERE token = %(token)s"


def reserve_start(
    conn: psycopg.Connection[Any], job: str, limit: RateLimit, *, max_wait: float
) -> tuple[bool, float]:
    """Reserve the next start of ``job`` that ``limit`` allows: (True, seconds to wait until
    it) when that is at most ``max_wait`` seconds away, else (False, seconds until the next
    free start) with nothing reserved. Call the provider when the wait is over, not before; the
    job's lock is held until the caller's transaction ends, so keep that short."""
    params = {"class": RATE_LOCK_CLASS, "job": job, "spacing": limit.spacing_seconds}
    params["max_wait"] = max(float(max_wait), 0.0)
    params["kept"] = limit.window_seconds + RATE_STARTS_KEPT_SECONDS
    with ledger_errors(f"cannot apply the rate limit of {job!r}"), conn.transaction():
        conn.execute(_RATE_LOCK, params)
        row = conn.execute(_RATE_RESERVE, params).fetchone()
    if row is None:  # pragma: no cover - the statement always answers one row
        return True, 0.0
    reserved, wait = row
    # Microseconds are the clock's grain: a refused start always has a wait, however short.
    return bool(reserved), max(float(wait), 0.0) if reserved else max(float(wait), 1e-6)


def acquire_concurrency(
    conn: psycopg.Connection[Any],
    job: str,
    key_value: str,
    max_running: int,
    *,
    holder: str,
    idem_key: str,
    token: uuid.UUID,
) -> bool:
    """Take one of the ``max_running`` slots of (``job``, ``key_value``) for the run of
    ``idem_key`` holding ``token``, until it is released or that run's lease passes; False
    when all are taken, or when no running row of ``idem_key`` holds ``token``."""
    params = {"class": CONCURRENCY_LOCK_CLASS, "job": job, "value": key_value, "max": max_running}
    params |= {"holder": holder, "key": idem_key, "token": token}
    with ledger_errors(f"cannot take a concurrency slot of {job!r}"), conn.transaction():
        conn.execute(_CONCURRENCY_LOCK, params)
        return conn.execute(_ACQUIRE, params).fetchone() is not None


def release_concurrency(conn: psycopg.Connection[Any], token: uuid.UUID) -> bool:
    """Free the slot the run holding ``token`` took; False when it had none (or it expired)."""
    with ledger_errors("cannot release a concurrency slot"), conn.transaction():
        return conn.execute(_RELEASE_SLOT, {"token": token}).rowcount == 1
