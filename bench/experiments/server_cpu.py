"""Server CPU per warm request: Thaw against the bare app (or another Thaw tree).

    .venv/bin/python bench/experiments/server_cpu.py [--clients 8] [--rounds 10] [--seconds 2]
    .venv/bin/python bench/experiments/server_cpu.py --against /path/to/an/older/checkout
    .venv/bin/python bench/experiments/server_cpu.py --jobs --against /path/to/an/older/checkout

With several keep-alive clients the server is one event loop at 100 % of a
core, so its requests/s is the inverse of its CPU per request: this measures
that CPU directly, from the server process's own user + system time
(/proc/PID/stat) over each window, divided by the requests the window
answered. Thaw and its baseline run side by side, measured in alternating
windows (A, B, B, A, ...), and every ratio is taken within a round, then the
median over rounds (bench/overhead.py's method). The async no-op `echo` by
default; `--path /invoke/echo_sync` for the sync one (the bare app's
`/thread/echo`).

`--against DIR` runs the Thaw of another checkout (its `runtime/`, started
from DIR) as the baseline instead of the bare app: what a change to the warm
path was worth, in CPU, on the same machine in the same minutes. With
`--jobs` (which needs `--against`: the bare app has no jobs) a window is one
client's durable job cycles (bench/overhead.py's `measure_jobs`: submit, then
long-poll the result), and the figures are per cycle.

Each side runs as `--processes` server processes (3 by default), window i
measuring the i-th modulo that count: two processes of the same code differ
by up to 5-7 % in CPU per request (bench/overhead.py's docstring).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402
    Proc,
    bare_argv,
    cpu_s,
    fmt_x,
    free_port,
    median,
    runtime_env,
    thaw_serve_argv,
)
from bench.overhead import measure, measure_jobs  # noqa: E402

# `--jobs`: the "path" of a window that runs job cycles.
JOBS = "job cycle"


@dataclass
class Window:
    cpu_per_request_us: float
    rps: float
    p50_s: float


def start(name: str, root: Path | None, tmp: Path) -> tuple[Proc, int]:
    """`thaw serve` of `root` (None: the bare app), healthy, and its port."""
    # Every job cycle keeps its job for the TTL: no quota refuses the last windows'.
    env = runtime_env(tmp / name, handlers="handlers.echo,bench.fixtures", max_jobs="10000000")
    port = free_port()
    if root is None:
        proc = Proc(bare_argv(port), env, port, tmp / f"{name}.log")
    else:
        env["PYTHONPATH"] = str(root)
        proc = Proc(thaw_serve_argv(port), env, port, tmp / f"{name}.log", cwd=root)
    proc.start()
    proc.wait_healthy()
    return proc, port


async def window(proc: Proc, port: int, path: str, clients: int, seconds: float) -> Window:
    """One window of `path` (JOBS: the job cycle, one client)."""
    assert proc.proc is not None
    before = cpu_s(proc.proc.pid)
    if path == JOBS:
        slot = await measure_jobs(port, seconds)
    else:
        slot = await measure(port, path, clients, seconds)
    spent = cpu_s(proc.proc.pid) - before
    return Window(spent / (slot.rps * seconds) * 1e6, slot.rps, slot.p50_s)


async def run(
    args: argparse.Namespace, ports: dict[str, list[int]], procs: dict[str, list[Proc]]
) -> None:
    path = JOBS if args.jobs else args.path
    paths = {"thaw": path, "base": path}
    if args.against is None and args.path == "/invoke/echo_sync":
        paths["base"] = "/thread/echo"
    for name in procs:  # first calls, thread pools
        for proc, port in zip(procs[name], ports[name], strict=True):
            await window(proc, port, paths[name], args.clients, 1.0)
    found: dict[str, list[Window]] = {name: [] for name in procs}
    for index in range(args.rounds):
        for name in ("thaw", "base") if index % 2 == 0 else ("base", "thaw"):
            turn = index % len(procs[name])
            found[name].append(
                await window(
                    procs[name][turn], ports[name][turn], paths[name], args.clients, args.seconds
                )
            )
    base = "the bare app" if args.against is None else f"Thaw at {args.against}"
    what = "the job cycle, 1 client" if args.jobs else f"{args.path}, {args.clients} clients"
    print(f"| {what}, medians of {args.rounds} | Thaw | {base} | ratio |")
    print("|---|---:|---:|---:|")
    thaw, other = found["thaw"], found["base"]
    each = "cycle" if args.jobs else "request"
    rows: list[tuple[str, str, Callable[[float], str]]] = [
        (f"server CPU per {each}", "cpu_per_request_us", lambda v: f"{v:.1f} us"),
        (f"{each}s/s", "rps", lambda v: f"{v:.0f}"),
        ("p50 latency", "p50_s", lambda v: f"{v * 1e6:.0f} us"),
    ]
    for label, field, fmt in rows:
        ratio = median(
            [getattr(a, field) / getattr(b, field) for a, b in zip(thaw, other, strict=True)]
        )
        print(
            f"| {label} | {fmt(median([getattr(w, field) for w in thaw]))} "
            f"| {fmt(median([getattr(w, field) for w in other]))} | {fmt_x(ratio)} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--path", default="/invoke/echo")
    parser.add_argument("--against", type=Path, help="another checkout's Thaw as the baseline")
    parser.add_argument(
        "--jobs", action="store_true", help="the durable job cycle, against --against's"
    )
    parser.add_argument(
        "--processes", type=int, default=3, help="server processes per side, windows in turn"
    )
    args = parser.parse_args()
    if args.processes < 1:
        parser.error("--processes must be at least 1")
    if args.jobs and args.against is None:
        parser.error("--jobs needs --against: the bare app has no jobs")
    with tempfile.TemporaryDirectory(prefix="thaw-cpu-") as tmp_dir:
        tmp = Path(tmp_dir)
        procs: dict[str, list[Proc]] = {"thaw": [], "base": []}
        ports: dict[str, list[int]] = {"thaw": [], "base": []}
        try:
            for index in range(args.processes):
                for name, root in (("thaw", ROOT), ("base", args.against)):
                    proc, port = start(f"{name}-{index}", root, tmp)
                    procs[name].append(proc)
                    ports[name].append(port)
            asyncio.run(run(args, ports, procs))
        finally:
            for each in procs.values():
                for proc in each:
                    proc.stop()


if __name__ == "__main__":
    main()
