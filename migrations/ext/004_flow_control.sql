-- Extension 4: flow control across runs (concurrency keys, queue caps, rate limits, fair
-- claims) and debounced submits.
--
-- cyclone_ext_limits: one row per limited scope. A scope is 'step:<kind>' (steps of a kind
-- running at once, per key), 'run:<workflow>' (runs of a workflow not ended, per key),
-- 'queue:<queue>' (steps of a queue running at once, across all workers) or
-- 'rate:<name>' (starts per window of length per, per key). max_count is the limit.
--
-- cyclone_ext_slots: the limit as rows, max_count per (scope, key): a claim takes a free
-- slot row (FOR UPDATE SKIP LOCKED), so concurrent claimers never share one. A step or
-- queue slot is free when its holder step is not running (a reclaimed or finished step
-- frees it without any write); a run slot when its holder run has ended; a rate slot
-- when it was last used more than per ago. Slots beyond max_count are ignored.
--
-- cyclone_ext_gates: one row per step that a limit applies to, written when the step is
-- inserted. The claim's main path skips these steps; the gated path takes them per fair
-- key, in round-robin order across keys, when every slot they need is free. The scanner
-- parks the rows of ended steps (queue = '', which no queue is), so claims no longer walk
-- past them; an operator retry of the step puts its queue back. All go with their step
-- (ON DELETE CASCADE).
--
-- cyclone_ext_debounce: the open debounce window of a (workflow, key): the run whose first
-- steps wait until fire_at, and take the input of the last submit made before it.
--
-- Extension track: new tables and indexes only, never an ALTER of a core table (see
-- README.md in this folder).

CREATE TABLE cyclone_ext_limits (
    scope text PRIMARY KEY,
    max_count integer NOT NULL CHECK (max_count >= 1),
    per interval CHECK (per > interval '0'),
    updated_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE cyclone_ext_slots (
    scope text NOT NULL REFERENCES cyclone_ext_limits (scope) ON DELETE CASCADE,
    key text NOT NULL,
    slot integer NOT NULL,
    holder bigint,
    used_at timestamptz,
    PRIMARY KEY (scope, key, slot)
);
CREATE INDEX idx_ext_slots_use ON cyclone_ext_slots (scope, key, used_at NULLS FIRST, slot);

CREATE TABLE cyclone_ext_gates (
    step_id bigint PRIMARY KEY REFERENCES cyclone_steps (id) ON DELETE CASCADE,
    run_id bigint NOT NULL,
    queue text NOT NULL,
    priority integer NOT NULL,
    fair_key text NOT NULL,
    step_scope text,
    step_key text,
    run_scope text,
    run_key text,
    rate_scope text,
    rate_key text,
    rate_units integer NOT NULL DEFAULT 1 CHECK (rate_units >= 1)
);
CREATE INDEX idx_ext_gates_claim ON cyclone_ext_gates (queue, fair_key, priority DESC, step_id);
CREATE INDEX idx_ext_gates_run ON cyclone_ext_gates (run_id);

CREATE TABLE cyclone_ext_debounce (
    workflow text NOT NULL,
    key text NOT NULL,
    run_id bigint NOT NULL REFERENCES cyclone_runs (id) ON DELETE CASCADE,
    fire_at timestamptz NOT NULL,
    PRIMARY KEY (workflow, key)
);
CREATE INDEX idx_ext_debounce_run ON cyclone_ext_debounce (run_id);

---- create above / drop below ----

DO $$
BEGIN
    IF EXISTS (
        SELECT 1 FROM cyclone_runs AS r
        WHERE r.state NOT IN ('completed', 'failed', 'cancelled')
          AND (EXISTS (SELECT 1 FROM cyclone_ext_gates AS g WHERE g.run_id = r.id)
               OR EXISTS (SELECT 1 FROM cyclone_ext_debounce AS d WHERE d.run_id = r.id))
    ) THEN
        RAISE EXCEPTION 'cannot migrate the extension track below 4 while a run under flow '
            'control (a concurrency key, a rate limit, a queue cap, a debounce window) is '
            'under way: it would run without its limits; let those runs end, or cancel '
            'them, first';
    END IF;
END
$$;

DROP TABLE cyclone_ext_debounce;
DROP TABLE cyclone_ext_gates;
DROP TABLE cyclone_ext_slots;
DROP TABLE cyclone_ext_limits;
