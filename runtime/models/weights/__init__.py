"""Tensors in and out of memory: the only home of torch and safetensors.

This package owns how a bundle's shards become tensors. On the CPU it parses
the safetensors format itself (format.py) and copies every byte, with pread,
into memory the process owns (cpu.py): nothing stays mapped, so once a model is
loaded no change to the bundle's files (a rewrite, a truncation, another
version copied over it) can reach its answers or crash the process, and a
shard that changes while it is read fails the load (`load_weights`). Other
devices load through safetensors, which copies to the device (device.py).
Importing the framework, resolving the device and returning memory are
framework.py's; what the C allocator keeps of freed host memory is host.py's.

Everything here imports torch lazily, so importing `runtime` (and serving
/healthz) never pays for it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from runtime.bundles.manifest import Manifest
from runtime.bundles.stamps import Stamp, stamp_of
from runtime.errors import BundleError
from runtime.models.weights.cpu import CHUNK_BYTES, Shard, read_shards
from runtime.models.weights.device import load_mapped
from runtime.models.weights.format import MAX_HEADER_BYTES, check_header
from runtime.models.weights.framework import (
    device_memory_free,
    host_memory_limit,
    inference_mode,
    preload_framework,
    release,
    resolve_device,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "MAX_HEADER_BYTES",
    "check_header",
    "device_memory_free",
    "host_memory_limit",
    "inference_mode",
    "load_weights",
    "preload_framework",
    "release",
    "resolve_device",
    "verified_stamps",
]

_DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}

# safetensors dtype codes -> torch dtype names (those safetensors.torch loads;
# a name missing from this torch build is refused as unsupported).


def verified_stamps(bundle_dir: Path, manifest: Manifest) -> dict[str, Stamp]:
    """The stat stamps of a bundle's shards, taken as its fetch returns (the hash
    vouched for these files; `verify_files` refuses one that changed while hashed)."""
    stamps: dict[str, Stamp] = {}
    for f in manifest.files:
        if f.path.endswith(".safetensors"):
            with contextlib.suppress(FileNotFoundError):  # the load says so, naming it
                stamps[f.path] = stamp_of(os.stat(bundle_dir / f.path, follow_symlinks=False))
    return stamps


def load_weights(
    bundle_dir: Path,
    manifest: Manifest,
    device: str,
    verified: Mapping[str, Stamp] | None = None,
    *,
    chunk_bytes: int = CHUNK_BYTES,
    on_progress: Callable[[int], None] | None = None,
) -> dict[str, torch.Tensor]:
    """Every tensor of every safetensors shard, in memory of this process (or the device).

    On the CPU every byte is copied out of the files (`cpu.read_shards`), so once
    loaded, nothing the bundle's files undergo reaches the model. Each shard's
    size must still match the manifest when opened, its stat the one it had
    when verified (`verified`, from `verified_stamps`: a shard rewritten in
    place with the same size, or replaced, since its hash matched), and its
    stat (inode, size, mtime, ctime, and what its path names) must be the same
    after the copy as before it: a shard changed in between fails the load with
    `IntegrityError`, and the retry verifies it again. `config["dtype"]`
    converts floating tensors once here, never per request. `chunk_bytes` is
    the size of one CPU read (tests make it small, to change a file mid-read).
    `on_progress(n)` is told the bytes read as they are (`thaw invoke`'s bar).
    """
    expected = verified or {}
    import torch

    dtype_name = manifest.config.get("dtype")
    dtype: torch.dtype | None = None
    if dtype_name is not None:
        if dtype_name not in _DTYPES:
            raise BundleError(f"config.dtype {dtype_name!r} is not one of {sorted(_DTYPES)}")
        dtype = getattr(torch, _DTYPES[dtype_name])
    files = [f for f in manifest.files if f.path.endswith(".safetensors")]
    weights: dict[str, torch.Tensor] = {}
    if not files:
        return weights
    if device.startswith("cpu"):
        shards: list[Shard] = []
        try:
            for f in files:
                shards.append(Shard(bundle_dir / f.path, f.path, f.size, expected.get(f.path)))
            weights = read_shards(shards, dtype, chunk_bytes, on_progress)
            for shard in shards:
                shard.check_unchanged()
            return weights
        finally:
            for shard in shards:
                shard.close()
    workers = max(1, min(len(files), os.cpu_count() or 1, 8))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        parts = pool.map(
            lambda f: load_mapped(
                bundle_dir / f.path, f.path, f.size, device, dtype, expected.get(f.path)
            ),
            files,
        )
        for f, part in zip(files, parts, strict=True):
            duplicate = weights.keys() & part.keys()
            if duplicate:
                raise BundleError(f"tensor {sorted(duplicate)[0]!r} appears in two shards")
            weights.update(part)
            if on_progress is not None:  # a device load is told a shard at a time
                on_progress(f.size)
    return weights
