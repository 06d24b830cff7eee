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

-- name: retry_node
-- Operator retry of a discarded or cancelled node: a fresh attempt budget and reclaim count.
UPDATE cyclone_steps AS s
SET state = 'pending', attempt = 0, reclaims = 0, error = NULL, error_kind = NULL,
    panic_stack = NULL, output = NULL, completed_at = NULL, started_at = NULL,
    lease_owner = NULL, lease_expiry = NULL, scheduled_at = now() + %(shift)s::interval
WHERE s.run_id = %(run_id)s AND s.item_of IS NULL
  AND ((s.node = %(node)s AND s.state IN ('discarded', 'cancelled')) OR s.state = 'cancelled')
RETURNING s.node

-- name: reopen_run
-- Put a failed or cancelled run back to running for an operator retry.
UPDATE cyclone_runs
SET state = 'running', finished_at = NULL, updated_at = now()
WHERE id = %(run_id)s
RETURNING id

-- name: node_state
-- One node of a run.
SELECT id, state FROM cyclone_steps WHERE run_id = %(run_id)s AND node = %(node)s
