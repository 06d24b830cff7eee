-- name: finish_child_nodes
-- Settle the parent nodes of child runs that ended: the child's result, or a failure. A
-- child run that completed with its result node cut off by a contained failure
-- (cancel_branch) has no result: a parent node that needs it fails, rather than take None.
UPDATE cyclone_steps AS p
SET state = CASE WHEN c.state = 'completed' AND NOT (p.child_needs_result AND res.cut)
                 THEN 'completed' ELSE 'discarded' END,
    output = CASE WHEN c.state = 'completed' AND p.child_needs_result AND NOT res.cut
                  THEN res.output END,
    error = CASE WHEN c.state <> 'completed' THEN
                     'child run ' || c.id || ' of ' || quote_literal(c.workflow) || ' ' || c.state
                 WHEN p.child_needs_result AND res.cut THEN
                     'child run ' || c.id || ' of ' || quote_literal(c.workflow)
                     || ' completed without a result: its result node '
                     || quote_literal(c.result_node) || ' was ' || res.state END,
    error_kind = CASE WHEN c.state <> 'completed' OR (p.child_needs_result AND res.cut)
                      THEN 'child_failed' END,
    completed_at = now() + %(shift)s::interval
FROM cyclone_runs AS c
LEFT JOIN LATERAL (
    SELECT s.output, s.state, s.state IN ('cancelled', 'discarded') AS cut
    FROM cyclone_steps AS s WHERE s.run_id = c.id AND s.node = c.result_node
) AS found ON true
-- No result node (or no step for it): nothing to cut off.
CROSS JOIN LATERAL (SELECT found.output, found.state, coalesce(found.cut, false) AS cut) AS res
WHERE c.id = ANY(%(child_ids)b::bigint[])
  AND p.run_id = c.parent_run_id AND p.node = c.parent_node_id AND p.state = 'waiting_child'
RETURNING p.id, p.run_id, p.node, p.item_of, p.state, true AS has_downstream, p.error

-- name: open_descendants
-- The non-terminal runs below these runs (children, grandchildren, ...).
WITH RECURSIVE down(id) AS (
    SELECT c.id FROM cyclone_runs AS c WHERE c.parent_run_id = ANY(%(run_ids)b::bigint[])
    UNION
    SELECT c.id FROM cyclone_runs AS c JOIN down ON c.parent_run_id = down.id
)
SELECT r.id FROM cyclone_runs AS r
WHERE r.id IN (SELECT id FROM down) AND r.state IN ('running', 'paused')

-- name: child_run_of
-- The child run already started for a parent node, if any.
SELECT id, state, parent_run_id, parent_node_id
FROM cyclone_runs WHERE parent_run_id = %(run_id)s AND parent_node_id = %(node)s

-- name: unstarted_children
-- Child nodes waiting for a child run that was never started (the process that activated
-- them did not have the child's definition), in running runs of the given (workflow,
-- def_version): a paused run's wait for its resume (see wake_unstarted_children).
-- Read without locks; start_deferred locks the runs, then checks again.
SELECT s.id, s.run_id
FROM cyclone_steps AS s
JOIN cyclone_runs AS r ON r.id = s.run_id
WHERE s.state = 'waiting_child' AND s.kind = '@child' AND r.state = 'running'
  AND (r.workflow, r.def_version) IN (
      SELECT v.workflow, v.def_version
      FROM unnest(%(workflows)b::text[], %(versions)b::text[]) AS v(workflow, def_version))
  AND NOT EXISTS (SELECT 1 FROM cyclone_runs AS c
                  WHERE c.parent_run_id = s.run_id AND c.parent_node_id = s.node)
ORDER BY s.id
LIMIT %(limit)s

-- name: waiting_child_nodes
-- These steps, if they still wait for a child run (the activation rows start_on_activation
-- takes).
SELECT s.id, s.run_id, s.node, s.kind, s.state, s.queue, s.fan_out_parallel, s.child_workflow
FROM cyclone_steps AS s
WHERE s.id = ANY(%(ids)b::bigint[]) AND s.state = 'waiting_child'
ORDER BY s.id

-- name: ended_children_of_waiting_nodes
-- Child runs that ended while their parent node still waits for them (a repair: normally
-- the child's end settles its parent node in the same transaction).
SELECT c.id, c.state, c.parent_run_id, c.parent_node_id
FROM cyclone_steps AS s
JOIN cyclone_runs AS c ON c.parent_run_id = s.run_id AND c.parent_node_id = s.node
WHERE {{ended_child_of_waiting_node}} AND s.id > %(after_id)s
ORDER BY s.id
LIMIT %(limit)s

-- fragment: ended_child_of_waiting_node
-- A child node s whose child run c has ended (scan_probe looks for one).
s.state = 'waiting_child' AND s.kind = '@child' AND c.state IN ('completed', 'failed', 'cancelled')

-- name: open_child_runs_of_nodes
-- The child runs, not ended, of some child nodes of a run, in id order.
SELECT c.id FROM cyclone_runs AS c
WHERE c.parent_run_id = %(run_id)s AND c.parent_node_id = ANY(%(nodes)b::text[])
  AND c.state IN ('running', 'paused')
ORDER BY c.id

-- name: versions_of_runs
-- The (workflow, def_version) of these runs: the version a child node's run was submitted
-- with decides which definition of the child workflow starts.
SELECT r.id, r.workflow, r.def_version FROM cyclone_runs AS r
WHERE r.id = ANY(%(run_ids)b::bigint[])

-- name: has_unstarted_children
-- Whether this run has a child node waiting for a child run never started.
SELECT EXISTS (
    SELECT 1 FROM cyclone_steps AS s
    WHERE s.run_id = %(run_id)s AND s.state = 'waiting_child' AND s.kind = '@child'
      AND NOT EXISTS (SELECT 1 FROM cyclone_runs AS c
                      WHERE c.parent_run_id = s.run_id AND c.parent_node_id = s.node)
) AS found
