-- Extension 8: trace context. The W3C trace context (traceparent, tracestate) a run was
-- submitted under, written in the submit transaction only when the submitter traces
-- (Client(tracing=...)), or, for a child run, the span of its parent node (written when a
-- tracing process starts the child). Workers that trace read it for the runs of the steps
-- they claim, so that every step attempt is a span of the run's trace. It goes with its
-- run (ON DELETE CASCADE).
--
-- Extension track: new tables and indexes only, never an ALTER of a core table (see
-- README.md in this folder).

CREATE TABLE cyclone_ext_trace_context (
    run_id bigint PRIMARY KEY REFERENCES cyclone_runs (id) ON DELETE CASCADE,
    traceparent text NOT NULL,
    tracestate text
);

---- create above / drop below ----

DROP TABLE cyclone_ext_trace_context;
