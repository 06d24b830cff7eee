-- Version 17: fan-out over a list (ForEach).
-- has_fan_out is read with the run row lock; a run without a fan-out node does no extra
-- work. fan_out_parallel (the WithMaxParallel limit, 0 for none) and fan_out_max_bytes
-- (the byte limit of the collected output, 0 for none, NULL for an action) are set on a
-- fan-out node only; item_of and item_index (from 0) on an item task only. An item task
-- is an ordinary step row named <fan-out node>[<index>], so the unique (run_id, node)
-- constraint gives it one identity. Every column is nullable or has a constant default:
-- no row is rewritten. cyclone_v_steps is re-issued with item_of and item_index.
--
-- The partial indexes start empty, but each build scans cyclone_steps while this
-- migration holds its lock. A large deployment can build them out of band first, outside
-- a transaction (IF NOT EXISTS below then keeps them):
--
--   ALTER TABLE cyclone_steps ADD COLUMN IF NOT EXISTS fan_out_parallel integer;
--   ALTER TABLE cyclone_steps ADD COLUMN IF NOT EXISTS fan_out_max_bytes bigint;
--   ALTER TABLE cyclone_steps ADD COLUMN IF NOT EXISTS item_of text;
--   ALTER TABLE cyclone_steps ADD COLUMN IF NOT EXISTS item_index integer;
--   CREATE INDEX CONCURRENTLY IF NOT EXISTS idx_steps_fan_out ON cyclone_steps (run_id)
--       WHERE fan_out_parallel IS NOT NULL AND state = 'pending';
--   CREATE INDEX CONCURRENTLY IF NOT EXISTS idx_steps_items
--       ON cyclone_steps (run_id, item_of, state, item_index) WHERE item_of IS NOT NULL;
--
-- Then check that both indexes are valid (indisvalid in pg_index) before migrating.

ALTER TABLE cyclone_runs ADD COLUMN IF NOT EXISTS has_fan_out boolean NOT NULL DEFAULT false;
ALTER TABLE cyclone_steps ADD COLUMN IF NOT EXISTS fan_out_parallel integer;
ALTER TABLE cyclone_steps ADD COLUMN IF NOT EXISTS fan_out_max_bytes bigint;
ALTER TABLE cyclone_steps ADD COLUMN IF NOT EXISTS item_of text;
ALTER TABLE cyclone_steps ADD COLUMN IF NOT EXISTS item_index integer;

CREATE INDEX IF NOT EXISTS idx_steps_fan_out ON cyclone_steps (run_id)
    WHERE fan_out_parallel IS NOT NULL AND state = 'pending';
CREATE INDEX IF NOT EXISTS idx_steps_items ON cyclone_steps (run_id, item_of, state, item_index)
    WHERE item_of IS NOT NULL;

CREATE OR REPLACE VIEW cyclone_v_steps AS
SELECT s.id, s.run_id, s.node, s.kind, s.state, s.queue, s.priority, s.attempt,
       s.max_attempts, s.error, s.error_kind, s.lease_owner, s.lease_expiry,
       (s.state = 'running' AND s.lease_expiry < now()) AS lease_expired,
       s.heartbeat_at, s.scheduled_at, s.created_at, s.started_at, s.completed_at,
       s.signal_name, s.panic_stack, s.reclaims, s.item_of, s.item_index
FROM cyclone_steps AS s;

---- create above / drop below ----

-- CREATE OR REPLACE VIEW cannot remove a column: the view of version 16 is re-created.
DROP VIEW cyclone_v_steps;
CREATE VIEW cyclone_v_steps AS
SELECT s.id, s.run_id, s.node, s.kind, s.state, s.queue, s.priority, s.attempt,
       s.max_attempts, s.error, s.error_kind, s.lease_owner, s.lease_expiry,
       (s.state = 'running' AND s.lease_expiry < now()) AS lease_expired,
       s.heartbeat_at, s.scheduled_at, s.created_at, s.started_at, s.completed_at,
       s.signal_name, s.panic_stack, s.reclaims
FROM cyclone_steps AS s;
DROP INDEX idx_steps_items;
DROP INDEX idx_steps_fan_out;
ALTER TABLE cyclone_steps DROP COLUMN item_index;
ALTER TABLE cyclone_steps DROP COLUMN item_of;
ALTER TABLE cyclone_steps DROP COLUMN fan_out_max_bytes;
ALTER TABLE cyclone_steps DROP COLUMN fan_out_parallel;
ALTER TABLE cyclone_runs DROP COLUMN has_fan_out;
