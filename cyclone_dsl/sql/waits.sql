-- name: due_timers
-- Timer waits that are due in running runs (a page after the cursor).
SELECT s.id, s.run_id
FROM cyclone_steps AS s
JOIN cyclone_runs AS r ON r.id = s.run_id
WHERE {{due_timer}} AND s.id > %(after_id)s
ORDER BY s.id
LIMIT %(limit)s

-- fragment: due_timer
-- A step s (of run r) of the due_timers pass (scan_probe looks for one).
s.state = 'waiting_timer' AND s.scheduled_at <= now() + %(shift)s::interval
AND r.state = 'running'

-- name: expired_signal_waits
-- Signal waits whose timeout passed in running runs (a page after the cursor).
SELECT s.id, s.run_id, s.node
FROM cyclone_steps AS s
JOIN cyclone_runs AS r ON r.id = s.run_id
WHERE {{expired_signal_wait}} AND s.id > %(after_id)s
ORDER BY s.id
LIMIT %(limit)s

-- fragment: expired_signal_wait
-- A step s (of run r) of the expired_signal_waits pass (scan_probe looks for one).
s.state = 'waiting_signal' AND s.wait_for IS NOT NULL
AND s.scheduled_at <= now() + %(shift)s::interval AND r.state = 'running'

-- name: due_in_tree
-- Whether a wait came due (and no scanner has applied it) in a run, the runs below it or
-- the runs above it: a look without locks before an operation on the run, which applies
-- what it finds under their locks.
WITH RECURSIVE {{runs_below}}, up(id) AS (
    SELECT (SELECT r.parent_run_id FROM cyclone_runs AS r WHERE r.id = %(run_id)s)
    UNION
    SELECT (SELECT r.parent_run_id FROM cyclone_runs AS r WHERE r.id = up.id)
    FROM up WHERE up.id IS NOT NULL
)
SELECT EXISTS (
    SELECT 1 FROM cyclone_steps AS s
    WHERE s.run_id = ANY(ARRAY(SELECT id FROM down UNION SELECT id FROM up WHERE id IS NOT NULL))
      AND (s.state = 'waiting_timer' OR (s.state = 'waiting_signal' AND s.wait_for IS NOT NULL))
      AND s.scheduled_at <= now() + %(shift)s::interval
) AS due

-- name: due_waits_in_order
-- The due waits of these runs (running) to apply next, in the order they came due: per
-- run, the timers due before its earliest due signal timeout, and that timeout. A timeout
-- can fail the run or cancel a branch, so what came due after it waits for the next round;
-- a timer's firing changes no other wait that is already due.
WITH due AS (
    SELECT s.id, s.run_id, s.state, s.scheduled_at
    FROM cyclone_steps AS s
    WHERE s.run_id = ANY(%(run_ids)b::bigint[])
      AND (s.state = 'waiting_timer' OR (s.state = 'waiting_signal' AND s.wait_for IS NOT NULL))
      AND s.scheduled_at <= now() + %(shift)s::interval
), first_timeout AS (
    SELECT DISTINCT ON (d.run_id) d.run_id, d.id, d.scheduled_at
    FROM due AS d WHERE d.state = 'waiting_signal'
    ORDER BY d.run_id, d.scheduled_at, d.id
)
SELECT d.id, d.state
FROM due AS d
JOIN cyclone_runs AS r ON r.id = d.run_id AND r.state = 'running'
LEFT JOIN first_timeout AS f ON f.run_id = d.run_id
WHERE d.id = f.id
   OR (d.state = 'waiting_timer'
       AND (f.id IS NULL OR (d.scheduled_at, d.id) < (f.scheduled_at, f.id)))
ORDER BY d.id

-- name: fire_timers
-- Complete due timers (guarded: still waiting, still due).
UPDATE cyclone_steps AS s
SET state = 'completed', completed_at = now() + %(shift)s::interval
FROM unnest(%(ids)b::bigint[]) AS t(id)
WHERE s.id = t.id AND s.state = 'waiting_timer'
  AND s.scheduled_at <= now() + %(shift)s::interval
RETURNING s.id, s.run_id, s.node, s.item_of, true AS has_downstream

-- name: time_out_signal_waits
-- Fail signal waits whose timeout passed (guarded: still waiting, still due).
UPDATE cyclone_steps AS s
SET state = 'discarded', completed_at = now() + %(shift)s::interval,
    error = CASE WHEN s.wait_count IS NOT NULL  -- a wait_n: how many of its n arrived
                 THEN 'only ' || coalesce(jsonb_array_length(CASE WHEN jsonb_typeof(s.output) = 'array'
                                                                  THEN s.output END), 0)
                      || ' of ' || s.wait_count || ' signals ' || quote_literal(s.signal_name)
                 ELSE 'no signal ' || coalesce(quote_literal(s.signal_name),
                                               'of ' || array_to_string(s.signal_names, ', '))
            END || ' arrived within ' || s.wait_for::text,
    error_kind = 'signal_timeout'
FROM unnest(%(ids)b::bigint[]) AS t(id)
WHERE s.id = t.id AND s.state = 'waiting_signal'
  AND s.wait_for IS NOT NULL AND s.scheduled_at <= now() + %(shift)s::interval
RETURNING s.id, s.run_id, s.node, s.item_of, s.error

-- name: expired_deadlines
-- Running runs past their deadline (a page after the cursor).
SELECT r.id FROM cyclone_runs AS r
WHERE {{expired_deadline}} AND r.id > %(after_id)s
ORDER BY r.id
LIMIT %(limit)s

-- fragment: expired_deadline
-- A run r of the expired_deadlines pass (scan_probe looks for one).
r.state = 'running' AND r.deadline_at IS NOT NULL AND r.deadline_at < now() + %(shift)s::interval

-- name: pause_run
-- Pause a running run and its ready or pending work. A descendant is paused in a later
-- statement of its ancestor's pause, which sees child runs created since that transaction
-- began: never stamped as updated before they were created.
WITH run AS (
    UPDATE cyclone_runs SET state = 'paused', paused_at = now() + %(shift)s::interval,
                            updated_at = greatest(now(), created_at)
    WHERE id = %(run_id)s AND state = 'running'
    RETURNING id
)
UPDATE cyclone_steps AS s SET state = 'paused'
FROM run
WHERE s.run_id = run.id AND s.state IN ('available', 'pending')
RETURNING s.id

-- name: resume_run
-- Resume a paused run: deadline and timed waits move forward by the pause length, but for
-- a wait already due when the run was paused (no scanner got to it): it came due first, and
-- fires (or times out) now.
WITH run AS (
    UPDATE cyclone_runs AS r
    SET state = 'running', paused_at = NULL, updated_at = now(),
        deadline_at = r.deadline_at + (now() + %(shift)s::interval - r.paused_at)
    WHERE r.id = %(run_id)s AND r.state = 'paused'
    RETURNING r.id, now() + %(shift)s::interval - %(paused_at)s::timestamptz AS pause_length
), waits AS (
    UPDATE cyclone_steps AS s SET scheduled_at = s.scheduled_at + run.pause_length
    FROM run
    WHERE s.run_id = run.id AND s.state IN ('waiting_timer', 'waiting_signal')
      AND (s.state = 'waiting_timer' OR s.wait_for IS NOT NULL)
      AND s.scheduled_at > %(paused_at)s::timestamptz
    RETURNING s.id
)
-- A step of a sequence_key (standalone work: no dependencies) is available again at once,
-- not activated, which would move its start to now: its start time is its place in the
-- sequence, ahead of the steps enqueued after it.
UPDATE cyclone_steps AS s
SET state = CASE WHEN s.sequence_key IS NOT NULL THEN 'available' ELSE 'pending' END
FROM run
WHERE s.run_id = run.id AND s.state = 'paused'
RETURNING s.id, s.node, s.item_of, s.state, s.queue
