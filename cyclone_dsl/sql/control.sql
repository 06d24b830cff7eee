-- name: run_tree
-- A run and all its descendant runs (child runs, grandchildren, ...).
WITH RECURSIVE tree(id) AS (
    SELECT %(run_id)s::bigint
    UNION
    SELECT c.id FROM cyclone_runs AS c JOIN tree ON c.parent_run_id = tree.id
)
SELECT id FROM tree

-- name: get_run_state
-- A run's state (no lock).
SELECT id, state FROM cyclone_runs WHERE id = %(run_id)s

-- name: node_state
-- One node of a run, and the fan-out node of an item task.
SELECT id, state, item_of FROM cyclone_steps WHERE run_id = %(run_id)s AND node = %(node)s

-- name: retry_run
-- What an operator retry checks on a run (locked by the caller): state, deadline, parent.
SELECT r.id, r.state, r.parent_run_id, r.parent_node_id,
       coalesce(r.deadline_at <= now() + %(shift)s::interval, false) AS past_deadline
FROM cyclone_runs AS r
WHERE r.id = %(run_id)s

-- name: retry_child_runs
-- The child runs of some child nodes of a run, with the columns of retry_run.
SELECT r.id, r.state, r.parent_run_id, r.parent_node_id,
       coalesce(r.deadline_at <= now() + %(shift)s::interval, false) AS past_deadline
FROM cyclone_runs AS r
WHERE r.parent_run_id = %(run_id)s AND r.parent_node_id = ANY(%(nodes)s::text[])
ORDER BY r.id

-- name: retry_steps
-- The graph nodes of a run (item tasks left out), in id order, for an operator retry.
SELECT s.id, s.node, s.kind, s.state, s.on_dep_failure, s.unique_key,
       s.fan_out_parallel IS NOT NULL AND EXISTS (
           SELECT 1 FROM cyclone_steps AS i
           WHERE i.run_id = s.run_id AND i.item_of = s.node) AS has_items
FROM cyclone_steps AS s
WHERE s.run_id = %(run_id)s AND s.item_of IS NULL
ORDER BY s.id

-- name: retry_deps
-- The dependency edges of a run (node depends on dep_node).
SELECT node, dep_node FROM cyclone_deps WHERE run_id = %(run_id)s

-- name: retry_reset_steps
-- Operator retry: these discarded or cancelled graph nodes go back to pending with a fresh
-- attempt budget and reclaim count. lease_generation is kept: it fences stale workers.
WITH listed AS (
    SELECT s.id FROM cyclone_steps AS s
    WHERE s.run_id = %(run_id)s AND s.node = ANY(%(nodes)s::text[]) AND s.item_of IS NULL
      AND s.state IN ('discarded', 'cancelled')
    ORDER BY s.id
    FOR NO KEY UPDATE
)
UPDATE cyclone_steps AS s
SET state = 'pending', attempt = 0, reclaims = 0, error = NULL, error_kind = NULL,
    panic_stack = NULL, output = NULL, started_at = NULL, completed_at = NULL,
    lease_owner = NULL, lease_expiry = NULL, scheduled_at = now() + %(shift)s::interval
WHERE s.id = ANY(ARRAY(SELECT id FROM listed))  -- locked in id order above
  AND s.state IN ('discarded', 'cancelled')
RETURNING s.node

-- name: retry_reset_items
-- Operator retry: the discarded and cancelled items of these fan-out nodes go back to
-- pending (completed items keep their outputs), reset like retry_reset_steps.
WITH listed AS (
    SELECT s.id FROM cyclone_steps AS s
    WHERE s.run_id = %(run_id)s AND s.item_of = ANY(%(nodes)s::text[])
      AND s.state IN ('discarded', 'cancelled')
    ORDER BY s.id
    FOR NO KEY UPDATE
)
UPDATE cyclone_steps AS s
SET state = 'pending', attempt = 0, reclaims = 0, error = NULL, error_kind = NULL,
    panic_stack = NULL, output = NULL, started_at = NULL, completed_at = NULL,
    lease_owner = NULL, lease_expiry = NULL, scheduled_at = now() + %(shift)s::interval
WHERE s.id = ANY(ARRAY(SELECT id FROM listed))  -- locked in id order above
  AND s.state IN ('discarded', 'cancelled')
RETURNING s.node

-- name: retry_reopen_run
-- Put an ended run (failed, cancelled, or completed with a contained failure) back to
-- running for an operator retry.
UPDATE cyclone_runs
SET state = 'running', finished_at = NULL, paused_at = NULL, updated_at = now()
WHERE id = %(run_id)s AND state IN ('completed', 'failed', 'cancelled')
RETURNING id
