"""Every statement that writes ``job_claims``, and the reads that decide who may write it.

No other module holds an ``INSERT``, ``UPDATE`` or ``DELETE`` on the table (a unit test reads the
tree for one). The rules several statements share are fragments defined once here; why they are
as they are is docs/design.md's "One state machine".

**One clock**, the database's transaction clock ``now()``: every lease is set and judged on it.
Schedules (``run_after``) count from ``clock_timestamp()`` instead.

**One lease end.** ``lease_end``: the lease, else (a lease-less row, as the field notes' Node worker
writes them) the claim time plus the queue's visibility timeout (``%(visibility)s``, bound by every
caller), else NULL: never "over", so nothing takes such a row. "Over" and "live" are that one end
compared with the clock; nothing in Python decides either.

**One takeover rule** (``TAKEOVER``): a running run whose lease is over, not flagged for a human,
whose effect may be repeated (an ``external`` run may be taken only if it never began its
call). A delivery's claim and a drain's ``take due`` both take over by it, each adding who may:
a delivery only a key-passing job's claim for the same work, a drain only work the ledger owns.
"""

from __future__ import annotations

from typing import LiteralString


def lease_end(row: LiteralString = "") -> LiteralString:
    """When the lease of ``row`` (a table alias, or none) ends, on the database's clock."""
    at = row + "." if row else ""
    return (
        "coalesce(" + at + "lease_until, " + at + "claimed_at + "
        "make_interval(secs => %(visibility)s))"
    )


def lease_over(row: LiteralString = "") -> LiteralString:
    return "(" + lease_end(row) + " < now())"


def lease_live(row: LiteralString = "") -> LiteralString:
    return "(" + lease_end(row) + " >= now())"


def new_lease(seconds: LiteralString) -> LiteralString:
    """A lease of ``seconds`` (an SQL expression) from now: the one place a lease is set."""
    return "now() + make_interval(secs => " + seconds + ")"


def lease_cut(row: LiteralString = "") -> LiteralString:
    """A lease ended now, unless it ended already: what a run that gives up its hold stores."""
    return "least(" + (row + "." if row else "") + "lease_until, now())"


def takeover(row: LiteralString = "") -> LiteralString:
    at = row + "." if row else ""
    return (
        "(" + at + "state = 'running' AND " + at + "error IS NULL AND " + lease_over(row) + " AND "
        "(" + at + "effect IS DISTINCT FROM 'external' OR "
        "(" + at + "run_after IS NOT NULL AND " + at + "began_at IS NULL)))"
    )


TAKEOVER: LiteralString = takeover()


def freeing_slots(statement: LiteralString, tokens: LiteralString = "%(tokens)s") -> LiteralString:
    """``statement`` (returning rows) ends the runs holding ``tokens``, so the concurrency slots
    they took (``flow.limits``) go in the same round trip, matched or not: the runs are over."""
    return (
        "WITH ended AS (" + statement + "\n),\nfreed AS (DELETE FROM flow_concurrency_slots "
        "WHERE token = ANY(" + tokens + "::uuid[]))\nSELECT * FROM ended"
    )


# --- Reads -------------------------------------------------------------------------------------

# The columns of a ClaimRow (work.states), for every statement that returns whole claims, and
# the two a reader needs to judge the lease: its end and whether it is live, by the rule above.
CLAIM_COLUMNS: LiteralString = (
    """idem_key, state, message_id, job, effect, attempts,
       payload_sha256, error, result, claimed_at, lease_until, updated_at, claim_token,
       payload, queue, run_after, deferred_at, last_error, began_at,
       """
    + lease_end()
    + " AS lease_end, (state = 'running' AND "
    + lease_live()
    + ") AS lease_live"
)

_RETURNING: LiteralString = "\nRETURNING " + CLAIM_COLUMNS
CLAIMS: LiteralString = "SELECT " + CLAIM_COLUMNS + "\nFROM job_claims"
CLAIM_BY_KEY: LiteralString = CLAIMS + " WHERE idem_key = %(key)s"
CLAIM_BY_KEY_FOR_UPDATE: LiteralString = CLAIM_BY_KEY + " FOR UPDATE"

# A stuck claim: running, its lease over, and flagged for a human (an outcome nobody knows), or
# untouched for ``%(threshold)s`` seconds since its latest claim, or (work the ledger owns) an
# ``external`` run that began its handler: its effect may have happened, so no drain takes it
# again. A run under a live lease is never stuck: its holder may be making the call right now.
STUCK_CLAIM: LiteralString = (
    "state = 'running' AND "
    + lease_over()
    + """
  AND (error IS NOT NULL
       OR (run_after IS NULL
           AND coalesce(updated_at, claimed_at) < now() - make_interval(secs => %(threshold)s))
       OR (run_after IS NOT NULL AND effect = 'external' AND began_at IS NOT NULL))"""
)

# Stuck claims, oldest first: every job's (``claims stuck``), or only those of ``jobs`` (the
# reconcile pass's candidates: the jobs that declare a probe) when it is not NULL.
STUCK_CLAIMS: LiteralString = (
    CLAIMS
    + "\nWHERE (%(jobs)s::text[] IS NULL OR job = ANY(%(jobs)s::text[])) AND "
    + STUCK_CLAIM
    + "\nORDER BY coalesce(updated_at, claimed_at)\nLIMIT %(limit)s\n"
)

# What the watcher pages on: how many are stuck, and the oldest running claim's age.
STUCK_CLAIM_COUNT: LiteralString = (
    "SELECT count(*) FILTER (WHERE "
    + STUCK_CLAIM
    + """),
       coalesce(extract(epoch FROM now() - min(coalesce(updated_at, claimed_at))), 0)
FROM job_claims WHERE state = 'running'
"""
)

DEFERRED_STATS: LiteralString = """
SELECT count(*), coalesce(extract(epoch FROM clock_timestamp() - min(deferred_at)), 0)
FROM job_claims
WHERE run_after IS NOT NULL AND state IN ('deferred', 'running')
"""

# --- A delivery's claim, a batch at a time ------------------------------------------------------

CLAIM: LiteralString = (
    """
WITH input AS (
    SELECT t.idem_key, t.message_id, t.job, t.effect, t.claim_token, t.fingerprint,
           -- The lease invariant: never past the message's visibility window.
           CASE WHEN t.lease_seconds IS NOT NULL THEN """
    + new_lease(
        "least(t.lease_seconds, greatest(coalesce(t.visibility_left, %(visibility)s), 0), "
        "%(visibility)s)"
    )
    + """ END AS lease_until
    -- One array per field of ClaimRequest.
    FROM unnest(
        %(idem_key)s::text[], %(message_id)s::text[], %(job)s::text[], %(effect)s::text[],
        %(claim_token)s::uuid[], %(lease_seconds)s::float8[], %(fingerprint)s::text[],
        %(visibility_left)s::float8[]
    ) AS t(idem_key, message_id, job, effect, claim_token, lease_seconds, fingerprint,
           visibility_left)
),
claimed AS (
    INSERT INTO job_claims AS c (idem_key, state, message_id, job, effect, claim_token,
                                 lease_until, payload_sha256, attempts, updated_at)
    SELECT idem_key, 'running', message_id, job, effect, claim_token, lease_until,
           fingerprint, 1, now()
    FROM input
    ORDER BY idem_key
    ON CONFLICT (idem_key) DO UPDATE
        SET message_id = EXCLUDED.message_id,
            claim_token = EXCLUDED.claim_token,
            lease_until = EXCLUDED.lease_until,
            attempts = CASE WHEN c.state = 'cancelled' THEN 1 ELSE coalesce(c.attempts, 1) + 1 END,
            error = NULL,
            updated_at = now(),
            -- Unchanged by a takeover (the same work, not ledger-owned); cleared for new work.
            state = 'running', job = EXCLUDED.job, effect = EXCLUDED.effect,
            payload_sha256 = EXCLUDED.payload_sha256, result = NULL, payload = NULL,
            queue = NULL, run_after = NULL, deferred_at = NULL, last_error = NULL,
            began_at = NULL,
            claimed_at = CASE WHEN c.state = 'cancelled' THEN now() ELSE c.claimed_at END
        -- Work an operator cancelled is free: a new message for its key is new work. A
        -- delivery takes over only a key-passing job's claim for the same work that the ledger
        -- does not own, by the takeover rule, or when the holder is this very message (its
        -- earlier delivery is certainly dead).
        WHERE c.state = 'cancelled'
           OR (c.run_after IS NULL
               AND c.effect = 'external_idempotent'
               AND EXCLUDED.effect = 'external_idempotent'
               AND c.payload_sha256 = EXCLUDED.payload_sha256
               AND c.state = 'running' AND c.error IS NULL
               AND ("""
    + takeover("c")
    + """ OR c.message_id = EXCLUDED.message_id))
    RETURNING c.idem_key, c.claim_token, c.attempts
)
-- j is the row as it stood before this statement (one snapshot for the whole WITH).
SELECT i.idem_key, c.claim_token AS won_token, c.attempts AS won_attempts,
       j.state, j.message_id, j.effect, j.payload_sha256, j.error, j.result,
       j.run_after IS NOT NULL AS owned, """
    + lease_over("j")
    + """ AS lease_expired,
       extract(epoch FROM now() - coalesce(j.updated_at, j.claimed_at))::float8 AS held_seconds
FROM input i
LEFT JOIN claimed c ON c.idem_key = i.idem_key
LEFT JOIN job_claims j ON j.idem_key = i.idem_key
"""
)

BEGIN_AND_CLAIM: LiteralString = "BEGIN;\n" + CLAIM

# A claim that lost a race with a transaction committing the same key cannot see that row in
# the claim statement's snapshot; this re-reads those few keys.
REREAD: LiteralString = (
    """
SELECT idem_key, NULL::uuid AS won_token, NULL::int AS won_attempts,
       state, message_id, effect, payload_sha256, error, result, run_after IS NOT NULL AS owned,
       """
    + lease_over()
    + """ AS lease_expired,
       extract(epoch FROM now() - coalesce(updated_at, claimed_at))::float8 AS held_seconds
FROM job_claims WHERE idem_key = ANY(%(keys)s::text[])
"""
)

# The holder's settles of a batch, fenced by each run's token, matching only a running claim.
# ``values`` is the result (as JSON text) of a done run, the error of any other.
_FENCED: LiteralString = """
    unnest(%(keys)s::text[], %(tokens)s::uuid[], %(values)s::text[])
    AS u(idem_key, claim_token, value)
WHERE c.idem_key = u.idem_key AND c.claim_token = u.claim_token AND c.state = 'running'
RETURNING c.idem_key"""
SETTLE_DONE: LiteralString = (
    "UPDATE job_claims AS c\n"
    "SET state = 'done', result = u.value::jsonb, error = NULL, updated_at = now()\nFROM" + _FENCED
)
SETTLE_DONE_AND_COMMIT: LiteralString = SETTLE_DONE + ";\nCOMMIT"
SETTLE_FAILED: LiteralString = (
    "UPDATE job_claims AS c\nSET state = 'failed', error = u.value, updated_at = now()\nFROM"
    + _FENCED
)
# The holder does not know whether its effect happened (a delivery's or a deferred run's):
# flagged for a human, its lease ended; only a human or a probe settles it.
MARK_UNCERTAIN: LiteralString = (
    "UPDATE job_claims AS c\nSET error = 'effect uncertain: ' || u.value, updated_at = now(),\n"
    "    lease_until = " + lease_cut("c") + "\nFROM" + _FENCED
)
RELEASE_BATCH: LiteralString = """
DELETE FROM job_claims AS c
USING unnest(%(keys)s::text[], %(tokens)s::uuid[]) AS u(idem_key, claim_token)
WHERE c.idem_key = u.idem_key AND c.claim_token = u.claim_token AND c.state = 'running'
RETURNING c.idem_key
"""

# Annotates a claim this delivery does not hold; it changes no state, so it is not fenced.
FLAG_STUCK: LiteralString = """
UPDATE job_claims AS c
SET error = u.reason, updated_at = now()
FROM unnest(%(keys)s::text[], %(reasons)s::text[]) AS u(idem_key, reason)
WHERE c.idem_key = u.idem_key AND c.state = 'running' AND c.error IS NULL
"""

# --- Work the ledger owns: a claim that waits -------------------------------------------------

# The run holding the claim defers it: the row waits, with its payload, until run_after.
DEFER: LiteralString = freeing_slots(
    """
UPDATE job_claims
SET state = 'deferred', payload = %(payload)s, queue = %(queue)s, message_id = %(message_id)s,
    attempts = %(attempts)s, last_error = %(error)s, error = NULL,
    run_after = clock_timestamp() + make_interval(secs => %(delay)s),
    deferred_at = coalesce(deferred_at, now()), claim_token = NULL, lease_until = NULL,
    began_at = NULL, updated_at = now()
WHERE idem_key = %(idem_key)s AND claim_token = %(token)s AND state = 'running'"""
    + _RETURNING,
    "ARRAY[%(token)s]",
)

# Work no claim holds yet (a dead letter taken back): a new row that waits.
DEFER_NEW: LiteralString = (
    """
INSERT INTO job_claims (idem_key, state, message_id, job, effect, payload_sha256, attempts,
                        payload, queue, last_error, run_after, deferred_at, updated_at)
VALUES (%(idem_key)s, 'deferred', %(message_id)s, %(job)s, %(effect)s, %(fingerprint)s,
        %(attempts)s, %(payload)s, %(queue)s, %(error)s,
        clock_timestamp() + make_interval(secs => %(delay)s), now(), now())
ON CONFLICT (idem_key) DO NOTHING"""
    + _RETURNING
)

# Due first (then the oldest deferral), skipping rows another drain has locked: waiting work
# whose time has come, or a run the ledger owns that may be taken over. Each taken row gets one
# of the tokens the caller minted (``%(tokens)s``, as many as it may take).
TAKE_DUE: LiteralString = (
    """
WITH due AS (
    SELECT idem_key AS due_key FROM job_claims
    WHERE run_after IS NOT NULL
      AND ((state = 'deferred' AND run_after <= clock_timestamp()) OR """
    + TAKEOVER
    + """)
      AND (%(jobs)s::text[] IS NULL OR job = ANY(%(jobs)s::text[]))
    ORDER BY run_after, deferred_at, idem_key
    LIMIT cardinality(%(tokens)s::uuid[])
    FOR UPDATE SKIP LOCKED
),
numbered AS (SELECT due_key, row_number() OVER (ORDER BY due_key) AS n FROM due),
minted AS (SELECT token, n FROM unnest(%(tokens)s::uuid[]) WITH ORDINALITY AS m(token, n))
UPDATE job_claims
SET state = 'running', attempts = attempts + 1, claim_token = minted.token,
    lease_until = """
    + new_lease("%(lease)s")
    + """, updated_at = now(), began_at = NULL
FROM numbered JOIN minted USING (n) WHERE idem_key = numbered.due_key"""
    + _RETURNING
)

BEGIN_RUN: LiteralString = """
UPDATE job_claims SET began_at = clock_timestamp()
WHERE idem_key = %(key)s AND claim_token = %(token)s AND state = 'running'
"""

# A job a limit held back did not run: its attempt is given back and its last error kept.
POSTPONE: LiteralString = freeing_slots(
    """
UPDATE job_claims
SET state = 'deferred', last_error = coalesce(%(error)s, last_error),
    attempts = attempts - CASE WHEN %(ran)s THEN 0 ELSE 1 END, claim_token = NULL,
    lease_until = NULL, began_at = NULL,
    run_after = clock_timestamp() + make_interval(secs => %(delay)s), updated_at = now()
WHERE idem_key = %(key)s AND claim_token = %(token)s AND state = 'running'
  AND run_after IS NOT NULL
RETURNING idem_key""",
    "ARRAY[%(token)s]",
)

# --- Settling one run: by its holder, or by anyone else once its lease is over ----------------

# ``claim_token IS NOT DISTINCT FROM``: the token as read, which is NULL on a row the field
# notes' worker wrote.
_SETTLE: LiteralString = """
UPDATE job_claims
SET state = %(state)s, result = %(result)s, error = %(error)s,
    last_error = coalesce(%(error)s, last_error), updated_at = now()
WHERE idem_key = %(key)s AND claim_token IS NOT DISTINCT FROM %(token)s AND state = 'running'"""
SETTLE_AS_HOLDER: LiteralString = freeing_slots(
    _SETTLE + " AND claim_token IS NOT NULL" + _RETURNING, "ARRAY[%(token)s]"
)
SETTLE_AS_OTHER: LiteralString = _SETTLE + " AND " + lease_over() + _RETURNING

# A run whose effect did not happen, released by anyone but its holder once its lease is over:
# work the ledger owns waits again, due now (its attempt stays counted); a message's claim is
# deleted, so its next delivery claims it afresh. A failed claim is deleted to run again.
RELEASE_OWNED: LiteralString = (
    """
UPDATE job_claims
SET state = 'deferred', claim_token = NULL, lease_until = NULL, began_at = NULL, error = NULL,
    run_after = now(), updated_at = now()
WHERE idem_key = %(key)s AND claim_token IS NOT DISTINCT FROM %(token)s
  AND state = 'running' AND run_after IS NOT NULL AND """
    + lease_over()
    + _RETURNING
)
RELEASE_CLAIM: LiteralString = (
    """
DELETE FROM job_claims
WHERE idem_key = %(key)s AND claim_token IS NOT DISTINCT FROM %(token)s
  AND (state = 'failed' OR (state = 'running' AND """
    + lease_over()
    + "))"
    + _RETURNING
)

# A dead letter taken back: a key-passing job's own claim, released by the takeover rule.
RELEASE_FOR_TAKE_BACK: LiteralString = (
    """
DELETE FROM job_claims
WHERE idem_key = %(key)s AND claim_token = %(token)s AND effect = 'external_idempotent'
  AND run_after IS NULL AND """
    + TAKEOVER
)

# ``claims cancel`` ends waiting work; ``claims run-now`` makes it due at once.
STEER_DEFERRED: LiteralString = (
    """
UPDATE job_claims
SET state = %(state)s,
    run_after = CASE WHEN %(state)s = 'deferred' THEN least(run_after, now()) ELSE run_after END,
    updated_at = now()
WHERE idem_key = %(key)s AND state = 'deferred' AND run_after IS NOT NULL"""
    + _RETURNING
)

# A redrive reopens the failed claims of one piece of work, by its message id or its payload
# fingerprint, returning each as it was.
REOPEN_FAILED: LiteralString = (
    """
DELETE FROM job_claims
WHERE state = 'failed' AND (message_id = %(message_id)s OR payload_sha256 = %(fingerprint)s)"""
    + _RETURNING
)

PRUNE_BATCH: LiteralString = """
DELETE FROM job_claims WHERE idem_key IN (
    SELECT idem_key FROM job_claims
    WHERE state IN ('done', 'failed', 'cancelled')
      AND coalesce(updated_at, claimed_at) < now() - make_interval(days => %(days)s)
    LIMIT %(batch)s
    FOR UPDATE SKIP LOCKED
)
"""

# For tests of what happens once a lease is over, without waiting for it (the test kit's).
END_LEASE: LiteralString = (
    "UPDATE job_claims SET lease_until = " + new_lease("-1") + " WHERE idem_key = %(key)s"
)
