-- name: record_event
-- Store one event of a running step (extension track). The step row is read FOR SHARE, so
-- a reclaim or release of its lease either committed before (the event is stored fenced)
-- or waits for this insert to commit (and then marks it fenced itself). The step's count
-- goes up only below the cap; the run's seq row, locked until the commit, numbers the
-- run's events in commit order. No row when the step does not exist; found but no seq
-- when the step reached the cap (nothing stored). %(decided)s: the worker has decided the
-- execution's end already (not committed yet, maybe): the event is fenced.
-- The COMMIT does not wait for its WAL flush (set_config(..., true)), as a claim's: the
-- step's completion commits synchronously and flushes its events with it, so a server
-- crash can only lose events of an execution whose outcome it loses too. The NOTIFY
-- (payload: the run id) goes with the commit, which then holds the notification lock only
-- briefly: it waits for no flush.
WITH relaxed AS (
    SELECT set_config('synchronous_commit', 'off', true) AS synchronous_commit
), step AS (
    SELECT s.id, s.run_id, s.node,
           s.state = 'running' AND s.lease_generation = %(generation)s
               AND NOT %(decided)s AS live
    FROM cyclone_steps AS s
    WHERE s.id = %(step_id)s
    FOR SHARE
), counted AS (
    INSERT INTO cyclone_ext_event_counts AS c (step_id, emitted)
    SELECT id, 1 FROM step
    ON CONFLICT (step_id) DO UPDATE SET emitted = c.emitted + 1
    WHERE c.emitted < %(cap)s
    RETURNING c.step_id
), numbered AS (
    INSERT INTO cyclone_ext_event_seqs AS q (run_id, last_seq)
    SELECT step.run_id, 1 FROM step JOIN counted ON counted.step_id = step.id
    ON CONFLICT (run_id) DO UPDATE SET last_seq = q.last_seq + 1
    RETURNING q.run_id, q.last_seq
), recorded AS (
    INSERT INTO cyclone_ext_events (run_id, seq, step_id, node, attempt, lease_generation,
                                    kind, payload, fenced, created_at)
    SELECT step.run_id, numbered.last_seq, step.id, step.node, %(attempt)s, %(generation)s,
           %(kind)s, %(payload)s::jsonb, NOT step.live, now() + %(shift)s::interval
    FROM step JOIN numbered ON numbered.run_id = step.run_id
    RETURNING seq, fenced
)
SELECT step.run_id, step.node, recorded.seq, recorded.fenced,
       CASE WHEN recorded.seq IS NOT NULL
            THEN pg_notify('cyclone_events', step.run_id::text) END AS woken
FROM step CROSS JOIN relaxed LEFT JOIN recorded ON true

-- name: record_events
-- record_event for a batch: store events of running steps, in the order given (``ord``
-- from 1). About twice record_event's cost for one event, a tenth per event for a hundred.
-- Each step row is read FOR SHARE, so a reclaim or release of its lease either committed
-- before (its events are stored fenced) or waits for this insert to commit (and then
-- marks them fenced itself). A step stores its events in the order given while below the
-- cap (those past it get no seq: nothing stored); each run's seq row, locked until the
-- commit, numbers its events in commit order, and in the order given within a batch.
-- Locks are taken in one order: the steps by id, their counts by step id, then the runs'
-- seq rows by run id (completions lock steps in id order too), so batches never wait on
-- each other in a cycle. One row per event, in order: no run_id when its step does not
-- exist. %(decided)s: the worker has decided the execution's end already (not committed
-- yet, maybe): the event is fenced.
-- The COMMIT does not wait for its WAL flush (set_config(..., true)), as a claim's: the
-- step's completion commits synchronously and flushes its events with it, so a server
-- crash can only lose events of an execution whose outcome it loses too. The NOTIFY
-- (payload: a run id) goes with the commit, which then holds the notification lock only
-- briefly: it waits for no flush.
WITH relaxed AS (
    SELECT set_config('synchronous_commit', 'off', true) AS synchronous_commit
), given AS (
    SELECT g.step_id, g.generation, g.attempt, g.kind, g.payload, g.decided, g.ord
    FROM unnest(%(step_ids)b::bigint[], %(generations)b::bigint[], %(attempts)b::integer[],
                %(kinds)b::text[], %(payloads)b::text[], %(decided)b::boolean[])
        WITH ORDINALITY AS g(step_id, generation, attempt, kind, payload, decided, ord)
), step AS (
    SELECT s.id, s.run_id, s.node, s.state, s.lease_generation
    FROM cyclone_steps AS s
    WHERE s.id = ANY(%(step_ids)b::bigint[])
    ORDER BY s.id
    FOR SHARE
), prior AS (
    SELECT c.step_id, c.emitted
    FROM cyclone_ext_event_counts AS c
    WHERE c.step_id = ANY(%(step_ids)b::bigint[])
    ORDER BY c.step_id
    FOR UPDATE
), kept AS (
    SELECT w.* FROM (
        SELECT g.ord, g.step_id, g.generation, g.attempt, g.kind, g.payload, step.run_id,
               step.node,
               step.state = 'running' AND step.lease_generation = g.generation
                   AND NOT g.decided AS live,
               row_number() OVER (PARTITION BY g.step_id ORDER BY g.ord) AS nth,
               %(cap)s - coalesce(prior.emitted, 0) AS room
        FROM given AS g
        JOIN step ON step.id = g.step_id
        LEFT JOIN prior ON prior.step_id = g.step_id
    ) AS w
    WHERE w.nth <= w.room
), counted AS (
    INSERT INTO cyclone_ext_event_counts AS c (step_id, emitted)
    SELECT kept.step_id, count(*)::integer FROM kept GROUP BY kept.step_id ORDER BY kept.step_id
    ON CONFLICT (step_id) DO UPDATE SET emitted = c.emitted + excluded.emitted
    WHERE c.emitted + excluded.emitted <= %(cap)s
    RETURNING c.step_id
), numbered AS (
    INSERT INTO cyclone_ext_event_seqs AS q (run_id, last_seq)
    SELECT kept.run_id, count(*) FROM kept JOIN counted ON counted.step_id = kept.step_id
    GROUP BY kept.run_id ORDER BY kept.run_id
    ON CONFLICT (run_id) DO UPDATE SET last_seq = q.last_seq + excluded.last_seq
    RETURNING q.run_id, q.last_seq
), placed AS (
    SELECT kept.ord, kept.run_id, kept.step_id, kept.node, kept.attempt, kept.generation,
           kept.kind, kept.payload, kept.live,
           numbered.last_seq - count(*) OVER (PARTITION BY kept.run_id)
               + row_number() OVER (PARTITION BY kept.run_id ORDER BY kept.ord) AS seq
    FROM kept
    JOIN counted ON counted.step_id = kept.step_id
    JOIN numbered ON numbered.run_id = kept.run_id
), recorded AS (
    INSERT INTO cyclone_ext_events (run_id, seq, step_id, node, attempt, lease_generation,
                                    kind, payload, fenced, created_at)
    SELECT placed.run_id, placed.seq, placed.step_id, placed.node, placed.attempt,
           placed.generation, placed.kind, placed.payload::jsonb, NOT placed.live,
           now() + %(shift)s::interval
    FROM placed
    RETURNING run_id
), woken AS (
    SELECT count(pg_notify('cyclone_events', r.run_id::text)) AS runs
    FROM (SELECT DISTINCT recorded.run_id FROM recorded) AS r
)
SELECT g.ord, step.run_id, step.node, placed.seq, NOT placed.live AS fenced
FROM given AS g
LEFT JOIN step ON step.id = g.step_id
LEFT JOIN placed ON placed.ord = g.ord
CROSS JOIN relaxed
CROSS JOIN woken
ORDER BY g.ord

-- name: fence_events
-- The executions (step id, lease generation) lost their lease to a reclaim or a release:
-- their events are marked fenced. A statement of its own, after the step update, so that
-- its snapshot sees every event those executions committed.
UPDATE cyclone_ext_events AS e
SET fenced = true
FROM unnest(%(ids)b::bigint[], %(generations)b::bigint[]) AS f(id, generation)
WHERE e.step_id = f.id AND e.lease_generation = f.generation AND NOT e.fenced

-- name: run_events_after
-- A run's state and its events after seq ``after`` (at most ``limit``, in seq order), in
-- one snapshot: when the run is terminal here, every event it recorded is too. No row when
-- the run does not exist; one row with no seq when it has no such events.
SELECT r.state AS run_state, e.seq, e.step_id, e.node, e.attempt, e.kind, e.payload,
       e.fenced, e.created_at
FROM cyclone_runs AS r
LEFT JOIN LATERAL (
    SELECT x.seq, x.step_id, x.node, x.attempt, x.kind, x.payload, x.fenced, x.created_at
    FROM cyclone_ext_events AS x
    WHERE x.run_id = r.id AND x.seq > %(after)s
    ORDER BY x.seq
    LIMIT %(limit)s
) AS e ON true
WHERE r.id = %(run_id)s
ORDER BY e.seq

-- name: followed_events
-- For each follower (a run and its cursor, numbered from 1 by ``follower``): the run's state
-- and its events after the cursor (at most ``limit``, in seq order), all in one snapshot, as
-- run_events_after gives them for one. No row for a run that does not exist. The run is
-- probed per follower by a scalar subquery (a join could hash every run of the table).
SELECT f.follower, r.run_state, e.seq, e.step_id, e.node, e.attempt, e.kind,
       e.payload, e.fenced, e.created_at
FROM unnest(%(run_ids)b::bigint[], %(afters)b::bigint[]) WITH ORDINALITY
    AS f(run_id, after, follower)
CROSS JOIN LATERAL (
    SELECT (SELECT runs.state FROM cyclone_runs AS runs WHERE runs.id = f.run_id) AS run_state
) AS r
LEFT JOIN LATERAL (
    SELECT x.seq, x.step_id, x.node, x.attempt, x.kind, x.payload, x.fenced, x.created_at
    FROM cyclone_ext_events AS x
    WHERE x.run_id = f.run_id AND x.seq > f.after
    ORDER BY x.seq
    LIMIT %(limit)s
) AS e ON true
WHERE r.run_state IS NOT NULL
ORDER BY f.follower, e.seq
