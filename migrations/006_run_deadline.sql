-- Run-level deadline (WithRunDeadline): the absolute cutoff now() + d set at submit.

ALTER TABLE cyclone_runs ADD COLUMN deadline_at timestamptz;
CREATE INDEX idx_runs_deadline ON cyclone_runs (deadline_at)
    WHERE state = 'running' AND deadline_at IS NOT NULL;

---- create above / drop below ----

DROP INDEX IF EXISTS idx_runs_deadline;
ALTER TABLE cyclone_runs DROP COLUMN IF EXISTS deadline_at;
