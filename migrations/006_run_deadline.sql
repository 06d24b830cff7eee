-- Version 6: run-level deadline (WithRunDeadline). deadline_at is the absolute cutoff
-- now() + d set at submit; NULL means no deadline, and such a run is never eligible.
-- Nullable with no default: existing runs are unchanged.

ALTER TABLE cyclone_runs ADD COLUMN deadline_at timestamptz;
CREATE INDEX idx_runs_deadline ON cyclone_runs (deadline_at)
    WHERE state = 'running' AND deadline_at IS NOT NULL;

---- create above / drop below ----

DROP INDEX idx_runs_deadline;
ALTER TABLE cyclone_runs DROP COLUMN deadline_at;
