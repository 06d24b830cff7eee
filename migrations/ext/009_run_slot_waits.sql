-- Extension 9: the steps waiting for a run slot, by key. A run slot is free once its
-- holder run has ended, which writes nothing to the slot: the run's end looks up the
-- queues of the steps gated on its (run scope, run key) and wakes their claimers. Only
-- live gates are indexed (a parked gate, queue = '', is an ended step's).
--
-- Extension track: new tables and indexes only, never an ALTER of a core table (see
-- README.md in this folder).

CREATE INDEX idx_ext_gates_run_slot ON cyclone_ext_gates (run_scope, run_key, queue)
    WHERE run_scope IS NOT NULL AND queue <> '';

---- create above / drop below ----

DROP INDEX idx_ext_gates_run_slot;
