        CREATE TABLE IF NOT EXISTS claim_history (
            id       bigserial PRIMARY KEY,
            idem_key text NOT NULL,
            action   text NOT NULL,
            actor    text NOT NULL,
            at       timestamptz NOT NULL DEFAULT now(),
            before   jsonb,
            after    jsonb,
            note     text
        );
        CREATE INDEX IF NOT EXISTS claim_history_key_idx ON claim_history (idem_key, id);
        CREATE OR REPLACE FUNCTION claim_history_append_only() RETURNS trigger
        LANGUAGE plpgsql AS $$
        BEGIN
            RAISE EXCEPTION 'claim_history is append-only';
        END $$;
        DROP TRIGGER IF EXISTS claim_history_append_only ON claim_history;
        CREATE TRIGGER claim_history_append_only BEFORE UPDATE OR DELETE ON claim_history
            FOR EACH ROW EXECUTE FUNCTION claim_history_append_only();
