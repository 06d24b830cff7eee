"""``python -m bench [--quick] [--json PATH]``: Cyclone against baselines, as ratios.

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
from typing import Any

import psycopg

from bench import cyclone_bench as cy
from bench import flows
from bench.baseline import pgqueuer_peer, procrastinate_peer, raw_queue
from cyclone_dsl import __version__
from cyclone_dsl.db.embedded import embedded_database
from cyclone_dsl.testing.schemas import create_schema, drop_schema, with_search_path

SIZES = {
    "quick": {"jobs": 2000, "runs": 300, "fan": 1000, "samples": 20, "submits": 200, "bulk": 2000},
    "full": {
        "jobs": 20000,
        "runs": 5000,
        "fan": 10000,
        "samples": 50,
        "submits": 2000,
        "bulk": 20000,
    },
}


def in_schema(admin: str, measure: Callable[[str], float]) -> float:
    """Run ``measure`` with a DSN whose search_path is a fresh, empty schema."""
    name = create_schema(admin, migrated=False)
    try:
        return measure(with_search_path(admin, name))
    finally:
        drop_schema(admin, name)


def raw(admin: str, jobs: int, batch: int) -> float:
    return in_schema(admin, lambda dsn: raw_queue.noop_throughput(dsn, jobs, batch))


def measure(admin: str, size: dict[str, int]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []

    def add(
        scenario: str,
        value: float,
        unit: str,
        peer: str | None = None,
        peer_value: float | None = None,
        target: str = "",
    ) -> None:
        ratio = value / peer_value if peer_value else None
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
        print(f"  {scenario:<34} {value:>10.1f} {unit:<10} {shown}", flush=True)

    raw_1 = raw(admin, size["jobs"], 1)
    raw_100 = raw(admin, size["jobs"], 100)
    add("raw SKIP LOCKED, 1 per tx", raw_1, "jobs/s")
    add("raw SKIP LOCKED, 100 per tx", raw_100, "jobs/s")
    noop = cy.noop_throughput(admin, size["jobs"])
    add("standalone no-op steps", noop, "steps/s", "raw x100", raw_100, ">= 0.30x raw x100")
    if pgqueuer_peer.available():
        peer = in_schema(admin, lambda dsn: pgqueuer_peer.noop_throughput(dsn, size["jobs"]))
        add("pgqueuer no-op jobs (asyncpg, batch 100)", peer, "jobs/s")
        add("standalone vs pgqueuer", noop, "steps/s", "pgqueuer", peer, ">= 1.5x pgqueuer")
    else:
        print("  (pgqueuer not installed: pip install 'cyclone-dsl[bench]')")
    if procrastinate_peer.available():
        peer = in_schema(admin, lambda dsn: procrastinate_peer.noop_throughput(dsn, size["jobs"]))
        add("procrastinate no-op jobs", peer, "jobs/s")
        add("standalone vs procrastinate", noop, "steps/s", "procrastinate", peer)
    else:
        print("  (procrastinate not installed: pip install 'cyclone-dsl[bench]')")
    chain = cy.workflow_throughput(admin, flows.chain, size["runs"], 3)
    add("3-step chains", chain, "steps/s", "standalone", noop)
    diamond = cy.workflow_throughput(admin, flows.diamond, size["runs"], 4)
    add("diamonds (4 steps)", diamond, "steps/s", "chain", chain, ">= 0.5x chain")
    wide = cy.workflow_throughput(admin, flows.wide, size["runs"], 7)
    add("wide joins (7 steps)", wide, "steps/s", "chain", chain, ">= 0.5x chain")
    fan = cy.fan_out_throughput(admin, size["fan"])
    add(f"fan-out of {size['fan']} items", fan, "items/s", "standalone", noop, ">= 0.5x")
    latencies = cy.wakeup_latency(admin, size["samples"])
    add("wake-up latency, median", cy.median(latencies) * 1000, "ms", target="<= 5 ms")
    add("wake-up latency, p99", cy.percentile(latencies, 0.99) * 1000, "ms", target="<= 25 ms")
    add(
        "submit(), 5-node workflow",
        cy.submit_rate(admin, size["submits"]),
        "runs/s",
        target=">= 1000",
    )
    add(
        "submit_many(), 5-node workflow",
        cy.submit_many_rate(admin, size["bulk"]),
        "runs/s",
        target=">= 10000",
    )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes (under 2 minutes)")
    parser.add_argument("--json", type=Path, default=Path("bench/results/latest.json"))
    args = parser.parse_args()
    size = SIZES["quick" if args.quick else "full"]
    started = time.perf_counter()
    with embedded_database() as admin:
        with psycopg.connect(admin) as conn:
            server = conn.execute("SHOW server_version").fetchone()
            sync = conn.execute("SHOW synchronous_commit").fetchone()
        print(
            f"cyclone {__version__}, PostgreSQL {server[0] if server else '?'}, "
            f"synchronous_commit={sync[0] if sync else '?'}, python {platform.python_version()}"
        )
        rows = measure(admin, size)
    report = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "mode": "quick" if args.quick else "full",
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
