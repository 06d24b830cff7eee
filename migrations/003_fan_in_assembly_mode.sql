-- Version 3: fan-in assembly mode (Join2..4 / FromAll). tuple is the {a, b, c, d} object
-- that Join2..4 build; array is the JSON array of FromAll. The default keeps every
-- existing binding in tuple mode.

ALTER TABLE cyclone_step_inputs ADD COLUMN assembly_mode text NOT NULL DEFAULT 'tuple';

---- create above / drop below ----

ALTER TABLE cyclone_step_inputs DROP COLUMN assembly_mode;
