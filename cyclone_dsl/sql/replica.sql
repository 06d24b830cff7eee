-- name: standby_status
-- Whether this server is a standby and how far its replay is: the age of the last commit it
-- replayed, whether it replayed all the WAL it received, whether a WAL receiver runs (the
-- view shows its pid to every role).
SELECT pg_is_in_recovery() AS in_recovery,
       now() - pg_last_xact_replay_timestamp() AS replay_age,
       coalesce(pg_last_wal_receive_lsn() = pg_last_wal_replay_lsn(), false) AS caught_up,
       EXISTS (SELECT 1 FROM pg_stat_wal_receiver) AS receiving

-- name: wal_position
-- The primary's current WAL position: a standby that replayed up to it sees every commit so
-- far (NULL on a standby).
SELECT CASE WHEN pg_is_in_recovery() THEN NULL ELSE pg_current_wal_lsn()::text END AS lsn

-- name: replayed_to
-- Whether this standby has replayed the WAL up to %(lsn)s (always true on a primary).
SELECT coalesce(pg_last_wal_replay_lsn() >= %(lsn)s::pg_lsn, true) AS replayed
