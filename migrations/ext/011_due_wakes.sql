-- Extension 11: wake-ups for work that comes due. A step made available with a later
-- scheduled_at (a delayed enqueue, a retry's backoff, a debounce window) becomes
-- claimable with no write at that time, so nothing would wake its queue's idle workers
-- before their next poll. The scanner's "due" pass wakes the queues of the steps that
-- came due since the last pass of any scanner: woken_until (database time) is where
-- that last pass stopped, so each window is looked at once however many workers scan.
-- One row.
--
-- Extension track: new tables and indexes only, never an ALTER of a core table (see
-- README.md in this folder).

CREATE TABLE cyclone_ext_due_wakes (
    id boolean PRIMARY KEY DEFAULT true CHECK (id),
    woken_until timestamptz NOT NULL
);

---- create above / drop below ----

DROP TABLE cyclone_ext_due_wakes;
