-- Extension 10: the steps waiting for a step slot, by key. A step slot (a kind's
-- Concurrency key) is free once its holder step stopped running, which writes nothing to
-- the slot, and it is the kind's and key's in every queue: the holder's end looks up the
-- queues of the steps gated on its (step scope, step key) and wakes their claimers, not
-- only those of its own queue. Only live gates are indexed (a parked gate, queue = '', is
-- an ended step's).
--
-- Extension track: new tables and indexes only, never an ALTER of a core table (see
-- README.md in this folder).

CREATE INDEX idx_ext_gates_step_slot ON cyclone_ext_gates (step_scope, step_key, queue)
    WHERE step_scope IS NOT NULL AND queue <> '';

---- create above / drop below ----

DROP INDEX idx_ext_gates_step_slot;
