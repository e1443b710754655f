"""Chaos: a job mix against a `thaw serve` killed with SIGKILL at random points and restarted.

    .venv/bin/python bench/experiments/chaos.py [--cycles 30] [--seed 15] [--max-uptime 2.0]

Each cycle starts a server on the same state dir and SQLite file (lease 600 s,
so nothing here waits for a lease), sends a seeded random mix for a random
time, then SIGKILLs its process group wherever it is: in a job's creation, its
run, its outcome's write, a sync call, a start-up reclaim. The mix: fast,
slow and failing jobs (`POST /handlers/logged/jobs`), and sync calls, fast ones that
answer 200 and slow ones past their `Prefer: wait` that turn into jobs (202).
After the last cycle one more server runs until every job is final.

The handler (tests/handlers/runlog.py) appends a line to a run log when each
run starts. Figures:

- jobs accepted: 202 answers (each names a job the runtime promised to keep)
- jobs lost: accepted, but unknown or not final at the end (must be 0)
- wrong outcomes: a failing job that succeeded or the reverse (must be 0)
- finished outputs recomputed: a run of a job that starts after the job's
  recorded finish (must be 0; runs interrupted by a kill are run again, legitimately)
- restart -> all final: from a server's spawn until every job accepted before
  it started is final (cycles where the next kill came first are counted apart)

Prints a markdown table; exits 1 when a must-be-0 figure is not 0.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import random
import signal
import sqlite3
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: make `bench` importable
    sys.path.insert(0, str(ROOT))

from bench.common import Proc, fmt_s, free_port, request, runtime_env, thaw_serve_argv  # noqa: E402

FINAL = ("succeeded", "failed", "cancelled")
# kind -> (weight, path, event without its tag, Prefer header, expected final status)
KINDS: dict[str, tuple[float, str, dict[str, Any], str | None, str]] = {
    "fast-job": (0.30, "/handlers/logged/jobs", {"s": 0.0}, None, "succeeded"),
    "slow-job": (0.20, "/handlers/logged/jobs", {"s": 0.8}, None, "succeeded"),
    "failing-job": (0.15, "/handlers/logged/jobs", {"s": 0.1, "fail": True}, None, "failed"),
    "fast-sync": (0.25, "/invoke/logged", {"s": 0.01}, "wait=5", "succeeded"),
    "slow-sync": (0.10, "/invoke/logged", {"s": 1.0}, "wait=0.3", "succeeded"),
}


@dataclass
class Config:
    cycles: int = 30
    seed: int = 15
    min_uptime_s: float = 0.3
    max_uptime_s: float = 2.0
    clients: int = 3
    final_timeout_s: float = 120.0


@dataclass
class Accepted:
    id: str
    tag: str
    kind: str
    expect: str


@dataclass
class Figures:
    cycles: int = 0
    accepted: list[Accepted] = field(default_factory=list)
    sync_answered: int = 0
    other_answers: Counter[int] = field(default_factory=Counter)
    cut_off_requests: int = 0
    lost: list[str] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)
    recomputed: list[str] = field(default_factory=list)
    rerun_after_kill: int = 0
    restart_to_final_s: list[float] = field(default_factory=list)
    cut_short: int = 0
    final_restart_to_final_s: float = float("nan")
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not (self.lost or self.wrong or self.recomputed) and bool(self.accepted)


class Chaos:
    def __init__(self, config: Config, workdir: Path) -> None:
        self.config = config
        self.workdir = workdir
        self.rng = random.Random(config.seed)
        self.run_log = workdir / "runs.log"
        self.database = workdir / "jobs.sqlite3"
        self.env = runtime_env(
            workdir,
            handlers="tests.handlers.runlog",
            job_lease_s="600",
            job_max_attempts="1000",  # many kills must not end a job as worker-lost
            log_level="INFO",
        )
        self.env["THAW_TEST_RUN_LOG"] = str(self.run_log)
        self.figures = Figures()
        self.tags = itertools.count()

    # ---- the store, read directly (as an operator would) ----------------------

    def _jobs(self) -> dict[str, tuple[str, float, Any]]:
        """id -> (status, updated_at, input) of every job in the database."""
        if not self.database.exists():
            return {}
        conn = sqlite3.connect(self.database, timeout=30)
        try:
            rows = conn.execute("SELECT id, status, updated_at, input FROM jobs").fetchall()
        finally:
            conn.close()
        return {r[0]: (r[1], r[2], orjson.loads(r[3]) if r[3] else None) for r in rows}

    def _unfinished(self, ids: set[str]) -> set[str]:
        jobs = self._jobs()
        return {i for i in ids if i not in jobs or jobs[i][0] not in FINAL}

    # ---- one server's life -----------------------------------------------------

    def _server(self) -> Proc:
        port = free_port()
        return Proc(thaw_serve_argv(port), self.env, port, self.workdir / "server.log").start()

    async def _submit(self, port: int) -> None:
        """Send the mix until cancelled (the kill) or the server stops answering."""
        names = list(KINDS)
        weights = [KINDS[k][0] for k in names]
        while True:
            kind = self.rng.choices(names, weights)[0]
            _, path, event, prefer, expect = KINDS[kind]
            tag = f"{kind}-{next(self.tags)}"
            body = orjson.dumps({**event, "tag": tag})
            headers = {"Prefer": prefer} if prefer else None
            try:
                reply = await request(port, "POST", path, body, headers)
            except (OSError, asyncio.IncompleteReadError, asyncio.CancelledError):
                self.figures.cut_off_requests += 1
                return  # killed under this request: its fate is the store's to tell
            if reply.status == 202:
                job_id = orjson.loads(reply.body)["id"]
                self.figures.accepted.append(Accepted(job_id, tag, kind, expect))
            elif reply.status == 200:
                self.figures.sync_answered += 1
            else:
                self.figures.other_answers[reply.status] += 1
            await asyncio.sleep(self.rng.uniform(0.0, 0.05))

    async def _watch(self, ids: set[str], spawned: float) -> float:
        """Seconds from the spawn until every job of `ids` is final."""
        while await asyncio.to_thread(self._unfinished, ids):
            await asyncio.sleep(0.02)
        return time.monotonic() - spawned

    async def _cycle(self) -> None:
        earlier = {a.id for a in self.figures.accepted}
        pending = await asyncio.to_thread(self._unfinished, earlier)
        server = self._server()
        spawned = server.started_at
        watch = asyncio.ensure_future(self._watch(pending, spawned))
        try:
            await asyncio.to_thread(server.wait_healthy, 60.0)
            uptime = self.rng.uniform(self.config.min_uptime_s, self.config.max_uptime_s)
            clients = [
                asyncio.ensure_future(self._submit(server.port)) for _ in range(self.config.clients)
            ]
            await asyncio.sleep(uptime)
            assert server.proc is not None
            os.killpg(server.proc.pid, signal.SIGKILL)  # wherever it is
            server.proc.wait(10)
            # The clients see their connections reset; any still waiting is cut off.
            await asyncio.wait(clients, timeout=2.0)
            for client in clients:
                client.cancel()
            await asyncio.gather(*clients, return_exceptions=True)
        finally:
            server.stop()
        if watch.done() and not watch.cancelled():
            self.figures.restart_to_final_s.append(watch.result())
        else:
            watch.cancel()
            self.figures.cut_short += 1
        self.figures.cycles += 1

    async def _settle(self) -> None:
        """One more server, not killed: until every job is final, then check each."""
        everything = set(await asyncio.to_thread(self._jobs))
        server = self._server()
        try:
            await asyncio.to_thread(server.wait_healthy, 60.0)
            watch = self._watch(everything, server.started_at)
            try:
                elapsed = await asyncio.wait_for(watch, self.config.final_timeout_s)
            except TimeoutError:
                elapsed = float("nan")
            self.figures.final_restart_to_final_s = elapsed
            for accepted in self.figures.accepted:
                reply = await request(server.port, "GET", f"/jobs/{accepted.id}")
                if reply.status != 200:
                    self.figures.lost.append(f"{accepted.id} ({accepted.kind}): {reply.status}")
                    continue
                job = orjson.loads(reply.body)
                if job["status"] not in FINAL:
                    self.figures.lost.append(f"{accepted.id} ({accepted.kind}): {job['status']}")
                elif job["status"] != accepted.expect or (
                    job["status"] == "succeeded" and job["output"]["tag"] != accepted.tag
                ):
                    self.figures.wrong.append(f"{accepted.id} ({accepted.kind}): {job}")
        finally:
            server.stop()

    def _count_runs(self) -> None:
        """Recomputes: a run of a job's input that starts after the job's recorded end."""
        starts: dict[str, list[float]] = {}
        if self.run_log.exists():
            for line in self.run_log.read_text().splitlines():
                parts = line.split()
                if len(parts) == 4 and parts[1] == "start":
                    starts.setdefault(parts[0], []).append(float(parts[3]))
        for job_id, (status, updated_at, event) in self._jobs().items():
            tag = event.get("tag") if isinstance(event, dict) else None
            runs = starts.get(str(tag), [])
            self.figures.rerun_after_kill += max(0, len(runs) - 1)
            if status in FINAL:
                late = [t for t in runs if t > updated_at]
                if late:
                    self.figures.recomputed.append(f"{job_id} ({tag}): {len(late)} run(s)")

    async def run(self) -> Figures:
        began = time.monotonic()
        for _ in range(self.config.cycles):
            await self._cycle()
        await self._settle()
        self._count_runs()
        self.figures.wall_s = time.monotonic() - began
        return self.figures


def run(config: Config, workdir: Path | None = None) -> Figures:
    """Run the chaos in `workdir` (a temporary directory when None)."""
    if workdir is not None:
        return asyncio.run(Chaos(config, workdir).run())
    with tempfile.TemporaryDirectory(prefix="thaw-chaos-") as tmp:
        return asyncio.run(Chaos(config, Path(tmp)).run())


def render(config: Config, figures: Figures) -> str:
    kinds = Counter(a.kind for a in figures.accepted)
    completed = figures.restart_to_final_s
    rows = [
        ("kill -9 / restart cycles", str(figures.cycles)),
        ("jobs accepted (202)", f"{len(figures.accepted)} ({dict(sorted(kinds.items()))})"),
        ("sync calls answered 200", str(figures.sync_answered)),
        ("other answers", str(dict(figures.other_answers)) or "none"),
        ("requests cut off by a kill", str(figures.cut_off_requests)),
        ("jobs lost (must be 0)", str(len(figures.lost))),
        ("wrong outcomes (must be 0)", str(len(figures.wrong))),
        ("finished outputs recomputed (must be 0)", str(len(figures.recomputed))),
        ("runs interrupted by a kill and run again", str(figures.rerun_after_kill)),
        (
            "longest restart -> all earlier jobs final",
            f"{fmt_s(max(completed)) if completed else 'n/a'} "
            f"({len(completed)} cycles; {figures.cut_short} killed again first)",
        ),
        ("last restart -> all jobs final", fmt_s(figures.final_restart_to_final_s)),
        ("wall time", fmt_s(figures.wall_s)),
    ]
    lines = ["| measurement | value |", "|---|---|"]
    lines += [f"| {name} | {value} |" for name, value in rows]
    for title, items in (
        ("lost", figures.lost),
        ("wrong", figures.wrong),
        ("recomputed", figures.recomputed),
    ):
        lines += [f"\n{title}: {item}" for item in items[:20]]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cycles", type=int, default=30)
    parser.add_argument("--seed", type=int, default=15)
    parser.add_argument("--min-uptime", type=float, default=0.3)
    parser.add_argument("--max-uptime", type=float, default=2.0)
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--keep", default="", help="work in this directory and keep it")
    args = parser.parse_args()
    config = Config(
        cycles=args.cycles,
        seed=args.seed,
        min_uptime_s=args.min_uptime,
        max_uptime_s=args.max_uptime,
        clients=args.clients,
    )
    workdir = Path(args.keep) if args.keep else None
    if workdir is not None:
        workdir.mkdir(parents=True, exist_ok=True)
    figures = run(config, workdir)
    print(render(config, figures))
    return 0 if figures.ok else 1


if __name__ == "__main__":
    sys.exit(main())
