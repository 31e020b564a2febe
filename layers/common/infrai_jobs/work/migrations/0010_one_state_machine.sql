        -- One state machine: deferred work is a claim that waits. A row of job_claims is the
        -- one unit of work, with one token (claim_token), one lease (lease_until) and one clock
        -- (the database's). A claim becomes ledger-owned when its attempt is deferred: its
        -- message is acked, run_after is set (and never cleared again), and the row keeps the
        -- payload to run it with. deferred_jobs is emptied into it, and kept only so that a
        -- drain of the previous version, running while this one deploys, still finds it.
        ALTER TABLE job_claims
            ADD COLUMN IF NOT EXISTS payload     jsonb,
            ADD COLUMN IF NOT EXISTS queue       text,
            ADD COLUMN IF NOT EXISTS run_after   timestamptz,
            ADD COLUMN IF NOT EXISTS deferred_at timestamptz,
            ADD COLUMN IF NOT EXISTS last_error  text,
            ADD COLUMN IF NOT EXISTS began_at    timestamptz;
        -- The state CHECK learns 'deferred' (waiting for run_after) and 'cancelled' (an
        -- operator ended waiting work). The notes' DDL and 0001 both wrote it inline, so it is
        -- found by what it checks, not by a name.
        DO $$
        DECLARE found_name text;
        BEGIN
            FOR found_name IN
                SELECT conname FROM pg_constraint
                WHERE conrelid = 'job_claims'::regclass AND contype = 'c'
                  AND pg_get_constraintdef(oid) LIKE '%state%running%'
            LOOP
                EXECUTE format('ALTER TABLE job_claims DROP CONSTRAINT %I', found_name);
            END LOOP;
        END $$;
        ALTER TABLE job_claims ADD CONSTRAINT job_claims_state_check
            CHECK (state IN ('running', 'done', 'failed', 'deferred', 'cancelled'));
        ALTER TABLE job_claims ADD CONSTRAINT job_claims_ledger_owned_check
            CHECK ((run_after IS NULL OR payload IS NOT NULL)
                   AND (state NOT IN ('deferred', 'cancelled') OR run_after IS NOT NULL)
                   AND (state <> 'deferred' OR claim_token IS NULL));
        CREATE INDEX IF NOT EXISTS job_claims_due_idx
            ON job_claims (run_after, deferred_at) WHERE state = 'deferred';
        CREATE INDEX IF NOT EXISTS job_claims_owned_running_idx
            ON job_claims (lease_until) WHERE state = 'running' AND run_after IS NOT NULL;

        -- Work waiting or running moves across with its lease; an ended one only where no claim
        -- stands for its key (a settled deferred run left one already).
        INSERT INTO job_claims AS c (idem_key, state, message_id, job, effect, claim_token,
                                     lease_until, attempts, payload_sha256, error, result,
                                     claimed_at, updated_at, payload, queue, run_after,
                                     deferred_at, last_error, began_at)
        SELECT d.idem_key, d.state, d.message_id, d.job, d.effect, d.lease_token, d.lease_until,
               d.attempts, d.payload_sha256,
               CASE WHEN d.state = 'failed' THEN d.last_error END,
               d.result, d.created_at, d.updated_at, d.payload, d.queue, d.run_after,
               d.created_at, d.last_error, d.began_at
        FROM deferred_jobs d
        ON CONFLICT (idem_key) DO UPDATE
            SET state = EXCLUDED.state, message_id = EXCLUDED.message_id, job = EXCLUDED.job,
                effect = EXCLUDED.effect, claim_token = EXCLUDED.claim_token,
                lease_until = EXCLUDED.lease_until, attempts = EXCLUDED.attempts,
                payload_sha256 = EXCLUDED.payload_sha256, error = NULL, result = NULL,
                updated_at = EXCLUDED.updated_at, payload = EXCLUDED.payload,
                queue = EXCLUDED.queue, run_after = EXCLUDED.run_after,
                deferred_at = EXCLUDED.deferred_at, last_error = EXCLUDED.last_error,
                began_at = EXCLUDED.began_at
            WHERE EXCLUDED.state IN ('deferred', 'running');
        DELETE FROM deferred_jobs;

        -- A drain of the previous version defers by releasing its claim and inserting here, in
        -- one transaction: the row goes to job_claims instead, and the insert reads as "already
        -- deferred", which that drain acks as the duplicate it now is.
        CREATE OR REPLACE FUNCTION deferred_jobs_into_claims() RETURNS trigger
        LANGUAGE plpgsql AS $$
        BEGIN
            INSERT INTO job_claims (idem_key, state, message_id, job, effect, attempts,
                                    payload_sha256, payload, queue, run_after, deferred_at,
                                    last_error, updated_at)
            VALUES (NEW.idem_key, 'deferred', NEW.message_id, NEW.job, NEW.effect, NEW.attempts,
                    NEW.payload_sha256, NEW.payload, NEW.queue, NEW.run_after, now(),
                    NEW.last_error, now())
            ON CONFLICT (idem_key) DO NOTHING;
            RETURN NULL;
        END $$;
        DROP TRIGGER IF EXISTS deferred_jobs_into_claims ON deferred_jobs;
        CREATE TRIGGER deferred_jobs_into_claims BEFORE INSERT ON deferred_jobs
            FOR EACH ROW EXECUTE FUNCTION deferred_jobs_into_claims();
