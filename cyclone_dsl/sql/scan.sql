-- name: expired_leases
-- Running steps whose lease expired (a page, oldest first, after the cursor id), but for a
-- step whose timeout (and its grace) passed before its lease expired: that came first, and
-- the timeouts pass fails it, as a prompt scanner would have.
SELECT s.id, s.run_id, s.lease_generation, s.kind
FROM cyclone_steps AS s
WHERE {{expired_lease}} AND s.id > %(after_id)s
ORDER BY s.id
LIMIT %(limit)s

-- fragment: expired_lease
-- A step s of the expired_leases pass (scan_probe looks for one).
s.state = 'running' AND s.lease_expiry < now() + %(shift)s::interval
AND NOT coalesce(s.lease_expiry - s.started_at > s.timeout + %(grace)s::interval, false)

-- name: reclaim_steps
-- Take expired leases back (guarded by state, generation and expiry): available, or discarded
-- with reclaim_limit once a step has been reclaimed more than its kind allows. Each reclaim
-- is kept in the attempt history (the execution it ended, and the worker that held it).
WITH {{lock_listed_steps}},
held AS MATERIALIZED (
    -- The leases held by an open transaction rather than by heartbeats (see hold_lease).
    SELECT l.objid FROM pg_locks AS l
    WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND l.granted
      AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
      AND l.classid = hashtext('cyclone.lease:' || current_schema())::oid
),
reclaimed AS (
    UPDATE cyclone_steps AS s
    SET reclaims = s.reclaims + 1,
        state = CASE
            WHEN s.reclaims + 1 > coalesce(l.max_reclaims, %(default_max_reclaims)s)
                THEN 'discarded'
            WHEN r.state = 'paused' THEN 'paused'
            ELSE 'available' END,
        error = CASE
            WHEN s.reclaims + 1 > coalesce(l.max_reclaims, %(default_max_reclaims)s)
                THEN 'the lease expired ' || (s.reclaims + 1) || ' times: the worker running '
                     || 'it crashed or stalled each time (max_reclaims reached)'
            ELSE s.error END,
        error_kind = CASE
            WHEN s.reclaims + 1 > coalesce(l.max_reclaims, %(default_max_reclaims)s)
                THEN 'reclaim_limit'
            ELSE s.error_kind END,
        completed_at = CASE
            WHEN s.reclaims + 1 > coalesce(l.max_reclaims, %(default_max_reclaims)s)
                THEN now() + %(shift)s::interval END,
        lease_owner = NULL, lease_expiry = NULL  -- scheduled_at kept: its place in its sequence
    FROM unnest(%(ids)b::bigint[], %(generations)b::bigint[]) AS e(id, generation)
    JOIN cyclone_steps AS cur ON cur.id = e.id
    JOIN cyclone_runs AS r ON r.id = cur.run_id
    LEFT JOIN unnest(%(kinds)b::text[], %(limits)b::int[]) AS l(kind, max_reclaims)
        ON l.kind = cur.kind
    WHERE s.id = ANY(ARRAY(SELECT id FROM listed))  -- locked in id order above
      AND s.id = e.id AND s.lease_generation = e.generation AND s.state = 'running'
      AND s.lease_expiry < now() + %(shift)s::interval
      AND NOT EXISTS (SELECT 1 FROM held WHERE held.objid = (s.id & 2147483647)::int::oid)
    -- cur is read in the statement's snapshot: the lease owner before this update
    RETURNING s.id, s.run_id, s.node, s.kind, s.state, s.queue, s.item_of, s.error, s.attempt,
              s.started_at, s.sequence_key, cur.lease_owner AS worker,
              -- for the span of the lost attempt (tracing)
              s.item_index, s.max_attempts, r.workflow, r.def_version
), history AS (
    INSERT INTO cyclone_ext_attempts (step_id, run_id, attempt, worker, started_at, ended_at,
                                      outcome, error, error_kind)
    SELECT id, run_id, attempt + 1, worker, started_at, now() + %(shift)s::interval,
           'reclaimed', 'the lease expired: its worker crashed, stalled or lost the database',
           'reclaimed'
    FROM reclaimed
)
SELECT id, run_id, node, kind, state, queue, item_of, error, attempt, started_at, worker,
       sequence_key, item_index, max_attempts, workflow, def_version
FROM reclaimed

-- name: timed_out_steps
-- Running steps past their own timeout plus a grace (the worker enforces it first).
-- Intervals are compared, not timestamps: started_at + timeout overflows for a timeout
-- past the last timestamp (a row another implementation wrote), and would fail the pass.
SELECT s.id, s.run_id, s.lease_generation, s.attempt, s.queue
FROM cyclone_steps AS s
WHERE {{timed_out_step}} AND s.id > %(after_id)s
ORDER BY s.id
LIMIT %(limit)s

-- fragment: timed_out_step
-- A step s of the timed_out_steps pass (scan_probe looks for one).
s.state = 'running' AND s.timeout IS NOT NULL
AND now() + %(shift)s::interval - s.started_at > s.timeout + %(grace)s::interval

-- name: scan_probe
-- Which scanner passes have anything to do, in one statement without locks: each column is
-- the condition of its pass's page query (the same fragments), or, for gates, a live gate
-- whose step has ended. The scanner runs only the passes found, and every pass now and
-- then whatever this says. Retention has work when its last look (any scanner's) is not
-- recent; the due pass is not probed.
SELECT
    EXISTS (SELECT 1 FROM cyclone_steps AS s WHERE {{expired_lease}}) AS leases,
    EXISTS (SELECT 1 FROM cyclone_steps AS s WHERE {{timed_out_step}}) AS timeouts,
    EXISTS (SELECT 1 FROM cyclone_steps AS s JOIN cyclone_runs AS r ON r.id = s.run_id
            WHERE {{due_timer}}) AS timers,
    EXISTS (SELECT 1 FROM cyclone_steps AS s JOIN cyclone_runs AS r ON r.id = s.run_id
            WHERE {{expired_signal_wait}}) AS signal_timeouts,
    EXISTS (SELECT 1 FROM cyclone_runs AS r WHERE {{expired_deadline}}) AS deadlines,
    EXISTS (SELECT 1 FROM cyclone_steps AS s
            JOIN cyclone_runs AS c ON c.parent_run_id = s.run_id AND c.parent_node_id = s.node
            WHERE {{ended_child_of_waiting_node}}) AS children,
    -- From the live gates to their steps by key (OFFSET 0 keeps it so): never a scan of
    -- the ended steps, which are most of cyclone_steps.
    EXISTS (SELECT 1 FROM cyclone_ext_gates AS g
            CROSS JOIN LATERAL (SELECT s.state FROM cyclone_steps AS s WHERE s.id = g.step_id
                                OFFSET 0) AS s
            WHERE g.queue <> '' AND {{ended_gate_step}}) AS gates,
    EXISTS (SELECT 1 FROM cyclone_schedules WHERE {{due_schedule}}) AS schedules,
    NOT EXISTS (SELECT 1 FROM cyclone_ext_scan_marks AS m
                WHERE {{recent_retention_look}}) AS retention

-- name: try_scan_leader
-- Only one scanner pass per schema at a time (transaction-level advisory lock).
SELECT pg_try_advisory_xact_lock(%(namespace)s, hashtext(current_schema() || %(scanner)s))
    AS leader

-- name: wake_due_steps
-- The queues of available steps that came due since the last due pass (of any scanner),
-- whose mark is moved to now. The window starts a second before the last mark: a step
-- whose transaction committed after that pass read, with a time inside its window, is
-- still seen. With no mark yet (the first pass ever), it is all the past; with one ahead
-- of now (the clock was moved back), the last minute. The (queue, priority) pairs of available steps are walked through
-- idx_steps_claim (a loose index scan), each probed once for a step due in the window.
WITH RECURSIVE moved AS (
    INSERT INTO cyclone_ext_due_wakes AS d (id, woken_until)
    VALUES (true, now() + %(shift)s::interval)
    ON CONFLICT (id) DO UPDATE SET woken_until = EXCLUDED.woken_until
    RETURNING d.woken_until AS until
), span AS (  -- one row; the scalar subquery reads the mark as it was before the move
    SELECT m.until,
           CASE WHEN o.last IS NULL THEN '-infinity'::timestamptz
                WHEN o.last > m.until THEN m.until - interval '1 minute'
                ELSE o.last - interval '1 second' END AS since
    FROM moved AS m
    CROSS JOIN (SELECT (SELECT d.woken_until FROM cyclone_ext_due_wakes AS d WHERE d.id)
                AS last) AS o
), pairs (queue, priority) AS (
    (SELECT s.queue, s.priority FROM cyclone_steps AS s WHERE s.state = 'available'
     ORDER BY s.queue, s.priority DESC LIMIT 1)
    UNION ALL
    SELECT n.queue, n.priority
    FROM pairs AS p
    CROSS JOIN LATERAL (
        (SELECT s.queue, s.priority FROM cyclone_steps AS s
         WHERE s.state = 'available' AND s.queue = p.queue AND s.priority < p.priority
         ORDER BY s.queue, s.priority DESC LIMIT 1)
        UNION ALL
        (SELECT s.queue, s.priority FROM cyclone_steps AS s
         WHERE s.state = 'available' AND s.queue > p.queue
         ORDER BY s.queue, s.priority DESC LIMIT 1)
        LIMIT 1
    ) AS n
)
SELECT DISTINCT p.queue
FROM pairs AS p, span AS w
WHERE (SELECT true FROM cyclone_steps AS s  -- a probe per pair (LIMIT: never a hash join)
       WHERE s.state = 'available' AND s.queue = p.queue AND s.priority = p.priority
         AND s.scheduled_at > w.since AND s.scheduled_at <= w.until
       LIMIT 1)
