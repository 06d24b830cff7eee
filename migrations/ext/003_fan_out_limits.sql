-- Extension 3: the max_items guard of a fan-out node (for_each(max_items=N)). The core
-- schema stores a fan-out's max_parallel and max_bytes on its step row but has no place
-- for this limit, so a run whose graph sets one gets a row here per such node, written
-- in the submit transaction. Expansion reads it: a list longer than max_items fails the
-- fan-out node (error_kind item_limit) and no item is created. Runs without the guard
-- write and read nothing here. The row goes with its step (ON DELETE CASCADE), whose
-- (run_id, node) key it references.
--
-- Extension track: new tables and indexes only, never an ALTER of a core table (see
-- README.md in this folder).

CREATE TABLE cyclone_ext_fan_out_limits (
    run_id bigint NOT NULL,
    node text NOT NULL,
    max_items integer NOT NULL CHECK (max_items >= 1),
    PRIMARY KEY (run_id, node),
    FOREIGN KEY (run_id, node) REFERENCES cyclone_steps (run_id, node) ON DELETE CASCADE
);

---- create above / drop below ----

DO $$
BEGIN
    IF EXISTS (
        SELECT 1 FROM cyclone_ext_fan_out_limits AS l
        JOIN cyclone_runs AS r ON r.id = l.run_id
        WHERE r.state NOT IN ('completed', 'failed', 'cancelled')
    ) THEN
        RAISE EXCEPTION 'cannot migrate the extension track below 3 while a run with a '
            'fan-out max_items is under way: its fan-out would expand without the limit; let '
            'those runs end, or cancel them, first';
    END IF;
END
$$;

DROP TABLE cyclone_ext_fan_out_limits;
