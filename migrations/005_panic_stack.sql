-- Version 5: the full stack of a handler's unexpected failure. error keeps a one-line
-- message; the stack lands in panic_stack. cyclone_v_steps is re-issued with the column.

ALTER TABLE cyclone_steps ADD COLUMN panic_stack text;

CREATE OR REPLACE VIEW cyclone_v_steps AS
SELECT s.id, s.run_id, s.node, s.kind, s.state, s.queue, s.priority, s.attempt,
       s.max_attempts, s.error, s.error_kind, s.lease_owner, s.lease_expiry,
       (s.state = 'running' AND s.lease_expiry < now()) AS lease_expired,
       s.heartbeat_at, s.scheduled_at, s.created_at, s.started_at, s.completed_at,
       s.signal_name, s.panic_stack
FROM cyclone_steps AS s;

---- create above / drop below ----

-- CREATE OR REPLACE VIEW cannot remove a column: the view of version 4 is re-created.
DROP VIEW cyclone_v_steps;
CREATE VIEW cyclone_v_steps AS
SELECT s.id, s.run_id, s.node, s.kind, s.state, s.queue, s.priority, s.attempt,
       s.max_attempts, s.error, s.error_kind, s.lease_owner, s.lease_expiry,
       (s.state = 'running' AND s.lease_expiry < now()) AS lease_expired,
       s.heartbeat_at, s.scheduled_at, s.created_at, s.started_at, s.completed_at,
       s.signal_name
FROM cyclone_steps AS s;
ALTER TABLE cyclone_steps DROP COLUMN panic_stack;
