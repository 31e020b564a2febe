        -- The producers' transactional outbox: one row per intent, written in the producer's
        -- own transaction (infrai_jobs.outbox.enqueue) and published by a relay. The key is
        -- the job's idempotency key, so a producer's retry of one intent is one row. queue
        -- NULL means the relay's own queue (INFRAI_QUEUE). A row is pending until a relay
        -- publishes it (message_id, published_at) or Infrai refuses it for good (dead: its
        -- dead letter is in dead_letters). seq orders the relay's batches, oldest first.
        CREATE TABLE IF NOT EXISTS outbox (
            idem_key        text PRIMARY KEY,
            seq             bigint GENERATED ALWAYS AS IDENTITY UNIQUE,
            queue           text,
            job             text,
            body            jsonb NOT NULL,
            payload_sha256  text NOT NULL,
            state           text NOT NULL DEFAULT 'pending'
                            CHECK (state IN ('pending', 'published', 'dead')),
            enqueued_at     timestamptz NOT NULL DEFAULT now(),
            attempts        int NOT NULL DEFAULT 0,
            next_attempt_at timestamptz NOT NULL DEFAULT now(),
            last_error      text,
            message_id      text,
            published_at    timestamptz,
            settled_at      timestamptz,
            CHECK ((state = 'published') = (message_id IS NOT NULL)),
            CHECK ((state = 'pending') = (settled_at IS NULL))
        );
        CREATE INDEX IF NOT EXISTS outbox_pending_idx ON outbox (seq) WHERE state = 'pending';
        CREATE INDEX IF NOT EXISTS outbox_settled_idx ON outbox (settled_at) WHERE state <> 'pending';
