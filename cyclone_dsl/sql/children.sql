-- name: finish_child_nodes
-- Settle the parent nodes of child runs that ended: the child's result, or a failure.
UPDATE cyclone_steps AS p
SET state = CASE WHEN c.state = 'completed' THEN 'completed' ELSE 'discarded' END,
    output = CASE WHEN c.state = 'completed' AND p.child_needs_result THEN
                 (SELECT s.output FROM cyclone_steps AS s
                  WHERE s.run_id = c.id AND s.node = c.result_node) END,
    error = CASE WHEN c.state <> 'completed' THEN
                 'child run ' || c.id || ' of ' || quote_literal(c.workflow) || ' ' || c.state END,
    error_kind = CASE WHEN c.state <> 'completed' THEN 'child_failed' END,
    completed_at = now() + %(shift)s::interval
FROM cyclone_runs AS c
WHERE c.id = ANY(%(child_ids)s::bigint[])
  AND p.run_id = c.parent_run_id AND p.node = c.parent_node_id AND p.state = 'waiting_child'
RETURNING p.id, p.run_id, p.node, p.item_of, p.state, true AS has_downstream, p.error

-- name: open_descendants
-- The non-terminal runs below these runs (children, grandchildren, ...).
WITH RECURSIVE down(id) AS (
    SELECT c.id FROM cyclone_runs AS c WHERE c.parent_run_id = ANY(%(run_ids)s::bigint[])
    UNION
    SELECT c.id FROM cyclone_runs AS c JOIN down ON c.parent_run_id = down.id
)
SELECT r.id FROM cyclone_runs AS r
WHERE r.id IN (SELECT id FROM down) AND r.state IN ('running', 'paused')

-- name: child_run_of
-- The child run already started for a parent node, if any.
SELECT id FROM cyclone_runs WHERE parent_run_id = %(run_id)s AND parent_node_id = %(node)s
