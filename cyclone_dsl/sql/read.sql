-- name: get_run
-- One run.
SELECT id, workflow, def_version, input, state, created_at, updated_at, finished_at,
       deadline_at, result_node, submit_key, paused_at, parent_run_id, parent_node_id
FROM cyclone_runs WHERE id = %(run_id)s

-- name: get_run_steps
-- Every step of a run, in insertion order.
SELECT id, node, kind, state, attempt, max_attempts, reclaims, queue, priority, error,
       error_kind, panic_stack, scheduled_at, created_at, started_at, completed_at,
       item_of, item_index, lease_owner, lease_expiry, child_workflow, signal_name,
       signal_names, wait_count, input, input_from, output
FROM cyclone_steps WHERE run_id = %(run_id)s ORDER BY id

-- name: get_run_attempts
-- The attempt history of a run's steps (failed, retried, timed out and reclaimed executions).
SELECT a.step_id, a.attempt, a.worker, a.started_at, a.ended_at, a.outcome, a.error,
       a.error_kind, a.panic_stack
FROM cyclone_steps AS s
JOIN cyclone_ext_attempts AS a ON a.step_id = s.id
WHERE s.run_id = %(run_id)s
ORDER BY a.step_id, a.id

-- name: list_runs
-- Runs newest first, optionally by state and workflow, keyset-paginated by id.
SELECT id, workflow, def_version, input, state, created_at, updated_at, finished_at,
       deadline_at, result_node, submit_key, paused_at, parent_run_id, parent_node_id
FROM cyclone_runs
WHERE (%(state)s::text IS NULL OR state = %(state)s)
  AND (%(workflow)s::text IS NULL OR workflow = %(workflow)s)
  AND (%(before_id)s::bigint IS NULL OR id < %(before_id)s)
  AND (%(parent_run_id)s::bigint IS NULL OR parent_run_id = %(parent_run_id)s)
  AND (%(since)s::timestamptz IS NULL OR created_at >= %(since)s)
  AND (%(until)s::timestamptz IS NULL OR created_at < %(until)s)
ORDER BY id DESC
LIMIT %(limit)s

-- name: run_outcome
-- A run's state, its result node's output, and its first failure.
SELECT r.id, r.state, r.result_node,
       (SELECT s.output FROM cyclone_steps AS s
        WHERE s.run_id = r.id AND s.node = r.result_node) AS result,
       f.node AS failed_node, f.error AS failed_error, f.error_kind AS failed_error_kind
FROM cyclone_runs AS r
LEFT JOIN LATERAL (
    SELECT s.node, s.error, s.error_kind FROM cyclone_steps AS s
    WHERE s.run_id = r.id AND s.state IN ('discarded', 'cancelled') AND s.error IS NOT NULL
    ORDER BY (s.state = 'discarded') DESC, s.completed_at NULLS LAST, s.id
    LIMIT 1
) AS f ON true
WHERE r.id = %(run_id)s

-- name: run_progress
-- How many steps of a run are terminal.
SELECT count(*) FILTER (WHERE state IN ('completed', 'discarded', 'cancelled')) AS done,
       count(*) AS total
FROM cyclone_steps WHERE run_id = %(run_id)s

-- name: get_run_deps
-- The dependency edges of a run.
SELECT node, dep_node, dep_type FROM cyclone_deps WHERE run_id = %(run_id)s ORDER BY node, dep_node

-- name: run_signals
-- A run's signal mailbox, in delivery order.
SELECT id, name, payload, created_at, consumed_by, consumed_at
FROM cyclone_signals WHERE run_id = %(run_id)s ORDER BY id

-- name: run_counts
-- How many runs are in each state.
SELECT state, count(*) AS count FROM cyclone_runs GROUP BY state ORDER BY state

-- name: child_runs
-- The child runs of a run.
SELECT id, workflow, state, parent_node_id FROM cyclone_runs
WHERE parent_run_id = %(run_id)s ORDER BY id
