-- Version 10: FIFO-per-key sequences (WithSequence, standalone enqueues only). The claim
-- gate lets one step per key be active at a time; the partial index backs it.

ALTER TABLE cyclone_steps ADD COLUMN sequence_key text;
CREATE INDEX idx_steps_sequence ON cyclone_steps (sequence_key, scheduled_at, id)
    WHERE sequence_key IS NOT NULL AND state IN ('available', 'running');

---- create above / drop below ----

DROP INDEX idx_steps_sequence;
ALTER TABLE cyclone_steps DROP COLUMN sequence_key;
