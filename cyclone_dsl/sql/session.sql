-- name: watch_client
-- Have the server check, every %(ms)s ms while a statement runs, that this session's
-- client is still there, and end the statement if not (PostgreSQL 14+).
SELECT set_config('client_connection_check_interval', %(ms)s::text, false)

-- name: transaction_age
-- How long ago this transaction began: now() is its start, which the engine's statements
-- read as the time; a completion at the end of a handler's transaction adds this.
SELECT extract(epoch FROM clock_timestamp() - now())::float8 AS age_s

-- name: discard_session
-- Drop what a transactional handler left on its session (settings, temporary tables,
-- advisory locks, prepared statements, LISTENs) before the next handler gets it.
DISCARD ALL
