-- name: insert_trace_contexts
-- Carry a W3C trace context with these runs (written only by a process that traces).
INSERT INTO cyclone_ext_trace_context (run_id, traceparent, tracestate)
SELECT run_id, %(traceparent)s, %(tracestate)s
FROM unnest(%(run_ids)b::bigint[]) AS r(run_id)
ON CONFLICT (run_id) DO NOTHING

-- name: trace_contexts_of
-- The trace context of these runs (read only by a process that traces).
SELECT run_id, traceparent, tracestate
FROM cyclone_ext_trace_context
WHERE run_id = ANY(%(run_ids)b::bigint[])
