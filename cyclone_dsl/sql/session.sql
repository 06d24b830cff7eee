-- name: watch_client
-- Have the server check, every %(ms)s ms while a statement runs, that this session's
-- client is still there, and end the statement if not (PostgreSQL 14+).
SELECT set_config('client_connection_check_interval', %(ms)s::text, false)
