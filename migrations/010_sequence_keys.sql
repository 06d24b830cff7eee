-- FIFO-per-key sequences (WithSequence): one active step per key, gated at claim.

ALTER TABLE cyclone_steps ADD COLUMN sequence_key text;
CREATE INDEX idx_steps_sequence ON cyclone_steps (sequence_key, scheduled_at, id)
    WHERE sequence_key IS NOT NULL AND state IN ('available', 'running');

---- create above / drop below ----

DROP INDEX IF EXISTS idx_steps_sequence;
ALTER TABLE cyclone_steps DROP COLUMN IF EXISTS sequence_key;
