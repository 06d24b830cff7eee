-- Extension 2: attempt history. One row for each execution of a step that did not end
-- in its completion: failed for good, retried, timed out, reclaimed after its lease
-- expired, or released by a stopping worker. attempt is the 1-based number of the
-- execution. The rows of a step go with it (ON DELETE CASCADE, so purging a run removes
-- its history); idx_ext_attempts_step serves both the cascade and the read of a step's
-- history in order.
--
-- Extension track: new tables and indexes only, never an ALTER of a core table (see
-- README.md in this folder).

CREATE TABLE cyclone_ext_attempts (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    step_id bigint NOT NULL REFERENCES cyclone_steps (id) ON DELETE CASCADE,
    run_id bigint NOT NULL,
    attempt integer NOT NULL,          -- 1-based number of the execution
    worker text,
    started_at timestamptz,
    ended_at timestamptz NOT NULL DEFAULT now(),
    outcome text NOT NULL,             -- 'failed', 'retried', 'timeout', 'reclaimed', 'released'
    error text,
    error_kind text,
    panic_stack text
);
CREATE INDEX idx_ext_attempts_step ON cyclone_ext_attempts (step_id, id);

---- create above / drop below ----

-- The index goes with its table.
DROP TABLE cyclone_ext_attempts;
