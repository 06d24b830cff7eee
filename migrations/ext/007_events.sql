-- Extension 7: step events. What a running handler reports with ctx.emit() and
-- ctx.progress(), kept durably and read in order by followers (RunHandle.events(),
-- cyclone run --follow, the dashboard).
--
-- cyclone_ext_events: one row per event, numbered per run (seq 1, 2, ...), with the step,
-- node, attempt and lease generation of the execution that wrote it. fenced is true when
-- that execution did not hold the step's lease when it wrote the event, or lost its lease
-- later to a reclaim or a release (its step runs again): set at the insert, and by the
-- reclaim and release transitions. The rows go with their run (ON DELETE CASCADE), so a
-- purge removes them; idx_ext_events_step serves the fence marking.
--
-- cyclone_ext_event_seqs: the last seq given in each run. Its row lock orders a run's
-- event inserts, so they commit in seq order and a follower reading "after seq N" never
-- skips one that commits later.
--
-- cyclone_ext_event_counts: how many events each step has written, against the per-step
-- cap. Steps that emit nothing have no row in any of these tables.
--
-- Extension track: new tables and indexes only, never an ALTER of a core table (see
-- README.md in this folder).

CREATE TABLE cyclone_ext_events (
    run_id bigint NOT NULL REFERENCES cyclone_runs (id) ON DELETE CASCADE,
    seq bigint NOT NULL,
    step_id bigint NOT NULL,
    node text NOT NULL,
    attempt integer NOT NULL,           -- 1-based, like StepContext.attempt
    lease_generation bigint NOT NULL,   -- the claim that wrote it
    kind text NOT NULL CHECK (kind IN ('event', 'progress')),
    payload jsonb NOT NULL,
    fenced boolean NOT NULL DEFAULT false,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, seq)
);
CREATE INDEX idx_ext_events_step ON cyclone_ext_events (step_id, lease_generation);

CREATE TABLE cyclone_ext_event_seqs (
    run_id bigint PRIMARY KEY REFERENCES cyclone_runs (id) ON DELETE CASCADE,
    last_seq bigint NOT NULL
);

CREATE TABLE cyclone_ext_event_counts (
    step_id bigint PRIMARY KEY REFERENCES cyclone_steps (id) ON DELETE CASCADE,
    emitted integer NOT NULL
);

---- create above / drop below ----

-- Each index goes with its table.
DROP TABLE cyclone_ext_event_counts;
DROP TABLE cyclone_ext_event_seqs;
DROP TABLE cyclone_ext_events;
