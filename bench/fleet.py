"""The fleet's figures: jobs across instances on one PostgreSQL, and chaos.

    .venv/bin/python bench/fleet.py bench [--jobs N] [--out FILE]
    .venv/bin/python bench/fleet.py chaos [--kills N] [--every S] [--out FILE]
    .venv/bin/python bench/fleet.py burst [--bursts 10,30] [--instances 2,3] [--run-s S]

Each run starts its own PostgreSQL cluster (tests/jobs/postgres_fixtures.py),
real `thaw serve` processes, each with its own state directory as on separate
machines, and Debian's nginx round-robin before them (tests/fleet/harness.py),
all on 127.0.0.1, and stops them all at the end.

`bench`, through nginx, for SQLite on one instance, then PostgreSQL with 1
and 3 instances:
- submit -> result: `POST /handlers/echo/jobs`, then `GET /jobs/{id}?wait=`
  until it is final, from 8 client threads; p50 and p99 of the whole;
- polls/s: `GET /jobs/{id}` of finished jobs from 8 client threads for 5 s;
- (PostgreSQL, 3 instances) the long-poll wake-up across instances: a job runs
  on instance B (`sleepy`, 0.3 s) while a `?wait=` poll waits on instance A;
  the wake-up is from B's record of the finish (`updated_at`) to A's answer.
  Target: p99 within 100 ms.
- (PostgreSQL, 3 instances) a streaming job's items followed across instances:
  a `ticks` job (a tick every 20 ms) runs on B, followed by SSE on B (from its
  memory) and on A (from the store, runtime/jobs/items.py) at once; per item,
  how much later it reaches A than B.

`chaos`: 3 instances behind nginx on one PostgreSQL; clients submit a mix of
jobs (`logged`: fast, slow, failing; `ticks`: streaming) and sync calls
(`echo`, `logged`), and poll every accepted job through nginx until it is
final; a random instance is SIGKILLed every `--every` seconds and started
again, `--kills` times, and PostgreSQL is restarted once halfway. Reported:
jobs accepted, lost (accepted, never final or gone), finished outputs
recomputed (a run of a job started after the run whose output was recorded),
polls of an accepted job answered 404, and the longest time from a kill to
that instance's running jobs starting elsewhere (from the run log, every
process on one machine clock).

`burst`: 2 and 3 instances behind nginx on one PostgreSQL, a handler declared
one call at a time (tests/handlers/serial.py: `Batch(max_size=1,
max_concurrent=1)`, sleeping `--run-s`, 2 s by default), and bursts of 10 and
30 jobs all submitted to instance 0. Reported per row: the wall time from the
first submission to the last run's end against the ideal (jobs x run-s /
instances; target >= 0.8 of ideal; beside it the floor of whole runs,
ceil(jobs / instances) x run-s), the jobs each instance ran, the median idle
gap between two runs of one instance (the claim's cost), the peak of
`thaw_fleet_jobs_queued` while the burst waited and its value at the end, and
the runs above capacity (two runs of one instance that overlapped, from the
handler's own log of start and end times; target 0).

The table goes to stdout (and FILE), progress to stderr. The client threads
share the machine's CPUs with the servers and the database: on a small
machine the figures include the load generator's own cost.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import os
import random
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from bench.common import Row, fmt_s, percentile, render, runtime_env  # noqa: E402

HANDLERS = "handlers.echo,tests.handlers.sleepy,tests.handlers.runlog,tests.handlers.ticks"


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@contextlib.contextmanager
def database() -> Iterator[Any]:
    """A cluster of our own (the server's durable defaults), removed at the end."""
    from tests.jobs.postgres_fixtures import PostgresCluster, server_bindir

    bindir = server_bindir()
    if bindir is None:
        raise SystemExit("no PostgreSQL server binaries: apt-get install postgresql")
    cluster = PostgresCluster(bindir, durable=True)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.remove()


@contextlib.contextmanager
def fleet(dsn: str, count: int, root: Path, **thaw: str) -> Iterator[Any]:
    from tests.fleet.harness import Fleet, nginx_binary

    binary = nginx_binary()
    if binary is None:
        raise SystemExit("no nginx: apt-get install nginx")
    env = runtime_env(root, **{"HANDLERS": HANDLERS, "LOG_LEVEL": "WARNING", **thaw})
    started = Fleet(binary, env, dsn, root / "fleet", count)
    try:
        yield started
    finally:
        started.stop()


# ---- bench ------------------------------------------------------------------


def submit_to_result(url: str, jobs: int, threads: int = 8) -> tuple[list[float], list[str]]:
    """Seconds from submit to final answer per job; and the finished jobs' ids."""
    latencies: list[float] = []
    ids: list[str] = []
    lock = threading.Lock()

    def one(n: int, client: httpx.Client) -> None:
        started = time.perf_counter()
        job_id = client.post("/handlers/echo/jobs", json={"n": n}).raise_for_status().json()["id"]
        while True:
            body = client.get(f"/jobs/{job_id}?wait=10").raise_for_status().json()
            if body["status"] in ("succeeded", "failed", "cancelled"):
                break
        with lock:
            latencies.append(time.perf_counter() - started)
            ids.append(job_id)

    def worker(index: int) -> None:
        with httpx.Client(base_url=url, timeout=60) as client:
            for n in range(index, jobs, threads):
                one(n, client)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(worker, range(threads)))
    return latencies, ids


def polls_per_s(url: str, ids: list[str], seconds: float = 5.0, threads: int = 8) -> float:
    done = 0
    lock = threading.Lock()
    stop_at = time.perf_counter() + seconds

    def worker(index: int) -> None:
        nonlocal done
        count = 0
        with httpx.Client(base_url=url, timeout=30) as client:
            while time.perf_counter() < stop_at:
                client.get(f"/jobs/{ids[(index + count) % len(ids)]}").raise_for_status()
                count += 1
        with lock:
            done += count

    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(worker, range(threads)))
    return done / (time.perf_counter() - started)


def wake_ups(a: str, b: str, samples: int, at_once: int = 4) -> list[float]:
    """Seconds from a job's finish recorded on B to a `?wait=` poll's answer on A."""
    from datetime import datetime

    found: list[float] = []
    lock = threading.Lock()

    def one(client_a: httpx.Client, client_b: httpx.Client) -> None:
        job_id = client_b.post("/handlers/sleepy/jobs", json={"s": 0.3}).raise_for_status()
        job_id = job_id.json()["id"]
        body = client_a.get(f"/jobs/{job_id}?wait=30").raise_for_status().json()
        answered = time.time()
        assert body["status"] == "succeeded", body
        finished = datetime.fromisoformat(body["updated_at"].replace("Z", "+00:00")).timestamp()
        with lock:
            found.append(answered - finished)

    def worker(index: int) -> None:
        with (
            httpx.Client(base_url=a, timeout=60) as client_a,
            httpx.Client(base_url=b, timeout=60) as client_b,
        ):
            for _ in range(index, samples, at_once):
                one(client_a, client_b)

    with ThreadPoolExecutor(at_once) as pool:
        list(pool.map(worker, range(at_once)))
    return found


def arrivals(url: str, job_id: str, connected: threading.Event) -> list[tuple[str, float]]:
    """(id, arrival time) of each item event of a job followed from `url`."""
    got: list[tuple[str, float]] = []
    with (
        httpx.Client(base_url=url, timeout=60) as client,
        client.stream("GET", f"/jobs/{job_id}", headers={"accept": "text/event-stream"}) as sse,
    ):
        connected.set()
        for line in sse.iter_lines():
            if line.startswith("id: "):
                got.append((line[4:], time.perf_counter()))
            elif line.startswith("event: "):
                break
    return got


def stream_follows(a: str, b: str, root: Path, jobs: int, n: int = 20) -> list[float]:
    """Per item of a streaming job run on B (a tick every 20 ms), how much later it
    reaches a follower on A (from the store) than one on B (from B's memory)."""
    found: list[float] = []
    with httpx.Client(base_url=b, timeout=60) as client, ThreadPoolExecutor(2) as pool:
        for index in range(jobs):
            hold = root / f"hold-{index}"
            hold.touch()  # the run waits before its first tick until both follow
            event = {"n": n, "gap_s": 0.02, "hold": str(hold), "hold_at": 0}
            job_id = client.post("/handlers/ticks/jobs", json=event).raise_for_status()
            job_id = job_id.json()["id"]
            ready = [threading.Event(), threading.Event()]
            there = pool.submit(arrivals, a, job_id, ready[0])
            here = pool.submit(arrivals, b, job_id, ready[1])
            for each in ready:
                each.wait(30)
            time.sleep(0.3)  # both requests reached their servers
            hold.unlink()
            far, near = dict(there.result()), dict(here.result())
            assert far.keys() == near.keys() and len(far) == n, (far, near)
            found += [far[i] - near[i] for i in far]
    return found


def run_bench(args: argparse.Namespace) -> list[Row]:
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="thaw-bench-fleet-") as tmp, database() as cluster:
        root = Path(tmp)
        configs: list[tuple[str, str, int]] = [
            ("SQLite, 1 instance", f"sqlite:///{root / 'jobs.sqlite3'}", 1),
            ("PostgreSQL, 1 instance", cluster.dsn(cluster.create_database()), 1),
            ("PostgreSQL, 3 instances", cluster.dsn(cluster.create_database()), 3),
        ]
        for name, dsn, count in configs:
            say(f"{name}: {args.jobs} jobs")
            with fleet(dsn, count, root / name.replace(" ", "_").replace(",", "")) as running:
                latencies, ids = submit_to_result(running.url, args.jobs)
                rate = polls_per_s(running.url, ids)
                rows.append(
                    Row(
                        f"submit -> result p50 / p99, {name}",
                        f"{fmt_s(percentile(latencies, 50))} / {fmt_s(percentile(latencies, 99))}",
                    )
                )
                rows.append(Row(f"polls/s (finished jobs, 8 clients), {name}", f"{rate:.0f}"))
                if count == 3:
                    a, b = running.instances[0].url, running.instances[1].url
                    woken = wake_ups(a, b, args.wakeups)
                    p99 = percentile(woken, 99)
                    rows.append(
                        Row(
                            f"long-poll wake-up across instances p50 / p99 ({len(woken)} polls)",
                            f"{fmt_s(percentile(woken, 50))} / {fmt_s(p99)}",
                            target="p99 <= 100 ms",
                            verdict="pass" if p99 <= 0.1 else "FAIL",
                        )
                    )
                    later = stream_follows(a, b, root, args.follows)
                    rows.append(
                        Row(
                            "stream item on a follower on another instance, later than on"
                            f" the owner p50 / p99 ({len(later)} items)",
                            f"{fmt_s(percentile(later, 50))} / {fmt_s(percentile(later, 99))}",
                        )
                    )
    return rows


# ---- burst ------------------------------------------------------------------


def fleet_queued(client: httpx.Client, handler: str) -> float:
    from tests.fleet.test_fleet import metric_lines

    text = client.get("/metrics").raise_for_status().text
    return metric_lines(text, "thaw_fleet_jobs_queued").get(f'{{handler="{handler}"}}', 0.0)


def one_burst(running: Any, jobs: int, run_s: float, log: Path) -> Row:
    from tests.handlers.serial import overlaps, runs

    count = len(running.instances)
    peak, stop = [0.0], threading.Event()

    def sample() -> None:
        with running.client() as anywhere:
            while not stop.is_set():
                peak[0] = max(peak[0], fleet_queued(anywhere, "serial"))
                stop.wait(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.monotonic()
    with running.instances[0].client(timeout=600) as first:
        ids = [
            first.post("/handlers/serial/jobs", json={"tag": f"b{jobs}-{n}", "s": run_s})
            .raise_for_status()
            .json()["id"]
            for n in range(jobs)
        ]
        statuses = []
        for job_id in ids:
            body = first.get(f"/jobs/{job_id}?wait=60").raise_for_status().json()
            while body["status"] in ("queued", "running"):
                body = first.get(f"/jobs/{job_id}?wait=60").raise_for_status().json()
            statuses.append(body["status"])
    stop.set()
    sampler.join()
    with running.client() as anywhere:
        left = fleet_queued(anywhere, "serial")
    record = [run for run in runs(log) if run.tag.startswith(f"b{jobs}-")]
    ends = [run.end for run in record if run.end is not None]
    wall = (max(ends) if ends else time.monotonic()) - started
    ideal = jobs * run_s / count
    ratio = ideal / wall
    per_pid: dict[int, int] = {}
    for run in record:
        per_pid[run.pid] = per_pid.get(run.pid, 0) + 1
    above = len(overlaps(log))
    # The idle time of an instance between two of its runs: the claim's cost.
    gaps = [
        later.start - earlier.end
        for pid in per_pid
        for earlier, later in itertools.pairwise([r for r in record if r.pid == pid])
        if earlier.end is not None
    ]
    # Whole runs: no instance can run part of one, so this is the best a fleet can do.
    floor = math.ceil(jobs / count) * run_s
    ok = ratio >= 0.8 and above == 0 and statuses.count("succeeded") == jobs and left == 0
    spread = "/".join(str(per_pid.get(s.proc.pid, 0)) for s in running.instances if s.proc)
    return Row(
        f"burst of {jobs} x {run_s:g} s jobs to one of {count} instances: wall"
        f" (runs per instance {spread}; gap between runs p50 {fmt_s(percentile(gaps, 50))};"
        f" gauge peak {peak[0]:.0f}, end {left:.0f}; runs above capacity {above})",
        fmt_s(wall),
        baseline=f"ideal {fmt_s(ideal)} (whole runs: {fmt_s(floor)})",
        ratio=f"{ratio:.2f} of ideal",
        target=">= 0.8 of ideal, 0 above capacity",
        verdict="pass" if ok else "FAIL",
    )


def run_burst(args: argparse.Namespace) -> list[Row]:
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="thaw-bench-burst-") as tmp, database() as cluster:
        root = Path(tmp)
        for count in args.instances:
            log = root / f"runs-{count}.log"
            dsn = cluster.dsn(cluster.create_database())
            thaw = {
                "HANDLERS": "tests.handlers.serial",
                "JOB_LEASE_S": "600",
                "TEST_RUN_LOG": str(log),
            }
            with fleet(dsn, count, root / f"burst-{count}", **thaw) as running:
                for instance in running.instances:
                    # Ready once it has joined the fleet: before, it records no job queued.
                    with instance.client() as direct:
                        while direct.get("/readyz").status_code != 200:
                            time.sleep(0.05)
                for jobs in args.bursts:
                    say(f"burst: {jobs} jobs to one of {count} instances")
                    rows.append(one_burst(running, jobs, args.run_s, log))
    return rows


# ---- chaos ------------------------------------------------------------------


@dataclass
class Ledger:
    accepted: dict[str, str] = field(default_factory=dict)  # job id -> kind
    final: dict[str, dict[str, Any]] = field(default_factory=dict)
    not_found: int = 0
    refused: int = 0  # submissions answered 502/503 (never accepted)
    sync_ok: int = 0
    sync_failed: int = 0
    kills: list[tuple[float, int]] = field(default_factory=list)  # (time, pid)
    lock: threading.Lock = field(default_factory=threading.Lock)


def submit_one(client: httpx.Client, n: int, ledger: Ledger) -> None:
    roll = random.random()
    if roll < 0.15:  # a sync call
        handler, body = ("echo", {"n": n}) if roll < 0.08 else ("logged", {"tag": f"s{n}"})
        try:
            ok = client.post(f"/invoke/{handler}", json=body).status_code == 200
        except httpx.HTTPError:
            ok = False
        with ledger.lock:
            if ok:
                ledger.sync_ok += 1
            else:
                ledger.sync_failed += 1
        return
    event: dict[str, Any]
    if roll < 0.5:
        kind, handler, event = "fast", "logged", {"s": 0.05}
    elif roll < 0.75:
        kind, handler, event = "slow", "logged", {"s": random.uniform(1.0, 4.0)}
    elif roll < 0.85:
        kind, handler, event = "failing", "logged", {"s": 0.2, "fail": True}
    else:
        kind, handler, event = "streaming", "ticks", {"n": 20, "gap_s": 0.05}
    if handler == "logged":
        event["tag"] = f"j{n}"
    try:
        response = client.post(f"/handlers/{handler}/jobs", json=event)
    except httpx.HTTPError:
        with ledger.lock:
            ledger.refused += 1
        return
    if response.status_code != 202:
        with ledger.lock:
            ledger.refused += 1
        return
    with ledger.lock:
        ledger.accepted[response.json()["id"]] = kind + ("" if handler != "logged" else f" j{n}")


def poll_all(url: str, ledger: Ledger, stop: threading.Event) -> None:
    with httpx.Client(base_url=url, timeout=60) as client:
        while True:
            with ledger.lock:
                pending = [j for j in ledger.accepted if j not in ledger.final]
            if not pending:
                if stop.is_set():
                    return
                time.sleep(0.2)
                continue
            for job_id in pending[:50]:
                try:
                    response = client.get(f"/jobs/{job_id}?wait=2")
                except httpx.HTTPError:
                    continue
                if response.status_code == 404:
                    with ledger.lock:
                        ledger.not_found += 1
                    continue
                if response.status_code != 200:
                    continue  # 502/503 while an instance or the database is down
                body = response.json()
                if body["status"] in ("succeeded", "failed", "cancelled"):
                    with ledger.lock:
                        ledger.final[job_id] = body


def run_log(path: Path) -> list[tuple[str, str, int, float]]:
    entries = []
    for line in path.read_text().splitlines() if path.exists() else []:
        parts = line.split()
        if len(parts) == 4:
            entries.append((parts[0], parts[1], int(parts[2]), float(parts[3])))
    return entries


def run_chaos(args: argparse.Namespace) -> list[Row]:
    random.seed(args.seed)
    ledger = Ledger()
    with tempfile.TemporaryDirectory(prefix="thaw-chaos-") as tmp, database() as cluster:
        root = Path(tmp)
        runs = root / "runs.log"
        dsn = cluster.dsn(cluster.create_database())
        thaw = {"TEST_RUN_LOG": str(runs), "JOB_MAX_ATTEMPTS": "20", "JOB_LEASE_S": "30"}
        with fleet(dsn, 3, root, **thaw) as running:
            stop_submitting, stop_polling = threading.Event(), threading.Event()

            def submitter(index: int) -> None:
                n = index
                with httpx.Client(base_url=running.url, timeout=60) as client:
                    while not stop_submitting.is_set():
                        submit_one(client, n, ledger)
                        n += 4
                        time.sleep(random.uniform(0.05, 0.3))

            workers = [threading.Thread(target=submitter, args=(i,)) for i in range(4)]
            workers += [
                threading.Thread(target=poll_all, args=(running.url, ledger, stop_polling))
                for _ in range(3)
            ]
            for worker in workers:
                worker.start()
            try:
                for kill in range(args.kills):
                    time.sleep(args.every)
                    if kill == args.kills // 2:
                        say("restarting PostgreSQL")
                        cluster.restart("fast")
                    index = random.randrange(3)
                    server = running.instances[index]
                    pid = server.proc.pid
                    running.kill(index)
                    with ledger.lock:
                        ledger.kills.append((time.time(), pid))
                    say(f"kill {kill + 1}/{args.kills}: instance {index} (pid {pid})")
                    # A new state directory, as a replacement pod's: its predecessor's jobs
                    # are found by liveness in the database, not by a lock file of the node.
                    running.restart(index, wait=False, fresh=True)
            finally:
                stop_submitting.set()
                for worker in workers[:4]:
                    worker.join()
                say(f"settling: {len(ledger.accepted)} accepted, waiting for every job")
                deadline = time.monotonic() + args.settle
                while time.monotonic() < deadline:
                    with ledger.lock:
                        if len(ledger.final) == len(ledger.accepted):
                            break
                    time.sleep(0.5)
                stop_polling.set()
                for worker in workers[4:]:
                    worker.join()
        return chaos_rows(args, ledger, run_log(runs))


def chaos_rows(
    args: argparse.Namespace, ledger: Ledger, entries: list[tuple[str, str, int, float]]
) -> list[Row]:
    lost = [j for j in ledger.accepted if j not in ledger.final]
    lost_attempts = [
        j
        for j, body in ledger.final.items()
        if body["status"] == "failed" and "stopped" in str(body.get("error", {}))
    ]
    # Recomputed: a run of a job that started after the run whose output was recorded.
    starts: dict[str, list[float]] = {}
    for tag, what, _, at in entries:
        if what == "start":
            starts.setdefault(tag, []).append(at)
    recomputed = 0
    for body in ledger.final.values():
        output = body.get("output")
        if isinstance(output, dict) and "started" in output and "tag" in output:
            later = [t for t in starts.get(output["tag"], []) if t > output["started"]]
            recomputed += bool(later)
    # Kill -> running elsewhere: runs of the killed pid that never ended, and the next
    # start of the same job by another process.
    longest = 0.0
    for killed_at, pid in ledger.kills:
        open_runs = {
            tag
            for tag, what, p, at in entries
            if p == pid and what == "start" and at <= killed_at and tag.startswith("j")
        } - {tag for tag, what, p, at in entries if p == pid and what == "end"}
        for tag in open_runs:
            again = [
                at
                for t, what, p, at in entries
                if t == tag and what == "start" and p != pid and at > killed_at
            ]
            if again:
                longest = max(longest, min(again) - killed_at)
    kinds: dict[str, int] = {}
    for kind in ledger.accepted.values():
        name = kind.split()[0]
        kinds[name] = kinds.get(name, 0) + 1
    mix = ", ".join(f"{k} {v}" for k, v in sorted(kinds.items()))
    return [
        Row("kills (SIGKILL, then restarted)", f"{len(ledger.kills)} (every {args.every} s)"),
        Row("PostgreSQL restarts", "1"),
        Row("jobs accepted", f"{len(ledger.accepted)} ({mix})"),
        Row("jobs lost", str(len(lost)), target="0", verdict="pass" if not lost else "FAIL"),
        Row(
            "jobs failed as lost (attempts exhausted)",
            str(len(lost_attempts)),
            target="0",
            verdict="pass" if not lost_attempts else "FAIL",
        ),
        Row(
            "finished outputs recomputed",
            str(recomputed),
            target="0",
            verdict="pass" if not recomputed else "FAIL",
        ),
        Row(
            "polls of an accepted job answered 404",
            str(ledger.not_found),
            target="0",
            verdict="pass" if not ledger.not_found else "FAIL",
        ),
        Row("longest kill -> its jobs running elsewhere", fmt_s(longest)),
        Row("sync calls answered 200 / failed", f"{ledger.sync_ok} / {ledger.sync_failed}"),
        Row("submissions refused (502/503, never accepted)", str(ledger.refused)),
    ]


def ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    bench = sub.add_parser("bench")
    bench.add_argument("--jobs", type=int, default=400)
    bench.add_argument("--wakeups", type=int, default=100)
    bench.add_argument("--follows", type=int, default=10)
    burst = sub.add_parser("burst")
    burst.add_argument(
        "--bursts", type=ints, default=[10, 30], help="jobs per burst, comma-separated"
    )
    burst.add_argument(
        "--instances", type=ints, default=[2, 3], help="fleet sizes to run, comma-separated"
    )
    burst.add_argument("--run-s", type=float, default=2.0, help="seconds each job runs")
    chaos = sub.add_parser("chaos")
    chaos.add_argument("--kills", type=int, default=30)
    chaos.add_argument("--every", type=float, default=3.0)
    chaos.add_argument("--settle", type=float, default=120.0)
    chaos.add_argument("--seed", type=int, default=1)
    for each in (bench, chaos, burst):
        each.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    runner: Callable[[argparse.Namespace], list[Row]] = {
        "bench": run_bench,
        "chaos": run_chaos,
        "burst": run_burst,
    }[args.what]
    table = render(runner(args))
    print(table)
    if args.out is not None:
        args.out.write_text(table + "\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    raise SystemExit(main())
