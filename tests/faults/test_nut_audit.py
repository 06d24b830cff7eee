"""Audit: a new user's subscription-billing app, built from the docs, run in production style.

``nut_bill`` (tests/faults/nut_handlers.py) prices an invoice: a step lists its lines, a
``for_each`` prices each line, a child run ``nut_charge`` charges the card (it waits for the
payment provider's ``payment`` or ``declined`` signal with ``wait_any``, with a timeout,
then a step records the outcome), and ``define_result`` returns the total and the payment
outcome. Worker processes are started the way an operator would start them
(``Worker(..., processes=2).run()`` in a process of its own); the test SIGKILLs a worker
process and then the supervisor while runs are in flight, and starts another worker.
Runs get their signal, time out, are cancelled, or are paused and resumed.

A second deploy (tests/faults/nut_handlers_v2.py: ``nut_bill`` gained a step) starts while
runs of the first are in flight; docs/howto/versioning.md says the runs in flight keep their
version and are served by the old deploy's workers, new runs go to the new deploy's, nothing
is failed on the way, and old runs left without an old worker stay untouched and listed in
``Client.stats()["unserved"]``.

Everything is checked from the client API: each run's end state, each result against what
plain Python computes from the input, every kept output from the last (unfenced) execution
of its step, and every wait bounded.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from cyclone_dsl import Client, Delivery, RunFailed, RunState, StepState
from tests.faults import nut_handlers
from tests.faults.conftest import ROOT
from tests.waiting import wait_until

Record = dict[str, Any]

#: The worker an operator runs: ``python -c WORKER_MAIN DSN PROCESSES`` in the app's directory.
WORKER_MAIN = """
import sys
from cyclone_dsl import Worker
Worker(
    sys.argv[1], ["tests.faults.nut_handlers"], processes=int(sys.argv[2]), lease=2.0,
    grace=1.0, poll_interval=0.1, scan_interval=0.2, concurrency=4,
).run()
"""

#: A client of the second deploy: resumes the runs ``resume`` names, submits a ``nut_bill``
#: run per invoice of ``submit``, and prints the new runs' ids and its definitions.
CLIENT_MAIN = """
import json, sys
from cyclone_dsl import Client
from tests.faults import nut_handlers
todo = json.loads(sys.argv[2])
with Client(sys.argv[1]) as client:
    for run_id in todo["resume"]:
        client.resume(run_id)
    ids = [client.submit(nut_handlers.bill, invoice).id for invoice in todo["submit"]]
print(json.dumps({
    "ids": ids,
    "bill": nut_handlers.bill.def_version,
    "charge": nut_handlers.charge.def_version,
}))
"""


# -- what the handlers recorded ---------------------------------------------------------------


def records(directory: Path) -> dict[tuple[int, str], dict[str, dict[str, Record]]]:
    """(run id, node) -> token -> phase -> the record's body."""
    found: dict[tuple[int, str], dict[str, dict[str, Record]]] = defaultdict(
        lambda: defaultdict(dict)
    )
    for path in directory.iterdir():
        run_id, node, token, phase = path.name.split("~")
        try:
            body = json.loads(path.read_text())
        except json.JSONDecodeError:  # being written right now
            continue
        found[(int(run_id), node)][token][phase] = body
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as status:
            return not any(line.split()[:2] == ["State:", "Z"] for line in status)
    except FileNotFoundError:
        return False


def running_pids(directory: Path, run_id: int | None = None) -> dict[int, int]:
    """Live pids running a handler now (of ``run_id`` if given), with how many each runs."""
    counts: dict[int, int] = defaultdict(int)
    for (rid, _), executions in records(directory).items():
        if run_id is not None and rid != run_id:
            continue
        for phases in executions.values():
            if "start" in phases and "end" not in phases and "fail" not in phases:
                counts[int(phases["start"]["pid"])] += 1
    return {pid: n for pid, n in counts.items() if alive(pid) and pid != os.getpid()}


def busiest_worker(directory: Path, at_least: int = 1, run_id: int | None = None) -> int:
    def find() -> int | None:
        pids = running_pids(directory, run_id)
        best = max(pids, key=lambda p: pids[p], default=None)
        return best if best is not None and pids[best] >= at_least else None

    pid = wait_until(find, what=f"a worker process running {at_least} handlers", timeout=30)
    assert pid is not None
    return pid


def kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not alive(pid), what=f"process {pid} gone", timeout=10)


def check_outputs_are_from_the_last_execution(
    client: Client, run_ids: list[int], directory: Path
) -> int:
    """Every completed step whose output carries a token kept the output of its last
    execution, which ran to its end (never a fenced, failed or earlier one)."""
    seen = records(directory)
    checked = 0
    for run_id in run_ids:
        for st in client.get_run(run_id).steps:
            if st.state is not StepState.COMPLETED or not isinstance(st.output, dict):
                continue
            token = st.output.get("token")
            if token is None or st.kind.startswith("@"):  # a child node: its run is checked
                continue
            executions = seen[(run_id, st.node)]
            assert token in executions, (run_id, st.node, token)
            assert "end" in executions[token], (run_id, st.node, "kept a failed execution")
            last = max(executions, key=lambda t: float(executions[t]["start"]["t"]))
            assert token == last, (run_id, st.node, "kept an earlier execution's output")
            checked += 1
    return checked


def step_of(client: Client, run_id: int, node: str) -> Any:
    return next(s for s in client.get_run(run_id).steps if s.node == node)


def kids_of(client: Client, run_id: int) -> list[int]:
    return [int(row["id"]) for row in client.children_of(run_id)]


# -- processes ----------------------------------------------------------------------------------


@pytest.fixture
def app_workers(cyclone_dsn: str, tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen[str]]]:
    """``spawn(app_dir, processes)`` starts the app's worker in ``app_dir`` (the repository:
    deploy 1), in a session of its own; every process group is killed at the end."""
    procs: list[subprocess.Popen[str]] = []

    def spawn(app_dir: Path = ROOT, processes: int = 2) -> subprocess.Popen[str]:
        log = open(tmp_path / f"worker-{len(procs)}.log", "w")  # noqa: SIM115
        proc = subprocess.Popen(
            [sys.executable, "-c", WORKER_MAIN, cyclone_dsn, str(processes)],
            cwd=app_dir,
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        log.close()
        procs.append(proc)
        return proc

    yield spawn
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


class PaymentProvider:
    """The payment provider (a thread with a client of its own): as soon as an invoice's
    charge run exists, it answers it (``payment`` or ``declined``), or the shop cancels or
    pauses the invoice's run. What each call returned is kept."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.plan: dict[int, str] = {}
        self.done: dict[int, object] = {}
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def add(self, run_id: int, action: str) -> None:
        with self.lock:
            self.plan[run_id] = action

    def _loop(self) -> None:
        try:
            with Client(self.dsn) as client:
                while not self.stop.wait(0.03):
                    with self.lock:
                        todo = {r: a for r, a in self.plan.items() if r not in self.done}
                    for run_id, action in todo.items():
                        kids = kids_of(client, run_id)
                        if not kids:
                            continue
                        if action == "cancel":
                            client.cancel(run_id)
                            result: object = "cancelled"
                        elif action == "pause":
                            client.pause(run_id)
                            result = "paused"
                        else:
                            result = client.signal(kids[0], action, {"ref": f"pay-{run_id}"})
                        with self.lock:
                            self.done[run_id] = result
        except BaseException as exc:  # re-raised by the test
            self.error = exc

    def __enter__(self) -> PaymentProvider:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(10)

    def result(self, run_id: int) -> object:
        def answered() -> bool:
            if self.error is not None:
                raise self.error
            with self.lock:
                return run_id in self.done

        wait_until(answered, what=f"the provider's answer to run {run_id}", timeout=30)
        return self.done[run_id]


# -- invoices and what plain Python makes of them -------------------------------------------


def make_invoice(i: int, directory: Path, lines: int, gate: Path | None = None) -> dict[str, Any]:
    return {
        "dir": str(directory),
        "id": f"inv-{i}",
        "plan": [[f"sku-{i}-{k}", k + 1, 100 * (i + 1) + 7 * k] for k in range(lines)],
        "gate": str(gate) if gate else None,
    }


def total_of(invoice: dict[str, Any]) -> int:
    return sum(qty * unit for _, qty, unit in invoice["plan"])


def expected(invoice: dict[str, Any], run_id: int, answer: str, deploy: int = 1) -> Record:
    total = total_of(invoice)
    tax = total * 20 // 100
    due = total + tax if deploy == 2 else total
    result: Record = {
        "invoice": invoice["id"],
        "total": total,
        "payment": "paid" if answer == "payment" else "declined",
        "ref": f"pay-{run_id}",
        "charged": due if answer == "payment" else 0,
        "deploy": deploy,
    }
    if deploy == 2:
        result["tax"] = tax
    return result


WAIT_NODE = "any_payment_declined"


# -- kills, timeouts, cancels and a pause ----------------------------------------------------


def test_nut_invoices_survive_killed_workers_with_timeouts_cancels_and_a_pause(
    client: Client,
    cyclone_dsn: str,
    tmp_path: Path,
    app_workers: Callable[..., subprocess.Popen[str]],
) -> None:
    directory = tmp_path / "effects"
    directory.mkdir()
    gate = tmp_path / "gate"  # the slow pricing service of invoice 5
    never = tmp_path / "never"  # invoice 6's service never answers: it is cancelled
    paused, paid, declined, timed_out, cancel_early, cancel_in_child = 0, (1, 2), 3, (4, 5), 6, 7
    paused_unpaid = 8  # paused past its payment timeout, resumed, never paid
    invoices = {
        0: make_invoice(0, directory, 1),
        1: make_invoice(1, directory, 3),
        2: make_invoice(2, directory, 2),
        3: make_invoice(3, directory, 2),
        4: make_invoice(4, directory, 2),
        5: make_invoice(5, directory, 3, gate),
        6: make_invoice(6, directory, 3, never),
        7: make_invoice(7, directory, 2),
        8: make_invoice(8, directory, 1),
    }
    ids: dict[int, int] = {}
    with PaymentProvider(cyclone_dsn) as provider:
        for i in (0, 1, 2, 3, 6, 7, 8):
            ids[i] = client.submit(nut_handlers.bill, invoices[i]).id
        provider.add(ids[paused], "pause")
        provider.add(ids[paused_unpaid], "pause")
        for i in paid:
            provider.add(ids[i], "payment")
        provider.add(ids[declined], "declined")
        provider.add(ids[cancel_in_child], "cancel")
        supervisor = app_workers()

        # A worker process dies with several handlers running: the supervisor restarts it.
        kill(busiest_worker(directory, at_least=2))
        # Invoice 6 is cancelled while its lines are being priced.
        busiest_worker(directory, run_id=ids[cancel_early])
        client.cancel(ids[cancel_early])

        # Invoices 0 and 8 were paused as soon as their charge runs existed. Invoices 4 and 5
        # are submitted now: their charge runs start after those pauses, so their payment
        # waits are due after invoice 0's and 8's would have been.
        assert provider.result(ids[paused]) == "paused"
        assert provider.result(ids[paused_unpaid]) == "paused"
        for i in timed_out:
            ids[i] = client.submit(nut_handlers.bill, invoices[i]).id

        # The supervisor is killed while a worker process prices invoice 5 (waiting on the
        # pricing service, which answers right after): its worker processes stop on their
        # own; another worker is started.
        victims = {busiest_worker(directory, run_id=ids[5])} | set(running_pids(directory))
        os.kill(supervisor.pid, signal.SIGKILL)
        supervisor.wait(10)
        gate.touch()
        app_workers()
        wait_until(
            lambda: not any(alive(p) for p in victims),
            what="the orphaned worker processes to stop",
            timeout=30,
        )

        # Nobody answers invoices 4 and 5: their charges time out and fail their runs.
        for i in timed_out:
            run = client.wait(ids[i], timeout=30)
            assert run.state is RunState.FAILED, (i, run.state)
        # Invoices 0's and 8's payment waits are held by the pause (waits.md: timers in a
        # paused run do not fire; pause reaches down to child runs; resume moves every
        # timed wait forward by the length of the pause).
        for i in (paused, paused_unpaid):
            assert client.get_run(ids[i]).state is RunState.PAUSED
            (kid,) = kids_of(client, ids[i])
            assert client.get_run(kid).state is RunState.PAUSED
            assert step_of(client, kid, WAIT_NODE).state is StepState.WAITING_SIGNAL
        # Invoice 8 is resumed unpaid: its wait has what was left of its timeout.
        unpaid = client.get_run(ids[paused_unpaid])
        (unpaid_kid,) = kids_of(client, ids[paused_unpaid])
        assert unpaid.paused_at is not None
        left = client.get_run(unpaid_kid).created_at + nut_handlers.PAY_TIMEOUT - unpaid.paused_at
        client.resume(ids[paused_unpaid])
        resumed_at = client.get_run(ids[paused_unpaid]).updated_at
        (kid,) = kids_of(client, ids[paused])
        # Invoice 0 is paid while paused: the waiting wait takes the payment; recording it,
        # newly ready, is paused with the run.
        delivery = client.signal(kid, "payment", {"ref": f"pay-{ids[paused]}"})
        assert delivery is Delivery.CONSUMED
        assert step_of(client, kid, "nut_record_payment").state is StepState.PAUSED
        assert client.get_run(ids[paused]).state is RunState.PAUSED
        client.resume(ids[paused])

        for i in (paused, *paid, declined):
            answer = "declined" if i == declined else "payment"
            got = client.result(ids[i], timeout=30)
            assert got == expected(invoices[i], ids[i], answer), i
        for i in (*paid, declined):
            assert provider.result(ids[i]) is Delivery.CONSUMED, i
        assert provider.result(ids[cancel_in_child]) == "cancelled"

    seen = records(directory)
    completed: list[int] = []
    # Invoice 8 timed out once what was left of its timeout had passed after the resume.
    unpaid_end = client.wait(unpaid_kid, timeout=30)
    assert unpaid_end.state is RunState.FAILED
    assert unpaid_end.finished_at is not None
    assert unpaid_end.finished_at - resumed_at > left - timedelta(seconds=0.5), (
        f"timed out {unpaid_end.finished_at - resumed_at} after the resume, with {left} left"
    )
    for i, run_id in ids.items():
        run = client.wait(run_id, timeout=30)
        kids = kids_of(client, run_id)
        if i in (cancel_early, cancel_in_child):
            assert run.state is RunState.CANCELLED, (i, run.state)
            assert len(kids) == (1 if i == cancel_in_child else 0), (i, kids)
            for kid in kids:
                assert client.get_run(kid).state is RunState.CANCELLED
                assert not seen.get((kid, "nut_record_payment"))
            with pytest.raises(RunFailed):
                client.result(run_id, timeout=5)
            continue
        assert len(kids) == 1, (i, kids)
        (kid,) = kids
        if i in (*timed_out, paused_unpaid):
            assert run.state is RunState.FAILED
            # The lines were priced and added up as plain Python does.
            assert step_of(client, run_id, "nut_total").output == {
                "dir": str(directory),
                "invoice": invoices[i]["id"],
                "total": total_of(invoices[i]),
            }
            charge = step_of(client, run_id, "nut_charge")
            assert (charge.state, charge.error_kind) == (StepState.DISCARDED, "child_failed")
            assert client.get_run(kid).state is RunState.FAILED
            wait = step_of(client, kid, WAIT_NODE)
            assert (wait.state, wait.error_kind) == (StepState.DISCARDED, "signal_timeout")
            assert step_of(client, run_id, "nut_summary").state is StepState.CANCELLED
            assert not seen.get((kid, "nut_record_payment"))
            with pytest.raises(RunFailed):
                client.result(run_id, timeout=5)
            completed.append(run_id)
            continue
        assert run.state is RunState.COMPLETED, (i, run.state)
        assert client.get_run(kid).state is RunState.COMPLETED
        completed += [run_id, kid]
    # One token per priced line of every run not cancelled, one per recorded payment.
    lines = sum(len(invoices[i]["plan"]) for i in ids if i not in (cancel_early, cancel_in_child))
    assert check_outputs_are_from_the_last_execution(client, completed, directory) == lines + 4


# -- a second deploy while the first one's runs are in flight ------------------------------


def deploy_2(tmp_path: Path) -> Path:
    """The app's second release in a directory of its own, its module under the same name."""
    app = tmp_path / "deploy2"
    (app / "tests" / "faults").mkdir(parents=True)
    (app / "tests" / "__init__.py").touch()
    (app / "tests" / "faults" / "__init__.py").touch()
    shutil.copy(
        ROOT / "tests" / "faults" / "nut_handlers_v2.py", app / "tests/faults/nut_handlers.py"
    )
    return app


def test_nut_a_second_deploy_leaves_the_first_deploys_runs_to_its_workers(
    client: Client,
    cyclone_dsn: str,
    tmp_path: Path,
    app_workers: Callable[..., subprocess.Popen[str]],
) -> None:
    directory = tmp_path / "effects"
    directory.mkdir()
    gate = tmp_path / "gate"
    total_gate = tmp_path / "total-gate"
    old = {
        0: make_invoice(0, directory, 2, gate),
        1: make_invoice(1, directory, 1, gate),
        5: {**make_invoice(5, directory, 1), "total_gate": str(total_gate)},
    }
    new = {2: make_invoice(2, directory, 2), 3: make_invoice(3, directory, 3)}
    answers = {0: "payment", 1: "declined", 2: "payment", 3: "declined", 4: "payment"}
    answers[5] = "payment"
    ids: dict[int, int] = {}
    with PaymentProvider(cyclone_dsn) as provider:
        for i, invoice in old.items():
            ids[i] = client.submit(nut_handlers.bill, invoice).id
            provider.add(ids[i], answers[i])
        old_worker = app_workers(ROOT, 1)
        busiest_worker(directory, run_id=ids[0])  # deploy 1's runs are in flight
        # Run 5 is paused while it adds up its lines: the charge node becomes ready (and
        # paused) without its child run.
        busiest_worker(directory, run_id=ids[5])
        client.pause(ids[5])
        total_gate.touch()
        wait_until(
            lambda: step_of(client, ids[5], "nut_charge").state is StepState.PAUSED,
            what="run 5's charge node ready and paused",
        )
        assert kids_of(client, ids[5]) == []

        # Deploy 2: its worker and its client start next to deploy 1's worker; the new
        # client resumes run 5 (versioning.md: a process of another deploy that moves the
        # parent on does not start the child with its own definition).
        app = deploy_2(tmp_path)
        app_workers(app, 1)
        todo = {"resume": [ids[5]], "submit": list(new.values())}
        submitted = subprocess.run(
            [sys.executable, "-c", CLIENT_MAIN, cyclone_dsn, json.dumps(todo)],
            cwd=app,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        out = json.loads(submitted.stdout)
        v2_version = out["bill"]
        assert v2_version != nut_handlers.bill.def_version
        assert out["charge"] != nut_handlers.charge.def_version
        for i, run_id in zip(new, out["ids"], strict=True):
            ids[i] = run_id
            provider.add(run_id, answers[i])
        for i, invoice in new.items():
            got = client.result(ids[i], timeout=30)
            assert got == expected(invoice, ids[i], answers[i], deploy=2), i
        # Deploy 1's runs are still at their lines (the pricing service has not answered).
        for i in (0, 1):
            assert client.get_run(ids[i]).state is RunState.RUNNING
        gate.touch()
        for i, invoice in old.items():  # run 5 included: its child was started for it
            got = client.result(ids[i], timeout=30)
            assert got == expected(invoice, ids[i], answers[i], deploy=1), i

        # Deploy 1's last worker stops; a late client of deploy 1 still submits a run.
        old_worker.send_signal(signal.SIGTERM)
        assert old_worker.wait(30) == 0
        late = make_invoice(4, directory, 1)
        ids[4] = client.submit(nut_handlers.bill, late).id
        provider.add(ids[4], answers[4])

        def listed() -> list[tuple[Any, ...]]:
            return [
                (u["workflow"], u["def_version"], u["kind"], u["steps"])
                for u in client.stats()["unserved"]
            ]

        # versioning.md: its steps stay available, untouched, and listed as unserved.
        wait_until(
            lambda: listed() == [("nut_bill", nut_handlers.bill.def_version, "nut_line_items", 1)],
            what="the late run listed as unserved",
            timeout=15,
        )
        first = step_of(client, ids[4], "nut_line_items")
        assert (first.state, first.attempt, first.reclaims) == (StepState.AVAILABLE, 0, 0)
        # An old worker is started again to drain it.
        app_workers(ROOT, 1)
        assert client.result(ids[4], timeout=30) == expected(late, ids[4], "payment", deploy=1)
        assert listed() == []

    seen = records(directory)
    for i, run_id in ids.items():
        run = client.get_run(run_id)
        deploy = 2 if i in new else 1
        assert run.def_version == (v2_version if deploy == 2 else nut_handlers.bill.def_version)
        assert ("nut_tax" in {s.node for s in run.steps}) == (deploy == 2)
        # Nothing was failed or retried on the way.
        for st in run.steps:
            assert st.state is StepState.COMPLETED, (i, st.node, st.state)
            assert st.attempts == () and st.attempt == 0, (i, st.node, st.attempts)
        # Each run's own steps ran on its deploy's workers only.
        for (rid, node), executions in seen.items():
            if rid == run_id:
                for phases in executions.values():
                    assert phases["start"]["deploy"] == deploy, (i, node)
        # Child runs follow their parent's version.
        (kid,) = kids_of(client, run_id)
        child = client.get_run(kid)
        assert child.state is RunState.COMPLETED
        charge = out["charge"] if deploy == 2 else nut_handlers.charge.def_version
        assert child.def_version == charge, (i, "child run of the wrong definition")
