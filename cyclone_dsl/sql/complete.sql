-- fragment: lock_runs_and_ancestors
-- Lock the runs of CTE mine(id) and their ancestor runs (a child's end changes its
-- parent), in id order. Only runs with a parent start the walk up, and mine reaches
-- the plan as ARRAY(...), whose length the planner cannot see: a recursive walk is
-- estimated at about a hundred times its input, and over a batch's bound array that
-- estimate crossed jit_above_cost, so every batch paid milliseconds of JIT compiling.
up(id) AS (
    SELECT r.parent_run_id FROM cyclone_runs AS r
    WHERE r.id = ANY(ARRAY(SELECT id FROM mine)) AND r.parent_run_id IS NOT NULL
    UNION
    -- A correlated lookup by id per run: a join here could scan every run when
    -- statistics are stale (a seq scan of all runs on each completion batch).
    SELECT p.id
    FROM (SELECT (SELECT r.parent_run_id FROM cyclone_runs AS r WHERE r.id = up.id) AS id
          FROM up) AS p
    WHERE p.id IS NOT NULL
)
SELECT r.id, r.state, r.has_fan_out, r.paused_at,
       coalesce(r.state = 'running' AND r.deadline_at < now() + %(shift)s::interval, false)
           AS past_deadline
FROM cyclone_runs AS r
-- an id lookup, never a scan of every run
WHERE r.id = ANY(ARRAY(SELECT id FROM mine UNION SELECT id FROM up))
ORDER BY r.id
FOR NO KEY UPDATE

-- name: lock_runs_of_steps
-- Lock the runs of these steps and their ancestor runs, in id order, before any step row.
WITH RECURSIVE mine(id) AS (
    -- = ANY: a primary-key lookup; a join with unnest() hashed every step on small tables.
    SELECT DISTINCT s.run_id FROM cyclone_steps AS s WHERE s.id = ANY(%(ids)b::bigint[])
), {{lock_runs_and_ancestors}}

-- name: lock_runs
-- Lock runs and their ancestor runs (a child's end changes its parent), in id order.
WITH RECURSIVE mine(id) AS (
    SELECT unnest(%(run_ids)b::bigint[])
), {{lock_runs_and_ancestors}}

-- name: lock_open_siblings
-- Steps completing in a snapshot older than their statements (a transactional handler's,
-- at repeatable read or serializable): lock the other open steps of their runs, as that
-- snapshot has them, in id order after the runs. One changed since (completed by another
-- branch, claimed) raises a serialization failure, and the attempt retries in a fresh
-- snapshot: activation and the run's end decided on the stale one would miss that change,
-- and a join would wait for ever.
SELECT s.id FROM cyclone_steps AS s
WHERE s.run_id = ANY(ARRAY(SELECT o.run_id FROM cyclone_steps AS o
                           WHERE o.id = ANY(%(ids)b::bigint[])))
  AND s.state NOT IN ('completed', 'discarded', 'cancelled')
  AND s.id <> ALL(%(ids)b::bigint[])
ORDER BY s.id
FOR SHARE

-- name: complete_steps
-- Record outputs of steps still leased at the given generations (a stale generation is fenced).
WITH {{lock_listed_steps}}
UPDATE cyclone_steps AS s
SET state = 'completed', output = c.output::jsonb,
    completed_at = now() + %(shift)s::interval,
    -- No lease is held any more (lease_expiry NULL); lease_owner stays: the worker that
    -- completed the step, which the attempt history (failed executions only) lacks.
    lease_expiry = NULL,
    -- A completed step has no error: its failed attempts are in the attempt history.
    error = NULL, error_kind = NULL, panic_stack = NULL
FROM unnest(%(ids)b::bigint[], %(generations)b::bigint[], %(outputs)b::text[])
    AS c(id, generation, output)
-- The CASE keeps the partial index on running steps from driving the plan (see finish_runs).
WHERE s.id = ANY(ARRAY(SELECT id FROM listed))  -- locked in id order above
  AND s.id = c.id AND s.lease_generation = c.generation
  AND CASE WHEN s.state = 'running' THEN true ELSE false END
RETURNING s.id, s.run_id, s.node, s.item_of, s.queue, s.sequence_key,
          EXISTS (SELECT 1 FROM cyclone_deps AS d
                  WHERE d.run_id = s.run_id AND d.dep_node = s.node) AS has_downstream

-- name: fail_steps
-- Count a failed execution: retry later while attempts remain and it is retryable, else
-- discard. Each failed execution is kept in the attempt history.
WITH {{lock_listed_steps}},
failed AS (
    UPDATE cyclone_steps AS s
    SET attempt = s.attempt + 1,
        state = CASE
            WHEN f.retry AND s.attempt + 1 < s.max_attempts THEN
                CASE WHEN r.state = 'paused' THEN 'paused' ELSE 'available' END
            ELSE 'discarded' END,
        scheduled_at = CASE
            WHEN f.retry AND s.attempt + 1 < s.max_attempts
                THEN now() + %(shift)s::interval + make_interval(secs => f.delay_s)
            ELSE s.scheduled_at END,
        completed_at = CASE
            WHEN f.retry AND s.attempt + 1 < s.max_attempts THEN NULL
            ELSE now() + %(shift)s::interval END,
        error = f.error, error_kind = f.error_kind, panic_stack = f.panic_stack,
        lease_owner = NULL, lease_expiry = NULL
    FROM unnest(%(ids)b::bigint[], %(generations)b::bigint[], %(retry)b::bool[],
                %(delays)b::float8[], %(errors)b::text[], %(error_kinds)b::text[],
                %(stacks)b::text[])
            AS f(id, generation, retry, delay_s, error, error_kind, panic_stack),
         cyclone_runs AS r, cyclone_steps AS cur
    WHERE s.id = ANY(ARRAY(SELECT id FROM listed))  -- locked in id order above
      AND s.id = f.id AND s.lease_generation = f.generation
      AND CASE WHEN s.state = 'running' THEN true ELSE false END  -- by id, not state index
      AND r.id = s.run_id
      AND cur.id = s.id  -- read in the statement's snapshot: the lease owner before
    RETURNING s.id, s.run_id, s.node, s.state, s.queue, s.item_of, s.error, s.error_kind,
              s.attempt, s.started_at, s.panic_stack, s.sequence_key, cur.lease_owner AS worker
), history AS (
    INSERT INTO cyclone_ext_attempts (step_id, run_id, attempt, worker, started_at, ended_at,
                                      outcome, error, error_kind, panic_stack)
    SELECT id, run_id, attempt, worker, started_at, now() + %(shift)s::interval,
           CASE WHEN state = 'discarded' THEN 'failed' ELSE 'retried' END,
           error, error_kind, panic_stack
    FROM failed
)
SELECT id, run_id, node, state, queue, item_of, error, error_kind, sequence_key FROM failed

-- name: dependents_of_nodes
-- The direct dependents of each given node (dep_node), with their failure policy.
SELECT c.node AS dep_node, d.node, s.on_dep_failure
FROM unnest(%(run_ids)b::bigint[], %(nodes)b::text[]) AS c(run_id, node)
CROSS JOIN LATERAL (
    SELECT e.node FROM cyclone_deps AS e
    WHERE e.run_id = c.run_id AND e.dep_node = c.node
    OFFSET 0
) AS d
JOIN cyclone_steps AS s ON s.run_id = c.run_id AND s.node = d.node

-- fragment: ready_conditions
-- Step s is a pending node (not a fan-out item) whose dependencies all completed, and not
-- a fan-out that has expanded already.
s.state = 'pending' AND s.item_of IS NULL
      AND NOT EXISTS (
          SELECT 1 FROM cyclone_deps AS d
          JOIN cyclone_steps AS u ON u.run_id = d.run_id AND u.node = d.dep_node
          WHERE d.run_id = s.run_id AND d.node = s.node AND u.state <> 'completed')
      AND NOT (s.fan_out_parallel IS NOT NULL AND EXISTS (
          SELECT 1 FROM cyclone_steps AS i WHERE i.run_id = s.run_id AND i.item_of = s.node))

-- fragment: activate_candidates
-- Activate the nodes of CTE ready(id, run_id, node) (ready_conditions, locked), by kind
-- and run state. A node of a conditional definition (a row in
-- cyclone_ext_guards) is judged first: it is skipped (completed, output NULL, error_kind
-- 'skipped') when every dependency was skipped and its on_skip is 'skip', or when its
-- condition does not hold on the outputs it reads. Nodes of other definitions find no
-- guard row, and the CASE reads nothing more for them. MATERIALIZED: the update sets six
-- columns from j.skip, and an inlined CTE planned (and ran) the judgement once for each.
judged AS MATERIALIZED (
    SELECT ready.id, r.state AS run_state, CASE
        WHEN g.node IS NULL THEN false
        WHEN g.on_skip = 'skip' AND (
            SELECT bool_and(u.error_kind IS NOT DISTINCT FROM 'skipped')
            FROM cyclone_deps AS d
            JOIN cyclone_steps AS u ON u.run_id = d.run_id AND u.node = d.dep_node
            WHERE d.run_id = ready.run_id AND d.node = ready.node) THEN true
        WHEN g.condition IS NULL THEN false
        ELSE NOT coalesce(jsonb_path_match(
            jsonb_build_object(
                'nodes', (SELECT coalesce(jsonb_object_agg(u.node, coalesce(u.output, 'null')),
                                          '{}'::jsonb)
                          FROM cyclone_steps AS u
                          WHERE u.run_id = ready.run_id AND u.node = ANY(g.sources)),
                'input', coalesce(r.input, 'null'::jsonb)),
            g.condition, g.variables, true), false)
        END AS skip
    FROM ready
    JOIN cyclone_runs AS r ON r.id = ready.run_id
    LEFT JOIN cyclone_ext_guards AS g ON g.def_version = r.def_version AND g.node = ready.node
)
UPDATE cyclone_steps AS s
SET state = CASE
        WHEN j.skip THEN 'completed'
        WHEN j.run_state = 'paused' THEN 'paused'
        WHEN s.fan_out_parallel IS NOT NULL THEN 'pending'  -- collects items (steps or runs)
        WHEN s.kind = '@signal' THEN 'waiting_signal'
        WHEN s.kind = '@timer' THEN 'waiting_timer'
        WHEN s.kind = '@child' THEN 'waiting_child'
        ELSE 'available' END,
    -- A wait's time starts now; another step keeps a later start it already has (a retry
    -- backoff or a delayed start that a pause and resume sent back through pending).
    scheduled_at = CASE
        WHEN j.skip OR s.wait_for IS NOT NULL
            THEN now() + %(shift)s::interval
                 + CASE WHEN j.skip THEN interval '0' ELSE s.wait_for END
        ELSE greatest(s.scheduled_at, now() + %(shift)s::interval) END,
    completed_at = CASE WHEN j.skip THEN now() + %(shift)s::interval ELSE s.completed_at END,
    output = CASE WHEN j.skip THEN NULL ELSE s.output END,
    error_kind = CASE WHEN j.skip THEN 'skipped' ELSE s.error_kind END
FROM judged AS j
WHERE s.id = j.id
RETURNING s.id, s.run_id, s.node, s.kind, s.state, s.queue, s.fan_out_parallel,
          s.child_workflow, j.skip AS skipped

-- name: activate_ready
-- Activate the given pending nodes whose dependencies all completed (activate_candidates).
-- Their steps are probed by (run_id, node) (OFFSET 0 keeps the probe from being
-- flattened), then locked by id: as a join, a bulk submit's activation of its runs' roots
-- (thousands of pairs, no statistics yet) scanned every step once per pair.
WITH candidates(run_id, node) AS (
    SELECT * FROM unnest(%(run_ids)b::bigint[], %(nodes)b::text[])
), probed AS (
    SELECT p.id
    FROM candidates AS c
    CROSS JOIN LATERAL (
        SELECT s.id FROM cyclone_steps AS s
        WHERE s.run_id = c.run_id AND s.node = c.node
        OFFSET 0
    ) AS p
), ready AS (
    SELECT s.id, s.run_id, s.node
    FROM cyclone_steps AS s
    WHERE s.id = ANY(ARRAY(SELECT id FROM probed)) AND {{ready_conditions}}
    ORDER BY s.id
    FOR NO KEY UPDATE OF s
), {{activate_candidates}}

-- name: activate_dependents
-- Activate the direct dependents of the given completed nodes that are now ready
-- (activate_candidates): finding them and activating them is one round trip. The LATERAL
-- probe (OFFSET 0 keeps it from being flattened into a join) reads idx_deps_depnode per
-- completed node; a join was planned as a scan of every edge.
WITH candidates(run_id, node) AS (
    SELECT DISTINCT d.run_id, d.node
    FROM unnest(%(run_ids)b::bigint[], %(nodes)b::text[]) AS c(run_id, node)
    CROSS JOIN LATERAL (
        SELECT e.run_id, e.node FROM cyclone_deps AS e
        WHERE e.run_id = c.run_id AND e.dep_node = c.node
        OFFSET 0
    ) AS d
), ready AS (
    -- A join: a batch's worth of candidates (the bulk form is activate_ready's).
    SELECT s.id, s.run_id, s.node
    FROM candidates AS c
    JOIN cyclone_steps AS s ON s.run_id = c.run_id AND s.node = c.node
    WHERE {{ready_conditions}}
    ORDER BY s.id
    FOR NO KEY UPDATE OF s
), {{activate_candidates}}

-- fragment: ended_run
-- What the statements that end runs return of each (r): run_limited, whether it was under a
-- workflow limit (its end frees a run slot), is a scalar subquery probed per run: written
-- as EXISTS it was hashed from a scan of every gate.
r.id, r.parent_run_id, r.parent_node_id, r.workflow, r.created_at, r.finished_at,
(SELECT true FROM cyclone_ext_gates AS g
 WHERE g.run_id = r.id AND g.run_scope IS NOT NULL LIMIT 1) IS NOT NULL AS run_limited

-- name: finish_runs
-- Complete the runs whose every step is terminal. The state guard is written as a CASE so
-- that no index on state can drive the plan: with stale statistics (a burst of new runs on
-- a large table) PostgreSQL would otherwise scan every running run for each call, instead
-- of looking the given ids up by primary key.
UPDATE cyclone_runs AS r
SET state = 'completed', finished_at = now() + %(shift)s::interval, updated_at = now()
-- = ANY: a primary-key lookup; a join with unnest() was planned as a scan of every run.
WHERE r.id = ANY(%(run_ids)b::bigint[])
  AND CASE WHEN r.state IN ('running', 'paused') THEN true ELSE false END
  -- A scalar subquery, probed per run through (run_id, node): written as NOT EXISTS it
  -- became an anti-join that scanned every open step of every run.
  AND (SELECT 1 FROM cyclone_steps AS s
       WHERE s.run_id = r.id AND s.state NOT IN ('completed', 'discarded', 'cancelled')
       LIMIT 1) IS NULL
RETURNING {{ended_run}}

-- name: end_runs
-- Fail or cancel runs that are not terminal yet. A cancel or failure ends descendants in
-- later statements, which see child runs created since its transaction began: they never
-- end, or are updated, before they were created.
UPDATE cyclone_runs AS r
SET state = %(state)s,
    finished_at = greatest(now() + %(shift)s::interval, r.created_at),
    updated_at = greatest(now(), r.created_at)
WHERE r.id = ANY(%(run_ids)b::bigint[])
  AND CASE WHEN r.state IN ('running', 'paused') THEN true ELSE false END
RETURNING {{ended_run}}

-- name: cancel_open_steps
-- Cancel every non-terminal step of these runs (a late completion is then fenced). As in
-- end_runs, a step made since the transaction began (a child run's) is not stamped as
-- completed before it was created.
WITH listed AS (
    SELECT s.id, s.state FROM cyclone_steps AS s
    WHERE s.run_id = ANY(%(run_ids)b::bigint[])
      AND s.state NOT IN ('completed', 'discarded', 'cancelled')
    ORDER BY s.id
    FOR NO KEY UPDATE
)
UPDATE cyclone_steps AS s
SET state = 'cancelled', completed_at = greatest(now() + %(shift)s::interval, s.created_at),
    -- The error describes the execution the row holds: a running one is what the cancel
    -- stopped (not the attempt before it, which is in the attempt history); a step waiting
    -- for its next attempt keeps its last one's (list_runs finds either). lease_owner
    -- stays, as a completion keeps it: the worker of the execution the cancel stopped.
    error = CASE WHEN s.state = 'running' THEN %(error)s ELSE coalesce(s.error, %(error)s) END,
    error_kind = CASE WHEN s.state = 'running' THEN %(error_kind)s
                      ELSE coalesce(s.error_kind, %(error_kind)s) END,
    panic_stack = CASE WHEN s.state = 'running' THEN NULL ELSE s.panic_stack END,
    lease_expiry = NULL
FROM unnest(%(run_ids)b::bigint[]) AS t(run_id)
WHERE s.id = ANY(ARRAY(SELECT id FROM listed))  -- locked in id order above
  AND s.run_id = t.run_id
  AND s.state NOT IN ('completed', 'discarded', 'cancelled')
RETURNING s.id, s.run_id, s.node, s.kind, s.queue, s.sequence_key,
          s.id = ANY(ARRAY(SELECT id FROM listed WHERE state = 'running')) AS was_running

-- name: cancel_downstream
-- Cancel the whole downstream branch of the given nodes of one run.
WITH RECURSIVE down(node) AS (
    SELECT d.node FROM cyclone_deps AS d
    WHERE d.run_id = %(run_id)s AND d.dep_node = ANY(%(nodes)b::text[])
    UNION
    SELECT d.node FROM cyclone_deps AS d JOIN down ON d.dep_node = down.node
    WHERE d.run_id = %(run_id)s
), running_before AS (
    -- Read in the statement's snapshot: the states before the update below.
    SELECT s.id FROM cyclone_steps AS s, down
    WHERE s.run_id = %(run_id)s AND (s.node = down.node OR s.item_of = down.node)
      AND s.state = 'running'
)
UPDATE cyclone_steps AS s
SET state = 'cancelled', completed_at = now() + %(shift)s::interval,
    error = %(error)s, error_kind = 'dep_failed', lease_expiry = NULL  -- lease_owner kept
FROM down
WHERE s.run_id = %(run_id)s AND (s.node = down.node OR s.item_of = down.node)
  AND s.state NOT IN ('completed', 'discarded', 'cancelled')
RETURNING s.id, s.node, s.kind, s.queue, s.id IN (SELECT id FROM running_before) AS was_running

-- name: queues_next_in_sequences
-- The queue of the next step of each of these sequence keys (available, first in
-- (scheduled_at, id) order, through idx_steps_sequence): a step of the key stopped running
-- or left the key's order, which frees the next one with no write of its own.
SELECT DISTINCT n.queue
FROM unnest(%(keys)b::text[]) AS k(sequence_key)
CROSS JOIN LATERAL (
    SELECT s.queue FROM cyclone_steps AS s
    WHERE s.sequence_key = k.sequence_key AND s.state = 'available'
    ORDER BY s.scheduled_at, s.id
    LIMIT 1
) AS n
