-- name: run_tree
-- A run and all its descendant runs (child runs, grandchildren, ...).
WITH RECURSIVE {{runs_below}}
SELECT id FROM down

-- fragment: runs_below
-- CTE down(id): run %(run_id)s and every run below it, by a probe of the parent index per
-- run (LATERAL, OFFSET 0): as a join, the planner hashed every run of a table without
-- statistics, on each operation on a run.
down(id) AS (
    SELECT %(run_id)s::bigint
    UNION
    SELECT c.id
    FROM down
    CROSS JOIN LATERAL (
        SELECT k.id FROM cyclone_runs AS k WHERE k.parent_run_id = down.id OFFSET 0
    ) AS c
)

-- name: get_run_state
-- A run's state (no lock).
SELECT id, state FROM cyclone_runs WHERE id = %(run_id)s

-- name: get_run_states
-- The states of these runs (no lock): what a client's waits are waiting for.
SELECT id, state FROM cyclone_runs WHERE id = ANY(%(run_ids)b::bigint[])

-- name: node_state
-- One node of a run, and the fan-out node of an item task.
SELECT id, state, error_kind, item_of FROM cyclone_steps
WHERE run_id = %(run_id)s AND node = %(node)s

-- name: retry_run
-- What an operator retry checks on a run (locked by the caller): state, deadline, parent.
SELECT r.id, r.state, r.parent_run_id, r.parent_node_id, {{retry_past_deadline}}
FROM cyclone_runs AS r
WHERE r.id = %(run_id)s

-- fragment: retry_past_deadline
-- Whether a run retried now is past its deadline. The deadline's clock stops while a run is
-- paused: a run that ended while paused (it keeps its paused_at) is judged as if resumed
-- now, its deadline moved forward by the pause (what retry_reopen_run writes), which is to
-- judge it at its pause.
coalesce(r.deadline_at <= coalesce(r.paused_at, now() + %(shift)s::interval), false)
    AS past_deadline

-- name: retry_child_runs
-- The child runs of some child nodes of a run, with the columns of retry_run.
SELECT r.id, r.state, r.parent_run_id, r.parent_node_id, {{retry_past_deadline}}
FROM cyclone_runs AS r
WHERE r.parent_run_id = %(run_id)s AND r.parent_node_id = ANY(%(nodes)b::text[])
ORDER BY r.id

-- name: retry_steps
-- The graph nodes of a run (item tasks left out), in id order, for an operator retry; a
-- fan-out node tells whether it has items, and whether one of them is still open (a
-- pending fan-out collecting items is under way).
SELECT s.id, s.node, s.kind, s.state, s.on_dep_failure, s.unique_key,
       s.fan_out_parallel IS NOT NULL AND EXISTS (
           SELECT 1 FROM cyclone_steps AS i
           WHERE i.run_id = s.run_id AND i.item_of = s.node) AS has_items,
       s.fan_out_parallel IS NOT NULL AND EXISTS (
           SELECT 1 FROM cyclone_steps AS i
           WHERE i.run_id = s.run_id AND i.item_of = s.node
             AND i.state NOT IN ('completed', 'discarded', 'cancelled')) AS open_items
FROM cyclone_steps AS s
WHERE s.run_id = %(run_id)s AND s.item_of IS NULL
ORDER BY s.id

-- name: retry_deps
-- The dependency edges of a run (node depends on dep_node).
SELECT node, dep_node FROM cyclone_deps WHERE run_id = %(run_id)s ORDER BY node, dep_node

-- fragment: retried_start
-- When a step reset by an operator retry or replay may start: a step that never started
-- keeps a later start it was given (enqueue's scheduled_at); any other starts now (its
-- attempt budget is fresh: no backoff is left to wait).
CASE WHEN s.started_at IS NULL AND s.attempt = 0 AND s.reclaims = 0
     THEN greatest(s.scheduled_at, now() + %(shift)s::interval)
     ELSE now() + %(shift)s::interval END

-- fragment: reset_listed_steps
-- The reset of the steps of CTE listed(id) by an operator retry or replay: back to pending
-- with a fresh attempt budget and reclaim count, no output. lease_generation is kept: it
-- fences stale workers. The execution each step row held is kept in the attempt history
-- (kept_executions): its completion ('replayed'), or the execution a cancel stopped
-- ('cancelled', with its worker and what ended it); a failed execution is there already.
-- before is read in the statement's snapshot: the rows as they were.
reset AS (
    UPDATE cyclone_steps AS s
    SET state = 'pending', attempt = 0, reclaims = 0, error = NULL, error_kind = NULL,
        panic_stack = NULL, output = NULL, started_at = NULL, completed_at = NULL,
        lease_owner = NULL, lease_expiry = NULL, scheduled_at = {{retried_start}}
    FROM cyclone_steps AS before
    WHERE s.id = ANY(ARRAY(SELECT id FROM listed))  -- locked in id order above
      AND before.id = s.id
    RETURNING s.id, s.run_id, s.node, before.state AS was, before.attempt AS attempts,
              before.started_at, before.completed_at, before.lease_owner AS worker,
              before.error, before.error_kind, before.panic_stack
), kept_executions AS (
    INSERT INTO cyclone_ext_attempts (step_id, run_id, attempt, worker, started_at, ended_at,
                                      outcome, error, error_kind, panic_stack)
    SELECT e.id, e.run_id, e.attempts + 1, e.worker, e.started_at,
           coalesce(e.completed_at, now() + %(shift)s::interval),
           CASE e.was WHEN 'completed' THEN 'replayed' WHEN 'cancelled' THEN 'cancelled'
                ELSE 'failed' END,
           CASE WHEN e.was <> 'completed' THEN e.error END,
           CASE WHEN e.was <> 'completed' THEN e.error_kind END,
           CASE WHEN e.was <> 'completed' THEN e.panic_stack END
    FROM reset AS e
    WHERE e.started_at IS NOT NULL AND e.error_kind IS DISTINCT FROM 'skipped'
      AND NOT EXISTS (SELECT 1 FROM cyclone_ext_attempts AS a
                      WHERE a.step_id = e.id AND a.started_at = e.started_at)
)

-- name: retry_reset_steps
-- Operator retry: these discarded or cancelled graph nodes are reset (reset_listed_steps).
WITH listed AS (
    SELECT s.id FROM cyclone_steps AS s
    WHERE s.run_id = %(run_id)s AND s.node = ANY(%(nodes)b::text[]) AND s.item_of IS NULL
      AND s.state IN ('discarded', 'cancelled')
    ORDER BY s.id
    FOR NO KEY UPDATE
), {{reset_listed_steps}}
SELECT node FROM reset

-- name: retry_reset_items
-- Operator retry: the discarded and cancelled items of these fan-out nodes are reset
-- (reset_listed_steps); completed items keep their outputs.
WITH listed AS (
    SELECT s.id FROM cyclone_steps AS s
    WHERE s.run_id = %(run_id)s AND s.item_of = ANY(%(nodes)b::text[])
      AND s.state IN ('discarded', 'cancelled')
    ORDER BY s.id
    FOR NO KEY UPDATE
), {{reset_listed_steps}}
SELECT node FROM reset

-- name: retry_reopen_run
-- Put an ended run (failed, cancelled, or completed with a contained failure) back to
-- running for an operator retry or replay. A run that ended while paused is resumed by
-- it: its deadline moves forward by the length of the pause, as resume_run moves it.
UPDATE cyclone_runs
SET state = 'running', finished_at = NULL, paused_at = NULL, updated_at = now(),
    deadline_at = deadline_at + coalesce(now() + %(shift)s::interval - paused_at, interval '0')
WHERE id = %(run_id)s AND state IN ('completed', 'failed', 'cancelled')
RETURNING id

-- name: replay_reset_steps
-- Operator replay (retry with force): these ended graph nodes are reset
-- (reset_listed_steps), their outputs dropped.
WITH listed AS (
    SELECT s.id FROM cyclone_steps AS s
    WHERE s.run_id = %(run_id)s AND s.node = ANY(%(nodes)b::text[]) AND s.item_of IS NULL
      AND s.state IN ('completed', 'discarded', 'cancelled', 'pending')
    ORDER BY s.id
    FOR NO KEY UPDATE
), {{reset_listed_steps}}
SELECT node FROM reset

-- name: replay_drop_items
-- Operator replay: the item tasks of these fan-out nodes go; the fan-out expands again
-- from its (new) input when it is activated.
DELETE FROM cyclone_steps
WHERE run_id = %(run_id)s AND item_of = ANY(%(nodes)b::text[])
RETURNING id

-- name: fork_source
-- The run a fork starts from, locked against a concurrent change of its steps' outcomes.
SELECT r.id, r.workflow, r.def_version, r.input FROM cyclone_runs AS r
WHERE r.id = %(run_id)s
FOR SHARE

-- name: fork_source_steps
-- The graph nodes of the run a fork starts from (item tasks left out).
SELECT s.node, s.kind, s.state FROM cyclone_steps AS s
WHERE s.run_id = %(run_id)s AND s.item_of IS NULL

-- name: fork_copy
-- A fork's copied nodes take the outputs the source run recorded (inserted completed), and
-- the fork is recorded with where it came from.
WITH src AS (
    SELECT s.node, s.output, s.error_kind FROM cyclone_steps AS s
    WHERE s.run_id = %(source_run_id)s AND s.node = ANY(%(nodes)b::text[])
), copied AS (
    UPDATE cyclone_steps AS s
    SET output = src.output, completed_at = now() + %(shift)s::interval,
        error_kind = CASE WHEN src.error_kind = 'skipped' THEN 'skipped' END
    FROM src
    WHERE s.run_id = %(run_id)s AND s.node = src.node AND s.state = 'completed'
    RETURNING s.node
), recorded AS (
    INSERT INTO cyclone_ext_forks (run_id, source_run_id, from_node, copied)
    VALUES (%(run_id)s, %(source_run_id)s, %(from_node)s, %(nodes)b::text[])
)
SELECT node FROM copied

-- name: fork_of
-- Where a fork came from (no row: the run is not a fork).
SELECT source_run_id, from_node, copied FROM cyclone_ext_forks WHERE run_id = %(run_id)s

-- name: fork_source_run
-- What a client needs to compile a fork of a run: its workflow, definition and input.
SELECT r.workflow, r.def_version, r.input FROM cyclone_runs AS r WHERE r.id = %(run_id)s
