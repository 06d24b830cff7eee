-- Repair rows the old API could write, guard the attempt budget, and index the
-- foreign keys the retention cascade follows.

UPDATE cyclone_steps SET unique_key = NULL WHERE unique_key = '';
UPDATE cyclone_steps SET sequence_key = NULL WHERE sequence_key = '';
UPDATE cyclone_steps SET max_attempts = 1 WHERE max_attempts < 1;
ALTER TABLE cyclone_steps ADD CONSTRAINT cyclone_steps_max_attempts_check
    CHECK (max_attempts >= 1) NOT VALID;

CREATE INDEX idx_signals_run ON cyclone_signals (run_id);
CREATE INDEX idx_schedule_fires_run ON cyclone_schedule_fires (run_id);

---- create above / drop below ----

DROP INDEX IF EXISTS idx_schedule_fires_run;
DROP INDEX IF EXISTS idx_signals_run;
ALTER TABLE cyclone_steps DROP CONSTRAINT IF EXISTS cyclone_steps_max_attempts_check;
