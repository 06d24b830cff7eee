-- Version 7: quorum waits (WaitN). wait_count is the quorum N; NULL means a
-- single-delivery WaitSignal. Partial payloads accumulate in output until the quorum is met.

ALTER TABLE cyclone_steps ADD COLUMN wait_count integer;

---- create above / drop below ----

ALTER TABLE cyclone_steps DROP COLUMN wait_count;
