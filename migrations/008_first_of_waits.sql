-- First-of waits (WaitAny): the candidate names; signal_name stays NULL for such a node.

ALTER TABLE cyclone_steps ADD COLUMN signal_names text[];

---- create above / drop below ----

ALTER TABLE cyclone_steps DROP COLUMN IF EXISTS signal_names;
