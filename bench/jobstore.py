"""Claims and finishes per second that one PostgreSQL sustains, with 1, 8 and 32 claimers,
straight to the server (statements unprepared, the default, and prepared) and
through PgBouncer in transaction mode, in one run.

    .venv/bin/python bench/jobstore.py [--quick] [--jobs N] [--out FILE]

Starts its own cluster (Debian's postgresql, run as `postgres` when root, with
the server's durable defaults: fsync and synchronous_commit on) and a PgBouncer
(tests/jobs/postgres_fixtures.py), and removes both at the end. Each claimer is
a thread with a `PostgresJobStore` of its own (one connection), as an instance
of a fleet would be; the claimers are spread over worker processes, one per
CPU, so that one interpreter's lock does not set the figures. Per configuration:

1. the queue is filled with N jobs (`create_many`, 100 a statement);
2. claims: every claimer runs `claim_next` until the queue is empty
   (`FOR UPDATE SKIP LOCKED` on the oldest queued job);
3. finishes: every claimer `finish`es the jobs it claimed.

Each phase's rate is its operations over the time from the first claimer's
start to the last one's end; latencies are per call, p50 and p99. Last, what
NOTIFY costs a write (`notify_cost`: plain UPDATEs, UPDATE + NOTIFY in one
transaction as the store does, and NOTIFY in a transaction of its own), with
1, 8 and 32 writers. The table goes to stdout (and FILE), progress to stderr.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import Row, fmt_s, percentile  # noqa: E402

CLAIMERS = (1, 8, 32)
PGBOUNCER_POOL = 16


@dataclass
class Phase:
    ops: int
    started: float
    ended: float
    latencies: list[float]


def _worker(url: str, claimers: int, barrier: Barrier, results: Any, owner_prefix: str) -> None:
    """`claimers` claimers in threads of this process, each with its own store."""
    import threading

    from runtime.jobs.job import JobStatus
    from runtime.jobs.stores.postgres import PostgresJobStore

    stores = [PostgresJobStore(url, ttl_s=3600.0) for _ in range(claimers)]
    claimed: list[list[str]] = [[] for _ in stores]
    phases: dict[str, list[Phase]] = {"claims": [], "finishes": []}
    lock = threading.Lock()

    def claim(index: int) -> None:
        store, mine, latencies = stores[index], claimed[index], []
        owner = f"{owner_prefix}-{index}"
        started = time.monotonic()
        while True:
            t0 = time.perf_counter()
            job = store.claim_next(owner, 300.0, 3)
            latencies.append(time.perf_counter() - t0)
            if job is None:
                latencies.pop()  # the empty queue's answer is not a claim
                break
            mine.append(job.id)
        with lock:
            phases["claims"].append(Phase(len(mine), started, time.monotonic(), latencies))

    def finish(index: int) -> None:
        store, latencies = stores[index], []
        owner = f"{owner_prefix}-{index}"
        started = time.monotonic()
        for job_id in claimed[index]:
            t0 = time.perf_counter()
            if not store.finish(job_id, owner, JobStatus.SUCCEEDED, {"ok": True}):
                raise RuntimeError(f"finish of {job_id} refused")
            latencies.append(time.perf_counter() - t0)
        with lock:
            phases["finishes"].append(Phase(len(latencies), started, time.monotonic(), latencies))

    for store in stores:  # connect before the clock starts
        store.ping(f"{owner_prefix}-warm")
    for target in (claim, finish):
        barrier.wait()
        threads = [threading.Thread(target=target, args=(i,)) for i in range(claimers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    for store in stores:
        store.close()
    results.put(phases)


def measure(url: str, admin_url: str, claimers: int, jobs: int) -> dict[str, Phase]:
    """One configuration: fill, claim all, finish all; each phase merged over claimers."""
    import psycopg

    from runtime.jobs.job import Job, new_job_id
    from runtime.jobs.stores.postgres import PostgresJobStore

    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute("TRUNCATE thaw_jobs")
    filler = PostgresJobStore(admin_url, ttl_s=3600.0)
    for start in range(0, jobs, 100):
        batch = [
            Job(id=new_job_id(), handler="echo", input={"i": i})
            for i in range(start, min(jobs, start + 100))
        ]
        filler.create_many(batch)
    filler.close()
    with psycopg.connect(admin_url, autocommit=True) as conn:
        # What autovacuum does within a minute of a burst like this one (the table's
        # analyze threshold is 2% of its rows): the planner then walks the queued
        # index from the oldest job instead of sorting the queue.
        conn.execute("ANALYZE thaw_jobs")
    context = multiprocessing.get_context("spawn")
    processes = min(claimers, os.cpu_count() or 1)
    shares = [
        claimers // processes + (1 if i < claimers % processes else 0) for i in range(processes)
    ]
    barrier = context.Barrier(processes)
    results = context.Queue()
    workers = [
        context.Process(target=_worker, args=(url, share, barrier, results, f"w{i}"))
        for i, share in enumerate(shares)
    ]
    for worker in workers:
        worker.start()
    merged: dict[str, list[Phase]] = {"claims": [], "finishes": []}
    for _ in workers:
        for name, phases in results.get(timeout=600).items():
            merged[name] += phases
    for worker in workers:
        worker.join(timeout=60)
        if worker.exitcode != 0:
            raise RuntimeError(f"a claimer process exited with {worker.exitcode}")
    out = {}
    for name, phases in merged.items():
        out[name] = Phase(
            sum(p.ops for p in phases),
            min(p.started for p in phases),
            max(p.ended for p in phases),
            [latency for p in phases for latency in p.latencies],
        )
    if out["claims"].ops != jobs or out["finishes"].ops != jobs:
        raise RuntimeError(
            f"{jobs} jobs, but {out['claims'].ops} claims, {out['finishes'].ops} finishes"
        )
    return out


# What NOTIFY costs a write, on a scratch table of the same database: a notifying
# commit holds a cluster-wide lock through its WAL flush, so such commits are
# serialized and lose group commit; a NOTIFY in a transaction of its own writes
# no WAL and holds that lock for microseconds.
_NOTIFY_VARIANTS = {
    "plain UPDATE": ("UPDATE bench_rows SET v = v + 1 WHERE id = %s",),
    "UPDATE + NOTIFY in its transaction (the store)": (
        "WITH u AS (UPDATE bench_rows SET v = v + 1 WHERE id = %s RETURNING id)"
        " SELECT pg_notify('bench', id::text) FROM u",
    ),
    "UPDATE, then NOTIFY in a transaction of its own": (
        "UPDATE bench_rows SET v = v + 1 WHERE id = %s",
        "SELECT pg_notify('bench', %s::text)",
    ),
}


def notify_cost(url: str, writes_each: int) -> list[Row]:
    import threading

    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS bench_rows (id int PRIMARY KEY, v int)")
        conn.execute(
            "INSERT INTO bench_rows SELECT g, 0 FROM generate_series(0, 63) g"
            " ON CONFLICT DO NOTHING"
        )
    listener = psycopg.connect(url, autocommit=True)
    listener.execute("LISTEN bench")  # notifications are queued only while someone listens
    rows = []
    try:
        for writers in CLAIMERS:
            cells = []
            for statements in _NOTIFY_VARIANTS.values():

                def write(index: int, statements: tuple[str, ...] = statements) -> None:
                    with psycopg.connect(url, autocommit=True, prepare_threshold=None) as conn:
                        for _ in range(writes_each):
                            for statement in statements:
                                conn.execute(statement, (index,))

                threads = [threading.Thread(target=write, args=(i,)) for i in range(writers)]
                started = time.perf_counter()
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
                cells.append(f"{writers * writes_each / (time.perf_counter() - started):,.0f}")
                for _ in listener.notifies(timeout=0.5):
                    pass
            rows.append(
                Row(
                    f"{writers} writer(s), writes/s: " + " | ".join(_NOTIFY_VARIANTS),
                    " | ".join(cells),
                )
            )
    finally:
        listener.close()
    return rows


def _rate(phase: Phase) -> float:
    return phase.ops / max(phase.ended - phase.started, 1e-9)


def run(quick: bool = False, jobs: int | None = None) -> list[Row]:
    from tests.jobs.postgres_fixtures import (
        PgBouncer,
        PostgresCluster,
        pgbouncer_binary,
        server_bindir,
    )

    bindir, bouncer_binary = server_bindir(), pgbouncer_binary()
    if bindir is None or bouncer_binary is None:
        return [
            Row(
                "jobstore",
                "skipped: needs postgresql and pgbouncer (apt-get install)",
                verdict="skipped",
            )
        ]
    count = jobs or (1000 if quick else 4000)
    cluster = PostgresCluster(bindir, durable=True)
    bouncer = None
    rows: list[Row] = []
    try:
        cluster.start()
        name = cluster.create_database()
        bouncer = PgBouncer(bouncer_binary, cluster, pool_size=PGBOUNCER_POOL)
        direct = cluster.dsn(name)
        routes = {
            "direct": direct,
            "direct, prepare=1": f"{direct}?prepare=1",
            f"PgBouncer (transaction, {PGBOUNCER_POOL} server conns)": bouncer.dsn(name),
        }
        from runtime.jobs.stores.postgres import PostgresJobStore

        PostgresJobStore(direct, ttl_s=3600.0).close()  # the schema, once
        for route, url in routes.items():
            for claimers in CLAIMERS:
                print(
                    f"[jobstore] {route}, {claimers} claimer(s), {count} jobs ...",
                    file=sys.stderr,
                    flush=True,
                )
                result = measure(url, direct, claimers, count)
                claims, finishes = result["claims"], result["finishes"]
                rows.append(
                    Row(
                        f"{route}, {claimers} claimer(s): claims/s | finishes/s",
                        f"{_rate(claims):,.0f} | {_rate(finishes):,.0f}",
                        baseline=(
                            f"claim p50 {fmt_s(percentile(claims.latencies, 50))},"
                            f" p99 {fmt_s(percentile(claims.latencies, 99))};"
                            f" finish p50 {fmt_s(percentile(finishes.latencies, 50))},"
                            f" p99 {fmt_s(percentile(finishes.latencies, 99))}"
                        ),
                    )
                )
        print("[jobstore] the cost of NOTIFY ...", file=sys.stderr, flush=True)
        rows += notify_cost(direct, 100 if quick else 300)
    finally:
        if bouncer is not None:
            bouncer.stop()
        cluster.remove()
    return rows


def render(rows: Sequence[Row]) -> str:
    lines = ["| configuration | claims/s \\| finishes/s | latencies |", "|---|---|---|"]
    for row in rows:
        cells = (row.measurement, row.thaw, row.baseline)
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1000 jobs per configuration")
    parser.add_argument("--jobs", type=int, default=None, help="jobs per configuration (4000)")
    parser.add_argument("--out", default="", help="also write the table to this file")
    args = parser.parse_args(argv)
    started = time.monotonic()
    table = render(run(quick=args.quick, jobs=args.jobs))
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")
    print(f"[jobstore] done in {time.monotonic() - started:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
