"""The benchmarks that back a claim: their registry, and one runner for all of them.

    .venv/bin/python bench/run.py                      # the in-process suite (~4.5 minutes)
    .venv/bin/python bench/run.py --quick              # the same, fewer rounds (~2 minutes)
    .venv/bin/python bench/run.py --only load,batching # any registered benchmark(s)
    .venv/bin/python bench/run.py --list               # name, what it measures, command, peer
    .venv/bin/python bench/run.py --write BENCHMARKS.md --only eviction_sim

Each benchmark in `BENCHMARKS` below is one command that prints one markdown
table: what it measures, the command that measures it, and the target or peer it
is held to. Those marked `suite` run in this process (their `run(quick=...)`),
the rest as their own command, one after another. Progress goes to stderr, the
tables to stdout (and to FILE with --out). Every server, moto and runtime
process a benchmark starts is stopped before it returns, also on Ctrl-C.

`--write FILE` also rewrites each benchmark's section of FILE, between its
markers (`<!-- bench:NAME -->` ... `<!-- /bench:NAME -->`), with the table and
the machine, commit, date and command it was measured with; the rest of FILE
is left as it is. A benchmark that crashed leaves its section alone.

Exit status: 0 when every benchmark ran (targets missed show as FAIL rows), 1
when one crashed (its row says why), 2 for a usage error.

Scripts under bench/experiments/ are not registered: each measured one
decision (docs/decisions/) and is kept to measure it again, outside CI.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import platform
import re
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import Row, render  # noqa: E402


@dataclass(frozen=True)
class Benchmark:
    """One registered benchmark: a command that prints one table."""

    name: str
    measures: str
    argv: tuple[str, ...]  # bench/SCRIPT.py and its arguments, as the record was measured
    compares: str  # the target or peer it is held to
    suite: str = ""  # "module:function" run in this process (run(quick=...)), or ""
    quick: tuple[str, ...] = ()  # extra arguments under --quick (commands only)
    owner: str = ""  # who maintains the script, where that is not bench/'s owner

    @property
    def script(self) -> Path:
        return ROOT / self.argv[0]

    @property
    def command(self) -> str:
        return " ".join((".venv/bin/python", *self.argv))

    def present(self) -> bool:
        return self.script.is_file()


BENCHMARKS: tuple[Benchmark, ...] = (
    Benchmark(
        "coldstart",
        "process start -> /healthz; each handler's first invocation split into fetch, load, "
        "init, warm-up and run, and the runtime's own overhead beside them",
        ("bench/coldstart.py", "--full"),
        "a bare Starlette+uvicorn process (/healthz <= 300 ms); overhead < 50 ms",
        suite="bench.coldstart:run",
    ),
    Benchmark(
        "load",
        "a 1 GiB, 4-shard bundle from a warm page cache to LOADED and to its first forward; "
        "sha256 verification; a re-fetch of verified files (stat stamps)",
        ("bench/load.py", "--full"),
        "the raw read of the same files (>= 0.9x), torch.load (>= 3x faster), safetensors",
        suite="bench.load:run",
    ),
    Benchmark(
        "overhead",
        "warm no-op invocations (async and sync handler, 1 and 8 clients): p50, p99, "
        "requests/s; the durable job cycle (submit -> result)",
        ("bench/overhead.py",),
        "the bare app (p50 <= 1.25x, p99 <= 1.5x, requests/s >= 0.8x); job p50 <= 1.0 ms; "
        "RunPod's worker with --runpod-python",
        suite="bench.overhead:run",
        quick=("--quick",),
    ),
    Benchmark(
        "singleflight",
        "64 concurrent first requests to a cold bundle: loads, the waiters' added latency; "
        "64 concurrent 202s (Prefer: wait=0.1) to a bundle that loads for seconds",
        ("bench/overhead.py", "--singleflight"),
        "one load; the runtime's part p99 <= 5 ms; 202 p99 <= 50 ms; a bare fan-out as floor",
        suite="bench.overhead:run_singleflight",
    ),
    Benchmark(
        "eviction_sim",
        "reload seconds, hit rate and evictions of the eviction policies on a seeded Zipf "
        "trace, replayed through the real ModelCache on a simulated clock",
        ("bench/eviction_sim.py", "--full"),
        "LRU (cachetools), the online and offline optima; reload <= 0.7x LRU",
        suite="bench.eviction_sim:run",
    ),
    Benchmark(
        "s3fetch",
        "an 8-shard 512 MiB bundle fetched from a moto S3 server, sha256 verified",
        ("bench/s3fetch.py", "--full"),
        "boto3 download_file with its defaults (>= 2x)",
        suite="bench.s3fetch:run",
    ),
    Benchmark(
        "firstanswer",
        "process start -> first answer of each shipped model handler on a fresh node "
        "(read-only image and writable directory), with each side's phases",
        ("bench/firstanswer.py", "--fresh-only", "--repeat", "9", "--phases"),
        "a bare script doing the same work (runtime/cli/bare.py): <= 1.05x",
        quick=("--repeat", "3"),
    ),
    Benchmark(
        "emulated",
        "a cold invocation under `thaw emulate`: the REPORT's Init Duration + Duration",
        ("bench/emulated.py", "--runs", "3", "--handler", "embed,classify,generate"),
        "the bare script as a plain Python Lambda function under awslambdaric: <= 1.05x",
    ),
    Benchmark(
        "warmup",
        "first request after READY against steady state, per declared warm-up path, "
        "warm-up on and off",
        ("bench/warmup.py", "--repeats", "5"),
        "the same request after the same idle: <= 1.1x with warm-up on",
        quick=("--repeats", "2"),
    ),
    Benchmark(
        "deadlines",
        "lateness past their deadlines of 200 answers while every load-time estimate is "
        "wrong 100x either way",
        ("bench/deadlines.py",),
        "no answer later than 50 ms past its deadline; every 202 job succeeds",
    ),
    Benchmark(
        "soak",
        "100,000 mixed valid, invalid and oversized requests: RSS growth, 5xx, crashes",
        ("bench/soak.py",),
        "RSS growth < 5 %, zero 5xx, zero unexpected statuses",
        quick=("--requests", "20000"),
    ),
    Benchmark(
        "batching",
        "batched `embed` at 32 and 1 clients: requests/s, p50, p99, batch size",
        ("bench/batching.py", "--rounds", "5"),
        "the shipped function one event a call (>= 2.5x) and Infinity 0.0.78 (>= 1x)",
        quick=("--quick",),
    ),
    Benchmark(
        "openai_routes",
        "/v1/embeddings against /invoke/embed at 32 clients, one server, interleaved",
        ("bench/openai_routes.py", "--rounds", "6"),
        "/invoke/embed: >= 0.95x its requests/s",
        quick=("--quick",),
    ),
    Benchmark(
        "streaming",
        "time to first token over SSE; tokens/s streamed and not; first chunk through "
        "`thaw emulate`'s response stream",
        ("bench/streaming.py",),
        "a bare decode loop (<= 1.1x); the same call not streamed (>= 0.95x); < 20 %",
    ),
    Benchmark(
        "generation",
        "continuous batching of `generate`: tokens/s and TTFT at 1, 8 and 16 streaming "
        "callers; greedy identity batched against alone (--identity)",
        ("bench/generation.py", "--window", "12", "--rounds", "2", "--pairs", "6"),
        "per-request decode loops (>= 3x at 8), a lone caller (TTFT <= 1.5x), transformers' "
        "continuous batching (>= 1x)",
        quick=("--window", "6", "--rounds", "1", "--pairs", "3"),
    ),
    Benchmark(
        "memory",
        "host memory handed back: idle RSS after load/unload cycles, peak RSS under "
        "evictions, warm request and unload costs",
        ("bench/memory.py",),
        "glibc's own behaviour; idle <= baseline + 128 MiB, peak <= baseline + budget + 128 MiB",
        quick=("--cycles", "3", "--rounds", "2"),
    ),
    Benchmark(
        "jobstore",
        "one PostgreSQL's claims/s and finishes/s with 1, 8 and 32 claimers, direct and "
        "through PgBouncer; what NOTIFY costs a write",
        ("bench/jobstore.py",),
        "no target: the figures docs/fleet.md plans with",
        quick=("--quick",),
    ),
    Benchmark(
        "fleet",
        "jobs across instances on PostgreSQL behind nginx: submit -> result, polls/s, "
        "cross-instance long-poll wake-up and stream follow",
        ("bench/fleet.py", "bench"),
        "SQLite on one instance; wake-up p99 <= 100 ms",
        owner="LEAD",
    ),
    Benchmark(
        "fleet_burst",
        "a burst of jobs submitted to one instance of 2 or 3, a handler declared one call at "
        "a time: the wall time, the runs per instance, the queue gauge, runs above capacity",
        ("bench/fleet.py", "burst"),
        "the ideal, jobs x run / instances (>= 0.8x of it); no run above capacity",
        quick=("--bursts", "10", "--instances", "2"),
        owner="LEAD",
    ),
    Benchmark(
        "gpu",
        "on a CUDA device: load against a pinned copy, unload x10, first request after "
        "READY, embed and generate throughput, peak device memory against the plan",
        ("bench/gpu.py",),
        "a pinned host->device copy; every byte back; <= 1.1x steady; <= 1.00x the plan",
    ),
    Benchmark(
        "bigload",
        "synthetic bundles of 1, 6 and 16 GiB (and a sharded layout with an index file) to "
        "READY on a fresh node, page cache dropped and warm, and a second instance; peak RSS",
        ("bench/bigload.py",),
        "floors in the same run (`import torch` + a parallel read: <= 1.25x at 6 GiB, cold) "
        "and a bare safetensors script (no slower); peak RSS <= kept + 10 % + 512 MiB",
        owner="LOADER",
    ),
)

BY_NAME = {b.name: b for b in BENCHMARKS}
SUITE = tuple(b.name for b in BENCHMARKS if b.suite)


def registered() -> tuple[Benchmark, ...]:
    """The registered benchmarks whose script is in this checkout."""
    return tuple(b for b in BENCHMARKS if b.present())


def _table_of(output: str) -> str:
    """A command's table: its stdout from the first table line on."""
    lines = output.strip("\n").splitlines()
    first = next((i for i, line in enumerate(lines) if line.startswith("|")), 0)
    return "\n".join(lines[first:]).strip()


def measure(bench: Benchmark, quick: bool) -> tuple[str, bool]:
    """(its table, whether it ran): in this process for the suite, else its command."""
    if bench.suite:
        module, _, function = bench.suite.partition(":")
        try:
            rows = getattr(importlib.import_module(module), function)(quick=quick)
        except Exception as exc:
            traceback.print_exc(file=sys.stderr)
            why = f"{type(exc).__name__}: {exc}"[:200]
            return render([Row(f"{bench.name}: crashed", why, verdict="FAIL")]), False
        return render(rows), True
    argv = [sys.executable, str(bench.script), *bench.argv[1:], *(bench.quick if quick else ())]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        why = f"`{bench.command}` exited {done.returncode}"
        return render([Row(f"{bench.name}: crashed", why, verdict="FAIL")]), False
    return _table_of(done.stdout), True


def machine() -> str:
    """This machine in one line: CPU model, CPUs, Python, torch where installed."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    parts = [model, f"{os.cpu_count()} CPUs", f"Python {platform.python_version()}"]
    try:
        from importlib.metadata import version

        parts.append(f"torch {version('torch')}")
    except Exception:
        pass
    return ", ".join(parts)


def commit() -> str:
    """HEAD's short hash, marked when the measured code differs from it."""
    git = ["git", "-C", str(ROOT)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(
        [*git, "status", "--porcelain", "--", "runtime", "handlers", "bench"],
        capture_output=True,
        text=True,
    )
    mark = " with uncommitted changes" if dirty.stdout.strip() else ""
    return (head.stdout.strip() or "unknown") + mark


def markers(name: str) -> tuple[str, str]:
    return f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"


def section(bench: Benchmark, table: str, quick: bool) -> str:
    """What --write puts between a benchmark's markers."""
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    if bench.suite:  # run in this process: its rounds are the runner's
        command = f".venv/bin/python bench/run.py --only {bench.name}" + (" --quick" * quick)
    else:
        command = bench.command + (" " + " ".join(bench.quick) if quick and bench.quick else "")
    return f"Measured {now}, commit {commit()}, {machine()}:\n`{command}`\n\n{table}"


def write_section(path: Path, name: str, body: str) -> None:
    """Replace the text between NAME's markers in `path` with `body`."""
    begin, end = markers(name)
    text = path.read_text()
    pattern = re.compile(re.escape(begin) + r"\n.*?" + re.escape(end), re.DOTALL)
    if not pattern.search(text):
        raise SystemExit(f"{path}: no section {begin} ... {end} to rewrite")
    path.write_text(pattern.sub(lambda _: f"{begin}\n{body}\n{end}", text, count=1))


def describe() -> str:
    lines = []
    for b in BENCHMARKS:
        where = "in-process suite" if b.suite else "command"
        absent = "" if b.present() else "  (not in this checkout yet)"
        owner = f"  [maintained by {b.owner}]" if b.owner else ""
        lines += [
            f"{b.name} ({where}){absent}{owner}",
            f"    measures: {b.measures}",
            f"    command:  {b.command}",
            f"    against:  {b.compares}",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument(
        "--only", default="", help=f"comma-separated names (default: the suite, {','.join(SUITE)})"
    )
    parser.add_argument("--list", action="store_true", help="describe every registered benchmark")
    parser.add_argument("--out", default="", help="also write the tables to this file")
    parser.add_argument(
        "--write", default="", metavar="FILE", help="rewrite each benchmark's section of FILE"
    )
    args = parser.parse_args(argv)
    if args.list:
        print(describe())
        return 0
    chosen = [m.strip() for m in args.only.split(",") if m.strip()] or list(SUITE)
    unknown = sorted(set(chosen) - set(BY_NAME))
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; choose from {sorted(BY_NAME)}")
    missing = [name for name in chosen if not BY_NAME[name].present()]
    if missing:
        parser.error(f"not in this checkout yet: {missing}")
    if args.write and not Path(args.write).is_file():
        parser.error(f"--write: no file {args.write}")
    tables: list[str] = []
    crashed = False
    started = time.monotonic()
    for name in chosen:
        bench = BY_NAME[name]
        began = time.monotonic()
        print(f"[bench] {name} ...", file=sys.stderr, flush=True)
        table, ran = measure(bench, args.quick)
        crashed |= not ran
        tables.append(f"## {name}\n\n{table}" if len(chosen) > 1 else table)
        if args.write and ran:
            write_section(Path(args.write), name, section(bench, table, args.quick))
            print(f"[bench] {name}: section rewritten in {args.write}", file=sys.stderr)
        took = time.monotonic() - began
        print(f"[bench] {name} done in {took:.0f} s", file=sys.stderr, flush=True)
    output = "\n\n".join(tables)
    print(output)
    if args.out:
        Path(args.out).write_text(output + "\n")
    print(f"[bench] all done in {time.monotonic() - started:.0f} s", file=sys.stderr)
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main())
