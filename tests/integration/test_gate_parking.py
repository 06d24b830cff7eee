"""Steps that end for good leave the keys a gated claim walks at once, not at the next
scanner pass.

A gated claim walks the keys of its queue (at most about 60 per claim, the rest at the next
wake-up or poll). A key whose only steps were cancelled or failed for good has nothing to
claim; while its steps' gates stay in the walk, a key with work behind many such keys waits
for a poll. The workers here scan and poll once a minute: the scanner's pass, which parks
what is left, does not run during the test.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from cyclone_dsl import Client, Concurrency, Permanent, RunFilter, RunState, Worker, step
from tests.waiting import LONG_POLL, PROMPT, wait_idle

#: How long the free key's step may take to start (lost: a 60 s poll).
SOON = 5.0
#: More keys than the claims of a worker's start and of one wake-up walk (4 windows of 16
#: each: a claim goes on from where the last one stopped).
DEAD_KEYS = 300


@step(name="gp_keyed", concurrency=Concurrency(key="tenant", limit=1), max_attempts=1)
def gp_keyed(job: dict[str, Any]) -> str:
    if job.get("fail"):
        raise Permanent("fails for good")
    return str(job["tenant"])


def _worker(start_worker: Callable[..., Worker], queue: str) -> Worker:
    return start_worker(
        gp_keyed,
        queues=[queue],
        concurrency=4,
        poll_interval=LONG_POLL,
        scan_interval=LONG_POLL,
    )


def test_a_key_behind_many_keys_of_cancelled_steps_starts_at_once(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    queue = f"gp_cancel_{os.getpid()}"
    worker = _worker(start_worker, queue)
    wait_idle(cyclone_dsn, worker, listeners=1)
    later = datetime.now(UTC) + timedelta(hours=1)
    client.enqueue_many(
        gp_keyed,
        [{"tenant": f"a{n:03}"} for n in range(DEAD_KEYS)],
        queue=queue,
        scheduled_at=later,
    )
    assert client.cancel_many(RunFilter(queues=queue)).acted == DEAD_KEYS
    wait_idle(cyclone_dsn, worker, listeners=1)
    assert client.enqueue(gp_keyed, {"tenant": "zz"}, queue=queue).result(timeout=SOON) == "zz"


def test_a_key_behind_many_keys_of_steps_failed_for_good_starts_at_once(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    queue = f"gp_fail_{os.getpid()}"
    worker = _worker(start_worker, queue)
    dead = client.enqueue_many(
        gp_keyed, [{"tenant": f"a{n:03}", "fail": True} for n in range(DEAD_KEYS)], queue=queue
    )
    for handle in dead:
        assert handle.wait(timeout=PROMPT).state is RunState.FAILED
    wait_idle(cyclone_dsn, worker, listeners=1)
    assert client.enqueue(gp_keyed, {"tenant": "zz"}, queue=queue).result(timeout=SOON) == "zz"
