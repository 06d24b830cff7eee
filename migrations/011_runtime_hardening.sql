-- Runtime hardening: lease generations fence stale workers; queue names are capped at
-- 256 bytes (API validation matches; NOTIFY payloads stay under the PostgreSQL limit).
-- Rollout: stop and drain v0.1.0 workers before applying; they do not send the generation.

ALTER TABLE cyclone_steps ADD COLUMN lease_generation bigint NOT NULL DEFAULT 0;
ALTER TABLE cyclone_steps ADD CONSTRAINT cyclone_steps_queue_check
    CHECK (octet_length(queue) <= 256);
ALTER TABLE cyclone_schedules ADD CONSTRAINT cyclone_schedules_queue_check
    CHECK (octet_length(queue) <= 256);

---- create above / drop below ----

ALTER TABLE cyclone_schedules DROP CONSTRAINT IF EXISTS cyclone_schedules_queue_check;
ALTER TABLE cyclone_steps DROP CONSTRAINT IF EXISTS cyclone_steps_queue_check;
ALTER TABLE cyclone_steps DROP COLUMN IF EXISTS lease_generation;
