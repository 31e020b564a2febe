        -- Work the ledger owns after its message was acked: a retry beyond the message's
        -- deliveries, or a start a rate limit or a concurrency key held back. A table of its own,
        -- not a 'deferred' state on job_claims: that state's CHECK and every rule over claims
        -- (stuck, takeover, prune, the notes' own statements, a drain of the previous version
        -- still running during a deploy) would have to learn it, while this only adds. It also
        -- holds what a claim has no place for: the payload, the next run time, 'cancelled'.
        -- A row in 'deferred' or 'running' holds its key: a copy of its message is a duplicate.
        -- A drain takes due rows (SKIP LOCKED) and runs each under a fenced lease
        -- (lease_token); an 'external' row whose lease expired is never taken again.
        CREATE TABLE IF NOT EXISTS deferred_jobs (
            idem_key       text PRIMARY KEY,
            job            text NOT NULL,
            effect         text NOT NULL
                CHECK (effect IN ('database', 'external', 'external_idempotent')),
            payload        jsonb NOT NULL,
            payload_sha256 text,
            message_id     text NOT NULL,
            queue          text,
            state          text NOT NULL DEFAULT 'deferred'
                CHECK (state IN ('deferred', 'running', 'done', 'failed', 'cancelled')),
            attempts       int NOT NULL DEFAULT 1 CHECK (attempts >= 0),
            last_error     text,
            result         jsonb,
            run_after      timestamptz NOT NULL,
            created_at     timestamptz NOT NULL DEFAULT now(),
            updated_at     timestamptz NOT NULL DEFAULT now(),
            lease_token    uuid,
            lease_until    timestamptz,
            CHECK ((state = 'running') = (lease_token IS NOT NULL AND lease_until IS NOT NULL))
        );
        CREATE INDEX IF NOT EXISTS deferred_jobs_due_idx
            ON deferred_jobs (run_after, created_at) WHERE state = 'deferred';
        CREATE INDEX IF NOT EXISTS deferred_jobs_running_idx
            ON deferred_jobs (lease_until) WHERE state = 'running';
        -- Each start a rate limit let through, on the database's clock. A job's starts are
        -- counted and written under a transaction-scoped advisory lock for that job, so every
        -- drain sees the others' starts: no window of the limit's length ever holds more.
        CREATE TABLE IF NOT EXISTS flow_rate_starts (
            id         bigserial PRIMARY KEY,
            job        text NOT NULL,
            started_at timestamptz NOT NULL
        );
        CREATE INDEX IF NOT EXISTS flow_rate_starts_job_idx
            ON flow_rate_starts (job, started_at);
        -- A run holding one of a concurrency key's slots, until it releases it or its lease
        -- (the claim's) ends: a killed drain's slot frees itself. Taken under an advisory lock
        -- per (job, key value), so two drains never both take the last one.
        CREATE TABLE IF NOT EXISTS flow_concurrency_slots (
            token       uuid PRIMARY KEY,
            job         text NOT NULL,
            key_value   text NOT NULL,
            holder      text NOT NULL,
            acquired_at timestamptz NOT NULL DEFAULT now(),
            lease_until timestamptz NOT NULL
        );
        CREATE INDEX IF NOT EXISTS flow_concurrency_slots_key_idx
            ON flow_concurrency_slots (job, key_value, lease_until);
