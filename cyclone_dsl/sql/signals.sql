-- name: find_signal_wait
-- The wait node of a run that declares the signal name (single-name or wait_any), and
-- whether it waits past its timeout (no scanner has failed it yet). In a paused run the
-- timeout's clock stands still: past it only if it passed before the pause.
SELECT s.id, s.node, s.state, s.signal_name, s.signal_names, s.wait_count, s.output,
       (s.state = 'waiting_signal' AND s.wait_for IS NOT NULL
        AND s.scheduled_at <= coalesce((SELECT r.paused_at FROM cyclone_runs AS r
                                        WHERE r.id = s.run_id),
                                       now() + %(shift)s::interval)) AS timed_out
FROM cyclone_steps AS s
WHERE s.run_id = %(run_id)s
  AND (s.signal_name = %(name)s OR %(name)s = ANY(s.signal_names))
ORDER BY s.id
LIMIT 1
FOR NO KEY UPDATE

-- name: count_buffered_signals
-- Unconsumed mailbox rows for the given names of a run.
SELECT count(*) AS buffered
FROM cyclone_signals
WHERE run_id = %(run_id)s AND name = ANY(%(names)b::text[]) AND consumed_by IS NULL

-- name: insert_signal
-- Store one delivery in the mailbox, consumed at once or buffered.
INSERT INTO cyclone_signals (run_id, name, payload, consumed_by, consumed_at)
VALUES (%(run_id)s, %(name)s, %(payload)s::jsonb, %(consumed_by)s,
        CASE WHEN %(consumed_by)s::text IS NULL THEN NULL ELSE now() + %(shift)s::interval END)
RETURNING id

-- name: take_buffered_signals
-- Consume up to %(limit)s buffered deliveries for a wait, oldest first, and return them in
-- that order (an UPDATE returns its rows in no set order: a quorum's payloads came out of
-- delivery order when concurrent senders' rows lay on disk in another order).
WITH taken AS (
    SELECT id FROM cyclone_signals
    WHERE run_id = %(run_id)s AND name = ANY(%(names)b::text[]) AND consumed_by IS NULL
    ORDER BY id
    LIMIT %(limit)s
    FOR UPDATE
), consumed AS (
    UPDATE cyclone_signals AS g
    SET consumed_by = %(node)s, consumed_at = now() + %(shift)s::interval
    FROM taken
    WHERE g.id = taken.id
    RETURNING g.id, g.name, g.payload
)
SELECT id, name, payload FROM consumed ORDER BY id

-- name: complete_wait
-- Complete a waiting node with its output (a signal payload, a quorum, a timer).
UPDATE cyclone_steps AS s
SET state = 'completed', output = %(output)s::jsonb, completed_at = now() + %(shift)s::interval
WHERE s.id = %(id)s AND s.state IN ('waiting_signal', 'waiting_timer')
RETURNING s.id, s.run_id, s.node, s.item_of, true AS has_downstream

-- name: record_partial_quorum
-- Keep the payloads a wait_n has received so far in its output.
UPDATE cyclone_steps SET output = %(output)s::jsonb WHERE id = %(id)s AND state = 'waiting_signal'

-- name: find_wait_by_id
-- A wait node by id.
SELECT s.id, s.node, s.state, s.signal_name, s.signal_names, s.wait_count, s.output
FROM cyclone_steps AS s WHERE s.id = %(id)s

-- name: runs_with_buffered_signals
-- Of these runs, those holding a delivery no wait consumed yet (most just-activated waits
-- have none: one statement instead of two per wait).
SELECT DISTINCT g.run_id FROM cyclone_signals AS g
WHERE g.run_id = ANY(%(run_ids)b::bigint[]) AND g.consumed_by IS NULL
