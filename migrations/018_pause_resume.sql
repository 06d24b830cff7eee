-- Pause and resume for runs (run.Pause / run.Resume). The new CHECKs accept every old
-- value, so they are added NOT VALID without a scan (VALIDATE CONSTRAINT out of band).
-- A paused step keeps its unique key and its place in its sequence.

ALTER TABLE cyclone_runs DROP CONSTRAINT cyclone_runs_state_check;
ALTER TABLE cyclone_runs ADD CONSTRAINT cyclone_runs_state_check
    CHECK (state IN ('running', 'paused', 'completed', 'failed', 'cancelled')) NOT VALID;
ALTER TABLE cyclone_steps DROP CONSTRAINT cyclone_steps_state_check;
ALTER TABLE cyclone_steps ADD CONSTRAINT cyclone_steps_state_check CHECK (state IN (
    'pending', 'available', 'running', 'waiting_signal', 'waiting_timer', 'paused',
    'completed', 'discarded', 'cancelled')) NOT VALID;

ALTER TABLE cyclone_runs ADD COLUMN paused_at timestamptz;

DROP INDEX idx_steps_unique_active;
CREATE UNIQUE INDEX idx_steps_unique_active ON cyclone_steps (kind, unique_key)
    WHERE unique_key IS NOT NULL AND state IN ('pending', 'available', 'running', 'paused');
DROP INDEX idx_steps_sequence;
CREATE INDEX idx_steps_sequence ON cyclone_steps (sequence_key, scheduled_at, id)
    WHERE sequence_key IS NOT NULL AND state IN ('available', 'running', 'paused');

---- create above / drop below ----

DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM cyclone_runs WHERE state = 'paused')
       OR EXISTS (SELECT 1 FROM cyclone_steps WHERE state = 'paused') THEN
        RAISE EXCEPTION 'cannot migrate down from 18 while a run or a step is paused: '
            'resume or cancel the paused runs first';
    END IF;
END
$$;

DROP INDEX idx_steps_sequence;
CREATE INDEX idx_steps_sequence ON cyclone_steps (sequence_key, scheduled_at, id)
    WHERE sequence_key IS NOT NULL AND state IN ('available', 'running');
DROP INDEX idx_steps_unique_active;
CREATE UNIQUE INDEX idx_steps_unique_active ON cyclone_steps (kind, unique_key)
    WHERE unique_key IS NOT NULL AND state IN ('pending', 'available', 'running');
ALTER TABLE cyclone_runs DROP COLUMN IF EXISTS paused_at;
ALTER TABLE cyclone_steps DROP CONSTRAINT cyclone_steps_state_check;
ALTER TABLE cyclone_steps ADD CONSTRAINT cyclone_steps_state_check CHECK (state IN (
    'pending', 'available', 'running', 'waiting_signal', 'waiting_timer',
    'completed', 'discarded', 'cancelled'));
ALTER TABLE cyclone_runs DROP CONSTRAINT cyclone_runs_state_check;
ALTER TABLE cyclone_runs ADD CONSTRAINT cyclone_runs_state_check
    CHECK (state IN ('running', 'completed', 'failed', 'cancelled'));
