-- Submit keys (SubmitOnce): one run per (workflow, key) in every state until purged.
--
-- Out of band on a large table (then check that the index is valid in pg_index):
--   ALTER TABLE cyclone_runs ADD COLUMN IF NOT EXISTS submit_key text;
--   CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS idx_runs_submit_key
--       ON cyclone_runs (workflow, submit_key) WHERE submit_key IS NOT NULL;

ALTER TABLE cyclone_runs ADD COLUMN IF NOT EXISTS submit_key text;
CREATE UNIQUE INDEX IF NOT EXISTS idx_runs_submit_key ON cyclone_runs (workflow, submit_key)
    WHERE submit_key IS NOT NULL;

---- create above / drop below ----

DROP INDEX IF EXISTS idx_runs_submit_key;
ALTER TABLE cyclone_runs DROP COLUMN IF EXISTS submit_key;
