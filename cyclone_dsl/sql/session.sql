-- name: watch_client
-- Have the server check, every %(ms)s ms while a statement runs, that this session's
-- client is still there, and end the statement if not (PostgreSQL 14+).
SELECT set_config('client_connection_check_interval', %(ms)s::text, false)

-- name: completion_setup
-- How long ago this transaction began: now() is its start, which the engine's statements
-- read as the time; a completion at the end of a handler's transaction adds this. It also
-- gives the rest of the transaction the session's own search_path back (a handler's SET
-- or SET LOCAL would hide Cyclone's tables from the completion).
SELECT extract(epoch FROM clock_timestamp() - now())::float8 AS age_s,
       set_config('search_path',
                  (SELECT reset_val FROM pg_settings WHERE name = 'search_path'), true)
           AS search_path

-- name: discard_session
-- Drop what a transactional handler left on its session (settings, temporary tables,
-- advisory locks, prepared statements, LISTENs) before the next handler gets it.
DISCARD ALL

-- name: transaction_age
-- How long ago this transaction began: now() is its start, which the engine's statements
-- read as the time; work in a caller's transaction that was already open adds this.
SELECT extract(epoch FROM clock_timestamp() - now())::float8 AS age_s
