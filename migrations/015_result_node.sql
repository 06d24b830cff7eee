-- Workflow result node (DefineResult): written in the run insert; read by primary key only.

ALTER TABLE cyclone_runs ADD COLUMN result_node text;

---- create above / drop below ----

ALTER TABLE cyclone_runs DROP COLUMN IF EXISTS result_node;
