"""A bundle's tensors opened for its builder, verified, and detached from its files.

`open_weights` reads every tensor of a bundle's shards into memory the process
owns (cpu.py), maps them on a read-only filesystem (mapped.py), stages them to a
CUDA device (staging.py) or hands them to safetensors for another device
(device.py), checking the chunks the fetch left unverified as it reads them;
`Loaded` holds them until the builder has taken them and `detach()` lets go of
the files.
"""

from __future__ import annotations

import logging
import os
import threading
import traceback
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from runtime.bundles.chunks import Landed, Pending, verify_chunks
from runtime.bundles.manifest import BundleFile, Manifest
from runtime.bundles.stamps import Stamp, shard_stamps
from runtime.errors import BundleError
from runtime.models.weights.cpu import CHUNK_BYTES, Shard, read_shards, wrap_landed
from runtime.models.weights.device import load_mapped

if TYPE_CHECKING:
    import torch

    from runtime.bundles.chunks import Chunked
    from runtime.models.weights import mapped


log = logging.getLogger("thaw.cache")

_DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}


def verified_stamps(bundle_dir: Path, manifest: Manifest) -> dict[str, Stamp]:
    """The stat stamps of a bundle's shards, taken as its fetch returns (the hash
    vouched for these files; `verify_files` refuses one that changed while hashed)."""
    return shard_stamps(bundle_dir, [f.path for f in manifest.files])


class Loaded:
    """A load's tensors, and what their build leaves to do.

    The loader hands `take()` to the builder and calls `detach()` once the
    builder has returned and the loader holds no tensor of its own: mapped
    shards then copy out what the model still views (mapped.py) and every
    shard must still be what it was when opened. `close()` gives up, on a
    failed load; it never waits for a `detach` under way (an abandoned build's
    thread may still be in one), which closes the shards as it ends.
    """

    def __init__(
        self,
        tensors: dict[str, torch.Tensor],
        shards: list[Shard] | None = None,
        regions: list[mapped.Region] | None = None,
        *,
        how: str = "copied",
    ) -> None:
        """`how` the tensors were read: "copied" (cpu.py), "mapped" (mapped.py) or
        "device" (device.py)."""
        self._tensors = tensors
        self._shards = shards or []
        self._regions = regions or []
        self._lock = threading.Lock()
        self.how = how
        # Bytes `detach` copied out of mapped files (whole pages).
        self.copied_out = 0

    def take(self) -> dict[str, torch.Tensor]:
        """The tensors, handed over: this object keeps no reference to them."""
        tensors, self._tensors = self._tensors, {}
        return tensors

    def detach(self) -> int:
        """Copy what the model views out of mapped shards; check every shard unchanged.
        The bytes copied (0 for a load that copied every byte as it read)."""
        with self._lock:
            try:
                self.copied_out = sum(region.detach() for region in self._regions)
                for shard in self._shards:
                    shard.check_unchanged()
                return self.copied_out
            finally:
                self._close()

    def close(self) -> None:
        if self._lock.acquire(blocking=False):
            try:
                self._close()
            finally:
                self._lock.release()

    def _close(self) -> None:
        shards, self._shards, self._regions, self._tensors = self._shards, [], [], {}
        for shard in shards:
            shard.close()


def load_weights(
    bundle_dir: Path,
    manifest: Manifest,
    device: str,
    verified: Mapping[str, Stamp] | None = None,
    *,
    chunk_bytes: int = CHUNK_BYTES,
    on_progress: Callable[[int], None] | None = None,
    pending: Pending | None = None,
) -> dict[str, torch.Tensor]:
    """Every tensor of the bundle in memory of this process (or the device), viewing
    no file: `open_weights`, detached at once."""
    loaded = open_weights(
        bundle_dir,
        manifest,
        device,
        verified,
        chunk_bytes=chunk_bytes,
        on_progress=on_progress,
        pending=pending,
    )
    tensors = loaded.take()
    loaded.detach()
    return tensors


def open_weights(
    bundle_dir: Path,
    manifest: Manifest,
    device: str,
    verified: Mapping[str, Stamp] | None = None,
    *,
    chunk_bytes: int = CHUNK_BYTES,
    on_progress: Callable[[int], None] | None = None,
    pending: Pending | None = None,
) -> Loaded:
    """Every tensor of every safetensors shard, for a builder (see `Loaded`).

    On the CPU every byte is copied out of the files (`cpu.read_shards`), so once
    loaded, nothing the bundle's files undergo reaches the model; where every
    shard is on a read-only filesystem they are mapped instead, until `detach`
    (mapped.py). Each shard's size must still match the manifest when opened,
    its stat the one it had when verified (`verified`, from `verified_stamps`: a
    shard rewritten in place with the same size, or replaced, since its hash
    matched), and its stat (inode, size, mtime, ctime, and what its path names)
    must be the same after the copy (or the detach) as before it: a shard
    changed in between fails the load with `IntegrityError`, and the retry
    verifies it again. `manifest.load_dtype` converts floating tensors once here,
    never per request. `chunk_bytes` is the size of one CPU read (tests make it
    small, to change a file mid-read). `on_progress(n)` is told the bytes read
    as they are (`thaw invoke`'s bar).

    The shards in `pending` (those the fetch left unhashed: runtime/bundles/chunks.py)
    are checked chunk by chunk against the manifest's digests as they are read, from
    the memory that keeps them (or from the mapping the tensors view), before this
    returns: no tensor leaves here unverified, and a chunk that does not match fails
    the load with `IntegrityError` naming the file and the chunk. Once they all
    matched, `pending.verified` records their stamps. Shards the fetch landed in
    memory already (`pending.landing`: runtime/bundles/sources/landing.py), read and
    checked while the framework imported, become the tensors as they are, once every
    chunk of them matched; a load that does not copy lets go of them.
    """
    landing = pending.landing if pending is not None else None
    if pending is not None:
        pending.landing = None  # this load's now
    try:
        return _open(
            bundle_dir, manifest, device, verified, chunk_bytes, on_progress, pending, landing
        )
    finally:
        if landing is not None:
            landing.discard()  # what it did not take (another device, a mapped load, a failure)


def _open(
    bundle_dir: Path,
    manifest: Manifest,
    device: str,
    verified: Mapping[str, Stamp] | None,
    chunk_bytes: int,
    on_progress: Callable[[int], None] | None,
    pending: Pending | None,
    landing: Landed | None,
) -> Loaded:
    expected = verified or {}
    checks = pending.files if pending is not None else {}
    import torch

    dtype_name = manifest.load_dtype  # thaw.dtype (format 2) or config.dtype (format 1)
    dtype: torch.dtype | None = None
    if dtype_name is not None:
        if dtype_name not in _DTYPES:
            raise BundleError(f"dtype {dtype_name!r} is not one of {sorted(_DTYPES)}")
        dtype = getattr(torch, _DTYPES[dtype_name])
    files = [f for f in manifest.files if f.path.endswith(".safetensors")]
    weights: dict[str, torch.Tensor] = {}
    if not files:
        return Loaded(weights)
    if device.startswith("cpu"):
        from runtime.models.weights import mapped  # ctypes: not on the control plane's import

        shards: list[Shard] = []
        try:
            for f in files:
                shards.append(Shard(bundle_dir / f.path, f.path, f.size, expected.get(f.path)))
            opened = {s.rel: s.opened for s in shards}
            if mapped.supported() and all(mapped.immutable(s.fd) for s in shards):
                try:
                    loaded = _mapped(shards, dtype, on_progress, checks)
                except OSError as exc:  # refused (a sandbox's filter, no address space)
                    log.warning("mapping weights failed (%s); copying them instead", exc)
                else:
                    if pending is not None:
                        pending.verified(opened)
                    return loaded
            weights = _copied(shards, dtype, chunk_bytes, on_progress, checks, landing)
            for shard in shards:
                shard.check_unchanged()
            if pending is not None:
                pending.verified(opened)
            return Loaded(weights)
        finally:
            for shard in shards:
                shard.close()
    if device.startswith("cuda"):
        return _staged(bundle_dir, files, device, dtype, expected, checks, pending, on_progress)
    for f in files:
        # Read twice on this path (safetensors reads the file again for the device).
        if f.path in checks:
            verify_chunks(bundle_dir / f.path, checks[f.path])
    if pending is not None and checks:
        pending.verified({rel: os.stat(bundle_dir / rel, follow_symlinks=False) for rel in checks})
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
    return Loaded(weights, how="device")


def _copied(
    shards: list[Shard],
    dtype: torch.dtype | None,
    chunk_bytes: int,
    on_progress: Callable[[int], None] | None,
    checks: Mapping[str, Chunked],
    landing: Landed | None,
) -> dict[str, torch.Tensor]:
    """Every tensor in memory of this process: the landed shards' as views of the memory
    they landed in (once all of it matched), the others read now (`read_shards`)."""
    landed: dict[str, dict[str, torch.Tensor]] = {}
    weights: dict[str, torch.Tensor] = {}
    try:
        if landing is not None:
            landing.wait(on_progress)
            for shard in shards:
                part = landing.take(shard.rel)
                if part is not None:
                    try:
                        landed[shard.rel] = wrap_landed(shard, part, dtype)
                    finally:
                        part.close()
        rest = [s for s in shards if s.rel not in landed]
        if rest:
            weights = read_shards(rest, dtype, chunk_bytes, on_progress, checks)
        for part in landed.values():
            duplicate = weights.keys() & part.keys()
            if duplicate:
                raise BundleError(f"tensor {sorted(duplicate)[0]!r} appears in two shards")
            weights.update(part)
        return weights
    except BaseException as exc:
        # Nothing read stays (the error's frames would hold it).
        landed.clear()
        weights = {}
        traceback.clear_frames(exc.__traceback__)
        raise
    finally:
        landed.clear()


def _staged(
    bundle_dir: Path,
    files: list[BundleFile],
    device: str,
    dtype: torch.dtype | None,
    expected: Mapping[str, Stamp],
    checks: Mapping[str, Chunked],
    pending: Pending | None,
    on_progress: Callable[[int], None] | None,
) -> Loaded:
    """A CUDA load: every shard through the pinned staging pool (staging.py), each
    chunk in `checks` checked in its slot; every shard unchanged after it."""
    from runtime.models.weights.staging import read_to_device

    shards: list[Shard] = []
    try:
        for f in files:
            shards.append(Shard(bundle_dir / f.path, f.path, f.size, expected.get(f.path)))
        weights = read_to_device(shards, device, dtype, checks, on_progress)
        for shard in shards:
            shard.check_unchanged()
        if pending is not None:
            pending.verified({s.rel: s.opened for s in shards})
        return Loaded(weights, how="device")
    finally:
        for shard in shards:
            shard.close()


def _mapped(
    shards: list[Shard],
    dtype: torch.dtype | None,
    on_progress: Callable[[int], None] | None,
    checks: Mapping[str, Chunked],
) -> Loaded:
    """Every shard mapped (mapped.py); the shards stay open until the load is detached from them.
    A shard in `checks` has its chunks checked from the mapping before any view of it."""
    from runtime.models.weights import mapped

    weights: dict[str, torch.Tensor] = {}
    regions: list[mapped.Region] = []
    for shard in shards:
        part, region = mapped.map_shard(shard, dtype, checks.get(shard.rel))
        regions.append(region)
        duplicate = weights.keys() & part.keys()
        if duplicate:
            raise BundleError(f"tensor {sorted(duplicate)[0]!r} appears in two shards")
        weights.update(part)
        if on_progress is not None:
            on_progress(shard.opened.st_size)
    # The shards now belong to the Loaded (the caller's `finally` closes what is
    # left in its list), which closes them once detached.
    opened = list(shards)
    shards.clear()
    return Loaded(weights, opened, regions, how="mapped")
