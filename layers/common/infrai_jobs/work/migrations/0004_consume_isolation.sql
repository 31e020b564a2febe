        -- After a consume whose answer was lost or unreadable, every drain of that queue takes
        -- one message at a time until single_until, so a poison message walks to the DLQ alone.
        CREATE TABLE IF NOT EXISTS consume_isolation (
            queue        text PRIMARY KEY,
            single_until timestamptz NOT NULL,
            reason       text NOT NULL DEFAULT '',
            updated_at   timestamptz NOT NULL DEFAULT now()
        );
