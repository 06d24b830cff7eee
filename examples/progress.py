"""Live progress from a running step: ctx.progress and ctx.emit, followed as they come.

The step reports each image it resizes and a summary event; the client follows the run's
events while it runs, and the loop ends when the run ends.
"""

from __future__ import annotations

import time

from cyclone_dsl import NodeRef, Ref, StepContext, step, workflow


@step(name="ex_resize_all")
def resize_all(images: list[str], ctx: StepContext) -> int:
    for done, name in enumerate(images, start=1):
        time.sleep(0.05)  # the real work
        ctx.progress(done, len(images), f"resized {name}")
    ctx.emit({"thumbnails": len(images), "bucket": "thumbs"})
    return len(images)


@workflow(name="ex_thumbnails")
def thumbnails(images: Ref[list[str]]) -> NodeRef[int]:
    return resize_all(images)


if __name__ == "__main__":
    from cyclone_dsl import Client, Worker, embedded_database, migrate

    with embedded_database() as dsn:
        migrate(dsn)
        with Worker(dsn, [thumbnails]), Client(dsn) as client:
            handle = client.submit(thumbnails, ["a.png", "b.png", "c.png"])
            for event in handle.events(timeout=30):  # live, in order; ends with the run
                if event.kind == "progress":
                    print(f"#{event.seq} {event.node}: {event.data}")
                else:
                    print(f"#{event.seq} {event.node} says {event.data}")
            events = client.events_of(handle.id)
            assert [e.seq for e in events] == [1, 2, 3, 4]
            print("result:", handle.result(timeout=5))
