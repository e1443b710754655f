"""Large job payloads: what a finished job costs the process, and its cycle.

    .venv/bin/python bench/experiments/job_payloads.py [--jobs 300] [--cycles 30]
    .venv/bin/python bench/experiments/job_payloads.py --against /path/to/an/older/checkout

Every figure is from a real `thaw serve` over HTTP: `echo` jobs whose input (and
so output) is a JSON list of floats, the shape of an embedding or a batch of
scores, submitted and their result long-polled one after another.

- RSS: the process's VmRSS (/proc) after 20 jobs and after `--jobs` more, per
  size; the growth between them is what the finished jobs it remembers cost
  (runtime/jobs/finished.py bounds them at 16 MiB of payload JSON). Target:
  at most 48 MiB of growth, whatever the number of jobs: about twice that
  bound, the parsed payloads' size in Python objects.
- The job cycle (submit, then `GET /jobs/{id}?wait=`): p50 latency and the
  server's CPU per cycle (user + system, /proc/PID/stat), medians of
  `--cycles` after a warm-up.

With `--against DIR` the Thaw of another checkout (its `runtime/`, started from
DIR) runs the same jobs as the baseline, one server after the other, and the
ratios compare the two.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402
    Conn,
    Proc,
    Row,
    cpu_s,
    fmt_s,
    fmt_x,
    free_port,
    median,
    render,
    runtime_env,
    thaw_serve_argv,
    verdict,
)
from bench.overhead import thaw_job_cycle  # noqa: E402
from tests.pretrained.host_memory import MIB, status_bytes  # noqa: E402

GROWTH_TARGET = 48 * MIB
# Floats per input: about 17 bytes of JSON each (inputs of 0.17 and 0.84 MB).
SIZES = (10_000, 50_000)
WARM_JOBS = 20


def body(floats: int) -> bytes:
    return orjson.dumps({"values": [i / 7 for i in range(floats)]})


def rss_bytes(proc: Proc) -> int:
    assert proc.proc is not None
    return status_bytes(proc.proc.pid, "VmRSS")


async def cycles(port: int, payload: bytes, count: int) -> list[float]:
    """`count` echo jobs one after another: each cycle's seconds."""
    conn = await Conn(port).open()
    took: list[float] = []
    try:
        for _ in range(count):
            started = time.monotonic()
            await thaw_job_cycle(conn, payload)
            took.append(time.monotonic() - started)
    finally:
        await conn.close()
    return took


def measure(root: Path, tmp: Path, floats: int, jobs: int, count: int) -> dict[str, float]:
    """One fresh server of `root`: RSS growth over `jobs`, then the cycle's figures."""
    env = runtime_env(tmp, handlers="handlers.echo", max_jobs="10000000")
    env["PYTHONPATH"] = str(root)
    port = free_port()
    payload = body(floats)
    with Proc(thaw_serve_argv(port), env, port, tmp / "server.log", cwd=root) as proc:
        proc.wait_healthy()
        assert proc.proc is not None
        asyncio.run(cycles(port, payload, WARM_JOBS))
        warm = rss_bytes(proc)
        asyncio.run(cycles(port, payload, jobs))
        grown = rss_bytes(proc) - warm
        before = cpu_s(proc.proc.pid)
        took = asyncio.run(cycles(port, payload, count))
        cpu = (cpu_s(proc.proc.pid) - before) / count
    return {"mb": len(payload) / 1e6, "grown": grown, "p50": median(took), "cpu": cpu}


def rows_for(thaw: dict[str, float], base: dict[str, float] | None, jobs: int) -> list[Row]:
    size = f"{thaw['mb']:.2f} MB in and out"
    grown_ok = thaw["grown"] <= GROWTH_TARGET

    def vs(field: str, shown: str) -> tuple[str, str]:
        if base is None:
            return "—", "—"
        return shown, fmt_x(thaw[field] / base[field])

    rows = [
        Row(
            f"RSS growth over {jobs} finished jobs, {size}",
            f"{thaw['grown'] / MIB:.0f} MiB",
            *(("—", "—") if base is None else (f"{base['grown'] / MIB:.0f} MiB", "—")),
            f"<= {GROWTH_TARGET // MIB} MiB",
            verdict(grown_ok),
        )
    ]
    for field, what in (("p50", "job cycle p50"), ("cpu", "server CPU per job cycle")):
        shown, ratio = vs(field, fmt_s(base[field]) if base else "—")
        rows.append(Row(f"{what}, {size}", fmt_s(thaw[field]), shown, ratio))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--jobs", type=int, default=300, help="jobs between the RSS readings")
    parser.add_argument("--cycles", type=int, default=30, help="job cycles timed per size")
    parser.add_argument("--against", type=Path, help="another checkout's Thaw as the baseline")
    args = parser.parse_args()
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="thaw-payloads-") as tmp_dir:
        tmp = Path(tmp_dir)
        for floats in SIZES:
            thaw = measure(ROOT, tmp / f"thaw-{floats}", floats, args.jobs, args.cycles)
            base = None
            if args.against is not None:
                base = measure(args.against, tmp / f"base-{floats}", floats, args.jobs, args.cycles)
            rows += rows_for(thaw, base, args.jobs)
    print(render(rows))


if __name__ == "__main__":
    main()
