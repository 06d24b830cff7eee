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

DROP TABLE cyclone_ext_fan_out_limits;
