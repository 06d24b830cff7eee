-- Version 12: schedule definition pinning. def_version is the workflow fingerprint pinned
-- at ScheduleWorkflow registration; a process whose builder produces another fingerprint
-- refuses the fire. NULL for a step or action schedule and for rows registered before
-- this migration (a new registration pins them). No worker drain is required.

ALTER TABLE cyclone_schedules ADD COLUMN def_version text;

---- create above / drop below ----

ALTER TABLE cyclone_schedules DROP COLUMN def_version;
