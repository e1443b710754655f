"""The warm path of two checkouts, side by side: `thaw serve` of each, in one run.

    .venv/bin/python bench/experiments/ab_overhead.py --base DIR --base-python PY
        [--head DIR] [--head-python PY] [--rounds N] [--modes jobs,async1,async8,sync8]

bench/overhead.py holds Thaw to a bare app; a change to Thaw's own warm path is
held to Thaw before it: `DIR` a checkout of the commit before (`git worktree add
DIR COMMIT`), `PY` a Python whose packages that checkout runs on (an older one
may pin an older uvicorn). Both run as 3 server processes each, and each round
measures one process of each, in alternating order, for one second
(bench/overhead.py's clients: a no-op `echo` or `echo_sync` at 1 or 8
concurrent clients, or the durable job cycle); each row is the median over the
rounds of head / base. Run against itself (`--base` the same checkout) it shows
the noise: about 2 % here.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import bench.common as common  # noqa: E402
from bench.common import Proc, free_port, runtime_env, stopping  # noqa: E402
from bench.overhead import Slot, measure, measure_jobs  # noqa: E402

PROCESSES = 3


async def _slot(port: int, mode: str, seconds: float) -> Slot:
    if mode == "jobs":
        return await measure_jobs(port, seconds)
    path = "/invoke/echo" if mode.startswith("async") else "/invoke/echo_sync"
    return await measure(port, path, int(mode.removeprefix("async").removeprefix("sync")), seconds)


async def _compare(ports: dict[str, list[int]], modes: list[str], rounds: int) -> list[str]:
    lines = ["| mode | head / base p50 | head / base requests/s | base p50 | head p50 |"]
    lines.append("|---|---|---|---|---|")
    for mode in modes:
        for each in ports.values():
            for port in each:  # first calls, thread pools
                await _slot(port, mode, 0.5)
        p50: list[float] = []
        rps: list[float] = []
        base_p50: list[float] = []
        head_p50: list[float] = []
        for index in range(rounds):
            order = ("base", "head") if index % 2 == 0 else ("head", "base")
            got = {name: await _slot(ports[name][index % PROCESSES], mode, 1.0) for name in order}
            p50.append(got["head"].p50_s / got["base"].p50_s)
            rps.append(got["head"].rps / got["base"].rps)
            base_p50.append(got["base"].p50_s)
            head_p50.append(got["head"].p50_s)
        lines.append(
            f"| {mode} | {statistics.median(p50):.3f}x | {statistics.median(rps):.3f}x "
            f"| {statistics.median(base_p50) * 1e6:.0f} µs "
            f"| {statistics.median(head_p50) * 1e6:.0f} µs |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", type=Path, required=True, help="the checkout before")
    parser.add_argument("--base-python", required=True, help="the Python it runs on")
    parser.add_argument("--head", type=Path, default=ROOT, help="the checkout after (this one)")
    parser.add_argument("--head-python", default=sys.executable, help="the Python it runs on")
    parser.add_argument("--rounds", type=int, default=16, help="rounds of 1 s per mode")
    parser.add_argument("--modes", default="jobs,async1,async8,sync8", help="comma-separated")
    args = parser.parse_args()
    sides = {"base": (args.base, args.base_python), "head": (args.head, args.head_python)}
    with tempfile.TemporaryDirectory(prefix="thaw-ab-") as tmp_dir, stopping([]) as procs:
        tmp = Path(tmp_dir)
        ports: dict[str, list[int]] = {"base": [], "head": []}
        for index in range(PROCESSES):
            for name, (root, python) in sides.items():
                common.ROOT = root  # runtime_env puts the checkout first on PYTHONPATH
                env = runtime_env(
                    tmp / f"{name}{index}",
                    handlers="handlers.echo,bench.fixtures",
                    max_jobs="10000000",
                )
                port = free_port()
                argv = [python, "-m", "runtime.cli.main", "serve", "--port", str(port)]
                procs.append(Proc(argv, env, port, tmp / f"{name}{index}.log", cwd=root).start())
                ports[name].append(port)
        common.ROOT = ROOT
        for proc in procs:
            proc.wait_healthy()
        print("\n".join(asyncio.run(_compare(ports, args.modes.split(","), args.rounds))))


if __name__ == "__main__":
    main()
