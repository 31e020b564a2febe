        -- Every drain of a queue alive now, with a lease it renews while it runs, and the slots
        -- a fan-out reserved for the drains it is starting. Counted under an advisory lock, so
        -- two drains never both start the missing ones; an expired lease is a dead drain.
        CREATE TABLE IF NOT EXISTS drain_leases (
            queue       text NOT NULL,
            drain_id    uuid NOT NULL,
            origin      text NOT NULL CHECK (origin IN ('schedule', 'fan_out')),
            started_at  timestamptz NOT NULL DEFAULT now(),
            lease_until timestamptz NOT NULL,
            PRIMARY KEY (queue, drain_id)
        );
