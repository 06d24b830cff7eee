-- name: claim_steps
-- Claim up to %(limit)s available steps of one queue and the given kinds (CTE, SKIP LOCKED).
-- One queue per statement: equality on queue lets idx_steps_claim return rows in order.
WITH candidates AS (
    SELECT s.id
    FROM cyclone_steps AS s
    WHERE s.state = 'available'
      AND s.queue = %(queue)s
      AND s.kind = ANY(%(kinds)s::text[])
      AND s.scheduled_at <= now() + %(shift)s::interval
      AND (s.sequence_key IS NULL OR NOT EXISTS (
            SELECT 1 FROM cyclone_steps AS h
            WHERE h.sequence_key = s.sequence_key
              AND h.state IN ('available', 'running', 'paused')
              AND h.id <> s.id
              AND (h.state <> 'available' OR (h.scheduled_at, h.id) < (s.scheduled_at, s.id))))
    ORDER BY s.priority DESC, s.scheduled_at
    LIMIT %(limit)s
    FOR NO KEY UPDATE SKIP LOCKED
)
UPDATE cyclone_steps AS s
SET state = 'running',
    lease_owner = %(owner)s,
    lease_generation = s.lease_generation + 1,
    lease_expiry = now() + %(shift)s::interval + %(lease)s::interval,
    heartbeat_at = now() + %(shift)s::interval,
    started_at = now() + %(shift)s::interval
FROM candidates
WHERE s.id = candidates.id
RETURNING s.id, s.run_id, s.node, s.kind, s.queue, s.attempt, s.max_attempts, s.lease_generation,
          extract(epoch FROM s.timeout)::float8 AS timeout_s, s.item_of, s.item_index,
          extract(epoch FROM (s.lease_expiry - now() - %(shift)s::interval))::float8 AS lease_s

-- name: assemble_inputs
-- The handler input of each step: static, single upstream, tuple {a..d} or array.
SELECT s.id,
       CASE
           WHEN s.input_from IS NOT NULL THEN
               (SELECT u.output FROM cyclone_steps AS u
                WHERE u.run_id = s.run_id AND u.node = s.input_from)
           WHEN EXISTS (SELECT 1 FROM cyclone_step_inputs AS i
                        WHERE i.run_id = s.run_id AND i.node = s.node) THEN
               (SELECT CASE
                           WHEN bool_or(i.assembly_mode = 'array') THEN
                               jsonb_agg(coalesce(u.output, 'null'::jsonb) ORDER BY i.slot)
                           ELSE coalesce(s.input, '{}'::jsonb)
                                || jsonb_object_agg(chr(97 + i.slot), coalesce(u.output, 'null'::jsonb))
                       END
                FROM cyclone_step_inputs AS i
                JOIN cyclone_steps AS u ON u.run_id = i.run_id AND u.node = i.dep_node
                WHERE i.run_id = s.run_id AND i.node = s.node)
           ELSE s.input
       END AS input,
       (s.input_from IS NULL
        AND NOT EXISTS (SELECT 1 FROM cyclone_step_inputs AS i
                        WHERE i.run_id = s.run_id AND i.node = s.node)
        AND s.input IS NULL) AS no_input
FROM unnest(%(ids)s::bigint[]) AS t(id)
JOIN cyclone_steps AS s ON s.id = t.id

-- name: heartbeat_steps
-- Extend the leases still held at the given generations; return the ones extended.
UPDATE cyclone_steps AS s
SET lease_expiry = now() + %(shift)s::interval + %(lease)s::interval,
    heartbeat_at = now() + %(shift)s::interval
FROM unnest(%(ids)s::bigint[], %(generations)s::bigint[]) AS h(id, generation)
WHERE s.id = h.id AND s.lease_generation = h.generation
  AND CASE WHEN s.state = 'running' THEN true ELSE false END  -- by id, never by state index
RETURNING s.id

-- name: release_steps
-- Give leases back at shutdown: available again, the attempt not consumed.
UPDATE cyclone_steps AS s
SET state = CASE WHEN r.state = 'paused' THEN 'paused' ELSE 'available' END,
    lease_owner = NULL, lease_expiry = NULL, heartbeat_at = NULL, started_at = NULL,
    scheduled_at = now() + %(shift)s::interval
FROM unnest(%(ids)s::bigint[], %(generations)s::bigint[]) AS h(id, generation), cyclone_runs AS r
WHERE s.id = h.id AND s.lease_generation = h.generation
  AND CASE WHEN s.state = 'running' THEN true ELSE false END  -- by id, never by state index
  AND r.id = s.run_id
RETURNING s.id, s.queue
