-- name: upsert_limits
-- Record the limit of each scope (the latest submitted definition's), with its window. A
-- raised limit gives every key of its scope its new slots at once: a key whose work was
-- queued before would otherwise keep the old limit until a submit of that key. Returns
-- the scope of each slot added so (the caller wakes the claimers of waiting work).
WITH changed AS (
    INSERT INTO cyclone_ext_limits (scope, max_count, per)
    SELECT * FROM unnest(%(scopes)b::text[], %(max_counts)b::int[], %(pers)b::interval[])
    ON CONFLICT (scope) DO UPDATE
    SET max_count = EXCLUDED.max_count, per = EXCLUDED.per, updated_at = now()
    WHERE (cyclone_ext_limits.max_count, cyclone_ext_limits.per)
          IS DISTINCT FROM (EXCLUDED.max_count, EXCLUDED.per)
    RETURNING scope, max_count
)
INSERT INTO cyclone_ext_slots (scope, key, slot)
SELECT c.scope, k.key, n.slot
FROM changed AS c
CROSS JOIN LATERAL (SELECT DISTINCT sl.key FROM cyclone_ext_slots AS sl
                    WHERE sl.scope = c.scope) AS k
CROSS JOIN LATERAL generate_series(1, c.max_count) AS n(slot)
WHERE NOT EXISTS (SELECT 1 FROM cyclone_ext_slots AS e  -- a lowered limit has its slots
                  WHERE e.scope = c.scope AND e.key = k.key AND e.slot = c.max_count)
ORDER BY 1, 2, 3
ON CONFLICT (scope, key, slot) DO NOTHING
RETURNING scope

-- name: ensure_slots
-- Make sure each (scope, key) has its limit's slot rows (1 .. max_count).
INSERT INTO cyclone_ext_slots (scope, key, slot)
SELECT k.scope, k.key, n.slot
FROM (SELECT DISTINCT * FROM unnest(%(scopes)b::text[], %(keys)b::text[]) AS t(scope, key)) AS k
JOIN cyclone_ext_limits AS l ON l.scope = k.scope
CROSS JOIN LATERAL generate_series(1, l.max_count) AS n(slot)
-- A key's slots are made in one statement and never deleted: with its top slot in place it
-- has them all, and the range is not generated again (a limit of 100,000 took 0.26 s).
WHERE NOT EXISTS (SELECT 1 FROM cyclone_ext_slots AS e
                  WHERE e.scope = k.scope AND e.key = k.key AND e.slot = l.max_count)
ORDER BY 1, 2, 3
ON CONFLICT (scope, key, slot) DO NOTHING

-- name: insert_gates
-- Record the limits that apply to steps of new runs (by run and node).
INSERT INTO cyclone_ext_gates (step_id, run_id, queue, priority, fair_key, step_scope,
                               step_key, run_scope, run_key, rate_scope, rate_key,
                               rate_units)
SELECT s.id, s.run_id, s.queue, s.priority, g.fair_key, g.step_scope, g.step_key,
       g.run_scope, g.run_key, g.rate_scope, g.rate_key, g.rate_units
FROM unnest(%(run_ids)b::bigint[], %(nodes)b::text[], %(fair_keys)b::text[],
            %(step_scopes)b::text[], %(step_keys)b::text[], %(run_scopes)b::text[],
            %(run_keys)b::text[], %(rate_scopes)b::text[], %(rate_keys)b::text[],
            %(rate_units)b::int[])
    AS g(run_id, node, fair_key, step_scope, step_key, run_scope, run_key, rate_scope,
         rate_key, rate_units)
JOIN cyclone_steps AS s ON s.run_id = g.run_id AND s.node = g.node

-- name: gate_fan_out_items
-- The items of gated fan-out nodes take their node's limits (after the expansion).
INSERT INTO cyclone_ext_gates (step_id, run_id, queue, priority, fair_key, step_scope,
                               step_key, run_scope, run_key, rate_scope, rate_key,
                               rate_units)
SELECT i.id, i.run_id, i.queue, i.priority, g.fair_key, g.step_scope, g.step_key,
       g.run_scope, g.run_key, g.rate_scope, g.rate_key, g.rate_units
FROM cyclone_ext_gates AS g
JOIN cyclone_steps AS f ON f.id = g.step_id
JOIN cyclone_steps AS i ON i.run_id = f.run_id AND i.item_of = f.node
WHERE g.step_id = ANY(%(ids)b::bigint[])
ON CONFLICT (step_id) DO NOTHING

-- fragment: gate_key_window
-- The keys a gated claim of %(queue)s looks at, in turn: at most %(max_keys)s keys after
-- %(after_key)s, then as many from the first (part 1: the window went round), each read
-- with one index probe (a loose scan of idx_ext_gates_claim).
later_keys(fair_key) AS (
    (SELECT g.fair_key FROM cyclone_ext_gates AS g
     WHERE g.queue = %(queue)s AND g.fair_key > %(after_key)s
     ORDER BY g.fair_key LIMIT 1)
    UNION ALL
    SELECT (SELECT g.fair_key FROM cyclone_ext_gates AS g
            WHERE g.queue = %(queue)s AND g.fair_key > k.fair_key
            ORDER BY g.fair_key LIMIT 1)
    FROM later_keys AS k WHERE k.fair_key IS NOT NULL
),
earlier_keys(fair_key) AS (
    (SELECT g.fair_key FROM cyclone_ext_gates AS g
     WHERE g.queue = %(queue)s AND g.fair_key <= %(after_key)s
     ORDER BY g.fair_key LIMIT 1)
    UNION ALL
    SELECT (SELECT g.fair_key FROM cyclone_ext_gates AS g
            WHERE g.queue = %(queue)s AND g.fair_key > k.fair_key
              AND g.fair_key <= %(after_key)s
            ORDER BY g.fair_key LIMIT 1)
    FROM earlier_keys AS k WHERE k.fair_key IS NOT NULL
),
some_keys AS (
    (SELECT fair_key, 0 AS part FROM later_keys WHERE fair_key IS NOT NULL
     LIMIT %(max_keys)s)
    UNION ALL
    (SELECT fair_key, 1 AS part FROM earlier_keys WHERE fair_key IS NOT NULL
     LIMIT %(max_keys)s)
),
keys AS (
    SELECT fair_key, row_number() OVER (ORDER BY part, fair_key) AS key_ord
    FROM some_keys
)

-- name: gate_window_end
-- Where a gated claim that took nothing moves its cursor, so that the next one looks at the
-- next keys (a window of keys whose slots are all taken would otherwise be looked at by
-- every claim, and a key with a free slot beyond it never): the last key after the cursor
-- when the window held %(max_keys)s of them (more may follow), else the last of the first
-- keys it went round to. went_round: the windows since %(origin)s, the cursor the claim
-- began with, have looked at every key.
WITH RECURSIVE {{gate_key_window}},
later AS (SELECT max(fair_key) AS last, count(*) AS n FROM some_keys WHERE part = 0),
earlier AS (SELECT max(fair_key) AS last FROM some_keys WHERE part = 1),
chosen AS (
    SELECT CASE WHEN l.n = %(max_keys)s OR e.last IS NULL THEN l.last ELSE e.last END
               AS fair_key,
           NOT (l.n = %(max_keys)s OR e.last IS NULL) AS wrapped
    FROM later AS l CROSS JOIN earlier AS e
)
SELECT c.fair_key,
       CASE WHEN c.wrapped THEN %(origin)s > %(after_key)s OR %(origin)s <= c.fair_key
            ELSE %(after_key)s < %(origin)s AND %(origin)s <= c.fair_key END AS went_round
FROM chosen AS c
WHERE c.fair_key IS NOT NULL

-- name: claim_gated_steps
-- Claim up to %(limit)s steps of one queue that limits apply to. Fair: the queue's keys are
-- taken in turn, starting after %(after_key)s (at most %(max_keys)s keys per claim), or the
-- keys %(only_keys)s when given, one step of each key per turn, each key's due steps in
-- priority order; each key's first per_key steps are looked at. A step is taken only
-- when every slot it needs is free (its kind's key, its run's key unless the run holds a
-- slot already, its rate budget, the queue's cap when %(capped)s); the slots go to the
-- claimed steps in the same statement, and concurrent claimers never share one (SKIP
-- LOCKED). Counts are conservative: a step can be left for the next claim, never let past
-- a limit. Autocommit, like claim_steps.
WITH RECURSIVE relaxed AS (
    SELECT set_config('synchronous_commit', 'off', true) AS synchronous_commit
),
{{gate_key_window}},
-- A one-time filter each: the window is not walked for a claim of given keys.
claim_keys AS (
    SELECT fair_key, key_ord FROM keys WHERE %(only_keys)b::text[] IS NULL
    UNION ALL
    SELECT u.fair_key, u.key_ord
    FROM unnest(%(only_keys)b::text[]) WITH ORDINALITY AS u(fair_key, key_ord)
    WHERE %(only_keys)b::text[] IS NOT NULL
),
per_key AS (
    SELECT ceil(%(limit)s::float8 / greatest(count(*), 1))::int AS n FROM claim_keys
),
picked AS (
    SELECT c.*, k.key_ord
    FROM claim_keys AS k
    CROSS JOIN LATERAL (
        SELECT s.id, s.run_id, g.fair_key, g.priority, g.step_scope, g.step_key,
               g.run_scope, g.run_key, g.rate_scope, g.rate_key, g.rate_units
        FROM cyclone_ext_gates AS g
        JOIN cyclone_steps AS s ON s.id = g.step_id
        WHERE g.queue = %(queue)s AND g.fair_key = k.fair_key
          AND {{claimable_by_id}}
        ORDER BY g.priority DESC, g.step_id
        LIMIT (SELECT n FROM per_key)
        FOR NO KEY UPDATE OF s SKIP LOCKED
    ) AS c
),
-- Steps of runs that hold their run slot need no new one, and must not wait behind runs
-- that wait for one: fan-out items and later nodes have higher ids (and may have lower
-- priorities) than the queued runs' first steps, which alone would fill the picks above
-- while the run holding the slot could never end. The holders are read from the run slots
-- the picked steps wait for (their run keys, which may differ from the key they are
-- queued under: a step with a concurrency key of its own is queued under that key), and
-- their steps by id: never by walking a key's queue.
held AS (
    SELECT s.id, s.run_id, g.fair_key, g.priority, g.step_scope, g.step_key,
           g.run_scope, g.run_key, g.rate_scope, g.rate_key, g.rate_units, k.key_ord
    FROM cyclone_steps AS s
    JOIN cyclone_ext_gates AS g ON g.step_id = s.id
    JOIN claim_keys AS k ON k.fair_key = g.fair_key
    WHERE s.id = ANY(ARRAY(
            SELECT hg.step_id FROM cyclone_ext_gates AS hg
            WHERE hg.run_id = ANY(ARRAY(
                    SELECT h.holder
                    FROM (SELECT DISTINCT p.run_scope, p.run_key FROM picked AS p
                          WHERE p.run_scope IS NOT NULL) AS w
                    CROSS JOIN LATERAL (  -- per run key, through the slots' key (OFFSET 0:
                        -- as a join it was planned as a scan of every slot)
                        SELECT h.holder FROM cyclone_ext_slots AS h
                        WHERE h.scope = w.run_scope AND h.key = w.run_key
                          AND h.holder IS NOT NULL
                        OFFSET 0
                    ) AS h))
              -- One CASE: no index on queue may drive this plan (a walk of the queue).
              AND CASE WHEN hg.queue = %(queue)s THEN true ELSE false END))
      AND {{claimable_by_id}}
    ORDER BY g.priority DESC, g.step_id
    LIMIT %(limit)s
    FOR NO KEY UPDATE OF s SKIP LOCKED
),
cands AS (
    SELECT p.*,
           row_number() OVER (PARTITION BY p.fair_key ORDER BY p.priority DESC, p.id) AS turn
    FROM (SELECT * FROM picked UNION SELECT * FROM held) AS p
),
limited AS (
    SELECT scope, max_count, per FROM cyclone_ext_limits
    WHERE scope IN (SELECT step_scope FROM cands UNION SELECT run_scope FROM cands
                    UNION SELECT rate_scope FROM cands
                    UNION SELECT 'queue:' || %(queue)s WHERE %(capped)s)
),
needs AS (
    SELECT c.id, c.step_scope AS scope, c.step_key AS key, 1 AS units, NULL::bigint AS run_id
    FROM cands AS c JOIN limited AS l ON l.scope = c.step_scope
    UNION ALL
    SELECT c.id, c.run_scope, c.run_key, 1, c.run_id
    FROM cands AS c JOIN limited AS l ON l.scope = c.run_scope
    -- A scalar subquery, probed per candidate through the slots' key: written as NOT
    -- EXISTS it became an anti-join that hashed every slot of every limit (a rate limit of
    -- 50,000 a second has 50,000 slots).
    WHERE (SELECT 1 FROM cyclone_ext_slots AS h
           WHERE h.scope = c.run_scope AND h.key = c.run_key AND h.holder = c.run_id
           LIMIT 1) IS NULL
    UNION ALL
    -- A step queued with more units than its budget has now (a deploy lowered the limit,
    -- or kinds sharing a budget declare different limits) takes the whole budget: it would
    -- never start, and every later step of the budget would wait behind it.
    SELECT c.id, c.rate_scope, c.rate_key, least(c.rate_units, l.max_count), NULL
    FROM cands AS c JOIN limited AS l ON l.scope = c.rate_scope
    UNION ALL
    SELECT c.id, l.scope, '', 1, NULL
    FROM cands AS c JOIN limited AS l ON l.scope = 'queue:' || %(queue)s
),
-- How many slots of each limited share the candidates could use (a run slot: one per run).
wanted AS (
    SELECT n.scope, n.key,
           CASE WHEN bool_or(n.run_id IS NOT NULL) THEN count(DISTINCT n.run_id)
                ELSE sum(n.units) END::int AS n
    FROM needs AS n GROUP BY n.scope, n.key
),
-- The free slots, locked, at most as many per share as wanted, least recently used first.
-- Whether a slot is free is decided from rows the statement locks: a claimer that finds a
-- slot or its holder changed since its snapshot re-checks both as they are now (a
-- condition in a subquery would be re-checked on the old snapshot, and two claimers could
-- take one slot). The holder is locked FOR SHARE, which conflicts with the claim's FOR NO
-- KEY UPDATE: a FOR KEY SHARE lock would be taken on the version of the snapshot without
-- seeing that the holder was claimed again meanwhile.
empty_slots AS (
    SELECT f.* FROM wanted AS w
    JOIN limited AS l ON l.scope = w.scope
    CROSS JOIN LATERAL (
        SELECT sl.scope, sl.key, sl.slot
        FROM cyclone_ext_slots AS sl
        WHERE sl.scope = w.scope AND sl.key = w.key AND sl.slot <= l.max_count
          AND CASE WHEN l.per IS NOT NULL
                   THEN sl.used_at IS NULL OR sl.used_at <= now() + %(shift)s::interval - l.per
                   ELSE sl.holder IS NULL END
        ORDER BY sl.used_at NULLS FIRST, sl.slot
        LIMIT w.n
        FOR UPDATE OF sl SKIP LOCKED
    ) AS f
),
-- The holder is joined by = ANY(ARRAY[...]), which cannot be hashed: as x.id = sl.holder
-- the planner hashed every step (or run) that was not running whenever the table looked
-- small; now each slot's holder is probed by key.
slots_of_ended_steps AS (
    SELECT f.* FROM wanted AS w
    JOIN limited AS l ON l.scope = w.scope
    CROSS JOIN LATERAL (
        SELECT sl.scope, sl.key, sl.slot
        FROM cyclone_ext_slots AS sl
        JOIN cyclone_steps AS x ON x.id = ANY(ARRAY[sl.holder])
        WHERE sl.scope = w.scope AND sl.key = w.key AND sl.slot <= l.max_count
          AND l.per IS NULL AND w.scope NOT LIKE 'run:%%'
          AND NOT {{held_by_current_claim}}
        ORDER BY sl.used_at NULLS FIRST, sl.slot
        LIMIT w.n
        FOR UPDATE OF sl SKIP LOCKED
        FOR SHARE OF x SKIP LOCKED
    ) AS f
),
slots_of_ended_runs AS (
    SELECT f.* FROM wanted AS w
    JOIN limited AS l ON l.scope = w.scope
    CROSS JOIN LATERAL (
        SELECT sl.scope, sl.key, sl.slot
        FROM cyclone_ext_slots AS sl
        JOIN cyclone_runs AS x ON x.id = ANY(ARRAY[sl.holder])
        WHERE sl.scope = w.scope AND sl.key = w.key AND sl.slot <= l.max_count
          AND l.per IS NULL AND w.scope LIKE 'run:%%'
          AND x.state NOT IN ('running', 'paused')
        ORDER BY sl.used_at NULLS FIRST, sl.slot
        LIMIT w.n
        FOR UPDATE OF sl SKIP LOCKED
        FOR SHARE OF x SKIP LOCKED
    ) AS f
),
locked_free AS (
    SELECT * FROM empty_slots
    UNION ALL SELECT * FROM slots_of_ended_steps
    UNION ALL SELECT * FROM slots_of_ended_runs
),
free AS (
    SELECT scope, key, slot, row_number() OVER (PARTITION BY scope, key ORDER BY slot) AS rank
    FROM locked_free
),
-- Slots numbered beyond a lowered limit whose holder still runs: they count against it.
-- Counted only for a share whose last slot lies beyond its limit (read backwards through
-- the primary key): a join was planned as a sort of every slot of every limit, and a count
-- of slot > max_count could walk every slot of the share by another index.
excess AS (
    SELECT w.scope, w.key, x.n
    FROM wanted AS w
    JOIN limited AS l ON l.scope = w.scope
    CROSS JOIN LATERAL (
        SELECT count(*) AS n FROM cyclone_ext_slots AS sl
        WHERE sl.scope = w.scope AND sl.key = w.key AND sl.slot > l.max_count
          AND {{slot_in_use}}
    ) AS x
    WHERE (SELECT sl.slot FROM cyclone_ext_slots AS sl
           WHERE sl.scope = w.scope AND sl.key = w.key
           ORDER BY sl.slot DESC LIMIT 1) > l.max_count
),
free_count AS (
    SELECT f.scope, f.key, count(*) - coalesce(max(e.n), 0) AS n
    FROM locked_free AS f
    LEFT JOIN excess AS e ON e.scope = f.scope AND e.key = f.key
    GROUP BY f.scope, f.key
),
-- Candidates that no share can serve (one they need has no free slot: their key is at its
-- limit) claim nothing and must not count against the others: in a queue cap or a rate
-- budget shared with other keys, a blocked key's step counted first would take the only
-- free slot on paper, and nothing would be claimed while that key stays at its limit.
hopeless AS (
    SELECT DISTINCT n.id FROM needs AS n
    LEFT JOIN free_count AS f ON f.scope = n.scope AND f.key = n.key
    WHERE coalesce(f.n, 0) < n.units
),
demand AS (
    SELECT n.id, n.scope, n.key,
           CASE WHEN n.run_id IS NOT NULL
                THEN dense_rank() OVER (PARTITION BY n.scope, n.key ORDER BY n.run_id)
                ELSE sum(n.units) OVER (PARTITION BY n.scope, n.key
                                        ORDER BY c.turn, c.key_ord, n.id)
           END AS upto
    FROM needs AS n JOIN cands AS c ON c.id = n.id
    WHERE n.id NOT IN (SELECT id FROM hopeless)
),
fitting AS (
    SELECT c.id, c.run_id, c.fair_key, c.turn, c.key_ord FROM cands AS c
    WHERE c.id NOT IN (SELECT id FROM hopeless)
      AND NOT EXISTS (
        SELECT 1 FROM demand AS d
        LEFT JOIN free_count AS f ON f.scope = d.scope AND f.key = d.key
        WHERE d.id = c.id AND d.upto > coalesce(f.n, 0))
),
first_fitting AS (
    SELECT * FROM fitting ORDER BY turn, key_ord LIMIT %(limit)s
),
-- A step of a run below a run past its deadline is left (after the LIMIT), before it takes
-- a slot.
selected AS (
    SELECT s.* FROM first_fitting AS s WHERE {{no_ancestor_past_deadline}}
),
assigned AS (
    SELECT n.id, n.scope, n.key, n.units, n.run_id,
           CASE WHEN n.run_id IS NOT NULL
                THEN dense_rank() OVER (PARTITION BY n.scope, n.key ORDER BY n.run_id)
                ELSE sum(n.units) OVER (PARTITION BY n.scope, n.key
                                        ORDER BY s.turn, s.key_ord, n.id)
           END AS upto
    FROM needs AS n JOIN selected AS s ON s.id = n.id
),
taken AS (
    UPDATE cyclone_ext_slots AS sl
    SET holder = coalesce(a.run_id, a.id), used_at = now() + %(shift)s::interval
    FROM assigned AS a
    JOIN free AS f ON f.scope = a.scope AND f.key = a.key
                  AND f.rank > a.upto - a.units AND f.rank <= a.upto
    WHERE sl.scope = f.scope AND sl.key = f.key AND sl.slot = f.slot
    RETURNING sl.slot
),
chosen AS (
    SELECT id FROM selected
),
{{claim_update}}
-- A full claim that leaves steps it could take had it more room wakes the queue's claimers
-- at its commit: it locked those steps and their slots, and a claimer running beside it
-- skipped them (SKIP LOCKED), with nothing else to wake it (pg_notify sends one per payload
-- and transaction).
SELECT {{claim_result}}, sel.fair_key, sel.turn, sel.key_ord, (SELECT n FROM per_key) AS per_key,
       CASE WHEN (SELECT count(*) FROM fitting) > (SELECT count(*) FROM first_fitting)
            THEN pg_notify('cyclone_work', %(queue)s) END AS left_behind
FROM claimed AS c CROSS JOIN relaxed
{{claimed_run}}
JOIN selected AS sel ON sel.id = c.id

-- name: claim_capped_steps
-- claim_steps for a queue with a cap across all workers: as many steps as the queue has
-- free slots (at most %(limit)s), each taking one (FOR UPDATE SKIP LOCKED).
WITH relaxed AS (
    SELECT set_config('synchronous_commit', 'off', true) AS synchronous_commit
),
-- The free slots of the queue, locked (see claim_gated_steps: freedom is decided from
-- locked rows only).
empty_slots AS (
    SELECT sl.slot
    FROM cyclone_ext_slots AS sl
    JOIN cyclone_ext_limits AS l ON l.scope = sl.scope
    WHERE sl.scope = 'queue:' || %(queue)s AND sl.key = '' AND sl.slot <= l.max_count
      AND sl.holder IS NULL
    ORDER BY sl.slot
    LIMIT %(limit)s
    FOR UPDATE OF sl SKIP LOCKED
),
slots_of_ended_steps AS (
    SELECT sl.slot
    FROM cyclone_ext_slots AS sl
    JOIN cyclone_ext_limits AS l ON l.scope = sl.scope
    JOIN cyclone_steps AS x ON x.id = ANY(ARRAY[sl.holder])  -- probed (slots_of_ended_steps)
    WHERE sl.scope = 'queue:' || %(queue)s AND sl.key = '' AND sl.slot <= l.max_count
      AND NOT {{held_by_current_claim}}
    ORDER BY sl.slot
    LIMIT %(limit)s
    FOR UPDATE OF sl SKIP LOCKED
    FOR SHARE OF x SKIP LOCKED
),
locked_free AS (
    SELECT slot FROM empty_slots UNION ALL SELECT slot FROM slots_of_ended_steps
),
free AS (
    SELECT slot, row_number() OVER (ORDER BY slot) AS rank FROM locked_free
),
-- Slots beyond a lowered cap whose holder still runs count against it.
excess AS (
    SELECT count(*) AS n
    FROM cyclone_ext_slots AS sl
    JOIN cyclone_ext_limits AS l ON l.scope = sl.scope
    WHERE sl.scope = 'queue:' || %(queue)s AND sl.key = '' AND sl.slot > l.max_count
      AND EXISTS (SELECT 1 FROM cyclone_steps AS x
                  WHERE x.id = sl.holder AND {{held_by_current_claim}})
),
-- As many steps as there are free slots. The inner LIMIT is what the planner sizes the
-- claim by (a LIMIT it cannot evaluate counts as a tenth of the queue: on a large queue,
-- an estimate above jit_above_cost); the outer one stops pulling rows, so no more steps
-- are locked than it takes.
cands AS (
    SELECT s.id FROM ({{next_ungated_steps}}) AS s WHERE {{no_ancestor_past_deadline}}
    LIMIT greatest(0, least(%(limit)s, (SELECT count(*) FROM locked_free) - (SELECT n FROM excess)))
),
ranked AS (
    SELECT id, row_number() OVER (ORDER BY id) AS rank FROM cands
),
taken AS (
    UPDATE cyclone_ext_slots AS sl
    SET holder = ranked.id, used_at = now() + %(shift)s::interval
    FROM ranked JOIN free ON free.rank = ranked.rank
    WHERE sl.scope = 'queue:' || %(queue)s AND sl.key = '' AND sl.slot = free.slot
    RETURNING sl.holder
),
chosen AS (
    SELECT holder AS id FROM taken
),
{{claim_chosen}}

-- name: hold_queue_slots
-- A cap set on queue %(queue)s (scope %(scope)s) counts the steps of it that already run
-- (claimed before the cap, or by a worker yet to read it): each takes a slot without a
-- holder as its claim would have (used_at its started_at, see held_by_current_claim), or
-- one numbered past the top slot, which claim_capped_steps counts as a lowered cap's
-- excess. No new step of the queue starts until they are below the cap. Slots are read
-- through their key (a cap of 100,000 has as many), and only as many as there are steps.
WITH running AS (
    SELECT s.id, s.started_at, row_number() OVER (ORDER BY s.id) AS n
    FROM cyclone_steps AS s
    WHERE s.state = 'running' AND s.queue = %(queue)s
      AND NOT EXISTS (SELECT 1 FROM cyclone_ext_slots AS sl
                      WHERE sl.scope = %(scope)s AND sl.key = ''
                        AND sl.used_at >= s.started_at AND sl.holder = s.id)
),
free AS (
    SELECT f.slot, row_number() OVER (ORDER BY f.slot) AS n
    FROM (SELECT sl.slot FROM cyclone_ext_slots AS sl
          WHERE sl.scope = %(scope)s AND sl.key = '' AND sl.holder IS NULL
          ORDER BY sl.slot
          LIMIT (SELECT count(*) FROM running)
          FOR UPDATE SKIP LOCKED) AS f
),
given AS (
    UPDATE cyclone_ext_slots AS sl SET holder = r.id, used_at = r.started_at
    FROM running AS r JOIN free AS f ON f.n = r.n
    -- EXISTS: nothing is read when no running step needs a slot (the usual case); else
    -- this reads the cap's slots once (an operator's call).
    WHERE EXISTS (SELECT 1 FROM free)
      AND sl.scope = %(scope)s AND sl.key = '' AND sl.slot = f.slot
    RETURNING sl.slot
)
INSERT INTO cyclone_ext_slots (scope, key, slot, holder, used_at)
SELECT %(scope)s, '',
       (SELECT coalesce(max(sl.slot), 0) FROM cyclone_ext_slots AS sl
        WHERE sl.scope = %(scope)s AND sl.key = '')
           + r.n - (SELECT count(*) FROM free),
       r.id, r.started_at
FROM running AS r
WHERE r.n > (SELECT count(*) FROM free)
ON CONFLICT (scope, key, slot) DO NOTHING

-- name: queue_caps
-- The queues capped across all workers, with their caps.
SELECT substr(scope, 7) AS queue, max_count FROM cyclone_ext_limits
WHERE scope LIKE 'queue:%%' ORDER BY scope

-- name: queues_with_gates
-- Which of these queues hold work that limits apply to (not parked): a worker whose own
-- definitions declare no limit claims it too (an earlier deploy's limited work).
SELECT q AS queue FROM unnest(%(queues)b::text[]) AS q
WHERE EXISTS (SELECT 1 FROM cyclone_ext_gates AS g WHERE g.queue = q)

-- name: gated_queues
-- Every queue holding limited work not parked, read one by one through idx_ext_gates_claim
-- (a loose index scan): the claimers to wake when a limit was raised.
WITH RECURSIVE q(queue) AS (
    (SELECT g.queue FROM cyclone_ext_gates AS g WHERE g.queue > '' ORDER BY g.queue LIMIT 1)
    UNION ALL
    SELECT (SELECT g.queue FROM cyclone_ext_gates AS g
            WHERE g.queue > q.queue ORDER BY g.queue LIMIT 1)
    FROM q WHERE q.queue IS NOT NULL
)
SELECT queue FROM q WHERE queue IS NOT NULL

-- name: queues_waiting_for_run_slots
-- The queues of live steps gated on a run slot that one of these ended runs held (same run
-- scope and key): a run slot frees with no write, so the run's end wakes their claimers.
-- Each key's queues are read one by one through idx_ext_gates_run_slot (a loose index
-- scan), however many steps wait on it.
WITH RECURSIVE freed AS (
    SELECT DISTINCT k.run_scope, k.run_key
    FROM unnest(%(run_ids)b::bigint[]) AS e(run_id)
    CROSS JOIN LATERAL (
        SELECT g.run_scope, g.run_key FROM cyclone_ext_gates AS g
        WHERE g.run_id = e.run_id AND g.run_scope IS NOT NULL
        LIMIT 1
    ) AS k
), waiting (run_scope, run_key, queue) AS (
    SELECT f.run_scope, f.run_key,
           (SELECT w.queue FROM cyclone_ext_gates AS w
            WHERE w.run_scope = f.run_scope AND w.run_key = f.run_key
              AND w.run_scope IS NOT NULL AND w.queue <> ''
            ORDER BY w.queue LIMIT 1)
    FROM freed AS f
    UNION ALL
    SELECT q.run_scope, q.run_key,
           (SELECT w.queue FROM cyclone_ext_gates AS w
            WHERE w.run_scope = q.run_scope AND w.run_key = q.run_key
              AND w.run_scope IS NOT NULL AND w.queue <> '' AND w.queue > q.queue
            ORDER BY w.queue LIMIT 1)
    FROM waiting AS q
    WHERE q.queue IS NOT NULL
)
SELECT DISTINCT queue FROM waiting WHERE queue IS NOT NULL

-- name: queues_waiting_for_step_slots
-- The queues of live steps gated on a step slot that one of these steps held (same step
-- scope and key): a step slot frees with no write, and it is the key's in every queue, so
-- its holder's end wakes their claimers. Each key's queues are read one by one through
-- idx_ext_gates_step_slot (a loose index scan), however many steps wait on it.
WITH RECURSIVE freed AS (
    SELECT DISTINCT k.step_scope, k.step_key
    FROM unnest(%(ids)b::bigint[]) AS e(step_id)
    CROSS JOIN LATERAL (
        SELECT g.step_scope, g.step_key FROM cyclone_ext_gates AS g
        WHERE g.step_id = e.step_id AND g.step_scope IS NOT NULL
        LIMIT 1
    ) AS k
), waiting (step_scope, step_key, queue) AS (
    SELECT f.step_scope, f.step_key,
           (SELECT w.queue FROM cyclone_ext_gates AS w
            WHERE w.step_scope = f.step_scope AND w.step_key = f.step_key
              AND w.step_scope IS NOT NULL AND w.queue <> ''
            ORDER BY w.queue LIMIT 1)
    FROM freed AS f
    UNION ALL
    SELECT q.step_scope, q.step_key,
           (SELECT w.queue FROM cyclone_ext_gates AS w
            WHERE w.step_scope = q.step_scope AND w.step_key = q.step_key
              AND w.step_scope IS NOT NULL AND w.queue <> '' AND w.queue > q.queue
            ORDER BY w.queue LIMIT 1)
    FROM waiting AS q
    WHERE q.queue IS NOT NULL
)
SELECT DISTINCT queue FROM waiting WHERE queue IS NOT NULL

-- name: delete_limit
-- Remove a limit (a queue's cap); its slots go with it.
DELETE FROM cyclone_ext_limits WHERE scope = %(scope)s RETURNING scope

-- name: park_ended_gates
-- Park a page of the gate rows whose steps have ended (queue '': no claim walks past them
-- any more); return the last step id looked at, for the next page. The ended steps are
-- locked and their state read again as committed: an operator retry that brought one back
-- (and unparked its gate) after this statement's snapshot must not see its gate parked
-- again, or the step would never be claimed.
WITH page AS (
    SELECT g.step_id, s.state FROM cyclone_ext_gates AS g
    JOIN cyclone_steps AS s ON s.id = g.step_id
    WHERE g.step_id > %(after_id)s AND g.queue <> ''
    ORDER BY g.step_id
    LIMIT %(limit)s
), ended AS (
    SELECT s.id FROM cyclone_steps AS s
    WHERE s.id = ANY(ARRAY(SELECT p.step_id FROM page AS p
                           WHERE p.state IN ('completed', 'discarded', 'cancelled')))
      AND {{ended_gate_step}}
    ORDER BY s.id
    FOR SHARE OF s
), parked AS (
    UPDATE cyclone_ext_gates AS g SET queue = ''
    FROM ended
    WHERE g.step_id = ended.id
    RETURNING g.step_id
)
SELECT (SELECT count(*) FROM parked) AS parked, (SELECT count(*) FROM page) AS seen,
       (SELECT max(step_id) FROM page) AS last_id

-- fragment: ended_gate_step
-- The step s of a gate that park_ended_gates parks (scan_probe looks for one).
s.state IN ('completed', 'discarded', 'cancelled')

-- name: park_gates_of_steps
-- Park the gates of steps that just ended (queue '': no claim walks past them). Gate
-- rows are locked in step id order; one another transaction holds (the scanner parking
-- it) is skipped: that transaction parks it.
UPDATE cyclone_ext_gates AS g SET queue = ''
WHERE g.step_id = ANY(ARRAY(
    SELECT l.step_id FROM cyclone_ext_gates AS l
    WHERE l.step_id = ANY(%(ids)b::bigint[]) AND l.queue <> ''
    ORDER BY l.step_id
    FOR NO KEY UPDATE SKIP LOCKED))

-- name: release_run_slots
-- An operator retry reopens this ended run: the run slots it held are let go, and it takes
-- one again as a new run would (under the limit as it is now, which may have been lowered).
UPDATE cyclone_ext_slots AS sl SET holder = NULL
WHERE sl.holder = %(run_id)s
  AND (sl.scope, sl.key) IN (SELECT DISTINCT g.run_scope, g.run_key FROM cyclone_ext_gates AS g
                             WHERE g.run_id = %(run_id)s AND g.run_scope IS NOT NULL)

-- name: unpark_gates
-- An operator retry brought steps of this run back: their gate rows take their queue again.
UPDATE cyclone_ext_gates AS g SET queue = s.queue
FROM cyclone_steps AS s
WHERE g.run_id = %(run_id)s AND g.queue = '' AND s.id = g.step_id
  AND s.state NOT IN ('completed', 'discarded', 'cancelled')

-- name: charge_rate_units
-- Charge units a handler reported beyond what its claim took (ctx.rate_limit_units): the
-- budget's least recently used slots count as used now, so later starts wait for them.
WITH wanted AS (
    SELECT g.rate_scope AS scope, g.rate_key AS key, sum(e.extra) AS extra
    FROM unnest(%(ids)b::bigint[], %(extra)b::int[]) AS e(step_id, extra)
    JOIN cyclone_ext_gates AS g ON g.step_id = e.step_id
    WHERE g.rate_scope IS NOT NULL AND e.extra > 0
    GROUP BY 1, 2
), oldest AS (
    SELECT sl.scope, sl.key, sl.slot
    FROM wanted AS w
    CROSS JOIN LATERAL (
        SELECT s2.scope, s2.key, s2.slot FROM cyclone_ext_slots AS s2
        WHERE s2.scope = w.scope AND s2.key = w.key
        ORDER BY s2.used_at NULLS FIRST, s2.slot
        LIMIT w.extra
        FOR UPDATE
    ) AS sl
)
UPDATE cyclone_ext_slots AS sl SET used_at = now() + %(shift)s::interval
FROM oldest
WHERE sl.scope = oldest.scope AND sl.key = oldest.key AND sl.slot = oldest.slot

-- fragment: slot_in_use
-- Whether slot sl of limit l is taken: a rate slot used within its window, a run slot
-- held by a run not ended, a step or queue slot held by a running step.
CASE
    WHEN l.per IS NOT NULL THEN
        sl.used_at IS NOT NULL AND sl.used_at > now() + %(shift)s::interval - l.per
    WHEN l.scope LIKE 'run:%%' THEN
        EXISTS (SELECT 1 FROM cyclone_runs AS x
                WHERE x.id = sl.holder AND x.state IN ('running', 'paused'))
    ELSE
        EXISTS (SELECT 1 FROM cyclone_steps AS x
                WHERE x.id = sl.holder AND {{held_by_current_claim}})
END

-- fragment: held_by_current_claim
-- Step x (running) holds slot sl through the claim that runs it now: that claim set the
-- slot's used_at and the step's started_at to one time. A slot the step took for an
-- earlier execution (before a retry or a reclaim, when the claim took another slot) is
-- free: a step holds one slot of a share, never two.
coalesce(x.state = 'running' AND sl.used_at >= x.started_at, false)

-- name: flow_stats
-- Per limited (scope, key): the limit, how many of its slots are taken, how many due steps
-- wait for it, and for a rate the time its next slot frees.
WITH usage AS (
    SELECT l.scope, sl.key, l.max_count, l.per,
           count(*) FILTER (WHERE {{slot_in_use}}) AS in_use,
           min(sl.used_at) FILTER (WHERE {{slot_in_use}}) AS oldest_use
    FROM cyclone_ext_limits AS l
    JOIN cyclone_ext_slots AS sl ON sl.scope = l.scope
    GROUP BY l.scope, sl.key, l.max_count, l.per
), waiting AS (
    SELECT scope, key, count(*) AS n FROM (
        SELECT g.step_scope AS scope, g.step_key AS key, g.step_id
        FROM cyclone_ext_gates AS g WHERE g.queue <> '' AND g.step_scope IS NOT NULL
        UNION ALL
        SELECT g.run_scope, g.run_key, g.step_id
        FROM cyclone_ext_gates AS g WHERE g.queue <> '' AND g.run_scope IS NOT NULL
        UNION ALL
        SELECT g.rate_scope, g.rate_key, g.step_id
        FROM cyclone_ext_gates AS g WHERE g.queue <> '' AND g.rate_scope IS NOT NULL
    ) AS w
    JOIN cyclone_steps AS s ON s.id = w.step_id AND s.state = 'available'
    GROUP BY scope, key
)
SELECT u.scope, u.key, u.max_count, extract(epoch FROM u.per)::float8 AS per_s, u.in_use,
       CASE WHEN u.scope LIKE 'queue:%%' THEN
                (SELECT count(*) FROM cyclone_steps AS s
                 WHERE s.queue = substr(u.scope, 7) AND s.state = 'available')
            ELSE coalesce(w.n, 0) END AS waiting,
       CASE WHEN u.per IS NOT NULL AND u.in_use >= u.max_count
            THEN u.oldest_use + u.per END AS next_free_at
FROM usage AS u
LEFT JOIN waiting AS w ON w.scope = u.scope AND w.key = u.key
ORDER BY u.scope, u.key

-- name: gate_wait_reasons
-- For each due step of a run that a limit holds back: the limit, its key, how full it is
-- and, for a rate, when its next slot frees. A step is held back by a share without room
-- for what it needs (one slot; a rate budget: its units, as the claim takes them), and by
-- its queue's cap, gated or not.
WITH due_steps AS (
    SELECT s.id, s.queue FROM cyclone_steps AS s
    WHERE s.run_id = %(run_id)s AND s.state = 'available'
      AND s.scheduled_at <= now() + %(shift)s::interval
), due AS (
    SELECT g.* FROM cyclone_ext_gates AS g JOIN due_steps AS s ON s.id = g.step_id
), wanted AS (
    SELECT d.step_id, d.step_scope AS scope, d.step_key AS key, 1 AS units FROM due AS d
    WHERE d.step_scope IS NOT NULL
    UNION ALL
    SELECT d.step_id, d.run_scope, d.run_key, 1 FROM due AS d
    WHERE d.run_scope IS NOT NULL AND NOT EXISTS (
        SELECT 1 FROM cyclone_ext_slots AS h
        WHERE h.scope = d.run_scope AND h.key = d.run_key AND h.holder = d.run_id)
    UNION ALL
    SELECT d.step_id, d.rate_scope, d.rate_key, d.rate_units FROM due AS d
    WHERE d.rate_scope IS NOT NULL
    UNION ALL
    SELECT s.id, l.scope, '', 1 FROM due_steps AS s
    JOIN cyclone_ext_limits AS l ON l.scope = 'queue:' || s.queue
), usage AS (
    SELECT w.step_id, w.scope, w.key, l.max_count, least(w.units, l.max_count) AS units,
           count(*) FILTER (WHERE {{slot_in_use}}) AS in_use,
           min(sl.used_at) FILTER (WHERE {{slot_in_use}}) + l.per AS free_at
    FROM wanted AS w
    JOIN cyclone_ext_limits AS l ON l.scope = w.scope
    JOIN cyclone_ext_slots AS sl ON sl.scope = w.scope AND sl.key = w.key
    GROUP BY w.step_id, w.scope, w.key, w.units, l.max_count, l.per
)
SELECT s.node, u.scope, u.key, u.max_count, u.in_use, u.free_at
FROM usage AS u JOIN cyclone_steps AS s ON s.id = u.step_id
WHERE u.in_use + u.units > u.max_count
ORDER BY s.id, u.scope

-- name: lock_debounce_key
-- Serialise the submits of one debounce window (transaction-level advisory lock).
SELECT pg_advisory_xact_lock(%(namespace)s, hashtext(%(workflow)s || chr(31) || %(key)s))
    AS locked

-- name: open_debounce
-- The run of a (workflow, key) debounce window, if it has one.
SELECT run_id FROM cyclone_ext_debounce WHERE workflow = %(workflow)s AND key = %(key)s

-- name: hold_debounced
-- Hold a debounced run's available steps until %(delay)s from now, and record its window.
WITH held AS (
    UPDATE cyclone_steps SET scheduled_at = now() + %(shift)s::interval + %(delay)s::interval
    WHERE run_id = %(run_id)s AND state = 'available'
    RETURNING id
)
INSERT INTO cyclone_ext_debounce (workflow, key, run_id, fire_at)
VALUES (%(workflow)s, %(key)s, %(run_id)s, now() + %(shift)s::interval + %(delay)s::interval)
ON CONFLICT (workflow, key) DO UPDATE SET run_id = EXCLUDED.run_id, fire_at = EXCLUDED.fire_at
RETURNING (SELECT count(*) FROM held) AS held

-- name: move_debounced
-- Another submit in the window: the run takes the new input and deadline (none: NULL) and
-- starts %(delay)s from now, unless one of its steps was claimed or the run is of another
-- definition (another deploy's rows and edges); then nothing changes and the window closes.
-- A paused run is joined too, and stays paused; its deadline's clock starts at the resume
-- (which adds the pause's length: here counted from paused_at). A paused step of the held
-- run gets the later start as an available one does (one downstream of the run's first
-- steps can only activate after them, and activation keeps the later of the two times).
-- Each step row is checked as it is updated, so a claim racing this update is seen.
WITH unstarted AS (
    SELECT r.id FROM cyclone_runs AS r
    WHERE r.id = %(run_id)s AND r.state IN ('running', 'paused')
      AND r.def_version = %(def_version)s
      AND NOT EXISTS (SELECT 1 FROM cyclone_steps AS s
                      WHERE s.run_id = r.id
                        AND (s.lease_generation > 0
                             OR s.state NOT IN ('available', 'pending', 'paused')))
), steps AS (
    UPDATE cyclone_steps AS s
    SET input = n.input::jsonb,
        scheduled_at = CASE WHEN s.state IN ('available', 'paused')
                            THEN now() + %(shift)s::interval + %(delay)s::interval
                            ELSE s.scheduled_at END
    FROM unstarted, unnest(%(nodes)b::text[], %(inputs)b::text[]) AS n(node, input)
    WHERE s.run_id = unstarted.id AND s.node = n.node
      AND s.lease_generation = 0 AND s.state IN ('available', 'pending', 'paused')
    RETURNING s.id
), run AS (
    UPDATE cyclone_runs AS r
    SET input = %(input)s::jsonb, updated_at = now(),
        deadline_at = CASE WHEN r.state = 'paused' THEN r.paused_at
                           ELSE now() + %(shift)s::interval END
                      + %(deadline)s::interval
    FROM unstarted WHERE r.id = unstarted.id
    RETURNING r.id
), window_ AS (
    UPDATE cyclone_ext_debounce
    SET fire_at = now() + %(shift)s::interval + %(delay)s::interval
    WHERE workflow = %(workflow)s AND key = %(key)s AND run_id IN (SELECT id FROM run)
    RETURNING run_id
)
SELECT (SELECT count(*) FROM steps) AS moved, (SELECT count(*) FROM run) AS runs

-- name: delete_run_gates
-- Forget the gates of a run (a debounced run re-keyed by a later input).
DELETE FROM cyclone_ext_gates WHERE run_id = %(run_id)s

-- name: clear_lost_holders
-- Free the slots whose holder step or run no longer exists (purged): the claim takes only
-- slots without a holder, or whose holder it can lock and see has ended.
UPDATE cyclone_ext_slots AS sl SET holder = NULL
WHERE sl.holder IS NOT NULL
  AND CASE WHEN sl.scope LIKE 'run:%%'
           THEN NOT EXISTS (SELECT 1 FROM cyclone_runs AS x WHERE x.id = sl.holder)
           ELSE NOT EXISTS (SELECT 1 FROM cyclone_steps AS x WHERE x.id = sl.holder) END
RETURNING sl.scope
