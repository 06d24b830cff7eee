-- Quorum waits (WaitN): the explicit quorum; partial payloads accumulate in output.

ALTER TABLE cyclone_steps ADD COLUMN wait_count integer;

---- create above / drop below ----

ALTER TABLE cyclone_steps DROP COLUMN IF EXISTS wait_count;
