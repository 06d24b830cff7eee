-- Extension 12: marks of the scanner passes that run once for all scanners in a span of
-- time, whichever scanner's look comes first (retention: a walk of every kept run,
-- which no index serves, runs about once a minute however many workers scan). One row
-- per such pass: marked_at is the database time of its last run.
--
-- Extension track: new tables and indexes only, never an ALTER of a core table (see
-- README.md in this folder).

CREATE TABLE cyclone_ext_scan_marks (
    pass text PRIMARY KEY,
    marked_at timestamptz NOT NULL
);

---- create above / drop below ----

DROP TABLE cyclone_ext_scan_marks;
