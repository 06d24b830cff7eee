-- name: expand_fan_outs
-- Create one item task per element of each activated fan-out node's list (idempotent).
-- The items of a fan-out over a workflow are child nodes: they start waiting for the child
-- run the caller then starts (the activation hooks), not available to a worker.
WITH f AS (
    SELECT s.id, s.run_id, s.node, s.kind, s.queue, s.priority, s.max_attempts, s.timeout,
           s.retention, s.fan_out_parallel, s.child_workflow, s.child_needs_result,
           coalesce(u.output, s.input) AS items
    FROM cyclone_steps AS s
    LEFT JOIN cyclone_steps AS u ON u.run_id = s.run_id AND u.node = s.input_from
    WHERE s.id = ANY(%(ids)b::bigint[]) AND s.state = 'pending'
      AND jsonb_typeof(coalesce(u.output, s.input)) = 'array'
)
INSERT INTO cyclone_steps (run_id, node, kind, state, input, queue, priority, max_attempts,
                           timeout, retention, item_of, item_index, scheduled_at,
                           child_workflow, child_needs_result)
SELECT f.run_id, f.node || '[' || (e.ord - 1) || ']', f.kind,
       CASE WHEN f.fan_out_parallel > 0 AND e.ord > f.fan_out_parallel THEN 'pending'
            WHEN f.kind = '@child' THEN 'waiting_child'
            ELSE 'available' END,
       e.value, f.queue, f.priority, f.max_attempts, f.timeout, f.retention, f.node,
       (e.ord - 1)::int, now() + %(shift)s::interval, f.child_workflow, f.child_needs_result
FROM f, jsonb_array_elements(f.items) WITH ORDINALITY AS e(value, ord)
ON CONFLICT (run_id, node) DO NOTHING
RETURNING id, run_id, node, kind, state, queue, fan_out_parallel, child_workflow, item_of

-- name: fan_out_sources
-- What each fan-out node would expand: the JSON type and length of its list, and its
-- max_items guard (NULL: none).
SELECT s.id, s.run_id, s.node, s.input_from, s.fan_out_max_bytes, l.max_items,
       jsonb_typeof(coalesce(u.output, s.input)) AS list_type,
       coalesce(jsonb_array_length(CASE WHEN jsonb_typeof(coalesce(u.output, s.input)) = 'array'
                                        THEN coalesce(u.output, s.input) END), 0) AS length
FROM cyclone_steps AS s
LEFT JOIN cyclone_steps AS u ON u.run_id = s.run_id AND u.node = s.input_from
LEFT JOIN cyclone_ext_fan_out_limits AS l ON l.run_id = s.run_id AND l.node = s.node
WHERE s.id = ANY(%(ids)b::bigint[])
ORDER BY s.id

-- name: activate_next_items
-- Make the next pending items of a fan-out available, up to its max_parallel.
WITH f AS (
    SELECT s.run_id, s.node, s.fan_out_parallel
    FROM cyclone_steps AS s
    WHERE s.run_id = %(run_id)s AND s.node = %(node)s AND s.state = 'pending'
), nxt AS (
    SELECT i.id
    FROM cyclone_steps AS i, f
    WHERE i.run_id = f.run_id AND i.item_of = f.node AND i.state = 'pending'
    ORDER BY i.item_index
    LIMIT (SELECT CASE WHEN f.fan_out_parallel = 0 THEN NULL
                       ELSE greatest(f.fan_out_parallel - (
                           SELECT count(*) FROM cyclone_steps AS b
                           WHERE b.run_id = f.run_id AND b.item_of = f.node
                             AND b.state IN ('available', 'running', 'waiting_child')), 0) END
           FROM f)
    FOR NO KEY UPDATE
)
UPDATE cyclone_steps AS s
SET state = CASE WHEN s.kind = '@child' THEN 'waiting_child' ELSE 'available' END,
    -- an item keeps a later start it already has (its retry backoff, through a pause)
    scheduled_at = greatest(s.scheduled_at, now() + %(shift)s::interval)
FROM nxt
WHERE s.id = nxt.id
RETURNING s.id, s.run_id, s.node, s.kind, s.state, s.queue, s.fan_out_parallel,
          s.child_workflow, s.item_of

-- name: finish_fan_out
-- Complete a fan-out node whose items all completed, with their outputs in item order.
-- A fan-out without items has not expanded yet (an empty list completes the node as it
-- expands, with complete_node): it is not finished.
UPDATE cyclone_steps AS s
SET state = 'completed', completed_at = now() + %(shift)s::interval,
    output = CASE WHEN s.fan_out_max_bytes IS NULL THEN NULL ELSE (
        SELECT coalesce(jsonb_agg(coalesce(i.output, 'null'::jsonb) ORDER BY i.item_index),
                        '[]'::jsonb)
        FROM cyclone_steps AS i WHERE i.run_id = s.run_id AND i.item_of = s.node) END
WHERE s.run_id = %(run_id)s AND s.node = %(node)s AND s.state = 'pending'
  AND s.fan_out_parallel IS NOT NULL
  AND EXISTS (SELECT 1 FROM cyclone_steps AS i WHERE i.run_id = s.run_id AND i.item_of = s.node)
  AND NOT EXISTS (
      SELECT 1 FROM cyclone_steps AS i
      WHERE i.run_id = s.run_id AND i.item_of = s.node
        AND i.state IN ('pending', 'available', 'running', 'paused', 'waiting_child'))
-- The collected output is measured as every payload is (compact JSON), which its text
-- form here, with a space after each comma and colon, is never shorter than: only an
-- output whose text form is over max_bytes comes back, to be measured exactly.
RETURNING s.id, s.run_id, s.node, s.item_of, true AS has_downstream, s.fan_out_max_bytes,
          CASE WHEN octet_length(s.output::text) > s.fan_out_max_bytes THEN s.output END
              AS collected_if_large

-- name: discard_node
-- Fail a node that is not running (a fan-out, a child node, a wait) for good.
UPDATE cyclone_steps AS s
SET state = 'discarded', completed_at = now() + %(shift)s::interval, output = NULL,
    error = %(error)s, error_kind = %(error_kind)s
WHERE s.id = %(id)s AND s.state NOT IN ('completed', 'discarded', 'cancelled', 'running')
RETURNING s.id, s.run_id, s.node, s.item_of, s.error

-- name: complete_node
-- Complete a node that is not running (an empty fan-out) with the given output.
UPDATE cyclone_steps AS s
SET state = 'completed', completed_at = now() + %(shift)s::interval, output = %(output)s::jsonb
WHERE s.id = %(id)s AND s.state = 'pending'
RETURNING s.id, s.run_id, s.node, s.item_of, true AS has_downstream

-- name: cancel_items
-- Cancel the unfinished items of a fan-out node (the caller cancels the child runs of
-- items that waited for one).
WITH listed AS (
    SELECT s.id, s.state FROM cyclone_steps AS s
    WHERE s.run_id = %(run_id)s AND s.item_of = %(node)s
      AND s.state IN ('pending', 'available', 'running', 'paused', 'waiting_child')
    ORDER BY s.id
    FOR NO KEY UPDATE
)
UPDATE cyclone_steps AS s
SET state = 'cancelled', completed_at = now() + %(shift)s::interval,
    error = %(error)s, error_kind = 'dep_failed', lease_expiry = NULL  -- lease_owner kept
WHERE s.id = ANY(ARRAY(SELECT id FROM listed))  -- locked in id order above
  AND s.run_id = %(run_id)s AND s.item_of = %(node)s
  AND s.state IN ('pending', 'available', 'running', 'paused', 'waiting_child')
RETURNING s.id, s.node, s.kind, s.queue,
          s.id = ANY(ARRAY(SELECT id FROM listed WHERE state = 'running')) AS was_running

-- name: fan_out_node
-- A fan-out node by run and node id.
SELECT id, state FROM cyclone_steps WHERE run_id = %(run_id)s AND node = %(node)s

-- name: fan_out_nodes_of_run
-- The fan-out nodes of a run still collecting items (expanded: a pending fan-out without
-- items waits for its list).
SELECT s.node FROM cyclone_steps AS s
WHERE s.run_id = %(run_id)s AND s.fan_out_parallel IS NOT NULL AND s.state = 'pending'
  AND EXISTS (SELECT 1 FROM cyclone_steps AS i WHERE i.run_id = s.run_id AND i.item_of = s.node)
ORDER BY s.id

-- name: discard_node_completed
-- Turn a just-completed node into a failure (its collected output broke a limit).
UPDATE cyclone_steps AS s
SET state = 'discarded', output = NULL, error = %(error)s, error_kind = %(error_kind)s
WHERE s.id = %(id)s AND s.state = 'completed'
RETURNING s.id, s.run_id, s.node, s.item_of, s.error
