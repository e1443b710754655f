"""Load throughput of a 1 GB synthetic bundle (4 shards), page cache warm.

Variants, measured in alternating order each round (medians over rounds):

- raw read: the shard files read sequentially into one reused buffer, like
  `cat` — the bandwidth of getting these bytes out of the page cache at all;
- Thaw: `runtime.models.weights.load_weights` (the LOADED phase), then every tensor
  summed once (the first forward touches every weight);
- `safetensors.torch.load_file` over the shards, one after another;
- `torch.load` of the same tensors saved with `torch.save` (4 files);
- fetch: the local source's sha256 verification of the same files, which is
  its own phase (FETCHED) before LOADED; and the same fetch once the files
  were verified on this node and are unchanged since (stat stamps, no hash).

With CUDA, pageable vs pinned host->device copies of the same gigabyte.
"""

from __future__ import annotations

import gc
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import Row, fmt_bw, fmt_s, fmt_x, median, verdict

SHARDS = 4
TENSORS_PER_SHARD = 16
FLOATS_PER_TENSOR = 4 * 1024 * 1024  # 16 MiB of float32; 4 x 16 x 16 MiB = 1 GiB
RAW_TARGET = 0.9
TORCH_LOAD_TARGET = 3.0
_READ_CHUNK = 16 * 1024 * 1024


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
            "thaw": lambda: _timed_load(thaw),
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
        thaw_loaded = median([t[0] for t in times["thaw"]])
        thaw_forward = median([t[1] for t in times["thaw"]])
        vs_raw = per_round("thaw", "raw")  # raw time / thaw time = thaw bandwidth / raw
        vs_torch = per_round("thaw", "torch.load")
        verify_s = median([t[1] for t in times["verify"]])
        gib = f"{nbytes / 2**30:.2f} GiB, {SHARDS} shards"
        rows = [
            Row(
                f"load {gib}: raw sequential read (page cache)",
                fmt_bw(nbytes / raw_s),
                verdict="info",
            ),
            Row(
                f"load {gib}: to LOADED (safetensors mmap: pages map on first touch)",
                f"{fmt_s(thaw_loaded)}",
                f"{fmt_s(raw_s)} raw read",
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
        rows += _cuda_rows(nbytes, rounds)
        return rows


def _timed(work: Callable[[], object]) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


if __name__ == "__main__":
    from bench.common import render

    print(render(run(quick=True)))
