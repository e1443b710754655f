"""Load throughput of a 1 GB synthetic bundle (4 shards), page cache warm.

Variants, measured in alternating order each round (medians over rounds):

- raw read: the shard files read sequentially into one reused buffer, like
  `cat` — the bandwidth of getting these bytes out of the page cache at all;
- raw read into fresh memory: the same read, into a new buffer per file — what
  any load that leaves the process owning its bytes pays at least (page faults
  on memory the process never touched);
- Thaw: `runtime.models.weights.load_weights` (the LOADED phase: every tensor
  copied out of the files into the process's memory), then every tensor summed
  once (the first forward touches every weight);
- mmap: the previous load path, kept here only as the comparison: safetensors
  maps each shard and `MADV_POPULATE_READ` maps every page; the tensors view
  the files, so rewriting one changed a READY model's answers and truncating
  one killed the process (SIGBUS);
- `safetensors.torch.load_file` over the shards, one after another;
- `torch.load` of the same tensors saved with `torch.save` (4 files);
- fetch: the local source's sha256 verification of the same files, which is
  its own phase (FETCHED) before LOADED; and the same fetch once the files
  were verified on this node and are unchanged since (stat stamps, no hash).

Then the first load of a fresh process (the cold start), Thaw against mmap,
each in its own child process (`--child`), alternating: load time and the
resident memory it leaves (RSS growth, anonymous and file-backed) and its peak
(VmHWM, reset before the load), as stored and with `config.dtype` float16.

With CUDA, pageable vs pinned host->device copies of the same gigabyte.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# `python bench/load.py` puts bench/ on sys.path, not the repository root.
ROOT_DIR = Path(__file__).resolve().parent.parent
if str(ROOT_DIR) not in sys.path:
    sys.path.insert(0, str(ROOT_DIR))

from bench.common import ROOT, Row, fmt_bw, fmt_s, fmt_x, median, verdict  # noqa: E402

SHARDS = 4
TENSORS_PER_SHARD = 16
FLOATS_PER_TENSOR = 4 * 1024 * 1024  # 16 MiB of float32; 4 x 16 x 16 MiB = 1 GiB
RAW_TARGET = 0.9
TORCH_LOAD_TARGET = 3.0
_READ_CHUNK = 16 * 1024 * 1024
_MADV_POPULATE_READ = 22
GiB = 2**30


def make_bundle(root: Path) -> tuple[Path, list[Path]]:
    """The bundle (safetensors shards + manifest) and the same tensors as torch.save files."""
    import torch
    from safetensors.torch import save_file

    from runtime.bundles.manifest import build_bundle

    src = root / "src"
    src.mkdir()
    pickles: list[Path] = []
    generator = torch.Generator().manual_seed(0)
    for shard in range(SHARDS):
        tensors = {
            f"layers.{shard}.{i}.weight": torch.rand(FLOATS_PER_TENSOR, generator=generator)
            for i in range(TENSORS_PER_SHARD)
        }
        save_file(tensors, src / f"model-{shard:05d}-of-{SHARDS:05d}.safetensors")
        pickle = root / f"model-{shard}.pt"
        torch.save(tensors, pickle)
        pickles.append(pickle)
        del tensors
    build_bundle(src, "synthetic", out=root / "synthetic")
    for path in src.iterdir():
        path.unlink()
    src.rmdir()
    return root / "synthetic", pickles


def raw_read(paths: list[Path]) -> int:
    buffer = bytearray(_READ_CHUNK)
    total = 0
    for path in paths:
        with open(path, "rb", buffering=0) as handle:
            while n := handle.readinto(buffer):
                total += n
    return total


def raw_read_fresh(paths: list[Path]) -> list[bytearray]:
    """Each file read into a new buffer of its size: the floor of any copying load."""
    out: list[bytearray] = []
    for path in paths:
        buffer = bytearray(path.stat().st_size)
        with open(path, "rb", buffering=0) as handle:
            view = memoryview(buffer)
            done = 0
            while n := handle.readinto(view[done:]):
                done += n
        out.append(buffer)
    return out


def mmap_load(bundle_dir: Path, manifest: Any) -> dict[str, Any]:
    """The previous `load_weights` on the CPU, for comparison only: `load_file` maps each
    shard (tensors view a MAP_PRIVATE mapping of the file), one MADV_POPULATE_READ per
    shard maps its pages, and a `config.dtype` conversion copies from the mapping."""
    import ctypes
    from concurrent.futures import ThreadPoolExecutor

    import torch
    from safetensors.torch import load_file

    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    dtype_name = manifest.load_dtype
    dtype = getattr(torch, dtype_name) if dtype_name else None

    def one(path: Path) -> dict[str, Any]:
        tensors = load_file(str(path))
        storages = {id(t.untyped_storage()): t.untyped_storage() for t in tensors.values()}
        for storage in storages.values():
            if storage.nbytes():
                start = storage.data_ptr() // 4096 * 4096
                madvise(start, storage.data_ptr() + storage.nbytes() - start, _MADV_POPULATE_READ)
        if dtype is not None:
            tensors = {
                k: v.to(dtype) if v.is_floating_point() and v.dtype != dtype else v
                for k, v in tensors.items()
            }
        return tensors

    shards = [bundle_dir / f.path for f in manifest.files if f.path.endswith(".safetensors")]
    out: dict[str, Any] = {}
    with ThreadPoolExecutor(max_workers=max(1, min(len(shards), os.cpu_count() or 1, 8))) as pool:
        for part in pool.map(one, shards):
            out.update(part)
    return out


def touch(weights: dict[str, Any]) -> float:
    """Read every weight once (what a first forward pass does to each).

    On one thread: for 16 MiB tensors on this shared two-core machine, torch's
    intra-op pool costs more in hand-offs than it gains (a 1 GiB sum took 0.23 s
    on two threads, 0.09 s on one), and the point is to read the bytes, not to
    measure the pool.
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return sum(float(t.sum()) for t in weights.values())
    finally:
        torch.set_num_threads(threads)


def _timed_load(load: Callable[[], dict[str, Any]]) -> tuple[float, float]:
    """(seconds to loaded, seconds to every tensor touched)."""
    started = time.perf_counter()
    weights = load()
    loaded = time.perf_counter() - started
    touch(weights)
    forward = time.perf_counter() - started
    del weights
    gc.collect()
    return loaded, forward


def _memory() -> dict[str, int]:
    """This process's resident memory now and its peak, in bytes (/proc/self/status)."""
    fields = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")
    out: dict[str, int] = {}
    with open("/proc/self/status") as handle:
        for line in handle:
            key, _, value = line.partition(":")
            if key in fields:
                out[key] = int(value.split()[0]) * 1024
    return out


def child(variant: str, bundle_dir: Path, dtype: str) -> dict[str, float]:
    """One first load in this (fresh) process; run as `python -m bench.load --child`."""
    from runtime.bundles.manifest import read_manifest
    from runtime.models import weights as weights_mod

    # What a server has done before its first load: torch and safetensors imported
    # (resolve_device), torch's first operations run (its lazy initialisation).
    weights_mod.resolve_device("cpu")
    import torch

    touch({"warm": torch.ones(4096).to(torch.float16)})
    manifest = read_manifest(bundle_dir)
    if dtype:
        manifest = dataclasses.replace(manifest, thaw={**manifest.thaw, "dtype": dtype})
    shards = [bundle_dir / f.path for f in manifest.files]
    raw_s = _timed(lambda: raw_read(shards))
    loads: dict[str, Callable[[], dict[str, Any]]] = {
        "thaw": lambda: weights_mod.load_weights(bundle_dir, manifest, "cpu"),
        "mmap": lambda: mmap_load(bundle_dir, manifest),
    }
    load = loads[variant]
    gc.collect()
    try:
        Path("/proc/self/clear_refs").write_text("5")  # 5: VmHWM := VmRSS
        peak_known = True
    except OSError:
        peak_known = False
    before = _memory()
    started = time.perf_counter()
    weights = load()
    loaded = time.perf_counter() - started
    after = _memory()
    touch(weights)
    forward = time.perf_counter() - started
    return {
        "raw_s": raw_s,
        "load_s": loaded,
        "forward_s": forward,
        "rss": after["VmRSS"] - before["VmRSS"],
        "anon": after["RssAnon"] - before["RssAnon"],
        "file": after["RssFile"] - before["RssFile"],
        "shmem": after["RssShmem"] - before["RssShmem"],
        "peak": (after["VmHWM"] - before["VmRSS"]) if peak_known else float("nan"),
    }


def _in_child(variant: str, bundle_dir: Path, dtype: str) -> dict[str, float]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "-m", "bench.load", "--child", variant, str(bundle_dir), dtype],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"child {variant} exited {done.returncode}: {done.stderr[-2000:]}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def _fresh_process_rows(bundle_dir: Path, nbytes: int, rounds: int) -> list[Row]:
    """First loads in fresh processes: Thaw against the mmap path, alternating."""
    runs: dict[tuple[str, str], list[dict[str, float]]] = {}
    for index in range(rounds):
        for dtype in ("", "float16"):
            order = ("thaw", "mmap") if index % 2 == 0 else ("mmap", "thaw")
            for variant in order:
                runs.setdefault((variant, dtype), []).append(_in_child(variant, bundle_dir, dtype))

    def med(variant: str, dtype: str, key: str) -> float:
        return median([r[key] for r in runs[(variant, dtype)]])

    def ratio(dtype: str, key: str) -> float:
        pairs = zip(runs[("thaw", dtype)], runs[("mmap", dtype)], strict=True)
        return median([m[key] / t[key] for t, m in pairs])

    def resident(variant: str, dtype: str) -> str:
        rss, anon, file = (med(variant, dtype, k) for k in ("rss", "anon", "file"))
        return f"{_gib(rss)} (anonymous {_gib(anon)}, file-backed {_gib(file)})"

    gib = f"{nbytes / GiB:.2f} GiB, {SHARDS} shards"
    spread = [r["load_s"] for r in runs[("thaw", "")]]
    raw_ratio = median([r["raw_s"] / r["load_s"] for r in runs[("thaw", "")]])
    rows = [
        Row(
            f"first load in a fresh process, {gib}: to LOADED, Thaw (copy) vs mmap + populate "
            f"(previous; its tensors view the files)",
            f"{fmt_s(med('thaw', '', 'load_s'))} ({fmt_bw(nbytes / med('thaw', '', 'load_s'))}; "
            f"{fmt_s(min(spread))}-{fmt_s(max(spread))}; "
            f"{fmt_x(raw_ratio)} that process's raw read)",
            f"{fmt_s(med('mmap', '', 'load_s'))} mmap",
            fmt_x(ratio("", "load_s")),
        ),
        Row(
            f"first load in a fresh process, {gib}: to first forward (every tensor summed)",
            fmt_s(med("thaw", "", "forward_s")),
            f"{fmt_s(med('mmap', '', 'forward_s'))} mmap",
            fmt_x(ratio("", "forward_s")),
        ),
        Row(
            f"first load in a fresh process, {gib}: RSS growth after load",
            resident("thaw", ""),
            f"{resident('mmap', '')} mmap",
        ),
        Row(
            f"first load in a fresh process, {gib}: peak RSS growth during load",
            _gib(med("thaw", "", "peak")),
            f"{_gib(med('mmap', '', 'peak'))} mmap",
        ),
        Row(
            f"first load in a fresh process, {gib}, config.dtype float16: to LOADED",
            fmt_s(med("thaw", "float16", "load_s")),
            f"{fmt_s(med('mmap', 'float16', 'load_s'))} mmap + .to()",
            fmt_x(ratio("float16", "load_s")),
        ),
        Row(
            f"first load in a fresh process, {gib}, config.dtype float16: RSS growth after "
            "load; peak",
            f"{resident('thaw', 'float16')}; peak {_gib(med('thaw', 'float16', 'peak'))}",
            f"{resident('mmap', 'float16')}; peak {_gib(med('mmap', 'float16', 'peak'))} "
            "mmap + .to()",
        ),
    ]
    return rows


def _cuda_rows(nbytes: int, rounds: int) -> list[Row]:
    import torch

    if not torch.cuda.is_available():
        return [
            Row("CUDA: pinned vs pageable host->device copy", "no CUDA device", verdict="skipped")
        ]
    host = torch.rand(nbytes // 4)
    pinned = host.pin_memory()
    torch.ones(1, device="cuda")  # create the context outside the timing
    times: dict[str, list[float]] = {"pageable": [], "pinned": []}
    for index in range(rounds):
        order = ("pageable", "pinned") if index % 2 == 0 else ("pinned", "pageable")
        for name in order:
            source = host if name == "pageable" else pinned
            torch.cuda.synchronize()
            started = time.perf_counter()
            on_device = source.to("cuda", non_blocking=name == "pinned")
            torch.cuda.synchronize()
            times[name].append(time.perf_counter() - started)
            del on_device
    pageable, pinned_s = median(times["pageable"]), median(times["pinned"])
    return [
        Row(
            "CUDA: 1 GiB host->device copy, pinned vs pageable",
            f"{fmt_bw(nbytes / pinned_s)} pinned",
            f"{fmt_bw(nbytes / pageable)} pageable",
            fmt_x(pageable / pinned_s),
        )
    ]


def run(*, quick: bool = False) -> list[Row]:
    import torch
    from safetensors.torch import load_file

    from runtime.bundles.manifest import read_manifest
    from runtime.bundles.sources.local import LocalSource
    from runtime.bundles.stamps import RACY_S, VerifiedStamps
    from runtime.models import weights as weights_mod

    rounds = 3 if quick else 5
    with tempfile.TemporaryDirectory(prefix="thaw-bench-load-") as tmp_dir:
        bundle_dir, pickles = make_bundle(Path(tmp_dir))
        manifest = read_manifest(bundle_dir)
        shards = [bundle_dir / f.path for f in manifest.files]
        nbytes = sum(p.stat().st_size for p in shards)
        source = LocalSource(bundle_dir.parent)
        stamped = LocalSource(bundle_dir.parent, VerifiedStamps(Path(tmp_dir) / "verified.json"))
        # Files are stamped only once they have been unchanged for RACY_S.
        newest = max(p.stat().st_ctime for p in shards)
        time.sleep(max(0.0, newest + RACY_S + 0.1 - time.time()))
        stamped.fetch(manifest, lambda n: None)
        raw_read(shards + pickles)  # page cache warm for every variant

        def thaw() -> dict[str, Any]:
            return weights_mod.load_weights(bundle_dir, manifest, "cpu")

        def safetensors_seq() -> dict[str, Any]:
            out: dict[str, Any] = {}
            for path in shards:
                out.update(load_file(str(path)))
            return out

        def torch_load() -> dict[str, Any]:
            out: dict[str, Any] = {}
            for path in pickles:
                out.update(torch.load(path))
            return out

        times: dict[str, list[tuple[float, float]]] = {}
        variants: dict[str, Callable[[], tuple[float, float]]] = {
            "raw": lambda: (t := _timed(lambda: raw_read(shards)), t),
            "fresh": lambda: (t := _timed(lambda: raw_read_fresh(shards)), t),
            "thaw": lambda: _timed_load(thaw),
            "mmap": lambda: _timed_load(lambda: mmap_load(bundle_dir, manifest)),
            "safetensors": lambda: _timed_load(safetensors_seq),
            "torch.load": lambda: _timed_load(torch_load),
            "verify": lambda: (t := _timed(lambda: source.fetch(manifest, lambda n: None)), t),
            "stamped": lambda: (t := _timed(lambda: stamped.fetch(manifest, lambda n: None)), t),
        }
        for index in range(rounds):
            names = list(variants)
            for name in names if index % 2 == 0 else names[::-1]:
                times.setdefault(name, []).append(variants[name]())

        def per_round(a: str, b: str, i: int = 1) -> float:
            """Median over rounds of b/a: how many times faster `a` is than `b`."""
            return median([y[i] / x[i] for x, y in zip(times[a], times[b], strict=True)])

        raw_s = median([t[1] for t in times["raw"]])
        fresh_s = median([t[1] for t in times["fresh"]])
        thaw_loaded = median([t[0] for t in times["thaw"]])
        thaw_forward = median([t[1] for t in times["thaw"]])
        mmap_loaded = median([t[0] for t in times["mmap"]])
        mmap_forward = median([t[1] for t in times["mmap"]])
        loaded_vs_raw = median(
            [r[1] / t[0] for r, t in zip(times["raw"], times["thaw"], strict=True)]
        )
        vs_raw = per_round("thaw", "raw")  # raw time / thaw time = thaw bandwidth / raw
        vs_torch = per_round("thaw", "torch.load")
        verify_s = median([t[1] for t in times["verify"]])
        spread = [t[0] for t in times["thaw"]]
        gib = f"{nbytes / 2**30:.2f} GiB, {SHARDS} shards"
        rows = [
            Row(
                f"load {gib}: raw sequential read (page cache)",
                fmt_bw(nbytes / raw_s),
                verdict="info",
            ),
            Row(
                f"load {gib}: raw read into fresh memory (a new buffer per file: "
                "the floor of any load that owns its bytes)",
                f"{fmt_bw(nbytes / fresh_s)} ({fmt_s(fresh_s)})",
                f"{fmt_bw(nbytes / raw_s)} raw read",
                fmt_x(per_round("fresh", "raw")),
            ),
            Row(
                f"load {gib}: to LOADED (every tensor copied into process memory), bandwidth",
                f"{fmt_bw(nbytes / thaw_loaded)} ({fmt_s(thaw_loaded)}; rounds "
                f"{fmt_s(min(spread))}-{fmt_s(max(spread))})",
                f"{fmt_bw(nbytes / raw_s)} raw read ({fmt_s(raw_s)})",
                fmt_x(loaded_vs_raw),
                f">= {RAW_TARGET}x raw",
                verdict(loaded_vs_raw >= RAW_TARGET),
            ),
            Row(
                f"load {gib}: to LOADED vs raw read into fresh memory",
                fmt_s(thaw_loaded),
                f"{fmt_s(fresh_s)} fresh read",
                fmt_x(
                    median(
                        [f[1] / t[0] for f, t in zip(times["fresh"], times["thaw"], strict=True)]
                    )
                ),
            ),
            Row(
                f"load {gib}: to first forward (every tensor summed), bandwidth",
                f"{fmt_bw(nbytes / thaw_forward)} ({fmt_s(thaw_forward)})",
                f"{fmt_bw(nbytes / raw_s)} raw read ({fmt_s(raw_s)})",
                fmt_x(vs_raw),
                f">= {RAW_TARGET}x raw",
                verdict(vs_raw >= RAW_TARGET),
            ),
            Row(
                f"load {gib}: to LOADED; to first forward — Thaw vs mmap + populate (previous; "
                "tensors view the files)",
                f"{fmt_s(thaw_loaded)}; {fmt_s(thaw_forward)}",
                f"{fmt_s(mmap_loaded)}; {fmt_s(mmap_forward)} mmap",
                f"{fmt_x(per_round('thaw', 'mmap', 0))}; {fmt_x(per_round('thaw', 'mmap'))}",
            ),
            Row(
                f"load {gib}: to first forward vs `torch.load` (speed-up)",
                fmt_s(thaw_forward),
                f"{fmt_s(median([t[1] for t in times['torch.load']]))} torch.load",
                fmt_x(vs_torch),
                f">= {TORCH_LOAD_TARGET}x faster",
                verdict(vs_torch >= TORCH_LOAD_TARGET),
            ),
            Row(
                f"load {gib}: to first forward vs `safetensors.torch.load_file`, shard by shard",
                fmt_s(thaw_forward),
                f"{fmt_s(median([t[1] for t in times['safetensors']]))} load_file",
                fmt_x(per_round("thaw", "safetensors")),
            ),
            Row(
                f"fetch {gib}: sha256 verify (local source), bandwidth",
                fmt_bw(nbytes / verify_s),
                f"{fmt_bw(nbytes / raw_s)} raw read",
                fmt_x(per_round("verify", "raw")),
            ),
            Row(
                f"fetch {gib} again, files unchanged since verified on this node (stat stamps)",
                fmt_s(median([t[1] for t in times["stamped"]])),
                f"{fmt_s(verify_s)} sha256 verify",
                fmt_x(per_round("stamped", "verify")) + " faster",
            ),
        ]
        rows += _fresh_process_rows(bundle_dir, nbytes, 2 if quick else 3)
        rows += _cuda_rows(nbytes, rounds)
        return rows


def _timed(work: Callable[[], object]) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


if __name__ == "__main__":
    if len(sys.argv) >= 4 and sys.argv[1] == "--child":
        dtype_arg = sys.argv[4] if len(sys.argv) > 4 else ""
        print(json.dumps(child(sys.argv[2], Path(sys.argv[3]), dtype_arg)))
    else:
        from bench.common import table_main

        table_main(run, __doc__)
