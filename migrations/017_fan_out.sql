-- Fan-out over a list (ForEach): item tasks are ordinary step rows named node[i].
--
-- Out of band on a large table (then check that the indexes are valid in pg_index):
--   CREATE INDEX CONCURRENTLY IF NOT EXISTS idx_steps_fan_out ON cyclone_steps (run_id)
--       WHERE fan_out_parallel IS NOT NULL AND state = 'pending';
--   CREATE INDEX CONCURRENTLY IF NOT EXISTS idx_steps_items
--       ON cyclone_steps (run_id, item_of, state, item_index) WHERE item_of IS NOT NULL;

ALTER TABLE cyclone_runs ADD COLUMN has_fan_out boolean NOT NULL DEFAULT false;
ALTER TABLE cyclone_steps ADD COLUMN fan_out_parallel integer;
ALTER TABLE cyclone_steps ADD COLUMN fan_out_max_bytes bigint;
ALTER TABLE cyclone_steps ADD COLUMN item_of text;
ALTER TABLE cyclone_steps ADD COLUMN item_index integer;

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

DROP VIEW cyclone_v_steps;
CREATE VIEW cyclone_v_steps AS
SELECT s.id, s.run_id, s.node, s.kind, s.state, s.queue, s.priority, s.attempt,
       s.max_attempts, s.error, s.error_kind, s.lease_owner, s.lease_expiry,
       (s.state = 'running' AND s.lease_expiry < now()) AS lease_expired,
       s.heartbeat_at, s.scheduled_at, s.created_at, s.started_at, s.completed_at,
       s.signal_name, s.panic_stack, s.reclaims
FROM cyclone_steps AS s;
DROP INDEX IF EXISTS idx_steps_items;
DROP INDEX IF EXISTS idx_steps_fan_out;
ALTER TABLE cyclone_steps DROP COLUMN IF EXISTS item_index;
ALTER TABLE cyclone_steps DROP COLUMN IF EXISTS item_of;
ALTER TABLE cyclone_steps DROP COLUMN IF EXISTS fan_out_max_bytes;
ALTER TABLE cyclone_steps DROP COLUMN IF EXISTS fan_out_parallel;
ALTER TABLE cyclone_runs DROP COLUMN IF EXISTS has_fan_out;
