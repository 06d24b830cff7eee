-- Version 9: per-branch failure policy (OnDepFailure). NULL means fail_run (fail fast);
-- 'cancel_branch' contains the failure in the node's downstream branch.

ALTER TABLE cyclone_steps ADD COLUMN on_dep_failure text;

---- create above / drop below ----

ALTER TABLE cyclone_steps DROP COLUMN on_dep_failure;
