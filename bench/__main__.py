"""``python -m bench [--quick | --smoke] [--json PATH]``: Cyclone against baselines, as ratios.

Every figure of one table comes from the same run on the same PostgreSQL
server (the embedded one, or ``CYCLONE_DATABASE_URL``), because absolute
numbers on shared machines are noisy; the ratios are what to compare.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType
from typing import Any

import psycopg

from bench import cyclone_bench as cy
from bench import flows, peers
from bench.cpu import Meter
from cyclone_dsl import __version__
from cyclone_dsl.db.embedded import embedded_database
from cyclone_dsl.worker.adaptive import WorkerSettings

SIZES = {
    # The test suite's run: every scenario, sizes too small for its figures to mean much.
    "smoke": {
        "jobs": 300,
        "runs": 60,
        "peer_runs": 30,
        "fan": 200,
        "samples": 5,
        "poll_samples": 2,
        "submits": 60,
        "bulk": 300,
        "history": 2_000,
        "expired": 1_000,
        # the server's CPU is read in clock ticks (10 ms): fewer looks read 0 ms
        "idle_looks": 200,
        "starts": 5,
        "slow_jobs": 10,
        "repeats": 1,
    },
    "quick": {
        "jobs": 2000,
        "runs": 300,
        "peer_runs": 100,
        "fan": 1000,
        "samples": 20,
        "poll_samples": 4,
        "submits": 200,
        "bulk": 2000,
        "history": 20_000,
        "expired": 10_000,
        "idle_looks": 30,
        "starts": 20,
        "slow_jobs": 1000,
        "repeats": 3,
    },
    "full": {
        "jobs": 20000,
        "runs": 5000,
        "peer_runs": 1000,
        "fan": 10000,
        "samples": 50,
        "poll_samples": 20,
        "submits": 2000,
        "bulk": 20000,
        "history": 1_000_000,
        "expired": 200_000,
        "idle_looks": 30,
        "starts": 50,
        "slow_jobs": 5000,
        "repeats": 3,
    },
}


def measure(admin: str, size: dict[str, int], only: str = "all") -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []

    def add(
        scenario: str,
        value: float,
        unit: str,
        peer: str | None = None,
        peer_value: float | None = None,
        target: str = "",
        lower_is_better: bool = False,
    ) -> None:
        ratio = None
        if peer_value and value:
            ratio = peer_value / value if lower_is_better else value / peer_value
        rows.append(
            {
                "scenario": scenario,
                "cyclone": value,
                "unit": unit,
                "peer": peer,
                "peer_value": peer_value,
                "ratio": ratio,
                "target": target,
            }
        )
        shown = f"{ratio:.2f}x {peer}" if ratio else ""
        print(f"  {scenario:<40} {value:>10.1f} {unit:<10} {shown}", flush=True)

    def peer(name: str) -> ModuleType | None:
        module = peers.load(name)
        if module is None:
            print(f"  ({name} not installed: pip install 'cyclone-dsl[bench]')", flush=True)
        return module

    if only == "processes":
        scaling(admin, size, add)
        return rows
    if only == "async":
        async_handlers(admin, size, add)
        return rows
    raw = peers.load("raw")
    assert raw is not None
    if only == "submits":
        submits(admin, size, add, raw)
        starts(admin, size, add)
        return rows
    raw_1 = raw.noop_throughput(admin, size["jobs"], 1)
    raw_100 = raw.noop_throughput(admin, size["jobs"], 100)
    add("raw SKIP LOCKED, 1 per tx", raw_1, "jobs/s")
    add("raw SKIP LOCKED, 100 per tx", raw_100, "jobs/s")
    own_cpu = Meter(admin)
    noop = cy.noop_throughput(admin, size["jobs"], own_cpu)
    add("standalone no-op steps", noop, "steps/s", "raw x100", raw_100, ">= 0.30x raw x100")
    queues = [m for m in (peer("pgqueuer"), peer("procrastinate")) if m is not None]
    for module in queues:
        name = peers.name_of(module)
        if name != "pgqueuer":
            value = module.noop_throughput(admin, size["jobs"])
            add(f"{name} no-op jobs", value, "jobs/s")
            add(f"standalone vs {name}", noop, "steps/s", name, value)
            continue
        their_cpu = Meter(admin)
        value = module.noop_throughput(admin, size["jobs"], their_cpu)
        add(f"{name} no-op jobs", value, "jobs/s")
        # Each side's best configuration: one process, or two (this machine's cores).
        their_two = module.noop_throughput_processes(admin, size["jobs"], 2)
        add(f"{name} no-op jobs, 2 processes", their_two, "jobs/s")
        own_two = cy.process_throughput(admin, size["jobs"], 2)
        add("standalone no-op steps, 2 worker processes", own_two, "steps/s")
        best, theirs = max(noop, own_two), max(value, their_two)
        add(f"standalone vs {name}, best of each", best, "steps/s", name, theirs, ">= 1.5x")
        # CPU per step: steadier than rates on a shared machine, and it says where the
        # time goes (lower is better: the ratio is theirs over ours).
        for side, ours, them in (
            ("server", own_cpu.server_s, their_cpu.server_s),
            ("worker", own_cpu.client_s, their_cpu.client_s),
        ):
            if ours and them:
                per_step = ours * 1e6 / size["jobs"]
                per_job = them * 1e6 / size["jobs"]
                add(f"{side} CPU per standalone step", per_step, "us", name, per_job, "", True)

    # Worker defaults: Worker(dsn, [handler]) with no tuning option against the tuned
    # worker, alternating, the median of each; the untuned worker's own settings printed.
    for label, handler in (("no-op", flows.noop), ("10 ms sleep", flows.sleepy)):
        tuned, untuned = [], []
        for _ in range(size["repeats"]):
            tuned.append(cy.defaults_throughput(admin, size["jobs"], handler, tuned=True)[0])
            rate, settings = cy.defaults_throughput(admin, size["jobs"], handler, tuned=False)
            untuned.append(rate)
            print(
                f"    untuned worker, {label}: {rate:,.0f} steps/s with concurrency "
                f"{settings.concurrency} (adaptive {settings.adaptive}, cap "
                f"{settings.max_concurrency}), claims of up to {settings.claim_size}, "
                f"{settings.threads} threads",
                flush=True,
            )
        add(
            f"untuned worker, {label} steps",
            cy.median(untuned),
            "steps/s",
            "tuned (100/100)",
            cy.median(tuned),
            ">= 0.8x",
        )

    async_handlers(admin, size, add)

    keyed = cy.keyed_throughput(admin, size["jobs"])
    add("steps under a concurrency key", keyed, "steps/s", "standalone", noop)
    rated = cy.rated_throughput(admin, size["jobs"])
    add("steps under a rate limit", rated, "steps/s", "standalone", noop)

    emitting = cy.emit_throughput(admin, size["jobs"])
    add(
        f"steps storing {flows.EVENTS_PER_STEP} events each",
        emitting,
        "steps/s",
        "standalone",
        noop,
    )

    own_writes = cy.write_throughput(admin, size["jobs"], transactional=False)
    add("steps writing a row on their own", own_writes, "steps/s", "standalone", noop)
    tx_writes = cy.write_throughput(admin, size["jobs"], transactional=True)
    add("transactional steps writing a row", tx_writes, "steps/s", "own tx", own_writes)
    add("transactional vs plain no-op steps", tx_writes, "steps/s", "standalone", noop)

    chain_cpu = Meter(admin)
    chain = cy.workflow_throughput(admin, flows.chain, size["runs"], 3, chain_cpu)
    add("3-step chains", chain, "steps/s", "standalone", noop, ">= 0.9x")
    if chain_cpu.server_s and own_cpu.server_s:
        add(
            "server CPU per chain step",
            chain_cpu.server_s * 1e6 / (size["runs"] * 3),
            "us",
            "standalone",
            own_cpu.server_s * 1e6 / size["jobs"],
            "",
            True,
        )
    engines = [m for m in (peer("dbos"), peer("absurd")) if m is not None]
    for module in engines:
        name = peers.name_of(module)
        value = module.chain_throughput(admin, size["peer_runs"])
        add(f"{name} 3-step workflows", value, "steps/s")
        add(f"3-step chains vs {name}", chain, "steps/s", name, value, ">= 10x")
    diamond = cy.workflow_throughput(admin, flows.diamond, size["runs"], 4)
    add("diamonds (4 steps)", diamond, "steps/s", "chain", chain, ">= 0.5x chain")
    wide = cy.workflow_throughput(admin, flows.wide, size["runs"], 7)
    add("wide joins (7 steps)", wide, "steps/s", "chain", chain, ">= 0.5x chain")
    fan = cy.fan_out_throughput(admin, size["fan"])
    add(f"fan-out of {size['fan']} items", fan, "items/s", "standalone", noop, ">= 0.5x")

    latencies = cy.wakeup_latency(admin, size["samples"])
    median = cy.median(latencies) * 1000
    add("wake-up latency, median", median, "ms", target="<= 5 ms")
    add("wake-up latency, p99", cy.percentile(latencies, 0.99) * 1000, "ms", target="<= 25 ms")
    for module in [raw, *queues, *engines]:
        name = peers.name_of(module)
        polls = name in ("dbos", "absurd")
        samples = size["poll_samples"] if polls else size["samples"]
        theirs = cy.median(module.wakeup_latency(admin, samples)) * 1000
        add(f"{name} wake-up, median", theirs, "ms")
        add(f"wake-up median vs {name}", median, "ms", name, theirs, "faster", True)

    waited = cy.median(cy.result_latency(admin, size["samples"])) * 1000
    add("result() latency, median", waited, "ms", "wake-up (handler start)", median, "", True)
    at_once = size["samples"] * 4
    drained, connections = cy.waits_at_once(admin, at_once)
    add(f"{at_once} result() at once: wait connections", connections, "", target="1")
    add(f"{at_once} result() at once: all returned", drained * 1000, "ms")
    followed, connections = cy.waits_at_once(admin, at_once, follow=True)
    add(f"{at_once} events() at once: wait connections", connections, "", target="1")
    add(
        f"{at_once} events() at once: all ended",
        followed * 1000,
        "ms",
        "result()",
        drained * 1000,
        "",
        True,
    )

    submits(admin, size, add, raw)
    starts(admin, size, add)
    grown, empty = bracketed(
        lambda: cy.noop_throughput_with_history(admin, size["jobs"], size["history"]),
        lambda: cy.noop_throughput(admin, size["jobs"]),
    )
    add(
        f"standalone with {size['history']:,} old runs",
        grown,
        "steps/s",
        "standalone (adjacent)",
        empty,
        ">= 0.8x",
    )
    purged = cy.retention_rate(admin, size["expired"])
    add(
        f"retention: {size['expired']:,} expired runs deleted",
        purged,
        "runs/s",
        "standalone",
        noop,
        ">= 1x (keeps up)",
    )
    idle = cy.idle_look_cost(admin, size["expired"], size["idle_looks"])
    if idle is not None:
        add(
            f"idle scanner look, {size['expired']:,} kept runs",
            idle[0],
            "ms server",
            "retention at every look",
            idle[1],
            ">= 5x",
            lower_is_better=True,
        )
    scaling(admin, size, add)
    return rows


def bracketed(measure: Callable[[], float], baseline: Callable[[], float]) -> tuple[float, float]:
    """Commit-bound and growth figures drift with the disk over a run: each is compared
    with its baseline measured right before and right after it (the mean of the two)."""
    before = baseline()
    value = measure()
    return value, (before + baseline()) / 2


def submits(admin: str, size: dict[str, int], add: Callable[..., None], raw: ModuleType) -> None:
    """submit() (sync and async) against the raw one-commit rate beside it; submit_many()."""
    submitted, raw_near = bracketed(
        lambda: cy.submit_rate(admin, size["submits"]),
        lambda: raw.noop_throughput(admin, size["submits"], 1),
    )
    add("submit(), 5-node workflow", submitted, "runs/s", "raw x1 (adjacent)", raw_near, ">= 1000")
    awaited, raw_near = bracketed(
        lambda: cy.async_submit_rate(admin, size["submits"]),
        lambda: raw.noop_throughput(admin, size["submits"], 1),
    )
    add("submit(), async client", awaited, "runs/s", "raw x1 (adjacent)", raw_near)
    add(
        "submit_many(), 5-node workflow",
        cy.submit_many_rate(admin, size["bulk"]),
        "runs/s",
        target=">= 10000",
    )


def starts(admin: str, size: dict[str, int], add: Callable[..., None]) -> None:
    """A client's start and first read against a raw connection's; the sessions a client
    start and a worker start open (each start checks the database on its pool's first)."""
    started = cy.start_cost(admin, size["starts"])
    add(
        "Client() start and one read",
        started.client_ms,
        "ms",
        "raw connect and one query",
        started.raw_ms,
        "",
        True,
    )
    add("sessions a client start opens", started.client_sessions, "", target="1")
    # its pool, its listener, its heartbeat (opened at start: reserved, see worker.py)
    add("sessions a worker start and stop open", started.worker_sessions, "", target="<= 4")


def async_handlers(admin: str, size: dict[str, int], add: Callable[..., None]) -> None:
    """Async handlers that sleep 10 ms, by ``Worker(dsn, [handler])`` with no tuning
    option, against sync ones sleeping as long by the tuned worker (100 threads, claims of
    100), alternating, the median of each; then handlers that sleep 1 s, async and sync,
    both untuned. The untuned worker's settings and peaks are printed."""

    def show(label: str, rate: float, settings: WorkerSettings, peaks: cy.Peaks) -> None:
        print(
            f"    untuned worker, {label}: {rate:,.0f} steps/s; async handlers "
            f"{settings.async_concurrency} at once now (cap {settings.max_async}), sync "
            f"{settings.concurrency} (cap {settings.max_concurrency}); claims of up to "
            f"{settings.claim_size}; at most {peaks.in_flight} in flight, "
            f"{settings.threads} handler threads, {peaks.threads} threads in the process",
            flush=True,
        )

    tuned, untuned = [], []
    for _ in range(size["repeats"]):
        tuned.append(cy.defaults_throughput(admin, size["jobs"], flows.sleepy, tuned=True)[0])
        peaks = cy.Peaks()
        rate, settings = cy.defaults_throughput(
            admin, size["jobs"], flows.async_sleepy, tuned=False, peaks=peaks
        )
        untuned.append(rate)
        show("async 10 ms sleep", rate, settings, peaks)
    add(
        "untuned worker, async 10 ms sleep steps",
        cy.median(untuned),
        "steps/s",
        "sync, tuned (100/100)",
        cy.median(tuned),
        ">= 0.8x",
    )
    slow: dict[str, float] = {}
    for label, handler in (("async", flows.async_sleepy_1s), ("sync", flows.sleepy_1s)):
        peaks = cy.Peaks()
        rate, settings = cy.defaults_throughput(
            admin, size["slow_jobs"], handler, tuned=False, peaks=peaks
        )
        slow[label] = rate
        show(f"{label} 1 s sleep", rate, settings, peaks)
    add(
        "untuned worker, async 1 s sleep steps",
        slow["async"],
        "steps/s",
        "sync, untuned",
        slow["sync"],
    )


def scaling(admin: str, size: dict[str, int], add: Callable[..., None]) -> None:
    """No-op standalone steps with 1, 2 and 4 worker processes, against 1 process."""
    one = None
    for count in cy.PROCESS_COUNTS:
        value = cy.process_throughput(admin, size["jobs"], count)
        one = one or value
        label = "process" if count == 1 else "processes"
        add(f"standalone no-op, {count} worker {label}", value, "steps/s", "1 process", one)


def markdown(report: dict[str, Any]) -> str:
    """The report as the Markdown table docs/performance.md shows."""
    lines = [
        "| Scenario | Cyclone | Compared with | Ratio | Target |",
        "|---|---|---|---|---|",
    ]
    for row in report["results"]:
        peer = ""
        if row["peer"]:
            peer = f"{row['peer']} ({row['peer_value']:,.1f})" if row["peer_value"] else row["peer"]
        ratio = f"{row['ratio']:.2f}x" if row["ratio"] else ""
        lines.append(
            f"| {row['scenario']} | {row['cyclone']:,.1f} {row['unit']} | {peer} | {ratio} "
            f"| {row['target']} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes (under 2 minutes)")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes: checks that every scenario runs (its figures mean little)",
    )
    parser.add_argument(
        "--only",
        choices=["all", "processes", "submits", "async"],
        default="all",
        help="processes: only the scaling scenario (1, 2 and 4 worker processes); "
        "submits: only submit() and submit_many(); async: only the async handler scenarios",
    )
    parser.add_argument("--json", type=Path, default=Path("bench/results/latest.json"))
    parser.add_argument(
        "--markdown", type=Path, help="print the table of this JSON report as Markdown; no run"
    )
    args = parser.parse_args()
    if args.markdown:
        print(markdown(json.loads(args.markdown.read_text())))
        return 0
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    size = SIZES[mode]
    started = time.perf_counter()
    with embedded_database() as admin:
        with psycopg.connect(admin) as conn:
            server = conn.execute("SHOW server_version").fetchone()
            sync = conn.execute("SHOW synchronous_commit").fetchone()
        print(
            f"cyclone {__version__}, PostgreSQL {server[0] if server else '?'}, "
            f"synchronous_commit={sync[0] if sync else '?'}, python {platform.python_version()}"
        )
        rows = measure(admin, size, args.only)
    report = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "mode": mode + ("" if args.only == "all" else f", {args.only}"),
        "machine": {"cpus": __import__("os").cpu_count(), "platform": platform.platform()},
        "versions": {
            "cyclone": __version__,
            "python": platform.python_version(),
            "postgres": server[0] if server else None,
        },
        "results": rows,
        "seconds": round(time.perf_counter() - started, 1),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    print(f"written to {args.json} in {report['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
