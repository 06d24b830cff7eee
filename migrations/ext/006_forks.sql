-- Extension 6: forks. A fork is a new run of a run's graph, started from one of its nodes:
-- the nodes outside that node's downstream part that completed in the source run are
-- copied (their recorded outputs, not run again). One row per fork records where it came
-- from and which nodes it copied; it goes with the fork (ON DELETE CASCADE). The source
-- run may be purged first: source_run_id is not a foreign key.
--
-- Extension track: new tables and indexes only, never an ALTER of a core table (see
-- README.md in this folder).

CREATE TABLE cyclone_ext_forks (
    run_id bigint PRIMARY KEY REFERENCES cyclone_runs (id) ON DELETE CASCADE,
    source_run_id bigint NOT NULL,
    from_node text NOT NULL,
    copied text[] NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX idx_ext_forks_source ON cyclone_ext_forks (source_run_id);

---- create above / drop below ----

-- The index goes with its table.
DROP TABLE cyclone_ext_forks;
