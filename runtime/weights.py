"""Tensors in and out of memory: the only home of torch and safetensors.

Everything here imports torch lazily, so importing `runtime` (and serving
/healthz) never pays for it.
"""

from __future__ import annotations

import ctypes
import gc
import importlib.util
import os
import struct
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime.bundles import Manifest
from runtime.errors import BundleError

if TYPE_CHECKING:
    import torch

# A safetensors header is JSON; real ones are kilobytes. A header length claim
# beyond this is refused before anything is allocated for it.
MAX_HEADER_BYTES = 64 * 1024 * 1024
_RTLD_NOW = 0x2
_RTLD_GLOBAL = 0x100

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
    """`THAW_DEVICE` if set, else `cuda` when available, else `cpu`."""
    preload_framework()
    if requested:
        return requested
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


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


def _load_shard(path: Path, device: str, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    check_header(path)
    try:
        tensors = load_file(str(path), device=device)
    except Exception as exc:  # safetensors raises its own SafetensorError and OSError
        raise BundleError(f"{path.name}: not a readable safetensors file ({exc})") from exc
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
