-- name: insert_run_graph
-- Insert a run with its whole graph (steps, deps, input bindings) in one statement. The steps
-- may come as the definition's template: a step whose input is the run input, or an object
-- with the run input under some keys, gets it here (as insert_run_graphs does).
WITH run AS (
    INSERT INTO cyclone_runs (workflow, def_version, input, state, deadline_at, result_node,
                              submit_key, has_fan_out, parent_run_id, parent_node_id)
    -- No input (JSON null) is stored as SQL NULL, as insert_run_graphs stores it. (In a
    -- caller's transaction open for a while, %(shift)s holds its age: times count from
    -- the submit, not from the transaction's start.)
    VALUES (%(workflow)s, %(def_version)s, nullif(%(input)s::jsonb, 'null'::jsonb), 'running',
            now() + %(shift)s::interval + %(deadline)s::interval,
            %(result_node)s, %(submit_key)s, %(has_fan_out)s, %(parent_run_id)s, %(parent_node_id)s)
    RETURNING id, input
), steps AS (
    INSERT INTO cyclone_steps (run_id, node, kind, state, input, input_from, queue, priority,
                               max_attempts, scheduled_at, timeout, signal_name, signal_names,
                               wait_for, wait_count, on_dep_failure, fan_out_parallel,
                               fan_out_max_bytes, child_workflow, child_needs_result, retention,
                               unique_key, sequence_key)
    SELECT run.id, s.node, s.kind, s.state,
           CASE
               -- JSON null as SQL NULL, as jsonb_to_recordset reads a step's null input
               WHEN s.input_is_run_input THEN nullif(run.input, 'null'::jsonb)
               WHEN s.run_input_keys IS NOT NULL THEN
                   coalesce(s.input, '{}'::jsonb)
                   || (SELECT jsonb_object_agg(k, coalesce(run.input, 'null'::jsonb))
                       FROM unnest(s.run_input_keys) AS k)
               ELSE s.input
           END,
           s.input_from, s.queue, s.priority, s.max_attempts,
           coalesce(%(scheduled_at)s::timestamptz, now() + %(shift)s::interval),
           make_interval(secs => s.timeout_s), s.signal_name, s.signal_names,
           make_interval(secs => s.wait_for_s), s.wait_count, s.on_dep_failure, s.fan_out_parallel,
           s.fan_out_max_bytes, s.child_workflow, s.child_needs_result,
           make_interval(secs => s.retention_s), %(unique_key)s, %(sequence_key)s
    FROM run, jsonb_to_recordset(%(steps)s::jsonb) AS s(
        node text, kind text, state text, input jsonb, input_from text, queue text,
        priority int, max_attempts int, timeout_s float8, signal_name text, signal_names text[],
        wait_for_s float8, wait_count int, on_dep_failure text, fan_out_parallel int,
        fan_out_max_bytes bigint, child_workflow text, child_needs_result bool,
        retention_s float8, input_is_run_input bool, run_input_keys text[])
), deps AS (
    INSERT INTO cyclone_deps (run_id, node, dep_node, dep_type)
    SELECT run.id, d.node, d.dep_node, d.dep_type
    FROM run, jsonb_to_recordset(%(deps)s::jsonb) AS d(node text, dep_node text, dep_type text)
), inputs AS (
    INSERT INTO cyclone_step_inputs (run_id, node, slot, dep_node, assembly_mode)
    SELECT run.id, i.node, i.slot, i.dep_node, i.assembly_mode
    FROM run, jsonb_to_recordset(%(inputs)s::jsonb)
        AS i(node text, slot int, dep_node text, assembly_mode text)
)
-- The data-modifying WITH parts run whether or not they are read.
SELECT run.id AS run_id,
       (SELECT count(pg_notify('cyclone_work', q))
        FROM unnest(%(wake)b::text[]) AS q) AS woken
FROM run

-- name: find_run_by_submit_key
-- The run holding a submit key, in any state.
SELECT id AS run_id FROM cyclone_runs WHERE workflow = %(workflow)s AND submit_key = %(submit_key)s

-- name: find_active_unique
-- The active standalone step holding (kind, unique_key), if any.
SELECT run_id FROM cyclone_steps
WHERE kind = %(kind)s AND unique_key = %(unique_key)s
  AND state IN ('pending', 'available', 'running', 'waiting_signal', 'waiting_timer', 'paused')

-- name: notify_queues
-- Wake idle workers of these queues (the payload is only the queue name).
SELECT pg_notify('cyclone_work', q) FROM unnest(%(queues)b::text[]) AS q

-- name: notify_runs_finished
-- Wake RunHandle.wait() callers: one notification per batch of run ids, comma-separated.
SELECT pg_notify('cyclone_run_done', p) FROM unnest(%(payloads)b::text[]) AS p

-- name: notify_steps_cancelled
-- Tell workers that running steps of these runs were cancelled (comma-separated run ids):
-- each checks its leases of those runs at once instead of at its next heartbeat.
SELECT pg_notify('cyclone_cancel', p) FROM unnest(%(payloads)b::text[]) AS p

-- name: ping
-- A round trip that shows a dead connection.
SELECT 1 AS ok

-- name: insert_run_graphs
-- Insert many runs of one graph in one statement; their ids come back in the inputs' order.
-- The graph's rows come once, as a template, and are multiplied here by the runs.
WITH r AS MATERIALIZED (
    SELECT nextval((SELECT pg_get_serial_sequence('cyclone_runs', 'id'))::regclass) AS id,
           nullif(t.input::jsonb, 'null'::jsonb) AS input, t.ord
    FROM unnest(%(run_inputs)b::text[]) WITH ORDINALITY AS t(input, ord)
), runs AS (
    INSERT INTO cyclone_runs (id, workflow, def_version, input, state, deadline_at, result_node,
                              has_fan_out)
    SELECT r.id, %(workflow)s, %(def_version)s, r.input, 'running',
           now() + %(shift)s::interval + %(deadline)s::interval, %(result_node)s, %(has_fan_out)s
    FROM r
), template AS MATERIALIZED (
    SELECT *
    FROM jsonb_to_recordset(%(steps)s::jsonb) AS s(
        node text, kind text, state text, input jsonb, input_from text, queue text,
        priority int, max_attempts int, timeout_s float8, signal_name text, signal_names text[],
        wait_for_s float8, wait_count int, on_dep_failure text, fan_out_parallel int,
        fan_out_max_bytes bigint, child_workflow text, child_needs_result bool,
        retention_s float8, input_is_run_input bool, run_input_keys text[])
), steps AS (
    INSERT INTO cyclone_steps (run_id, node, kind, state, input, input_from, queue, priority,
                               max_attempts, scheduled_at, timeout, signal_name, signal_names,
                               wait_for, wait_count, on_dep_failure, fan_out_parallel,
                               fan_out_max_bytes, child_workflow, child_needs_result, retention)
    SELECT r.id, s.node, s.kind, s.state,
           CASE
               WHEN s.input_is_run_input THEN r.input
               WHEN s.run_input_keys IS NOT NULL THEN
                   coalesce(s.input, '{}'::jsonb)
                   || (SELECT jsonb_object_agg(k, coalesce(r.input, 'null'::jsonb))
                       FROM unnest(s.run_input_keys) AS k)
               ELSE s.input
           END,
           s.input_from, s.queue, s.priority, s.max_attempts,
           coalesce(%(scheduled_at)s::timestamptz, now() + %(shift)s::interval),
           make_interval(secs => s.timeout_s), s.signal_name, s.signal_names,
           make_interval(secs => s.wait_for_s), s.wait_count, s.on_dep_failure, s.fan_out_parallel,
           s.fan_out_max_bytes, s.child_workflow, s.child_needs_result,
           make_interval(secs => s.retention_s)
    FROM r CROSS JOIN template AS s
), deps AS (
    INSERT INTO cyclone_deps (run_id, node, dep_node, dep_type)
    SELECT r.id, d.node, d.dep_node, d.dep_type
    FROM r CROSS JOIN jsonb_to_recordset(%(deps)s::jsonb)
        AS d(node text, dep_node text, dep_type text)
), inputs AS (
    INSERT INTO cyclone_step_inputs (run_id, node, slot, dep_node, assembly_mode)
    SELECT r.id, i.node, i.slot, i.dep_node, i.assembly_mode
    FROM r CROSS JOIN jsonb_to_recordset(%(inputs)s::jsonb)
        AS i(node text, slot int, dep_node text, assembly_mode text)
)
-- The data-modifying WITH parts run whether or not they are read.
SELECT (SELECT array_agg(id ORDER BY ord) FROM r) AS ids,
       (SELECT count(pg_notify('cyclone_work', q))
        FROM unnest(%(wake)b::text[]) AS q) AS woken

-- name: insert_fan_out_limits
-- Record the max_items guard of fan-out nodes that set one (extension track).
INSERT INTO cyclone_ext_fan_out_limits (run_id, node, max_items)
SELECT * FROM unnest(%(run_ids)b::bigint[], %(nodes)b::text[], %(max_items)b::int[])

-- name: record_guards
-- The nodes a conditional definition's activations judge (extension track): written by
-- every submit of the definition, the same rows each time.
INSERT INTO cyclone_ext_guards (def_version, node, condition, variables, sources, on_skip)
SELECT %(def_version)s, g.node, g.condition::jsonpath, g.variables, g.sources, g.on_skip
FROM jsonb_to_recordset(%(guards)s::jsonb)
    AS g(node text, condition text, variables jsonb, sources text[], on_skip text)
ON CONFLICT (def_version, node) DO NOTHING

-- name: transaction_isolation
-- The isolation level of the current transaction ('read committed', 'repeatable read',
-- 'serializable').
SELECT current_setting('transaction_isolation') AS level
