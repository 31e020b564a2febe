        -- A dead letter whose work the ledger shows done (its key's claim is done, for the same
        -- work) is resolved 'done' by the watcher: nothing is left to redrive, and it stops
        -- counting toward the dead-letter alarm. The resolution CHECK learns the new value; it
        -- is found by what it checks, not by a name. Only widened: the previous version never
        -- writes 'done', and reads a done letter as resolved (it counts resolution IS NULL).
        DO $$
        DECLARE found_name text;
        BEGIN
            FOR found_name IN
                SELECT conname FROM pg_constraint
                WHERE conrelid = 'dead_letters'::regclass AND contype = 'c'
                  AND pg_get_constraintdef(oid) LIKE '%resolution%discarded%'
            LOOP
                EXECUTE format('ALTER TABLE dead_letters DROP CONSTRAINT %I', found_name);
            END LOOP;
        END $$;
        ALTER TABLE dead_letters ADD CONSTRAINT dead_letters_resolution_check
            CHECK (resolution IN ('discarded', 'redriven', 'done'));
