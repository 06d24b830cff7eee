-- name: lock_worker_registry
-- Serialise worker registrations of this schema (two workers starting at once both see
-- each other's handlers). Released at commit.
SELECT pg_advisory_xact_lock(%(namespace)s, hashtext(current_schema()))

-- name: handler_conflicts
-- Live workers (other than this one) that serve one of these kinds with another handler.
SELECT h.kind, mine.identity AS mine, h.identity AS theirs, w.id AS worker_id
FROM unnest(%(kinds)b::text[], %(identities)b::text[]) AS mine(kind, identity)
JOIN cyclone_ext_worker_handlers AS h ON h.kind = mine.kind AND h.identity <> mine.identity
JOIN cyclone_ext_workers AS w ON w.id = h.worker_id
WHERE w.id <> %(worker_id)s AND w.stopped_at IS NULL
  AND w.heartbeat_at > now() + %(shift)s::interval - %(live_for)s::interval
ORDER BY h.kind, w.id

-- name: register_worker
-- Record (or refresh) a worker with what it serves: its handlers and workflow versions.
-- A supervisor's restarted worker process keeps its id (name/N) and brings a new pid.
WITH worker AS (
    INSERT INTO cyclone_ext_workers (id, host, pid, queues, concurrency, package_version,
                                     started_at, heartbeat_at)
    VALUES (%(id)s, %(host)s, %(pid)s, %(queues)b::text[], %(concurrency)s,
            %(package_version)s, now() + %(shift)s::interval, now() + %(shift)s::interval)
    ON CONFLICT (id) DO UPDATE
        SET heartbeat_at = excluded.heartbeat_at, stopped_at = NULL, queues = excluded.queues,
            host = excluded.host, pid = excluded.pid  -- a restarted worker process, same id
    RETURNING id
), handlers AS (
    INSERT INTO cyclone_ext_worker_handlers (worker_id, kind, identity)
    SELECT worker.id, h.kind, h.identity
    FROM worker, unnest(%(kinds)b::text[], %(identities)b::text[]) AS h(kind, identity)
    ON CONFLICT (worker_id, kind) DO UPDATE SET identity = excluded.identity
    RETURNING 1
), versions AS (
    INSERT INTO cyclone_ext_worker_versions (worker_id, workflow, def_version)
    SELECT worker.id, v.workflow, v.def_version
    FROM worker, unnest(%(workflows)b::text[], %(versions)b::text[]) AS v(workflow, def_version)
    ON CONFLICT DO NOTHING
    RETURNING 1
)
SELECT (SELECT id FROM worker) AS id,
       (SELECT count(*) FROM handlers) AS handlers,
       (SELECT count(*) FROM versions) AS versions

-- name: beat_worker
-- A registered worker is alive; no row back means it was pruned and must register again.
UPDATE cyclone_ext_workers
SET heartbeat_at = now() + %(shift)s::interval
WHERE id = %(id)s AND stopped_at IS NULL
RETURNING id

-- name: stop_worker
-- A worker stopped gracefully: it serves nothing from now on (kept a while for the fleet).
UPDATE cyclone_ext_workers SET stopped_at = now() + %(shift)s::interval
WHERE id = %(id)s
RETURNING id

-- name: prune_workers
-- Forget workers stopped, or silent, for longer than %(keep)s.
DELETE FROM cyclone_ext_workers
WHERE coalesce(stopped_at, heartbeat_at) < now() + %(shift)s::interval - %(keep)s::interval
RETURNING id

-- name: list_workers
-- Every known worker, live ones first, with what it serves and how many of its slots hold
-- a running step (the running steps are found through idx_steps_lease: only they hold one).
SELECT w.id, w.host, w.pid, w.queues, w.concurrency, w.package_version, w.started_at,
       w.heartbeat_at, w.stopped_at, coalesce(busy.steps, 0) AS slots_in_use,
       (w.stopped_at IS NULL
        AND w.heartbeat_at > now() + %(shift)s::interval - %(live_for)s::interval) AS live,
       coalesce((SELECT jsonb_object_agg(h.kind, h.identity ORDER BY h.kind)
                 FROM cyclone_ext_worker_handlers AS h WHERE h.worker_id = w.id),
                '{}'::jsonb) AS handlers,
       coalesce((SELECT jsonb_agg(jsonb_build_object('workflow', v.workflow,
                                                     'def_version', v.def_version)
                                  ORDER BY v.workflow, v.def_version)
                 FROM cyclone_ext_worker_versions AS v
                 WHERE v.worker_id = w.id AND v.def_version <> 'standalone'),
                '[]'::jsonb) AS versions
FROM cyclone_ext_workers AS w
LEFT JOIN (SELECT s.lease_owner, count(*) AS steps FROM cyclone_steps AS s
           WHERE s.lease_expiry IS NOT NULL AND s.state = 'running'
           GROUP BY s.lease_owner) AS busy ON busy.lease_owner = w.id
ORDER BY live DESC, w.heartbeat_at DESC, w.id

-- name: unserved_work
-- Due available steps that no live worker serves (its queue, its kind and its run's
-- workflow version), grouped, among the first %(sample)s due steps of the given queues
-- (NULL: every queue). A bounded sample keeps this cheap on a large backlog. Child nodes
-- whose child run no process could start (kind '@child', waiting for a worker with the
-- run's version: see start_deferred) count too; any live worker of that version starts them.
WITH live AS (
    SELECT w.id, w.queues FROM cyclone_ext_workers AS w
    WHERE w.stopped_at IS NULL
      AND w.heartbeat_at > now() + %(shift)s::interval - %(live_for)s::interval
), due AS (
    (SELECT s.queue, s.kind, r.workflow, r.def_version, s.scheduled_at
     FROM cyclone_steps AS s
     -- Each step's run by key (OFFSET 0 keeps it so): as a join, the planner hashed a
     -- scan of every run, the history of ended ones included.
     CROSS JOIN LATERAL (SELECT r.workflow, r.def_version FROM cyclone_runs AS r
                         WHERE r.id = s.run_id OFFSET 0) AS r
     WHERE s.state = 'available'
       AND s.scheduled_at <= now() + %(shift)s::interval
       AND (%(queues)b::text[] IS NULL OR s.queue = ANY(%(queues)b::text[]))
     LIMIT %(sample)s)
    UNION ALL
    (SELECT s.queue, s.kind, r.workflow, r.def_version, s.scheduled_at
     FROM cyclone_steps AS s
     JOIN cyclone_runs AS r ON r.id = s.run_id
     WHERE s.state = 'waiting_child' AND s.kind = '@child' AND r.state = 'running'
       AND (%(queues)b::text[] IS NULL OR s.queue = ANY(%(queues)b::text[]))
       AND NOT EXISTS (SELECT 1 FROM cyclone_runs AS c
                       WHERE c.parent_run_id = s.run_id AND c.parent_node_id = s.node)
     LIMIT %(sample)s)
)
SELECT d.queue, d.kind, d.workflow, d.def_version, count(*) AS steps,
       min(d.scheduled_at) AS oldest
FROM due AS d
WHERE NOT EXISTS (
    SELECT 1 FROM live AS l
    JOIN cyclone_ext_worker_versions AS v ON v.worker_id = l.id
    WHERE v.workflow = d.workflow AND v.def_version = d.def_version
      AND (d.kind = '@child'
           OR (d.queue = ANY(l.queues)
               AND EXISTS (SELECT 1 FROM cyclone_ext_worker_handlers AS h
                           WHERE h.worker_id = l.id AND h.kind = d.kind))))
GROUP BY d.queue, d.kind, d.workflow, d.def_version
ORDER BY oldest, d.queue, d.kind
