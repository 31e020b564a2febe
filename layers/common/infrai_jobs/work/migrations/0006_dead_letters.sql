        -- Infrai cannot peek at a queue: reading its DLQ consumes it. Whatever reads the DLQ
        -- records each dead letter here, then acks it there; the operator works on these rows.
        -- A readable one keeps its payload (what a redrive publishes again); an unreadable one
        -- keeps what could be learnt of it (raw_text, size_bytes) and is never redriven; a read
        -- one that jsonb cannot hold (a NUL character) keeps its exact JSON text in raw_text.
        -- state is what the listing shows (the claim's state, conflict, unreadable), as seen
        -- when it was recorded; claim_state is the claim's own state then.
        CREATE TABLE IF NOT EXISTS dead_letters (
            message_id      text PRIMARY KEY,
            queue           text NOT NULL,
            dlq             text NOT NULL,
            unreadable      boolean NOT NULL DEFAULT false,
            payload         jsonb,
            raw_text        text,
            size_bytes      int,
            job             text,
            idem_key        text,
            state           text,
            claim_state     text,
            reason          text NOT NULL DEFAULT '',
            main_deliveries int,
            dlq_deliveries  int,
            published_at    timestamptz,
            first_seen      timestamptz NOT NULL DEFAULT now(),
            resolution      text CHECK (resolution IN ('discarded', 'redriven')),
            resolved_at     timestamptz,
            resolved_by     text,
            resolution_note text,
            CHECK ((resolution IS NULL) = (resolved_at IS NULL))
        );
        CREATE INDEX IF NOT EXISTS dead_letters_unresolved_idx
            ON dead_letters (queue, first_seen) WHERE resolution IS NULL;
        CREATE INDEX IF NOT EXISTS dead_letters_key_idx ON dead_letters (idem_key);
