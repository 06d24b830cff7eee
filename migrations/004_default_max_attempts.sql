-- Version 4: the default attempt budget goes from 25 to 5. Only the column defaults
-- change: existing rows, and in-flight work, keep the budget they were created with.

ALTER TABLE cyclone_steps ALTER COLUMN max_attempts SET DEFAULT 5;
ALTER TABLE cyclone_schedules ALTER COLUMN max_attempts SET DEFAULT 5;

---- create above / drop below ----

ALTER TABLE cyclone_schedules ALTER COLUMN max_attempts SET DEFAULT 25;
ALTER TABLE cyclone_steps ALTER COLUMN max_attempts SET DEFAULT 25;
