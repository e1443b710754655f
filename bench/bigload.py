"""Cold start at real model sizes: a synthetic sharded bundle, loaded by `thaw serve`.

`python bench/bigload.py [--sizes 1,6,16] [--dir DIR] [--rounds 3]` writes, per size, a bundle
laid out as a Hugging Face sharded checkpoint (shards of at most 2 GiB,
`model-0000i-of-0000n.safetensors` and `model.safetensors.index.json`, built
with per-chunk digests by `build_bundle`), whose builder (below) keeps every
tensor, and measures in the same run:

- in each of `--rounds` cold rounds, each after a drop of the page cache: the
  floors (the same bytes read by one thread per core; `import torch` in a fresh
  process), a bare script (a fresh process that imports torch,
  `safetensors.torch.load_file`s each shard and touches every page, which
  verifies nothing), and Thaw on a fresh node: spawn -> first answer, with the
  phases of its Server-Timing header (an empty state directory: no verified
  stamps). The rows show the round whose Thaw / floor ratio is the median, and
  the spread of that ratio over the rounds;
- Thaw, fresh node, page cache warm (the files read once beforehand; an empty
  state directory again): a landing copies from the page cache what it holds, and
  reads what it does not with O_DIRECT (runtime/bundles/sources/landing.py);
- Thaw, a second instance on the same node (the stamps the first one recorded).

Peak RSS is each process's own (VmHWM, or ru_maxrss of the bare script). Dropping
the page cache needs root (`echo 3 > /proc/sys/vm/drop_caches`); without it the
"cold" rows say so. The multi-GiB files are removed when it ends (--keep keeps
them). The warm rows are one run each.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT_DIR = Path(__file__).resolve().parent.parent
if str(ROOT_DIR) not in sys.path:
    sys.path.insert(0, str(ROOT_DIR))

from bench.common import Proc, free_port, runtime_env, thaw_serve_argv  # noqa: E402
from runtime import Context, bundle, handler  # noqa: E402

GIB = 1024**3
MIB = 1024**2
SHARD_MAX_BYTES = 2 * GIB
TENSOR_BYTES = 128 * MIB
NAME = "bigload"
RSS_SLACK_BYTES = 512 * MIB


# ---- the handler the server loads (THAW_HANDLERS=bench.bigload) -------------------------


@bundle(NAME)
def build_bigload(weights: dict[str, Any]) -> dict[str, Any]:
    """Keeps every tensor, as a model that uses all its weights does."""
    return weights


@handler(NAME, uses=[NAME])
def bigload(event: dict[str, Any], model: dict[str, Any], ctx: Context) -> dict[str, Any]:
    return {
        "tensors": len(model),
        "bytes": sum(t.nbytes for t in model.values()),
        "pid": os.getpid(),
    }


# ---- the bundle ---------------------------------------------------------------------------


def write_bundle(root: Path, size_bytes: int) -> tuple[list[Path], int]:
    """A sharded checkpoint of about `size_bytes` of float16 tensors, built in place:
    its shards, and the bytes of its tensors."""
    from runtime.bundles.manifest import build_bundle

    directory = root / NAME
    directory.mkdir(parents=True)
    shards = max(1, math.ceil(size_bytes / SHARD_MAX_BYTES))
    per_shard = size_bytes // shards
    block = bytearray(os.urandom(64 * MIB))
    weight_map: dict[str, str] = {}
    weight_sizes: list[int] = []
    paths = []
    for s in range(shards):
        shard = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        sizes = [TENSOR_BYTES] * (per_shard // TENSOR_BYTES)
        if per_shard % TENSOR_BYTES:
            sizes.append(per_shard % TENSOR_BYTES)
        header: dict[str, Any] = {}
        at = 0
        for t, n in enumerate(sizes):
            name = f"model.layers.{s}.{t}.weight"
            header[name] = {"dtype": "F16", "shape": [n // 2], "data_offsets": [at, at + n]}
            weight_map[name] = shard
            weight_sizes.append(n)
            at += n
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        path = directory / shard
        with open(path, "wb") as out:
            out.write(len(raw).to_bytes(8, "little") + raw)
            left = at
            while left:
                block[:8] = left.to_bytes(8, "little")  # no two blocks alike
                n = min(left, len(block))
                out.write(memoryview(block)[:n])
                left -= n
        paths.append(path)
    index = {"metadata": {"total_size": size_bytes}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    build_bundle(directory, NAME)
    return paths, sum(size for size in weight_sizes)


# ---- measurements -------------------------------------------------------------------------


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def parallel_read_s(paths: list[Path]) -> float:
    """Every byte of `paths` read once, by one thread per core, in 16 MiB reads."""
    threads = max(2, len(os.sched_getaffinity(0)))
    spans = [
        (p, at, min(16 * MIB, p.stat().st_size - at))
        for p in paths
        for at in range(0, p.stat().st_size, 16 * MIB)
    ]
    fds = {p: os.open(p, os.O_RDONLY) for p in paths}
    buffers = [bytearray(16 * MIB) for _ in range(threads)]
    started = time.monotonic()
    try:
        with ThreadPoolExecutor(threads) as pool:
            list(
                pool.map(
                    lambda i: [
                        os.preadv(fds[p], [memoryview(buffers[i])[:n]], at)
                        for p, at, n in spans[i::threads]
                    ],
                    range(threads),
                )
            )
        return time.monotonic() - started
    finally:
        for fd in fds.values():
            os.close(fd)


def fresh_process_s(code: str) -> tuple[float, dict[str, Any]]:
    """A fresh Python process running `code` (which prints one JSON line last)."""
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT_DIR
    )
    took = time.monotonic() - started
    return took, json.loads(done.stdout.strip().splitlines()[-1])


IMPORT_TORCH = "import torch, json; print(json.dumps({}))"
BARE = """
import json, resource, sys
import torch
from safetensors.torch import load_file
kept = {}
for path in sys.argv[1:] or %r:
    for name, t in load_file(path).items():
        t.view(torch.uint8)[::4096].sum()  # every page touched
        kept[name] = t
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"peak": peak, "bytes": sum(t.nbytes for t in kept.values())}))
"""


@dataclass
class Run:
    wall_s: float
    phases: dict[str, float]
    peak_bytes: int
    answer: dict[str, Any]


def thaw_first_answer(bundles: Path, state: Path) -> Run:
    """Spawn `thaw serve`, invoke the handler once: spawn -> first answer."""
    env = runtime_env(state, bundle_source=str(bundles), handlers="bench.bigload")
    port = free_port()
    with Proc(thaw_serve_argv(port), env, port, state / "server.log") as proc:
        proc.wait_healthy(120)
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/invoke/{NAME}",
            data=b"{}",
            headers={"Content-Type": "application/json", "Prefer": "wait=900"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=1000) as response:
            body = json.loads(response.read())
            timing = response.headers.get("Server-Timing", "")
            accepted = response.status == 202
        while accepted and body.get("status") in ("queued", "running"):
            # Past the runtime's estimate for a caller's wait: a job, polled to its end.
            poll = f"http://127.0.0.1:{port}/jobs/{body['id']}?wait=30"
            with urllib.request.urlopen(poll, timeout=60) as response:
                body = json.loads(response.read())
        wall = time.monotonic() - proc.started_at
        if accepted:
            if body.get("status") != "succeeded":
                raise RuntimeError(f"the load's job ended {body}:\n{proc.log()}")
            body = body["output"]
            timing = _phases_of(port)
        status = Path(f"/proc/{body['pid']}/status").read_text()
        peak_kib = int(next(s for s in status.splitlines() if s.startswith("VmHWM:")).split()[1])
    phases = {}
    for part in timing.split(","):
        name, _, rest = part.strip().partition(";dur=")
        with contextlib.suppress(ValueError):
            phases[name] = float(rest) / 1000
    return Run(wall, phases, peak_kib * 1024, body)


def _phases_of(port: int) -> str:
    """The last load's phases from /models, as a Server-Timing header would give them."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/models", timeout=30) as response:
        models = json.loads(response.read())["models"]
    entry = next(m for m in models if m["name"] == NAME)
    phases = entry.get("phase_ms") or entry.get("last_phase_ms") or {}
    return ", ".join(f"{k};dur={v}" for k, v in phases.items())


# ---- the table ----------------------------------------------------------------------------


def gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


@dataclass
class Round:
    """One round of the cold measurements, each after the page cache was dropped."""

    read_s: float
    import_s: float
    bare_s: float
    bare: dict[str, Any]
    thaw: Run

    @property
    def floor_s(self) -> float:
        return self.read_s + self.import_s

    @property
    def ratio(self) -> float:
        return self.thaw.wall_s / self.floor_s


def measure(size_gib: float, work: Path, rounds: int) -> list[str]:
    size_bytes = int(size_gib * GIB)
    rows: list[str] = []
    bundles = work / f"bundles-{size_gib:g}"
    print(f"[{size_gib:g} GiB] writing and building the bundle ...", file=sys.stderr)
    try:
        paths, kept = write_bundle(bundles, size_bytes)
        rss_cap = int(kept * 1.1) + RSS_SLACK_BYTES

        # The page cache warm first (a cold node reads past it, with O_DIRECT, and
        # would leave it cold).
        parallel_read_s(paths)
        warm = thaw_first_answer(bundles, work / f"state-{size_gib:g}-warm")
        second = thaw_first_answer(bundles, work / f"state-{size_gib:g}-warm")
        # Then the cold rounds, each measuring the floors, the bare script and Thaw
        # after a drop of its own: one round swings by a third from one run to the
        # next here (a microVM's host faults), and a ratio is taken within a round.
        cold = drop_caches()
        note = "" if cold else " (page cache NOT dropped: needs root)"
        measured: list[Round] = []
        for index in range(rounds):
            print(f"[{size_gib:g} GiB] cold round {index + 1} of {rounds}", file=sys.stderr)
            drop_caches()
            read_s = parallel_read_s(paths)
            drop_caches()
            import_s, _ = fresh_process_s(IMPORT_TORCH)
            drop_caches()
            bare_s, bare = fresh_process_s(BARE % [str(p) for p in paths])
            drop_caches()
            thaw = thaw_first_answer(bundles, work / f"state-{size_gib:g}-cold-{index}")
            measured.append(Round(read_s, import_s, bare_s, bare, thaw))
        for run in (warm, second, *(r.thaw for r in measured)):
            assert run.answer["bytes"] == kept, run.answer
        assert all(r.bare["bytes"] == kept for r in measured)
        ordered = sorted(measured, key=lambda r: r.ratio)
        median = ordered[len(ordered) // 2]  # the round whose ratio is the median
        spread = f"{ordered[0].ratio:.2f}-{ordered[-1].ratio:.2f}x over {rounds} rounds"
        bare_ratios = sorted(r.thaw.wall_s / r.bare_s for r in measured)

        def phases(run: Run) -> str:
            return ", ".join(f"{k} {run.phases.get(k, 0.0):.2f}" for k in ("fetch", "load", "init"))

        def row(what: str, wall: float, detail: str, peak: int | None, vs: str) -> None:
            rss = "—" if peak is None else f"{gib(peak)} ({'ok' if peak <= rss_cap else 'OVER'})"
            rows.append(f"| {size_gib:g} GiB | {what} | {wall:.2f} s | {detail} | {rss} | {vs} |")

        floor_s = median.floor_s
        row(f"parallel read, {len(paths)} shards{note}", median.read_s, "floor", None, "—")
        row("`import torch`, fresh process", median.import_s, "floor", None, "—")
        row("import + read", floor_s, "floor", None, "1.00x")
        row(
            "bare `load_file` script",
            median.bare_s,
            "verifies nothing",
            max(r.bare["peak"] for r in measured),
            f"{median.bare_s / floor_s:.2f}x",
        )
        row(
            f"Thaw, fresh node, cold{note}",
            median.thaw.wall_s,
            f"{phases(median.thaw)}; {spread}",
            max(r.thaw.peak_bytes for r in measured),
            f"{median.ratio:.2f}x (bare {bare_ratios[len(bare_ratios) // 2]:.2f}x)",
        )
        row("Thaw, fresh node, warm", warm.wall_s, phases(warm), warm.peak_bytes, "—")
        row("Thaw, second instance (stamps)", second.wall_s, phases(second), second.peak_bytes, "—")
        cap = f"peak RSS cap: kept {gib(kept)} x 1.1 + 512 MiB"
        rows.append(f"| {size_gib:g} GiB | {cap} | {gib(rss_cap)} | | | |")
    finally:
        shutil.rmtree(bundles, ignore_errors=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1", help="GiB, comma-separated (e.g. 1,6,16)")
    parser.add_argument("--dir", default="/var/tmp", help="where the bundles are written")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument(
        "--rounds", type=int, default=3, help="cold rounds per size, the median shown (3)"
    )
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="thaw-bigload-", dir=args.dir))
    try:
        rows = [
            "| size | measurement | wall | phases (s) / note | peak RSS | vs import + read |",
            "|---|---|---|---|---|---|",
        ]
        for size in args.sizes.split(","):
            rows += measure(float(size), work, max(1, args.rounds))
            print("\n".join(rows), file=sys.stderr)  # so far, should a later size fail
        print("\n".join(rows))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
