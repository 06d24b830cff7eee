-- Version 8: first-of waits (WaitAny). signal_names holds the candidate names;
-- signal_name stays NULL for such a node, so idx_steps_signal_name_unique does not apply
-- (the DAG validator enforces per-name uniqueness at submit).

ALTER TABLE cyclone_steps ADD COLUMN signal_names text[];

---- create above / drop below ----

ALTER TABLE cyclone_steps DROP COLUMN signal_names;
