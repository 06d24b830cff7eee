-- Version 11: runtime hardening.
-- lease_generation is incremented by every claim; completion and heartbeat compare it,
-- which fences an execution whose lease was reclaimed and claimed again.
-- Queue names are capped at 256 bytes, as the API validates, so NOTIFY payloads stay
-- below the PostgreSQL limit.
--
-- Rollout: NOT safe next to v0.1.0 workers (they do not send lease_generation). Stop and
-- drain them, apply this migration, then start the upgraded workers.

ALTER TABLE cyclone_steps ADD COLUMN lease_generation bigint NOT NULL DEFAULT 0;
ALTER TABLE cyclone_steps ADD CONSTRAINT cyclone_steps_queue_check
    CHECK (octet_length(queue) <= 256);
ALTER TABLE cyclone_schedules ADD CONSTRAINT cyclone_schedules_queue_check
    CHECK (octet_length(queue) <= 256);

---- create above / drop below ----

ALTER TABLE cyclone_schedules DROP CONSTRAINT cyclone_schedules_queue_check;
ALTER TABLE cyclone_steps DROP CONSTRAINT cyclone_steps_queue_check;
ALTER TABLE cyclone_steps DROP COLUMN lease_generation;
