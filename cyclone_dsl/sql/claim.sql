-- name: claim_steps
-- Claim up to %(limit)s available steps of one queue and the given kinds, and return each
-- with its handler input (static, single upstream, tuple {a..d} or array): one statement,
-- so a claim is one round trip in autocommit mode.
-- One queue per statement: equality on queue lets idx_steps_claim return rows in order.
-- The claim's COMMIT does not wait for its WAL flush (set_config(..., true)): a claim lost
-- in a server crash leaves the step available, to run again (at least once, as after a
-- worker crash), and the claimer's completion is fenced by the lease generation. A
-- completion commits synchronously, which flushes every earlier claim with it.
-- Steps a limit applies to (a row in cyclone_ext_gates) are left to claim_gated_steps.
WITH relaxed AS (
    SELECT set_config('synchronous_commit', 'off', true) AS synchronous_commit
),
chosen AS (
    SELECT s.id FROM ({{next_ungated_steps}}) AS s WHERE {{no_ancestor_past_deadline}}
),
{{claim_chosen}}

-- fragment: next_ungated_steps
-- Up to %(limit)s claimable steps that no limit applies to, in claim order, locked (ids
-- and runs).
SELECT s.id, s.run_id
FROM cyclone_steps AS s
WHERE {{claimable}}
  AND {{ungated}}
ORDER BY s.priority DESC, s.scheduled_at
LIMIT %(limit)s
FOR NO KEY UPDATE SKIP LOCKED

-- fragment: ungated
-- Step s has no limit (no row in cyclone_ext_gates). A scalar subquery, probed per row:
-- written as NOT EXISTS it became an anti-join that read every available step of the
-- queue before the LIMIT could stop it. A boolean rather than IS NULL, whose default
-- selectivity (0.5%) made the planner expect to walk most of the queue for a claim: on
-- analyzed tables, an estimate above jit_above_cost.
coalesce((SELECT false FROM cyclone_ext_gates AS g WHERE g.step_id = s.id), true)

-- fragment: claimable
-- Step s may be claimed now by this worker: available and due in %(queue)s, of one of its
-- %(kinds)s, in a run whose (workflow, def_version) it has the definition of and whose
-- deadline has not passed, and not behind an earlier step of its sequence_key.
s.state = 'available'
      AND s.queue = %(queue)s
      AND {{claimable_rest}}

-- fragment: claimable_by_id
-- The claimable conditions for a step looked up by id, written as one CASE, so that no index on state
-- or queue (idx_steps_claim) can drive the plan instead of the primary key, which a
-- planner without statistics would pick (a scan of every available step per step).
CASE WHEN s.state = 'available' AND s.queue = %(queue)s THEN {{claimable_rest}}
     ELSE false END

-- fragment: claimable_rest
-- The claimable conditions beyond state and queue.
s.kind = ANY(%(kinds)b::text[])
      AND s.scheduled_at <= now() + %(shift)s::interval
      -- Only runs whose definition this worker has: (workflow, def_version) it serves. A
      -- scalar subquery, probed per step by the run's key: as EXISTS it became a semi-join
      -- that hashed every run of those definitions whenever the runs table looked small.
      AND (SELECT 1 FROM cyclone_runs AS r
           WHERE r.id = s.run_id
             -- nothing starts in a run past its deadline (the scanner is yet to fail it)
             AND (r.deadline_at IS NULL OR r.deadline_at >= now() + %(shift)s::interval)
             AND (r.workflow, r.def_version) IN (
                 SELECT v.workflow, v.def_version
                 FROM unnest(%(workflows)b::text[], %(versions)b::text[])
                     AS v(workflow, def_version))
           LIMIT 1) IS NOT NULL
      -- A running step of the key holds every other; an available or paused one only
      -- those after it (a paused step keeps its place: it does not hold the ones ahead).
      AND (s.sequence_key IS NULL OR NOT EXISTS (
            SELECT 1 FROM cyclone_steps AS h
            WHERE h.sequence_key = s.sequence_key
              AND h.state IN ('available', 'running', 'paused')
              AND h.id <> s.id
              AND (h.state = 'running' OR (h.scheduled_at, h.id) < (s.scheduled_at, s.id))))

-- fragment: no_ancestor_past_deadline
-- No ancestor run of step s's run is past its deadline: a child run has no deadline of its
-- own, and nothing of it starts once its parent's (or a grandparent's) has passed, though no
-- scanner has failed that run yet. Checked on the steps a claim chose (after its LIMIT), not
-- on every candidate: a recursive walk per candidate put the claim's estimate above
-- jit_above_cost. Checked before they take any slot of a limit (a rate unit spent for its
-- window by a step that never ran). Such a step stays available, locked by this claim until
-- it commits, and the deadline scanner ends it with its run; until then, work it comes
-- before in its key or queue waits behind it. Each level is a probe by primary key (OFFSET 0
-- keeps the LATERAL from being flattened into a join, which could hash every run); a paused
-- ancestor's deadline stands still (resume moves it), as in lock_runs_and_ancestors.
-- The CASE sets the walk up only for a run with a parent; reading whether the run has one
-- is what the check costs a standalone step (1-3 us of the claim's 21-24 per step).
CASE WHEN (SELECT r.parent_run_id FROM cyclone_runs AS r WHERE r.id = s.run_id) IS NULL
     THEN true
     ELSE NOT EXISTS (
    WITH RECURSIVE up(parent_id, past) AS (
        SELECT a.parent_run_id, {{run_past_deadline}}
        FROM cyclone_runs AS a
        WHERE a.id = (SELECT r.parent_run_id FROM cyclone_runs AS r WHERE r.id = s.run_id)
        UNION ALL
        SELECT a.parent_run_id, a.past
        FROM up CROSS JOIN LATERAL (
            SELECT a.parent_run_id, {{run_past_deadline}} AS past
            FROM cyclone_runs AS a WHERE a.id = up.parent_id
            OFFSET 0
        ) AS a
        WHERE up.parent_id IS NOT NULL
    )
    SELECT 1 FROM up WHERE up.past
) END

-- fragment: run_past_deadline
-- Run a is past its deadline (a paused run's deadline stands still until its resume).
coalesce(a.state = 'running' AND a.deadline_at < now() + %(shift)s::interval, false)

-- fragment: claim_chosen
-- Lease the steps of CTE ``chosen`` (ids, locked) and return each with its handler input;
-- the statement defines ``relaxed`` (its commit mode) before.
{{claim_update}}
SELECT {{claim_result}}
FROM claimed AS c CROSS JOIN relaxed
{{claimed_run}}

-- fragment: claimed_run
-- The run r of claimed step c, probed by primary key per step (OFFSET 0 keeps it from
-- being flattened): as a join, the planner hashed a scan of every run whenever that
-- looked cheaper than a claim's worth of probes, which cost more than the rest of the
-- claim on small tables.
CROSS JOIN LATERAL (
    SELECT r.workflow, r.def_version, r.deadline_at FROM cyclone_runs AS r
    WHERE r.id = c.run_id
    OFFSET 0
) AS r

-- fragment: claim_update
-- The CTE ``claimed``: the steps of CTE ``chosen`` leased to %(owner)s.
claimed AS (
    UPDATE cyclone_steps AS s
    SET state = 'running',
        lease_owner = %(owner)s,
        lease_generation = s.lease_generation + 1,
        lease_expiry = now() + %(shift)s::interval + %(lease)s::interval,
        heartbeat_at = now() + %(shift)s::interval,
        started_at = now() + %(shift)s::interval
    -- = ANY: a primary-key probe per step. A join with chosen was planned as a hash of a
    -- scan of every step whenever the table looked small to the planner (no statistics
    -- yet after a burst of enqueues): a third of a gated claim's time at 20,000 steps.
    WHERE s.id = ANY(ARRAY(SELECT id FROM chosen))
    RETURNING s.id, s.run_id, s.node, s.kind, s.queue, s.attempt, s.max_attempts,
              s.lease_generation, s.input, s.input_from,
              extract(epoch FROM s.timeout)::float8 AS timeout_s, s.item_of, s.item_index,
              extract(epoch FROM (s.lease_expiry - now() - %(shift)s::interval))::float8
                  AS lease_s,
              EXISTS (SELECT 1 FROM cyclone_step_inputs AS i
                      WHERE i.run_id = s.run_id AND i.node = s.node) AS has_slots
)

-- fragment: claim_result
-- The columns a claim returns for claimed step c of run r.
c.id, c.run_id, c.node, c.kind, c.queue, c.attempt, c.max_attempts,
       c.lease_generation, c.timeout_s, c.item_of, c.item_index, c.lease_s,
       r.workflow, r.def_version, r.deadline_at,
       {{step_input}} AS input,
       {{no_input}} AS no_input

-- name: heartbeat_steps
-- Extend the leases still held at the given generations; return the ones extended.
WITH {{lock_listed_steps}}
UPDATE cyclone_steps AS s
SET lease_expiry = now() + %(shift)s::interval + %(lease)s::interval,
    heartbeat_at = now() + %(shift)s::interval
FROM unnest(%(ids)b::bigint[], %(generations)b::bigint[]) AS h(id, generation)
WHERE s.id = ANY(ARRAY(SELECT id FROM listed))  -- locked in id order above
  AND s.id = h.id AND s.lease_generation = h.generation
  AND CASE WHEN s.state = 'running' THEN true ELSE false END  -- by id, never by state index
RETURNING s.id, s.lease_generation

-- name: leases_held
-- Of the given (id, generation) leases, those still held: the steps of transactional
-- handlers whose snapshot is open, which no heartbeat updates (see hold_lease).
SELECT s.id, s.lease_generation
FROM cyclone_steps AS s
JOIN unnest(%(ids)b::bigint[], %(generations)b::bigint[]) AS h(id, generation) ON h.id = s.id
WHERE s.id = ANY(%(ids)b::bigint[]) AND s.lease_generation = h.generation
  AND CASE WHEN s.state = 'running' THEN true ELSE false END  -- by id, never by state index

-- name: hold_lease
-- Hold the lease of step %(id)s for as long as the calling transaction is open. A
-- transactional handler at repeatable read or serializable runs in one snapshot, and its
-- completion conflicts with any update of its step's row after it: its lease is kept
-- by this lock instead of heartbeats, and reclaim_steps skips a step whose lock is held.
-- The lock ends with the transaction, also when its worker dies or the server ends it.
-- False: a step whose id matches in its low 31 bits holds the key (its lock covers this
-- step too while it lasts).
SELECT pg_try_advisory_xact_lock(
    hashtext('cyclone.lease:' || current_schema()), (%(id)s::bigint & 2147483647)::int
) AS held

-- name: release_steps
-- Give leases back at shutdown: available again, the attempt not consumed, its
-- scheduled_at kept (its place in its queue and in its sequence_key's order). Each
-- execution so ended is written to the attempt history ('released').
WITH {{lock_listed_steps}},
released AS (
    UPDATE cyclone_steps AS s
    SET state = CASE WHEN r.state = 'paused' THEN 'paused' ELSE 'available' END,
        lease_owner = NULL, lease_expiry = NULL, heartbeat_at = NULL, started_at = NULL
    FROM unnest(%(ids)b::bigint[], %(generations)b::bigint[]) AS h(id, generation),
         cyclone_steps AS cur, cyclone_runs AS r
    WHERE s.id = ANY(ARRAY(SELECT id FROM listed))  -- locked in id order above
      AND s.id = h.id AND s.lease_generation = h.generation
      AND CASE WHEN s.state = 'running' THEN true ELSE false END  -- by id, not state index
      AND cur.id = s.id AND r.id = s.run_id
    -- cur is read in the statement's snapshot: the execution's owner and start
    RETURNING s.id, s.queue, s.run_id, s.attempt, cur.lease_owner AS worker,
              cur.started_at
), history AS (
    INSERT INTO cyclone_ext_attempts (step_id, run_id, attempt, worker, started_at, ended_at,
                                      outcome, error, error_kind)
    SELECT id, run_id, attempt + 1, worker, started_at, now() + %(shift)s::interval,
           'released', 'its worker stopped and gave the lease back', NULL
    FROM released
)
SELECT id, queue FROM released

-- name: assemble_inputs
-- The handler input of each step (the claim computes the same in its own statement).
SELECT c.id, {{step_input}} AS input, {{no_input}} AS no_input
FROM (SELECT s.id, s.run_id, s.node, s.input, s.input_from,
             EXISTS (SELECT 1 FROM cyclone_step_inputs AS i
                     WHERE i.run_id = s.run_id AND i.node = s.node) AS has_slots
      FROM cyclone_steps AS s
      -- = ANY: a primary-key lookup; a join with unnest() hashed every step on small tables.
      WHERE s.id = ANY(%(ids)b::bigint[])) AS c

-- fragment: step_input
-- The handler input of step c (columns run_id, node, input, input_from, has_slots):
-- static, single upstream output, tuple {a..d} (over the static input) or array.
CASE
    WHEN c.input_from IS NOT NULL THEN
        (SELECT u.output FROM cyclone_steps AS u
         WHERE u.run_id = c.run_id AND u.node = c.input_from)
    WHEN c.has_slots THEN
        (SELECT CASE
                    WHEN bool_or(i.assembly_mode = 'array') THEN
                        jsonb_agg(coalesce(u.output, 'null'::jsonb) ORDER BY i.slot)
                    ELSE coalesce(c.input, '{}'::jsonb)
                         || jsonb_object_agg(chr(97 + i.slot), coalesce(u.output, 'null'::jsonb))
                END
         FROM cyclone_step_inputs AS i
         JOIN cyclone_steps AS u ON u.run_id = i.run_id AND u.node = i.dep_node
         WHERE i.run_id = c.run_id AND i.node = c.node)
    ELSE c.input
END

-- fragment: no_input
-- Whether step c's handler is called without an argument.
(c.input_from IS NULL AND NOT c.has_slots AND c.input IS NULL)

-- fragment: lock_listed_steps
-- Lock the steps %(ids)s in id order, for a statement that then updates them as
-- s.id = ANY(ARRAY(SELECT id FROM listed)): the array is built, every lock taken in
-- order, before the first update. Every write to several possibly running steps takes
-- their locks in id order, so a heartbeat and a completion never deadlock.
listed AS (
    SELECT s.id FROM cyclone_steps AS s
    WHERE s.id = ANY(%(ids)b::bigint[])
    ORDER BY s.id
    FOR NO KEY UPDATE
)

-- name: lease_states
-- The state and generation of steps whose heartbeat found no lease (cancelled, or taken).
SELECT s.id, s.state, s.lease_generation FROM cyclone_steps AS s
WHERE s.id = ANY(%(ids)b::bigint[])
