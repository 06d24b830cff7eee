-- name: database_gauges
-- The database-wide gauges of /metrics in one statement: open steps per queue and state
-- (with the age of each queue's oldest due available step), open runs per state, and the
-- runs waiting on a signal, a timer or a child run. Open steps are found through the open
-- runs, each run's probed by key (see open_steps_of_open_runs): a join let the planner
-- hash a scan of every step, the history of ended steps included.
WITH open_runs AS MATERIALIZED (
    SELECT r.id, r.state FROM cyclone_runs AS r WHERE r.state IN ('running', 'paused')
), open_steps AS MATERIALIZED (
    SELECT s.run_id, s.queue, s.state, s.scheduled_at
    {{open_steps_of_open_runs}}
)
SELECT 'steps' AS gauge, o.queue, o.state, count(*)::bigint AS value,
       extract(epoch FROM now() + %(shift)s::interval - min(o.scheduled_at) FILTER (
           WHERE o.state = 'available' AND o.scheduled_at <= now() + %(shift)s::interval
       ))::float8 AS oldest_s
FROM open_steps AS o GROUP BY o.queue, o.state
UNION ALL
SELECT 'runs', NULL, r.state, count(*)::bigint, NULL FROM open_runs AS r GROUP BY r.state
UNION ALL
SELECT 'waiting_runs', NULL, NULL, count(DISTINCT o.run_id)::bigint, NULL FROM open_steps AS o
WHERE o.state IN ('waiting_signal', 'waiting_timer', 'waiting_child')
