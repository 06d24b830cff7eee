-- Schedule definition pinning: the workflow fingerprint pinned at registration.
-- NULL for step and action schedules and for rows registered before this migration.

ALTER TABLE cyclone_schedules ADD COLUMN def_version text;

---- create above / drop below ----

ALTER TABLE cyclone_schedules DROP COLUMN IF EXISTS def_version;
