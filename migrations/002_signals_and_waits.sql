-- Signals and wait nodes (WaitSignal / WaitTimer): the wait states, the activation-relative
-- wait duration, the mailbox consume time and the indexes the sender and scanners use.

ALTER TABLE cyclone_steps DROP CONSTRAINT cyclone_steps_state_check;
ALTER TABLE cyclone_steps ADD CONSTRAINT cyclone_steps_state_check CHECK (state IN (
    'pending', 'available', 'running', 'waiting_signal', 'waiting_timer',
    'completed', 'discarded', 'cancelled')) NOT VALID;
ALTER TABLE cyclone_steps VALIDATE CONSTRAINT cyclone_steps_state_check;

ALTER TABLE cyclone_steps ADD COLUMN wait_for interval;
ALTER TABLE cyclone_signals ADD COLUMN consumed_at timestamptz;

CREATE INDEX idx_signals_unconsumed ON cyclone_signals (run_id, name, id)
    WHERE consumed_by IS NULL;
CREATE INDEX idx_steps_signal_timeout ON cyclone_steps (scheduled_at)
    WHERE state = 'waiting_signal' AND wait_for IS NOT NULL;
CREATE UNIQUE INDEX idx_steps_signal_name_unique ON cyclone_steps (run_id, signal_name)
    WHERE signal_name IS NOT NULL;

---- create above / drop below ----

DROP INDEX IF EXISTS idx_steps_signal_name_unique;
DROP INDEX IF EXISTS idx_steps_signal_timeout;
DROP INDEX IF EXISTS idx_signals_unconsumed;
ALTER TABLE cyclone_signals DROP COLUMN IF EXISTS consumed_at;
ALTER TABLE cyclone_steps DROP COLUMN IF EXISTS wait_for;
ALTER TABLE cyclone_steps DROP CONSTRAINT cyclone_steps_state_check;
ALTER TABLE cyclone_steps ADD CONSTRAINT cyclone_steps_state_check CHECK (state IN (
    'pending', 'available', 'running', 'completed', 'discarded', 'cancelled'));
