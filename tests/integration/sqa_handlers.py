"""Handlers of ``test_sqa_audit`` that a worker process (killed by a test) imports too.

In a process started with ``SQA_CHILD=1`` the handler only blocks (it is the victim's);
elsewhere it records its start and end, in order, in :data:`events`.
"""

from __future__ import annotations

import os
import threading
import time

from cyclone_dsl import action

events: list[tuple[str, str]] = []
events_lock = threading.Lock()


@action(name="sqa_proc_seq")
def proc_seq(x: dict[str, str]) -> None:
    if os.environ.get("SQA_CHILD") == "1":
        time.sleep(60)  # killed long before
        return
    with events_lock:
        events.append((x["n"], "start"))
    time.sleep(0.05)
    with events_lock:
        events.append((x["n"], "end"))
