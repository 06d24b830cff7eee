-- Version 19: child workflow runs (workflow.Child).
-- parent_run_id and parent_node_id are written by the insert of a child run, in the
-- transaction that inserts its graph; NULL for a run with no parent. There is no foreign
-- key: a purge can delete the parent run before the child run. The reserved column
-- cyclone_steps.parent_node of version 1 stays reserved.
-- child_workflow (the workflow a child node starts; its kind is @child) and
-- child_needs_result (true for ResultWorkflow.Child, false for Workflow.Child) are set on
-- a child node only. idx_runs_parent keeps one child run per parent node, in every state.
-- waiting_child joins cyclone_steps_state_check; the new CHECK accepts every old value,
-- so it is added NOT VALID. cyclone_v_runs is re-issued with the parent link appended.
-- Every column is nullable with no default: no row is rewritten.
--
-- Each index build scans its table while this migration holds its lock (the indexes
-- start empty). A large deployment can build the columns and the indexes out of band
-- first, outside a transaction (IF NOT EXISTS below then keeps them):
--
--   ALTER TABLE cyclone_runs ADD COLUMN IF NOT EXISTS parent_run_id bigint;
--   ALTER TABLE cyclone_runs ADD COLUMN IF NOT EXISTS parent_node_id text;
--   CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS idx_runs_parent
--       ON cyclone_runs (parent_run_id, parent_node_id) WHERE parent_run_id IS NOT NULL;
--   CREATE INDEX CONCURRENTLY IF NOT EXISTS idx_steps_waiting_child
--       ON cyclone_steps (run_id) WHERE state = 'waiting_child';
--
-- Then check that both indexes are valid (indisvalid in pg_index) before migrating.
--
-- Down refuses while a step is waiting_child; child runs stay, as runs with no parent.

ALTER TABLE cyclone_runs ADD COLUMN IF NOT EXISTS parent_run_id bigint;
ALTER TABLE cyclone_runs ADD COLUMN IF NOT EXISTS parent_node_id text;
ALTER TABLE cyclone_steps ADD COLUMN IF NOT EXISTS child_workflow text;
ALTER TABLE cyclone_steps ADD COLUMN IF NOT EXISTS child_needs_result boolean;

CREATE UNIQUE INDEX IF NOT EXISTS idx_runs_parent
    ON cyclone_runs (parent_run_id, parent_node_id) WHERE parent_run_id IS NOT NULL;
CREATE INDEX IF NOT EXISTS idx_steps_waiting_child ON cyclone_steps (run_id)
    WHERE state = 'waiting_child';

ALTER TABLE cyclone_steps DROP CONSTRAINT cyclone_steps_state_check;
ALTER TABLE cyclone_steps ADD CONSTRAINT cyclone_steps_state_check CHECK (state IN (
    'pending', 'available', 'running', 'waiting_signal', 'waiting_timer', 'waiting_child',
    'paused', 'completed', 'discarded', 'cancelled')) NOT VALID;

CREATE OR REPLACE VIEW cyclone_v_runs AS
SELECT r.id, r.workflow, r.def_version, r.state, r.created_at, r.updated_at, r.finished_at,
       count(s.id) AS steps_total,
       count(s.id) FILTER (WHERE s.state = 'completed') AS steps_completed,
       count(s.id) FILTER (WHERE s.state = 'discarded') AS steps_discarded,
       count(s.id) FILTER (WHERE s.state = 'running') AS steps_running,
       count(s.id) FILTER (WHERE s.state = 'waiting_signal') AS steps_waiting_signal,
       count(s.id) FILTER (WHERE s.state = 'waiting_timer') AS steps_waiting_timer,
       r.parent_run_id, r.parent_node_id
FROM cyclone_runs AS r
LEFT JOIN cyclone_steps AS s ON s.run_id = r.id
GROUP BY r.id;

---- create above / drop below ----

DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM cyclone_steps WHERE state = 'waiting_child') THEN
        RAISE EXCEPTION 'cannot migrate down from 19 while a step is waiting_child: '
            'cancel the parent runs of the waiting child nodes first';
    END IF;
END
$$;

-- CREATE OR REPLACE VIEW cannot remove a column: the view of version 18 is re-created.
DROP VIEW cyclone_v_runs;
CREATE VIEW cyclone_v_runs AS
SELECT r.id, r.workflow, r.def_version, r.state, r.created_at, r.updated_at, r.finished_at,
       count(s.id) AS steps_total,
       count(s.id) FILTER (WHERE s.state = 'completed') AS steps_completed,
       count(s.id) FILTER (WHERE s.state = 'discarded') AS steps_discarded,
       count(s.id) FILTER (WHERE s.state = 'running') AS steps_running,
       count(s.id) FILTER (WHERE s.state = 'waiting_signal') AS steps_waiting_signal,
       count(s.id) FILTER (WHERE s.state = 'waiting_timer') AS steps_waiting_timer
FROM cyclone_runs AS r
LEFT JOIN cyclone_steps AS s ON s.run_id = r.id
GROUP BY r.id;
-- The check of version 18 was NOT VALID: restore it NOT VALID.
ALTER TABLE cyclone_steps DROP CONSTRAINT cyclone_steps_state_check;
ALTER TABLE cyclone_steps ADD CONSTRAINT cyclone_steps_state_check CHECK (state IN (
    'pending', 'available', 'running', 'waiting_signal', 'waiting_timer', 'paused',
    'completed', 'discarded', 'cancelled')) NOT VALID;
DROP INDEX idx_steps_waiting_child;
DROP INDEX idx_runs_parent;
ALTER TABLE cyclone_steps DROP COLUMN child_needs_result;
ALTER TABLE cyclone_steps DROP COLUMN child_workflow;
ALTER TABLE cyclone_runs DROP COLUMN parent_node_id;
ALTER TABLE cyclone_runs DROP COLUMN parent_run_id;
