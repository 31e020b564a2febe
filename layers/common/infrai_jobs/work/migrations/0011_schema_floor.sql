        -- The schema's floor: the oldest infrai-jobs version that may run on it. `migrate`
        -- (or the SQL `migrate --emit-sql` prints) writes the floor the migrating version
        -- declares, never a lower one; code older than the floor refuses the database before it
        -- consumes anything. One row, not a column of infrai_jobs_schema: the floor is one fact
        -- about the whole schema, read by key at each cold start; older versions' migrate still
        -- writes that table's rows as (version, name); and an operator may raise the floor by
        -- hand to fence off a version, with no migration. A release version (MAJOR.MINOR.PATCH),
        -- so the database and the code compare it alike, number by number.
        CREATE TABLE IF NOT EXISTS infrai_jobs_schema_floor (
            one_row     boolean PRIMARY KEY DEFAULT true CHECK (one_row),
            floor       text NOT NULL CHECK (floor ~ '^[0-9]+\.[0-9]+\.[0-9]+$'),
            recorded_by text NOT NULL,
            recorded_at timestamptz NOT NULL DEFAULT now()
        );
