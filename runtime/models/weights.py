"""Tensors in and out of memory: the only home of torch and safetensors.

Everything here imports torch lazily, so importing `runtime` (and serving
/healthz) never pays for it.
"""

from __future__ import annotations

import functools
import gc
import importlib.util
import os
import struct
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime.bundles.manifest import Manifest
from runtime.errors import BundleError

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

# A safetensors header is JSON; real ones are kilobytes. A header length claim
# beyond this is refused before anything is allocated for it.
MAX_HEADER_BYTES = 64 * 1024 * 1024
_RTLD_NOW = 0x2
_RTLD_GLOBAL = 0x100
_MADV_WILLNEED = 3
_MADV_POPULATE_READ = 22  # Linux 5.14+
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

_DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}


def preload_framework() -> None:
    """dlopen torch's native libraries through a ctypes call, which releases the GIL.

    `import torch` spends most of its time in the static initialisers of
    libtorch_cpu (and libtorch_cuda), run by dlopen while the importing thread
    holds the GIL: the event loop, and every deadline timer on it, freezes for
    that long (0.3-0.8 s measured here). Loading those libraries first through
    a foreign call lets the loop run meanwhile; the import then finds them
    loaded. Best effort: any failure just leaves the work to `import torch`.
    """
    if sys.platform != "linux" or "torch" in sys.modules:
        return
    try:
        import ctypes  # here, not at module level: the control interface never needs it

        spec = importlib.util.find_spec("torch")
        if spec is None or spec.origin is None:
            return
        lib_dir = Path(spec.origin).parent / "lib"
        libc = ctypes.CDLL(None)
        libc.dlopen.restype = ctypes.c_void_p
        libc.dlopen.argtypes = [ctypes.c_char_p, ctypes.c_int]
        for name in ("libtorch_cpu.so", "libtorch_cuda.so"):
            path = lib_dir / name
            if path.exists():
                libc.dlopen(str(path).encode(), _RTLD_NOW | _RTLD_GLOBAL)
    except (OSError, AttributeError, ValueError, ImportError):
        return


def resolve_device(requested: str) -> str:
    """`THAW_DEVICE` if set, else `cuda` when available, else `cpu`.

    Imports the framework either way (the cache runs this alongside the first
    fetch, so the import overlaps it instead of following it), then freezes
    what the import made; see `_freeze_framework`.
    """
    preload_framework()
    import safetensors.torch  # noqa: F401  (its first import is part of the same cost)
    import torch

    _freeze_framework()
    if requested:
        return requested
    return "cuda" if torch.cuda.is_available() else "cpu"


_frozen = False


def _freeze_framework() -> None:
    """Move every object alive now (torch's modules, the runtime) out of the GC's view.

    `release()` runs a full collection at each unload and eviction, and with
    torch imported one walks some 10^5 objects holding the GIL: ~0.1 s during
    which the event loop, and every request on it, stands still. These
    objects live as long as the process, so the collector gains nothing by
    walking them (gc.freeze, as CPython documents it). Garbage is collected
    first, so none is frozen; models loaded later are collected as before.
    """
    global _frozen
    if not _frozen:
        _frozen = True
        gc.collect()
        gc.freeze()


def check_header(path: Path) -> None:
    """Refuse a safetensors file whose header length is absurd or past the file end."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        prefix = handle.read(8)
    if len(prefix) < 8:
        raise BundleError(f"{path.name}: too short to be safetensors")
    (header_len,) = struct.unpack("<Q", prefix)
    if header_len > MAX_HEADER_BYTES:
        raise BundleError(
            f"{path.name}: safetensors header claims {header_len} bytes (limit {MAX_HEADER_BYTES})"
        )
    if 8 + header_len > size:
        raise BundleError(f"{path.name}: safetensors header runs past the end of the file")


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's madvise, or None off Linux. Foreign calls release the GIL."""
    if sys.platform != "linux":
        return None
    import ctypes

    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def _spans(tensors: dict[str, torch.Tensor]) -> list[tuple[int, int]]:
    """Page-aligned [start, end) address ranges of the tensors' storages, merged."""
    raw = sorted(
        (s.data_ptr(), s.data_ptr() + s.nbytes())
        for s in {id(t.untyped_storage()): t.untyped_storage() for t in tensors.values()}.values()
        if s.nbytes() > 0
    )
    merged: list[tuple[int, int]] = []
    for start, end in raw:
        start -= start % _PAGE_BYTES
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def populate(tensors: dict[str, torch.Tensor]) -> None:
    """Map every page of these (mmap-backed, CPU) tensors now, in the load phase.

    safetensors maps the file and hands out tensors that view the mapping, so
    loading takes milliseconds and each page is faulted in later, 4-64 KiB at a
    time, by whatever reads it first: the warm-up or a request, in the middle of
    a forward pass, from disk if the page cache dropped the file. One
    MADV_POPULATE_READ per contiguous range has the kernel map (and read, in
    order) all of it in one pass, about twice as fast as the faults, so LOADED
    means resident. Best effort: older kernels refuse it (EINVAL) and get
    MADV_WILLNEED (read-ahead only); other platforms get nothing.
    """
    madvise = _madvise()
    if madvise is None:
        return
    for start, end in _spans(tensors):
        if madvise(start, end - start, _MADV_POPULATE_READ) != 0:
            madvise(start, end - start, _MADV_WILLNEED)


def _load_shard(path: Path, device: str, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    check_header(path)
    try:
        tensors = load_file(str(path), device=device)
    except Exception as exc:  # safetensors raises its own SafetensorError and OSError
        raise BundleError(f"{path.name}: not a readable safetensors file ({exc})") from exc
    if device.startswith("cpu"):
        populate(tensors)
    if dtype is not None:
        tensors = {
            k: (v.to(dtype) if v.is_floating_point() and v.dtype != dtype else v)
            for k, v in tensors.items()
        }
    return tensors


def load_weights(bundle_dir: Path, manifest: Manifest, device: str) -> dict[str, torch.Tensor]:
    """Every tensor of every safetensors shard, shards read in parallel.

    `config["dtype"]` converts floating tensors once here, never per request.
    """
    import torch

    dtype_name = manifest.config.get("dtype")
    dtype: torch.dtype | None = None
    if dtype_name is not None:
        if dtype_name not in _DTYPES:
            raise BundleError(f"config.dtype {dtype_name!r} is not one of {sorted(_DTYPES)}")
        dtype = getattr(torch, _DTYPES[dtype_name])
    shards = [bundle_dir / f.path for f in manifest.files if f.path.endswith(".safetensors")]
    weights: dict[str, torch.Tensor] = {}
    if not shards:
        return weights
    workers = max(1, min(len(shards), os.cpu_count() or 1, 8))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for part in pool.map(lambda p: _load_shard(p, device, dtype), shards):
            duplicate = weights.keys() & part.keys()
            if duplicate:
                raise BundleError(f"tensor {sorted(duplicate)[0]!r} appears in two shards")
            weights.update(part)
    return weights


def release(device: str) -> None:
    """Return freed memory: collect cycles and empty the CUDA caching allocator."""
    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


def device_memory_free(device: str) -> int | None:
    """Free bytes on a CUDA device, or None for host memory."""
    if not device.startswith("cuda"):
        return None
    import torch

    free, _total = torch.cuda.mem_get_info(torch.device(device))
    return int(free)


def host_memory_limit() -> int:
    """The container's memory limit (cgroup v2/v1), else the host's total memory."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:
            return int(text)
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 1024**3


def inference_mode() -> Any:
    """A context manager that disables autograd for handler runs."""
    import torch

    return torch.inference_mode()
