-- Version 18: pause and resume for runs (run.Pause / run.Resume).
-- paused joins cyclone_runs_state_check and cyclone_steps_state_check. Each new CHECK
-- accepts every old value, so it is added NOT VALID and the table is not scanned; to
-- validate it out of band, run ALTER TABLE ... VALIDATE CONSTRAINT.
-- paused_at is the time of the pause (catalog-only). Resume moves deadline_at and every
-- timed wait forward by the length of the pause and clears it.
-- idx_steps_unique_active and idx_steps_sequence are rebuilt with paused in their
-- predicates: a paused step keeps its unique key and its place in its sequence. Each
-- rebuild scans cyclone_steps once while this migration holds its lock.
-- Down refuses while a run or a step is paused.

ALTER TABLE cyclone_runs DROP CONSTRAINT cyclone_runs_state_check;
ALTER TABLE cyclone_runs ADD CONSTRAINT cyclone_runs_state_check CHECK (state IN (
    'running', 'paused', 'completed', 'failed', 'cancelled')) NOT VALID;
ALTER TABLE cyclone_steps DROP CONSTRAINT cyclone_steps_state_check;
ALTER TABLE cyclone_steps ADD CONSTRAINT cyclone_steps_state_check CHECK (state IN (
    'pending', 'available', 'running', 'waiting_signal', 'waiting_timer', 'paused',
    'completed', 'discarded', 'cancelled')) NOT VALID;

ALTER TABLE cyclone_runs ADD COLUMN paused_at timestamptz;

DROP INDEX idx_steps_unique_active;
CREATE UNIQUE INDEX idx_steps_unique_active ON cyclone_steps (kind, unique_key)
    WHERE unique_key IS NOT NULL
      AND state IN ('pending', 'available', 'running', 'waiting_signal', 'waiting_timer',
                    'paused');
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
    WHERE unique_key IS NOT NULL
      AND state IN ('pending', 'available', 'running', 'waiting_signal', 'waiting_timer');
ALTER TABLE cyclone_runs DROP COLUMN paused_at;
-- The checks of versions 2 and 1 were validated: restore them validated.
ALTER TABLE cyclone_steps DROP CONSTRAINT cyclone_steps_state_check;
ALTER TABLE cyclone_steps ADD CONSTRAINT cyclone_steps_state_check CHECK (state IN (
    'pending', 'available', 'running', 'waiting_signal', 'waiting_timer',
    'completed', 'discarded', 'cancelled'));
ALTER TABLE cyclone_runs DROP CONSTRAINT cyclone_runs_state_check;
ALTER TABLE cyclone_runs ADD CONSTRAINT cyclone_runs_state_check CHECK (state IN (
    'running', 'completed', 'failed', 'cancelled'));
