"""A nightly job: @schedule registers a cron schedule when a worker starts.

The schedule pins the workflow's def_version; every scanner (one per worker)
competes for due slots and each slot fires once. To show a fire without
waiting until 02:30, this example moves this process's database clock forward
with ``cyclone_dsl.testing.shifted_clock`` — the same knob the tests use.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from cyclone_dsl import NodeRef, Ref, schedule, step, workflow


@step(name="nightly_cleanup")
def cleanup(params: dict[str, int]) -> str:
    return f"removed files older than {params['days']} days"


@schedule("30 2 * * *", id="nightly-cleanup", location="Europe/Paris", input={"days": 30})
@workflow(name="nightly")
def nightly(params: Ref[dict[str, int]]) -> NodeRef[str]:
    return cleanup(params)


if __name__ == "__main__":
    import time

    from cyclone_dsl import Client, Worker, embedded_database, migrate
    from cyclone_dsl.testing import shifted_clock

    with embedded_database() as dsn:
        migrate(dsn)
        with Client(dsn) as client:
            client.register_schedules()
            (entry,) = [s for s in client.list_schedules() if s.id == "nightly-cleanup"]
            print(f"next fire: {entry.next_run_at.isoformat()} (pinned {entry.def_version})")
            shift = entry.next_run_at - datetime.now(UTC) + timedelta(seconds=1)
            with shifted_clock(shift), Worker(dsn, [nightly], scan_interval=0.2):
                deadline = time.monotonic() + 30
                while not client.list_runs(workflow="nightly"):
                    assert time.monotonic() < deadline, "the schedule did not fire"
                    time.sleep(0.1)
                (run,) = client.list_runs(workflow="nightly")
                print(client.handle(run.id).result(timeout=30))
