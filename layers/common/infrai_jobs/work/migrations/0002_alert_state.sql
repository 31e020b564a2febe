        CREATE TABLE IF NOT EXISTS alert_state (
            scope      text NOT NULL,
            signal     text NOT NULL,
            value      bigint NOT NULL DEFAULT 0,
            alerted_at timestamptz,
            updated_at timestamptz NOT NULL DEFAULT now(),
            PRIMARY KEY (scope, signal)
        );
