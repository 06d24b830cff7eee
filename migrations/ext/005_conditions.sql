-- Extension 5: conditional nodes (when=, otherwise=, on_skip=). The core schema has no
-- place for a node's condition, so each definition (def_version) of a conditional
-- workflow has a row here per node the engine must judge when it activates it: a node
-- with a condition, and every node downstream of one (skipped when all its dependencies
-- were, unless its on_skip is 'run'). The rows are a function of the definition, written
-- by the submits of that definition (ON CONFLICT DO NOTHING) and never changed. The
-- activation statement looks a node up here by (def_version, node) and evaluates the
-- condition, a SQL/JSON path predicate, over the outputs of its source nodes and the run
-- input. A skipped node is stored as completed, output NULL, error_kind 'skipped'.
--
-- Extension track: new tables and indexes only, never an ALTER of a core table (see
-- README.md in this folder).

CREATE TABLE cyclone_ext_guards (
    def_version text NOT NULL,
    node text NOT NULL,
    condition jsonpath,
    variables jsonb NOT NULL DEFAULT '{}'::jsonb,
    sources text[] NOT NULL DEFAULT '{}'::text[],
    on_skip text NOT NULL DEFAULT 'skip' CHECK (on_skip IN ('skip', 'run')),
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (def_version, node)
);

---- create above / drop below ----

DO $$
BEGIN
    IF EXISTS (
        SELECT 1 FROM cyclone_runs AS r
        WHERE r.state NOT IN ('completed', 'failed', 'cancelled')
          AND EXISTS (SELECT 1 FROM cyclone_ext_guards AS g WHERE g.def_version = r.def_version)
    ) THEN
        RAISE EXCEPTION 'cannot migrate the extension track below 5 while a run of a workflow '
            'with conditions (when=) is under way: its nodes would run without them; let '
            'those runs end, or cancel them, first';
    END IF;
END
$$;

DROP TABLE cyclone_ext_guards;
