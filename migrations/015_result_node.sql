-- Version 15: workflow result node (DefineResult). The node whose output is the run
-- result, written by the run insert. NULL for a run from Define, a standalone run and
-- every older run. Nullable with no default: catalog-only. No index: it is read only by
-- the run's primary key.

ALTER TABLE cyclone_runs ADD COLUMN result_node text;

---- create above / drop below ----

ALTER TABLE cyclone_runs DROP COLUMN result_node;
