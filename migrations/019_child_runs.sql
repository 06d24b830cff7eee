-- Child workflow runs (workflow.Child): the parent link on the child run, the child node's
-- workflow and whether it needs the child's result, and the waiting_child state.
-- There is no foreign key on parent_run_id: a purge may delete a parent before its child.
--
-- Out of band on a large table (then check that the indexes are valid in pg_index):
--   ALTER TABLE cyclone_runs ADD COLUMN IF NOT EXISTS parent_run_id bigint;
--   ALTER TABLE cyclone_runs ADD COLUMN IF NOT EXISTS parent_node_id text;
--   CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS idx_runs_parent
--       ON cyclone_runs (parent_run_id, parent_node_id) WHERE parent_run_id IS NOT NULL;
--   CREATE INDEX CONCURRENTLY IF NOT EXISTS idx_steps_waiting_child
--       ON cyclone_steps (run_id) WHERE state = 'waiting_child';

ALTER TABLE cyclone_runs ADD COLUMN IF NOT EXISTS parent_run_id bigint;
ALTER TABLE cyclone_runs ADD COLUMN IF NOT EXISTS parent_node_id text;
ALTER TABLE cyclone_steps ADD COLUMN child_workflow text;
ALTER TABLE cyclone_steps ADD COLUMN child_needs_result boolean;

CREATE UNIQUE INDEX IF NOT EXISTS idx_runs_parent ON cyclone_runs (parent_run_id, parent_node_id)
    WHERE parent_run_id IS NOT NULL;
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
ALTER TABLE cyclone_steps DROP CONSTRAINT cyclone_steps_state_check;
ALTER TABLE cyclone_steps ADD CONSTRAINT cyclone_steps_state_check CHECK (state IN (
    'pending', 'available', 'running', 'waiting_signal', 'waiting_timer', 'paused',
    'completed', 'discarded', 'cancelled')) NOT VALID;
DROP INDEX IF EXISTS idx_steps_waiting_child;
DROP INDEX IF EXISTS idx_runs_parent;
ALTER TABLE cyclone_steps DROP COLUMN IF EXISTS child_needs_result;
ALTER TABLE cyclone_steps DROP COLUMN IF EXISTS child_workflow;
ALTER TABLE cyclone_runs DROP COLUMN IF EXISTS parent_node_id;
ALTER TABLE cyclone_runs DROP COLUMN IF EXISTS parent_run_id;
