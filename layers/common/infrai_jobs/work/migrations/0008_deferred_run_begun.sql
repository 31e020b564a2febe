        -- When a taken deferred run began its handler (NULL: not yet). An external run whose
        -- lease ran out before it began has done nothing and may be taken again; one that began
        -- may have had its effect, and waits for a human.
        ALTER TABLE deferred_jobs ADD COLUMN IF NOT EXISTS began_at timestamptz;
