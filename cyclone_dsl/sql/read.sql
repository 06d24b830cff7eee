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
-- Runs newest first, optionally by state and workflow, keyset-paginated by id. %(text)s
-- matches (case-insensitively, as plain text) the input's JSON or the submit key;
-- %(error_kind)s, a step that ended with that error kind or an attempt that failed with it.
SELECT r.id, r.workflow, r.def_version, r.input, r.state, r.created_at, r.updated_at,
       r.finished_at, r.deadline_at, r.result_node, r.submit_key, r.paused_at,
       r.parent_run_id, r.parent_node_id
FROM cyclone_runs AS r
WHERE (%(state)s::text IS NULL OR r.state = %(state)s)
  AND (%(workflow)s::text IS NULL OR r.workflow = %(workflow)s)
  AND (%(before_id)s::bigint IS NULL OR r.id < %(before_id)s)
  AND (%(parent_run_id)s::bigint IS NULL OR r.parent_run_id = %(parent_run_id)s)
  AND (%(since)s::timestamptz IS NULL OR r.created_at >= %(since)s)
  AND (%(until)s::timestamptz IS NULL OR r.created_at < %(until)s)
  AND (%(text)s::text IS NULL
       OR strpos(lower(r.input::text), lower(%(text)s)) > 0
       OR strpos(lower(coalesce(r.submit_key, '')), lower(%(text)s)) > 0)
  AND (%(error_kind)s::text IS NULL
       OR EXISTS (SELECT 1 FROM cyclone_steps AS s
                  WHERE s.run_id = r.id AND s.error_kind = %(error_kind)s)
       OR EXISTS (SELECT 1 FROM cyclone_steps AS s
                  JOIN cyclone_ext_attempts AS a ON a.step_id = s.id
                  WHERE s.run_id = r.id AND a.error_kind = %(error_kind)s))
ORDER BY r.id DESC
LIMIT %(limit)s

-- name: run_outcome
-- A run's state, its result node's output, and the failure that ended it: a step that
-- ended with the run (in its transaction), a failed one first (one whose failure the run
-- did not contain: a failure contained in the same batch, whose dependents all cancel
-- their branch, did not end it), then one the run's end cancelled (a failure contained
-- earlier did not end it); with whether the run ended past its deadline (a step waiting
-- to retry keeps its last attempt's error when the deadline cancels it).
SELECT r.id, r.state, r.result_node, res.output AS result, res.state AS result_state,
       f.node AS failed_node, f.error AS failed_error, f.error_kind AS failed_error_kind,
       f.state = 'discarded' AND f.completed_at = r.finished_at AS failed_at_end,
       coalesce(r.finished_at >= r.deadline_at, false) AS past_deadline
FROM cyclone_runs AS r
LEFT JOIN LATERAL (
    SELECT s.node, s.error, s.error_kind, s.state, s.completed_at FROM cyclone_steps AS s
    WHERE s.run_id = r.id AND s.state IN ('discarded', 'cancelled') AND s.error IS NOT NULL
    ORDER BY s.completed_at = r.finished_at DESC, (s.state = 'discarded') DESC,
             s.state = 'discarded'
             AND EXISTS (SELECT 1 FROM cyclone_deps AS d
                         WHERE d.run_id = s.run_id AND d.dep_node = s.node)
             AND NOT EXISTS (
                 SELECT 1 FROM cyclone_deps AS d
                 JOIN cyclone_steps AS below ON below.run_id = d.run_id AND below.node = d.node
                 WHERE d.run_id = s.run_id AND d.dep_node = s.node
                   AND below.on_dep_failure IS DISTINCT FROM 'cancel_branch'),
             s.error_kind IN ('deadline', 'cancelled', 'dep_failed') DESC,
             s.completed_at NULLS LAST, s.id
    LIMIT 1
) AS f ON true
LEFT JOIN cyclone_steps AS res ON res.run_id = r.id AND res.node = r.result_node
WHERE r.id = %(run_id)s

-- name: run_progress
-- How many steps of a run are terminal (no row: the run does not exist).
SELECT count(s.id) FILTER (WHERE s.state IN ('completed', 'discarded', 'cancelled')) AS done,
       count(s.id) AS total
FROM cyclone_runs AS r LEFT JOIN cyclone_steps AS s ON s.run_id = r.id
WHERE r.id = %(run_id)s
GROUP BY r.id

-- name: get_run_deps
-- The dependency edges of a run; one row of NULLs for a run without edges, none for a run
-- that does not exist.
SELECT d.node, d.dep_node, d.dep_type
FROM cyclone_runs AS r LEFT JOIN cyclone_deps AS d ON d.run_id = r.id
WHERE r.id = %(run_id)s
ORDER BY d.node, d.dep_node

-- name: run_signals
-- A run's signal mailbox, in delivery order; one row of NULLs for an empty mailbox, none
-- for a run that does not exist.
SELECT x.id, x.name, x.payload, x.created_at, x.consumed_by, x.consumed_at
FROM cyclone_runs AS r LEFT JOIN cyclone_signals AS x ON x.run_id = r.id
WHERE r.id = %(run_id)s
ORDER BY x.id

-- name: run_counts
-- How many runs are in each state.
SELECT state, count(*) AS count FROM cyclone_runs GROUP BY state ORDER BY state

-- name: child_runs
-- The child runs of a run.
SELECT id, workflow, state, parent_node_id FROM cyclone_runs
WHERE parent_run_id = %(run_id)s ORDER BY id

-- name: child_runs_of_run
-- The child runs of a run; one row of NULLs for a run without any, none for a run that
-- does not exist.
SELECT c.id, c.workflow, c.state, c.parent_node_id
FROM cyclone_runs AS r LEFT JOIN cyclone_runs AS c ON c.parent_run_id = r.id
WHERE r.id = %(run_id)s
ORDER BY c.id

-- name: step_throughput
-- Steps started in each of %(buckets)s equal buckets of the last %(window)s (by their
-- latest start, through idx_steps_timeout), how many of them completed, and how long they
-- waited once due (started_at - scheduled_at): median, 95th percentile and maximum, in
-- seconds. Bucket 0 is the oldest; now is the database's clock.
WITH span AS (
    SELECT now() + %(shift)s::interval AS until,
           extract(epoch FROM %(window)s::interval) / %(buckets)s AS bucket_s
), started AS (
    SELECT s.state, greatest(0, extract(epoch FROM s.started_at - s.scheduled_at)) AS wait_s,
           least(%(buckets)s - 1, floor(extract(epoch FROM s.started_at
                                                - (span.until - %(window)s::interval))
                                        / span.bucket_s))::int AS bucket
    FROM cyclone_steps AS s, span
    WHERE s.started_at >= span.until - %(window)s::interval AND s.started_at <= span.until
)
SELECT (SELECT until FROM span) AS until, b.bucket, count(st.bucket) AS started,
       count(st.bucket) FILTER (WHERE st.state = 'completed') AS completed,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY st.wait_s) AS wait_p50_s,
       percentile_cont(0.95) WITHIN GROUP (ORDER BY st.wait_s) AS wait_p95_s,
       max(st.wait_s) AS wait_max_s
FROM generate_series(0, %(buckets)s - 1) AS b(bucket)
LEFT JOIN started AS st ON st.bucket = b.bucket
GROUP BY b.bucket
ORDER BY b.bucket
