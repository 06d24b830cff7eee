-- Extension 1: worker registrations. A worker records itself (host, pid, queues,
-- concurrency, package version) when it starts, beats while it runs and stamps
-- stopped_at when it stops; it also records the identity of each handler it serves and
-- the workflow definitions (def_version) it knows, so that a conflict or work nobody can
-- run is visible. Rows of a worker go with it (ON DELETE CASCADE).
--
-- Extension track: new tables and indexes only, never an ALTER of a core table (see
-- README.md in this folder).

CREATE TABLE cyclone_ext_workers (
    id text PRIMARY KEY,
    host text NOT NULL,
    pid integer NOT NULL,
    queues text[] NOT NULL,
    concurrency integer NOT NULL,
    package_version text NOT NULL,
    started_at timestamptz NOT NULL DEFAULT now(),
    heartbeat_at timestamptz NOT NULL DEFAULT now(),
    stopped_at timestamptz
);
CREATE INDEX idx_ext_workers_heartbeat ON cyclone_ext_workers (heartbeat_at);

CREATE TABLE cyclone_ext_worker_handlers (
    worker_id text NOT NULL REFERENCES cyclone_ext_workers (id) ON DELETE CASCADE,
    kind text NOT NULL,
    identity text NOT NULL,
    PRIMARY KEY (worker_id, kind)
);
CREATE INDEX idx_ext_worker_handlers_kind ON cyclone_ext_worker_handlers (kind);

CREATE TABLE cyclone_ext_worker_versions (
    worker_id text NOT NULL REFERENCES cyclone_ext_workers (id) ON DELETE CASCADE,
    workflow text NOT NULL,
    def_version text NOT NULL,
    PRIMARY KEY (worker_id, workflow, def_version)
);
CREATE INDEX idx_ext_worker_versions_workflow
    ON cyclone_ext_worker_versions (workflow, def_version);

---- create above / drop below ----

-- Each index goes with its table.
DROP TABLE cyclone_ext_worker_versions;
DROP TABLE cyclone_ext_worker_handlers;
DROP TABLE cyclone_ext_workers;
