-- Version 2: signals and wait nodes (WaitSignal / WaitTimer).
-- The state check admits waiting_signal and waiting_timer: added NOT VALID (no scan under
-- the lock that blocks writes), then validated (a scan that does not block writes).

ALTER TABLE cyclone_steps DROP CONSTRAINT cyclone_steps_state_check;
ALTER TABLE cyclone_steps ADD CONSTRAINT cyclone_steps_state_check CHECK (state IN (
    'pending', 'available', 'running', 'waiting_signal', 'waiting_timer',
    'completed', 'discarded', 'cancelled')) NOT VALID;
ALTER TABLE cyclone_steps VALIDATE CONSTRAINT cyclone_steps_state_check;

-- The activation-relative wait duration of a timer or capped signal wait.
ALTER TABLE cyclone_steps ADD COLUMN wait_for interval;
-- The time a wait consumed the mailbox row.
ALTER TABLE cyclone_signals ADD COLUMN consumed_at timestamptz;

CREATE INDEX idx_signals_unconsumed ON cyclone_signals (run_id, name, id)
    WHERE consumed_by IS NULL;
CREATE INDEX idx_steps_signal_timeout ON cyclone_steps (scheduled_at)
    WHERE state = 'waiting_signal' AND wait_for IS NOT NULL;
-- One waiter per signal name in a run: the sender and the scanner rely on it.
CREATE UNIQUE INDEX idx_steps_signal_name_unique ON cyclone_steps (run_id, signal_name)
    WHERE signal_name IS NOT NULL;

---- create above / drop below ----

DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM cyclone_steps
               WHERE state IN ('waiting_signal', 'waiting_timer')) THEN
        RAISE EXCEPTION 'cannot migrate down from 2 while a step is waiting_signal or '
            'waiting_timer: cancel the runs of the waiting steps first';
    END IF;
END
$$;

DROP INDEX idx_steps_signal_name_unique;
DROP INDEX idx_steps_signal_timeout;
DROP INDEX idx_signals_unconsumed;
ALTER TABLE cyclone_signals DROP COLUMN consumed_at;
ALTER TABLE cyclone_steps DROP COLUMN wait_for;
ALTER TABLE cyclone_steps DROP CONSTRAINT cyclone_steps_state_check;
ALTER TABLE cyclone_steps ADD CONSTRAINT cyclone_steps_state_check CHECK (state IN (
    'pending', 'available', 'running', 'completed', 'discarded', 'cancelled'));
