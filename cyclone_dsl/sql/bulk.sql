-- fragment: bulk_match
-- Run r matches a bulk operation's filter: one of %(states)s, created at or before the
-- operation started (id up to %(up_to)s); each other criterion is skipped when NULL.
r.state = ANY(%(states)b::text[])
  AND r.id <= %(up_to)s
  AND (%(workflows)b::text[] IS NULL OR r.workflow = ANY(%(workflows)b::text[]))
  AND (%(since)s::timestamptz IS NULL OR r.created_at >= %(since)s::timestamptz)
  AND (%(until)s::timestamptz IS NULL OR r.created_at < %(until)s::timestamptz)
  AND (%(ended_since)s::timestamptz IS NULL OR r.finished_at >= %(ended_since)s::timestamptz)
  AND (%(ended_until)s::timestamptz IS NULL OR r.finished_at < %(ended_until)s::timestamptz)
  AND (%(queues)b::text[] IS NULL OR EXISTS (
        SELECT 1 FROM cyclone_steps AS q
        WHERE q.run_id = r.id AND q.queue = ANY(%(queues)b::text[])))
  -- A step carries the kind, or one of its attempts failed with it (as list_runs reads it).
  AND (%(error_kinds)b::text[] IS NULL
       OR EXISTS (SELECT 1 FROM cyclone_steps AS e
                  WHERE e.run_id = r.id AND e.error_kind = ANY(%(error_kinds)b::text[]))
       OR EXISTS (SELECT 1 FROM cyclone_steps AS e
                  JOIN cyclone_ext_attempts AS a ON a.step_id = e.id
                  WHERE e.run_id = r.id AND a.error_kind = ANY(%(error_kinds)b::text[])))

-- name: bulk_bound
-- The newest run id now: a bulk operation acts on runs up to it, never on later ones.
SELECT coalesce(max(id), 0) AS up_to FROM cyclone_runs

-- name: bulk_count
-- How many runs a bulk operation's filter matches now (its dry run).
SELECT count(*) AS runs FROM cyclone_runs AS r WHERE {{bulk_match}}

-- name: bulk_lock_page
-- The next page of runs a bulk operation acts on, after run %(after_id)s, locked in id
-- order. No SKIP LOCKED: a run a worker is completing is waited for, not left out; the
-- filter is checked again on the row as it is once locked (a run that ended meanwhile
-- is not returned).
SELECT r.id FROM cyclone_runs AS r
WHERE r.id > %(after_id)s AND {{bulk_match}}
ORDER BY r.id
LIMIT %(limit)s
FOR NO KEY UPDATE OF r
