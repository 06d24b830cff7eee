-- name: read_only
-- Whether this session's transactions are read-only: a standby, or a role or database
-- with default_transaction_read_only.
SELECT current_setting('transaction_read_only') = 'on' AS read_only

-- name: keep_idle_session
-- This session may sit idle between calls for as long as it likes: a role's or database's
-- idle_session_timeout (PostgreSQL 14+; NULL before) would end a pool's idle sessions and
-- a LISTEN session, which the next call then finds dead. A no-op when it is 0 already.
SELECT set_config('idle_session_timeout', '0', false)
WHERE current_setting('idle_session_timeout', true) <> '0'

-- name: iso_dates
-- Dates written in the ISO style, which the driver reads, for this session (the input
-- order of the role's DateStyle is kept: 'ISO' alone sets only the output style).
SELECT set_config('DateStyle', 'ISO', false)

-- name: watch_client
-- Have the server check, every %(ms)s ms while a statement runs, that this session's
-- client is still there, and end the statement if not (PostgreSQL 14+).
SELECT set_config('client_connection_check_interval', %(ms)s::text, false)

-- fragment: transaction_age_s
-- How long ago this transaction began, in seconds (now() is its start).
SELECT extract(epoch FROM clock_timestamp() - now())::float8 AS age_s

-- fragment: completion_state
-- transaction_age_s, and the transaction's isolation level as it is now (a handler may have
-- set it with SET TRANSACTION, which the completion must know: see ready_for_completion).
{{transaction_age_s}},
       current_setting('transaction_isolation') AS isolation

-- fragment: session_reset
-- What a transactional handler may leave on its session: settings (RESET ALL leaves the
-- role and the session authorization out), temporary tables, session advisory locks,
-- LISTENs, open cursors (see completion_reset).
RESET SESSION AUTHORIZATION; RESET ROLE; RESET ALL; DISCARD TEMP;
SELECT pg_advisory_unlock_all(); UNLISTEN *; CLOSE ALL

-- name: completion_setup
-- Before a completion at the end of a handler's transaction through a pooler (whose
-- sessions are its own to reset), in one round trip (no parameter): the session's own
-- search_path and role back (a handler's SET or SET LOCAL would hide Cyclone's tables
-- from the completion, or run it as a role that may not write them), then how long ago
-- this transaction began (now() is its start, which the engine's statements read as the
-- time).
RESET SESSION AUTHORIZATION; RESET ROLE; RESET search_path; {{completion_state}}

-- name: completion_reset
-- completion_setup on a session of the worker's own, which it also gives back clean: what
-- the handler left on it (settings, temporary tables, session advisory locks, LISTENs,
-- open cursors) is dropped in the same round trip, and is kept so at the commit; after a
-- rollback the pool runs it again, outside a transaction. Not DISCARD ALL (not allowed in
-- a transaction): it would also drop the prepared statements and plans that the
-- completions on this connection reuse (transactional steps ran at half their rate).
{{session_reset}};
{{completion_state}}

-- name: completion_reset_watched
-- completion_reset, with the server's check of the client set again (PostgreSQL 14+:
-- RESET ALL reset it; see watch_client): 2000 ms, CHECK_CLIENT_MS.
{{session_reset}};
SELECT set_config('client_connection_check_interval', '2000', false);
{{completion_state}}

-- name: transaction_age
-- How long ago this transaction began: now() is its start, which the engine's statements
-- read as the time; work in a caller's transaction that was already open adds this.
{{transaction_age_s}}
