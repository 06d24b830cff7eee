-- Version 16: submit keys (SubmitOnce). SubmitOnce and SubmitOnceTx write their key;
-- every other path writes NULL. idx_runs_submit_key keeps (workflow, submit_key) unique
-- for runs in every state: a key stays in use until its run is purged.
--
-- The index build reads all of cyclone_runs while this migration holds its lock. A large
-- deployment can build the column and the index out of band first, outside a transaction:
--
--   ALTER TABLE cyclone_runs ADD COLUMN IF NOT EXISTS submit_key text;
--   CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS idx_runs_submit_key
--       ON cyclone_runs (workflow, submit_key) WHERE submit_key IS NOT NULL;
--
-- Then check that the index is valid before migrating (a failed concurrent build leaves
-- an invalid index, which IF NOT EXISTS below would keep; drop it and build it again):
--
--   SELECT indisvalid FROM pg_index WHERE indexrelid = 'idx_runs_submit_key'::regclass;

ALTER TABLE cyclone_runs ADD COLUMN IF NOT EXISTS submit_key text;
CREATE UNIQUE INDEX IF NOT EXISTS idx_runs_submit_key ON cyclone_runs (workflow, submit_key)
    WHERE submit_key IS NOT NULL;

---- create above / drop below ----

DROP INDEX idx_runs_submit_key;
ALTER TABLE cyclone_runs DROP COLUMN submit_key;
