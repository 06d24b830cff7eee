-- name: migration_lock
-- Take the session-level migration lock (namespace, schema); waits up to lock_timeout.
SELECT pg_advisory_lock(%(namespace)s, hashtext(current_schema()))

-- name: migration_unlock
-- Release the session-level migration lock; false means it was not held.
SELECT pg_advisory_unlock(%(namespace)s, hashtext(current_schema())) AS released

-- name: migration_lock_holder
-- The pid of the session holding the migration lock of this schema, if any.
SELECT l.pid
FROM pg_locks AS l
WHERE l.locktype = 'advisory'
  AND l.classid = %(namespace)s::int::oid
  AND l.objid = hashtext(current_schema())::oid
  AND l.objsubid = 2
  AND l.granted
LIMIT 1

-- name: migration_session
-- The schema migrations go to (NULL: no schema of search_path exists and may be used by
-- this role), the search_path that chose it, and the session's lock_timeout (restored
-- after the migrator's own).
SELECT current_schema() AS schema, current_setting('search_path') AS search_path,
       current_setting('lock_timeout') AS lock_timeout

-- name: set_lock_timeout
-- Bound how long the migrator waits for the lock (milliseconds).
SELECT set_config('lock_timeout', %(timeout)s, false)

-- name: create_version_table
-- tern's version table (one row, one column) for the core, and the same for the extension
-- track. Two statements, no parameters: sent with the simple query protocol.
CREATE TABLE IF NOT EXISTS cyclone_schema_version (version int4 NOT NULL);
CREATE TABLE IF NOT EXISTS cyclone_ext_schema_version (version int4 NOT NULL)

-- name: read_version
-- The highest applied core migration, or NULL before the first one.
SELECT version FROM cyclone_schema_version LIMIT 1

-- name: insert_version
-- The first row of the core version table.
INSERT INTO cyclone_schema_version (version) VALUES (%(version)s)

-- name: update_version
-- Record the applied core version (within the migration's transaction).
UPDATE cyclone_schema_version SET version = %(version)s

-- name: read_ext_version
-- The highest applied extension migration, or NULL before the first one.
SELECT version FROM cyclone_ext_schema_version LIMIT 1

-- name: insert_ext_version
-- The first row of the extension version table.
INSERT INTO cyclone_ext_schema_version (version) VALUES (%(version)s)

-- name: update_ext_version
-- Record the applied extension version (within the migration's transaction).
UPDATE cyclone_ext_schema_version SET version = %(version)s

-- name: version_tables_exist
-- Whether the core and the extension version tables exist on search_path (read-only probe).
SELECT to_regclass('cyclone_schema_version') IS NOT NULL AS core,
       to_regclass('cyclone_ext_schema_version') IS NOT NULL AS extension

-- name: set_migration_lock_timeout
-- Bound how long one try of a migration waits for a table lock (for this transaction).
SELECT set_config('lock_timeout', %(timeout)s, true)

-- name: long_lock_holders
-- The sessions (other than this one) holding a lock on a table of this schema in a
-- transaction older than the given seconds: what a migration waited behind. Their
-- transaction's start is NULL when this role may not see it: they are listed then.
SELECT DISTINCT l.pid
FROM pg_locks AS l
JOIN pg_class AS c ON c.oid = l.relation
LEFT JOIN pg_stat_activity AS a ON a.pid = l.pid
WHERE c.relnamespace = current_schema()::regnamespace
  AND l.granted
  AND l.pid <> pg_backend_pid()
  AND coalesce(a.xact_start < clock_timestamp() - make_interval(secs => %(seconds)s), true)
ORDER BY l.pid

-- name: read_only_transaction
-- The guards of the down migrations are checked in a transaction that cannot write.
SELECT set_config('transaction_read_only', 'on', true)
