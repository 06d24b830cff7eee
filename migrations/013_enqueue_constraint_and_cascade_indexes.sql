-- Version 13: enqueue constraint and cascade indexes.
-- Repairs rows the old API could write (an empty unique_key or sequence_key becomes NULL,
-- max_attempts < 1 becomes 1), then guards the attempt budget. The check is NOT VALID:
-- it applies to new writes without a scan (VALIDATE CONSTRAINT out of band if wanted).
-- idx_signals_run and idx_schedule_fires_run keep the ON DELETE CASCADE that retention
-- triggers from scanning the child tables.

UPDATE cyclone_steps SET unique_key = NULL WHERE unique_key = '';
UPDATE cyclone_steps SET sequence_key = NULL WHERE sequence_key = '';
UPDATE cyclone_steps SET max_attempts = 1 WHERE max_attempts < 1;
ALTER TABLE cyclone_steps ADD CONSTRAINT cyclone_steps_max_attempts_check
    CHECK (max_attempts >= 1) NOT VALID;

CREATE INDEX idx_signals_run ON cyclone_signals (run_id);
CREATE INDEX idx_schedule_fires_run ON cyclone_schedule_fires (run_id);

---- create above / drop below ----

-- The repaired rows stay repaired: the old values are not recoverable and were invalid.
DROP INDEX idx_schedule_fires_run;
DROP INDEX idx_signals_run;
ALTER TABLE cyclone_steps DROP CONSTRAINT cyclone_steps_max_attempts_check;
