-- Per-branch failure policy (OnDepFailure): NULL means fail_run; 'cancel_branch' contains it.

ALTER TABLE cyclone_steps ADD COLUMN on_dep_failure text;

---- create above / drop below ----

ALTER TABLE cyclone_steps DROP COLUMN IF EXISTS on_dep_failure;
