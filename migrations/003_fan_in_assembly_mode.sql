-- Fan-in assembly mode (Join2..4 / FromAll): tuple builds {a,b,c,d}, array builds a list.

ALTER TABLE cyclone_step_inputs ADD COLUMN assembly_mode text NOT NULL DEFAULT 'tuple';

---- create above / drop below ----

ALTER TABLE cyclone_step_inputs DROP COLUMN IF EXISTS assembly_mode;
