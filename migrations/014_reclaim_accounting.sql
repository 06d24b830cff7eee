-- Version 14: crash-reclaim accounting (WithMaxReclaims). reclaims counts the
-- expired-lease reclaims of a step; an operator retry resets it. The constant default
-- makes this a catalog-only change: no row is rewritten. error_kind has no CHECK, so the
-- new reclaim_limit kind needs no constraint change. cyclone_v_steps is re-issued.

ALTER TABLE cyclone_steps ADD COLUMN reclaims integer NOT NULL DEFAULT 0;

CREATE OR REPLACE VIEW cyclone_v_steps AS
SELECT s.id, s.run_id, s.node, s.kind, s.state, s.queue, s.priority, s.attempt,
       s.max_attempts, s.error, s.error_kind, s.lease_owner, s.lease_expiry,
       (s.state = 'running' AND s.lease_expiry < now()) AS lease_expired,
       s.heartbeat_at, s.scheduled_at, s.created_at, s.started_at, s.completed_at,
       s.signal_name, s.panic_stack, s.reclaims
FROM cyclone_steps AS s;

---- create above / drop below ----

-- CREATE OR REPLACE VIEW cannot remove a column: the view of version 13 is re-created.
DROP VIEW cyclone_v_steps;
CREATE VIEW cyclone_v_steps AS
SELECT s.id, s.run_id, s.node, s.kind, s.state, s.queue, s.priority, s.attempt,
       s.max_attempts, s.error, s.error_kind, s.lease_owner, s.lease_expiry,
       (s.state = 'running' AND s.lease_expiry < now()) AS lease_expired,
       s.heartbeat_at, s.scheduled_at, s.created_at, s.started_at, s.completed_at,
       s.signal_name, s.panic_stack
FROM cyclone_steps AS s;
ALTER TABLE cyclone_steps DROP COLUMN reclaims;
