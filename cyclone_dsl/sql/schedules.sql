-- name: db_now
-- The database clock (with the engine's shift): cron slots are computed from it.
SELECT now() + %(shift)s::interval AS now

-- name: upsert_schedule
-- Register or update a schedule; registration pins the workflow definition.
INSERT INTO cyclone_schedules (id, kind, input, cron_spec, location, next_run_at, enabled,
                               max_attempts, timeout, queue, priority, retention, def_version)
VALUES (%(id)s, %(kind)s, %(input)s::jsonb, %(cron_spec)s, %(location)s, %(next_run_at)s,
        %(enabled)s, %(max_attempts)s, %(timeout)s, %(queue)s, %(priority)s, %(retention)s,
        %(def_version)s)
ON CONFLICT (id) DO UPDATE
SET kind = EXCLUDED.kind, input = EXCLUDED.input,
    -- A changed cron or zone starts from its next slot; a schedule enabled again fires
    -- at most the latest of the slots it missed while disabled.
    next_run_at = CASE
        WHEN cyclone_schedules.cron_spec <> EXCLUDED.cron_spec
          OR cyclone_schedules.location <> EXCLUDED.location THEN EXCLUDED.next_run_at
        WHEN NOT cyclone_schedules.enabled AND EXCLUDED.enabled AND NOT %(from_code)s
            THEN greatest(cyclone_schedules.next_run_at,
                          coalesce(%(latest_run_at)s::timestamptz, EXCLUDED.next_run_at))
        ELSE cyclone_schedules.next_run_at END,
    cron_spec = EXCLUDED.cron_spec, location = EXCLUDED.location,
    enabled = CASE WHEN %(from_code)s THEN cyclone_schedules.enabled AND EXCLUDED.enabled
                   ELSE EXCLUDED.enabled END,
    max_attempts = EXCLUDED.max_attempts,
    timeout = EXCLUDED.timeout, queue = EXCLUDED.queue, priority = EXCLUDED.priority,
    retention = EXCLUDED.retention, def_version = EXCLUDED.def_version,
    last_error = CASE WHEN cyclone_schedules.def_version IS DISTINCT FROM EXCLUDED.def_version
                      THEN NULL ELSE cyclone_schedules.last_error END,
    updated_at = now()
RETURNING id, next_run_at

-- name: delete_schedule
-- Remove a schedule (its fire records go with it).
DELETE FROM cyclone_schedules WHERE id = %(id)s RETURNING id

-- name: list_schedules
-- Every schedule, by id.
SELECT id, kind, input, cron_spec, location, next_run_at, enabled, lease_owner, lease_expiry,
       last_run_id, last_error, consecutive_failures, max_attempts,
       extract(epoch FROM timeout)::float8 AS timeout_s, queue, priority,
       extract(epoch FROM retention)::float8 AS retention_s, def_version, created_at, updated_at
FROM cyclone_schedules ORDER BY id

-- name: lease_due_schedules
-- Lease due schedules (one scanner fires each); an expired lease can be taken over. Those
-- this process can fire come first, so that no number of others starves them. One it
-- cannot fire is leased only while no refusal says why (schedule_refused): its refusal is
-- written once, not on every pass of every scanner.
WITH due AS (
    SELECT id FROM cyclone_schedules
    WHERE {{due_schedule}}
      AND ({{fireable_schedule}}
           OR last_error IS NULL OR NOT starts_with(last_error, 'refused here: '))
    ORDER BY {{fireable_schedule}} DESC, next_run_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
UPDATE cyclone_schedules AS s
SET lease_owner = %(owner)s, lease_expiry = now() + %(shift)s::interval + %(lease)s::interval
FROM due
WHERE s.id = due.id
RETURNING s.id, s.kind, s.input, s.cron_spec, s.location, s.next_run_at, s.max_attempts,
          extract(epoch FROM s.timeout)::float8 AS timeout_s, s.queue, s.priority,
          extract(epoch FROM s.retention)::float8 AS retention_s, s.def_version,
          now() + %(shift)s::interval AS now

-- fragment: fireable_schedule
-- A schedule the leasing process can fire (%(kinds)s NULL: it says not, so any): one of its
-- kinds (workflows, steps, actions), of the definition it has when the schedule pins one
-- (%(workflows)s and %(versions)s pair each workflow with its def_version), and not among
-- those it refused lately for their input (%(refused)s).
(%(kinds)b::text[] IS NULL
 OR (kind = ANY(%(kinds)b::text[]) AND id <> ALL(%(refused)b::text[])
     AND (def_version IS NULL
          OR EXISTS (SELECT 1 FROM unnest(%(workflows)b::text[], %(versions)b::text[])
                         AS w(name, def_version)
                     WHERE w.name = kind AND w.def_version = cyclone_schedules.def_version))))

-- fragment: due_schedule
-- A schedule of lease_due_schedules (scan_probe looks for one).
enabled AND next_run_at <= now() + %(shift)s::interval
AND (lease_expiry IS NULL OR lease_expiry < now() + %(shift)s::interval)

-- name: lock_leased_schedule
-- The schedule this scanner leased, read again and locked for its fire (None: deleted,
-- or the lease taken over).
SELECT id, kind, input, cron_spec, location, next_run_at, enabled, max_attempts,
       extract(epoch FROM timeout)::float8 AS timeout_s, queue, priority,
       extract(epoch FROM retention)::float8 AS retention_s, def_version,
       now() + %(shift)s::interval AS now
FROM cyclone_schedules
WHERE id = %(id)s AND lease_owner = %(owner)s
FOR UPDATE

-- name: release_schedule_lease
-- Give back a lease whose schedule is no longer due (updated or disabled since).
UPDATE cyclone_schedules SET lease_owner = NULL, lease_expiry = NULL
WHERE id = %(id)s AND lease_owner = %(owner)s

-- name: record_fire
-- Record one slot; the primary key makes a second fire of the same slot a no-op.
INSERT INTO cyclone_schedule_fires (schedule_id, scheduled_for, run_id)
VALUES (%(schedule_id)s, %(scheduled_for)s, %(run_id)s)
ON CONFLICT (schedule_id, scheduled_for) DO NOTHING
RETURNING run_id

-- name: schedule_fired
-- Advance a schedule past the slot it fired (or found fired), releasing its lease.
UPDATE cyclone_schedules
SET next_run_at = %(next_run_at)s,
    last_run_id = coalesce(%(run_id)s, last_run_id),
    last_error = NULL, consecutive_failures = 0,
    lease_owner = NULL, lease_expiry = NULL, updated_at = now()
WHERE id = %(id)s AND lease_owner = %(owner)s

-- name: schedule_retired
-- The last slot of a cron bound by year was fired (or found fired): disable the schedule,
-- its slot kept (fired once: record_fire holds it), saying why; release the lease.
UPDATE cyclone_schedules
SET enabled = false, last_run_id = coalesce(%(run_id)s, last_run_id),
    last_error = 'disabled: ' || quote_literal(cron_spec) || ' has no slot after the last it fired',
    consecutive_failures = 0,
    lease_owner = NULL, lease_expiry = NULL, updated_at = now()
WHERE id = %(id)s AND lease_owner = %(owner)s

-- name: schedule_failed
-- Record a failed fire; advance to the next slot when told to, and release the lease.
UPDATE cyclone_schedules
SET last_error = %(error)s, consecutive_failures = consecutive_failures + 1,
    next_run_at = coalesce(%(next_run_at)s, next_run_at),
    lease_owner = NULL, lease_expiry = NULL, updated_at = now()
WHERE id = %(id)s AND lease_owner = %(owner)s

-- name: disable_failed_schedule
-- Disable a schedule that cannot fire (its cron or zone is refused): record why, release
-- the lease.
UPDATE cyclone_schedules
SET enabled = false, last_error = %(error)s, consecutive_failures = consecutive_failures + 1,
    lease_owner = NULL, lease_expiry = NULL, updated_at = now()
WHERE id = %(id)s AND lease_owner = %(owner)s

-- name: schedule_refused
-- Leave the slot for a process that can fire it (the pinned definition, a handler that takes
-- the input): record why, release the lease. lease_due_schedules knows a refusal by its
-- 'refused here: ' and leaves the schedule to processes that can fire it.
UPDATE cyclone_schedules
SET last_error = 'refused here: ' || %(error)s,
    lease_owner = NULL, lease_expiry = NULL, updated_at = now()
WHERE id = %(id)s AND lease_owner = %(owner)s

-- name: lock_schedule
-- One schedule, locked, with the database clock.
SELECT id, cron_spec, location, next_run_at, enabled, now() + %(shift)s::interval AS now
FROM cyclone_schedules WHERE id = %(id)s
FOR UPDATE

-- name: set_schedule_enabled
-- Enable or disable a schedule (its next slot computed by the caller).
UPDATE cyclone_schedules
SET enabled = %(enabled)s, next_run_at = %(next_run_at)s, updated_at = now()
WHERE id = %(id)s
