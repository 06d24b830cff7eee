"""How the supervisor reads its worker processes' reports (cyclone_dsl.worker.processes):
lines that arrive in pieces, a line that is not a report, and the counts of a process
that exited."""

from __future__ import annotations

import json
import os

from cyclone_dsl.worker.processes import Supervisor


def report(completed: int, slots: int) -> bytes:
    return json.dumps({"completed": completed, "settings": {"slots_in_use": slots}}).encode()


def test_reports_in_pieces_garbage_and_an_exited_process() -> None:
    supervisor = Supervisor({}, 2, grace=1)
    first, second = supervisor.children
    pipes = []
    for child in (first, second):
        read_end, write_end = os.pipe()
        os.set_blocking(read_end, False)
        child.report_fd = read_end
        pipes.append(write_end)
    os.write(pipes[0], report(3, 1) + b"\n" + report(5, 2)[:10])  # the second one cut short
    os.write(pipes[1], report(7, 0) + b"\nnot a report\n")
    for child in (first, second):
        supervisor._read_reports(child)
    assert supervisor.completed_count == 3 + 7  # a cut line waits; garbage is skipped
    assert sorted(r["slots_in_use"] for r in supervisor.reports()) == [0, 1]

    os.write(pipes[0], report(5, 2)[10:] + b"\n")
    os.close(pipes[0])  # the first process exits after its last report
    supervisor._retire(first)
    assert first.report_fd is None and first.report is None
    assert supervisor.completed_count == 5 + 7  # kept after it exited
    assert [r["slots_in_use"] for r in supervisor.reports()] == [0]  # running ones only
    os.close(pipes[1])
    supervisor._retire(second)
    assert supervisor.completed_count == 12
