-- name: purge_runs
-- Delete a batch of terminal runs that ended before the cutoff (cascades to their rows).
-- A child run is kept while its parent exists and has not completed. Only ids up to
-- up_to, when given (a purge ends, however many runs end meanwhile).
WITH doomed AS (
    SELECT r.id FROM cyclone_runs AS r
    WHERE r.state = ANY(%(states)b::text[])
      AND r.finished_at < now() + %(shift)s::interval - %(older_than)s::interval
      AND r.id <= coalesce(%(up_to)s::bigint, r.id)
      AND NOT EXISTS (SELECT 1 FROM cyclone_runs AS p
                      WHERE p.id = r.parent_run_id AND p.state <> 'completed')
    ORDER BY r.id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
DELETE FROM cyclone_runs AS r USING doomed WHERE r.id = doomed.id
RETURNING r.id

-- name: purge_left
-- Whether a run purge_runs would take is still there: a batch skips the runs another
-- transaction holds (a retry or a signal of them, the batch of another purge).
SELECT EXISTS (
    SELECT 1 FROM cyclone_runs AS r
    WHERE r.state = ANY(%(states)b::text[])
      AND r.finished_at < now() + %(shift)s::interval - %(older_than)s::interval
      AND r.id <= %(up_to)s::bigint
      AND NOT EXISTS (SELECT 1 FROM cyclone_runs AS p
                      WHERE p.id = r.parent_run_id AND p.state <> 'completed')
) AS left_over

-- name: expire_runs
-- Delete a batch of terminal runs past their retention (the longest step override,
-- else the default). A child run is kept while its parent exists and has not completed.
-- Intervals are compared, not timestamps (see timed_out_steps).
WITH doomed AS (
    SELECT r.id FROM cyclone_runs AS r
    WHERE r.state IN ('completed', 'failed', 'cancelled')
      AND now() + %(shift)s::interval - r.finished_at > coalesce(
            (SELECT max(s.retention) FROM cyclone_steps AS s WHERE s.run_id = r.id),
            %(default_retention)s::interval)
      AND NOT EXISTS (SELECT 1 FROM cyclone_runs AS p
                      WHERE p.id = r.parent_run_id AND p.state <> 'completed')
    ORDER BY r.id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
DELETE FROM cyclone_runs AS r USING doomed WHERE r.id = doomed.id
RETURNING r.id

-- fragment: recent_retention_look
-- The retention pass's mark m is recent: set within the last %(retention_every)s by
-- the database clock (a mark ahead of now, the clock moved back, is not recent).
m.pass = 'retention'
AND m.marked_at > now() + %(shift)s::interval - %(retention_every)s::interval
AND m.marked_at <= now() + %(shift)s::interval

-- name: take_retention_look
-- Take the retention pass of this moment for this scanner, unless any scanner took it
-- less than %(retention_every)s ago: a row comes back only when the mark moved. A
-- scanner that finds the row locked waits for that transaction, then sees its mark as
-- recent.
INSERT INTO cyclone_ext_scan_marks AS m (pass, marked_at)
VALUES ('retention', now() + %(shift)s::interval)
ON CONFLICT (pass) DO UPDATE SET marked_at = EXCLUDED.marked_at
WHERE NOT ({{recent_retention_look}})
RETURNING m.marked_at

-- fragment: open_steps_of_open_runs
-- FROM and WHERE: each open step s of an open run r. A step is open only while its run is,
-- so the open steps are found through the open runs (idx_runs_state_id), each run's probed
-- by key (OFFSET 0 keeps it so): the cost follows the work in flight, never the ended
-- steps a retention of days keeps by the million. (A join let the planner hash a scan of
-- every step with 10,000 runs open beside 1,000,000 ended: 163 ms, against 19-46 probed.)
FROM cyclone_runs AS r
CROSS JOIN LATERAL (
    SELECT s.run_id, s.queue, s.kind, s.state, s.scheduled_at, s.lease_expiry
    FROM cyclone_steps AS s
    WHERE s.run_id = r.id AND s.state NOT IN ('completed', 'discarded', 'cancelled')
    OFFSET 0
) AS s
WHERE r.state IN ('running', 'paused')

-- fragment: oldest_available_and_expired_leases
-- Two columns of the stats over open steps s: the age of the oldest available one (as
-- the views have it: a step not due yet counts, with a negative age), and the running
-- ones whose lease expired.
extract(epoch FROM now() + %(shift)s::interval
                   - min(s.scheduled_at) FILTER (WHERE s.state = 'available')
)::float8 AS oldest_available_s,
count(*) FILTER (WHERE s.state = 'running'
                   AND s.lease_expiry < now() + %(shift)s::interval) AS expired_leases

-- name: queue_stats
-- Per-queue counts of the open steps, as the view cyclone_v_queues has them, through the
-- open runs (the view's filter has no index: it walked every step). An open dashboard page
-- reads this every 2 s.
SELECT s.queue,
       count(*) FILTER (WHERE s.state = 'available') AS available,
       count(*) FILTER (WHERE s.state = 'running') AS running,
       count(*) FILTER (WHERE s.state NOT IN ('available', 'running')) AS waiting,
       {{oldest_available_and_expired_leases}}
{{open_steps_of_open_runs}}
GROUP BY s.queue
ORDER BY s.queue

-- name: kind_stats
-- Per-kind and state counts of the open steps, as the view cyclone_v_kinds has them,
-- through the open runs (see queue_stats).
SELECT s.kind, s.state, count(*) AS count,
       {{oldest_available_and_expired_leases}}
{{open_steps_of_open_runs}}
GROUP BY s.kind, s.state
ORDER BY s.kind, s.state

-- name: count_purgeable
-- How many runs a purge with these states and cutoff would delete now (a dry run): those
-- purge_runs takes, and the child runs it then takes once their parent is deleted.
WITH RECURSIVE doomed AS (
    SELECT r.id FROM cyclone_runs AS r
    WHERE r.state = ANY(%(states)b::text[])
      AND r.finished_at < now() + %(shift)s::interval - %(older_than)s::interval
      AND NOT EXISTS (SELECT 1 FROM cyclone_runs AS p
                      WHERE p.id = r.parent_run_id AND p.state <> 'completed')
    UNION
    SELECT c.id FROM doomed AS d
    JOIN cyclone_runs AS c ON c.parent_run_id = d.id
    WHERE c.state = ANY(%(states)b::text[])
      AND c.finished_at < now() + %(shift)s::interval - %(older_than)s::interval
)
SELECT count(*) AS runs FROM doomed
