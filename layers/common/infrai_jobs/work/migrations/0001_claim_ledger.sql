        CREATE TABLE IF NOT EXISTS job_claims (
            idem_key   text PRIMARY KEY,
            state      text NOT NULL CHECK (state IN ('running', 'done', 'failed')),
            message_id text NOT NULL,
            result     jsonb,
            claimed_at timestamptz NOT NULL DEFAULT now()
        );
        ALTER TABLE job_claims
            ADD COLUMN IF NOT EXISTS job            text,
            ADD COLUMN IF NOT EXISTS effect         text,
            ADD COLUMN IF NOT EXISTS claim_token    uuid,
            ADD COLUMN IF NOT EXISTS lease_until    timestamptz,
            ADD COLUMN IF NOT EXISTS attempts       int DEFAULT 1,
            ADD COLUMN IF NOT EXISTS payload_sha256 text,
            ADD COLUMN IF NOT EXISTS error          text,
            ADD COLUMN IF NOT EXISTS updated_at     timestamptz;
        DO $$ BEGIN
            ALTER TABLE job_claims ADD CONSTRAINT job_claims_effect_check
                CHECK (effect IN ('database', 'external', 'external_idempotent'));
        EXCEPTION WHEN duplicate_object THEN NULL;
        END $$;
        CREATE INDEX IF NOT EXISTS job_claims_running_idx
            ON job_claims (claimed_at) WHERE state = 'running';
        CREATE INDEX IF NOT EXISTS job_claims_settled_idx
            ON job_claims ((coalesce(updated_at, claimed_at))) WHERE state IN ('done', 'failed');
