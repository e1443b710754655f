"""Tensors in and out of memory: the only home of torch and safetensors.

It owns how a bundle's shards become tensors. On the CPU it parses the
safetensors format itself and copies every byte, with pread, into memory the
process owns: nothing stays mapped, so once a model is loaded no change to the
bundle's files (a rewrite, a truncation, another version copied over it) can
reach its answers or crash the process, and a shard that changes while it is
read fails the load (`load_weights`). Other devices load through safetensors,
which copies to the device.

Everything here imports torch lazily, so importing `runtime` (and serving
/healthz) never pays for it.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib.util
import os
import queue
import stat
import struct
import sys
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from runtime.bundles.manifest import Manifest
from runtime.bundles.stamps import Stamp, stamp_of
from runtime.errors import BundleError, IntegrityError, LoadFailed

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

# A safetensors header is JSON; real ones are kilobytes. A header length claim
# beyond this is refused before anything is allocated for it.
MAX_HEADER_BYTES = 64 * 1024 * 1024
_RTLD_NOW = 0x2
_RTLD_GLOBAL = 0x100
# One read task: large enough that syscalls and thread hand-offs vanish in the
# copy, small enough that a big tensor spreads over every read thread.
_CHUNK_BYTES = 16 * 1024 * 1024
_MADV_POPULATE_WRITE = 23  # Linux 5.14+
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

# safetensors dtype codes -> torch dtype names (those safetensors.torch loads;
# a name missing from this torch build is refused as unsupported).
_SAFETENSORS_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U64": "uint64",
    "U32": "uint32",
    "U16": "uint16",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2": "float8_e5m2",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "C64": "complex64",
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


def _import_framework() -> None:
    """Import torch and safetensors' torch support, or fail the load saying which is missing.

    torch is an extra (`thaw[torch]`): the control plane and model-less
    handlers run without it, and the first load is where its absence shows,
    as one `load-failed` that names the package (every later load of the
    instance fails the same way, as the device is resolved once).
    """
    try:
        import safetensors.torch  # noqa: F401  (its first import is part of the same cost)
        import torch  # noqa: F401
    except ImportError as exc:
        missing = exc.name or "torch"
        raise LoadFailed(
            f"loading a model needs the Python package {missing!r}, which is not installed: "
            "pip install 'thaw[torch]' (or a torch build for this machine first)",
            missing=missing,
        ) from exc


def resolve_device(requested: str) -> str:
    """`THAW_DEVICE` if set, else `cuda` when available, else `cpu`.

    Imports the framework either way (the cache runs this alongside the first
    fetch, so the import overlaps it instead of following it); see
    `_import_frozen` for how.
    """
    _import_frozen()
    import torch

    if requested:
        return requested
    return "cuda" if torch.cuda.is_available() else "cpu"


_frozen = False


def _import_frozen() -> None:
    """Import the framework with the cyclic GC paused, then freeze what it made.

    `import torch` creates some 2.5 * 10^5 GC-tracked objects, and with the
    collector running, every 700 net allocations trigger a collection (353
    during one import) that walks the young ones again: 0.2-0.3 s of a
    1.4-1.9 s import here, and a full collection after it another 0.08 s.
    Those objects live as long as the process, so the collector gains nothing
    by walking them, then or ever: they go to the permanent generation
    (gc.freeze, the pattern CPython documents for long-lived start-up state),
    and `release()`'s collection at each unload and eviction stays short. The
    import leaves almost no garbage to freeze with them (a full collection
    right after it found 26 objects); cyclic garbage other threads make in
    that second is frozen too, once per process, where collecting first would
    cost every cold start 0.08 s. A failed import is not tried this way
    again: the next load reports the same missing package.
    """
    global _frozen
    if _frozen:
        _import_framework()
        return
    enabled = gc.isenabled()
    gc.disable()
    try:
        preload_framework()
        _import_framework()
    finally:
        gc.freeze()
        _frozen = True
        if enabled:
            gc.enable()


def _header_length(prefix: bytes, size: int, name: str) -> int:
    """The header length a shard's first 8 bytes claim, refused when absurd or past its end."""
    if len(prefix) < 8:
        raise BundleError(f"{name}: too short to be safetensors")
    (header_len,) = struct.unpack("<Q", prefix)
    if header_len > MAX_HEADER_BYTES:
        raise BundleError(
            f"{name}: safetensors header claims {header_len} bytes (limit {MAX_HEADER_BYTES})"
        )
    if 8 + header_len > size:
        raise BundleError(f"{name}: safetensors header runs past the end of the file")
    return int(header_len)


def check_header(path: Path) -> None:
    """Refuse a safetensors file whose header length is absurd or past the file end."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        _header_length(handle.read(8), size, path.name)


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


def _prefault(address: int, nbytes: int) -> None:
    """Map fresh memory for writing in one call, before a read fills it.

    Filling memory the process never touched costs a page fault per page, and
    those faults, not the copy, are most of a copying load. One
    MADV_POPULATE_WRITE per read has the kernel map the range in a loop instead
    of a trap per page: first loads of 1 GiB in fresh processes took 0.38-0.98 s
    against 0.64-1.09 s without it on this machine (median 0.69 vs 0.87 s).
    Best effort: older kernels refuse it (EINVAL) and the read faults as before.
    """
    madvise = _madvise()
    if madvise is None or nbytes <= 0:
        return
    start = address - address % _PAGE_BYTES
    madvise(start, address + nbytes - start, _MADV_POPULATE_WRITE)


def _torch_dtype(code: str) -> torch.dtype | None:
    import torch

    name = _SAFETENSORS_DTYPES.get(code)
    dtype = getattr(torch, name, None) if name is not None else None
    return dtype if isinstance(dtype, torch.dtype) else None


@dataclass(frozen=True)
class _TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # of its first byte in the file
    nbytes: int


def _parse_header(raw: bytes, data_bytes: int, data_start: int, rel: str) -> list[_TensorSpec]:
    """The tensors a safetensors header describes, checked as safetensors checks them.

    Every tensor's byte range must match its dtype and shape, and the ranges
    must tile the data section exactly (no hole, overlap or trailing byte), so
    nothing a header claims is allocated beyond the file's own size.
    """

    def bad(why: str) -> BundleError:
        return BundleError(f"{rel}: not a readable safetensors file ({why})")

    try:
        header = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad(f"header is not JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    specs: list[tuple[int, int, str, torch.dtype, tuple[int, ...]]] = []
    for name, info in header.items():
        if name == "__metadata__":
            if not isinstance(info, dict):
                raise bad("__metadata__ is not an object")
            continue
        if not isinstance(info, dict):
            raise bad(f"tensor {name!r} is not an object")
        code, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        dtype = _torch_dtype(code) if isinstance(code, str) else None
        if dtype is None:
            raise bad(f"tensor {name!r} has unsupported dtype {code!r}")
        if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
            raise bad(f"tensor {name!r} has shape {shape!r}")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(_is_count(o) for o in offsets)
            or offsets[0] > offsets[1]
        ):
            raise bad(f"tensor {name!r} has data_offsets {offsets!r}")
        numel = 1
        for dim in shape:
            numel *= dim
        if numel * dtype.itemsize != offsets[1] - offsets[0]:
            raise bad(f"tensor {name!r}: {offsets[1] - offsets[0]} bytes for shape {shape}")
        specs.append((offsets[0], offsets[1], name, dtype, tuple(shape)))
    specs.sort(key=lambda s: (s[0], s[1]))
    end = 0
    for begin, stop, name, _dtype, _shape in specs:
        if begin != end:
            raise bad(f"tensor {name!r} starts at byte {begin}, expected {end}")
        end = stop
    if end != data_bytes:
        raise bad(f"tensors cover {end} of the {data_bytes} data bytes")
    return [
        _TensorSpec(name, dtype, shape, data_start + begin, stop - begin)
        for begin, stop, name, dtype, shape in specs
    ]


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class _Shard:
    """One open shard file: what it held when opened, and the stat to hold it to."""

    def __init__(self, path: Path, rel: str, size: int, verified: Stamp | None = None) -> None:
        self.path = path
        self.rel = rel
        try:
            # O_NOFOLLOW and O_NONBLOCK: a shard swapped for a link or a FIFO since
            # it was verified is refused, never followed or waited on.
            self.fd = os.open(
                path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0)
            )
        except FileNotFoundError as exc:
            raise IntegrityError(f"{rel}: deleted since it was verified", file=rel) from exc
        except OSError as exc:
            raise BundleError(f"{rel}: cannot be opened ({exc.strerror})") from exc
        try:
            self.opened = os.fstat(self.fd)
            if not stat.S_ISREG(self.opened.st_mode):
                raise BundleError(f"{rel}: is not a regular file")
            if self.opened.st_size != size:
                raise IntegrityError(
                    f"{rel}: size {self.opened.st_size} does not match manifest size {size} "
                    "(changed since it was verified)",
                    file=rel,
                )
            if verified is not None and stamp_of(self.opened) != verified:
                # Same size, other bytes or another file: rewritten or replaced after
                # its hash matched (it is verified again on the next load).
                raise IntegrityError(f"{rel}: changed since it was verified", file=rel)
            prefix = os.pread(self.fd, 8, 0)
            header_len = _header_length(prefix, size, rel)
            raw = os.pread(self.fd, header_len, 8)
            if len(raw) != header_len:
                raise self.changed()
            start = 8 + header_len
            self.tensors = _parse_header(raw, size - start, start, rel)
        except BaseException:
            os.close(self.fd)
            raise

    def changed(self) -> IntegrityError:
        return IntegrityError(
            f"{self.rel}: changed while it was being read (it is verified again on the next load)",
            file=self.rel,
        )

    def read_into(self, view: memoryview, offset: int) -> None:
        """Fill `view` from the file at `offset`; a file that ended early has changed."""
        done = 0
        while done < len(view):
            try:
                n = os.preadv(self.fd, [view[done:]], offset + done)
            except OSError as exc:
                raise BundleError(f"{self.rel}: read failed ({exc.strerror})") from exc
            if n == 0:
                raise self.changed()
            done += n

    def check_unchanged(self) -> None:
        """Refuse the bytes read if the file, or what its path names, changed since it was
        opened: a rewrite in place moves mtime and ctime, a rename or delete the path."""
        now = os.fstat(self.fd)
        try:
            named = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            raise self.changed() from None
        if not stamp_of(self.opened) == stamp_of(now) == stamp_of(named):
            raise self.changed()

    def close(self) -> None:
        os.close(self.fd)


def _writable(tensor: torch.Tensor) -> memoryview:
    """The bytes of a fresh, contiguous CPU tensor, writable in place (no copy).

    The view does not own the memory: callers keep `tensor` alive while using it.
    """
    import ctypes

    return memoryview((ctypes.c_char * tensor.nbytes).from_address(tensor.data_ptr())).cast("B")


def _read_shards(shards: list[_Shard], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Copy every tensor of `shards` into fresh memory of this process, in parallel.

    The tensors never view a file: safetensors' `load_file` hands out tensors
    that view a MAP_PRIVATE mapping of the shard, so a READY model read the
    bundle's files on every request. Rewriting one changed its answers, and
    truncating one killed the process with SIGBUS (copy-on-write pages of a
    private mapping are unmapped past a truncated end too). Reading with
    pread() never maps the file: a shard cut short during the read is a short
    read, refused, not a signal.

    Each tensor gets its own allocation (a model that keeps a few tensors
    frees the rest), read in chunks spread over threads (pread and torch's
    copies release the GIL). A tensor converted to `dtype` is read a chunk at a
    time into a scratch buffer and converted from there, so the file's dtype
    never occupies memory in full.
    """
    import torch

    out: dict[str, torch.Tensor] = {}
    # (shard, destination, first byte, end byte (of the destination's elements
    # for a conversion), source dtype when converting)
    tasks: list[tuple[_Shard, torch.Tensor, int, int, int, torch.dtype | None]] = []
    for shard in shards:
        for spec in shard.tensors:
            if spec.name in out:
                raise BundleError(f"tensor {spec.name!r} appears in two shards")
            convert = dtype is not None and spec.dtype.is_floating_point and spec.dtype != dtype
            target = torch.empty(spec.shape, dtype=dtype if convert else spec.dtype)
            out[spec.name] = target
            step = max(1, _CHUNK_BYTES // spec.dtype.itemsize) * spec.dtype.itemsize
            for begin in range(0, spec.nbytes, step):
                end = min(spec.nbytes, begin + step)
                tasks.append(
                    (
                        shard,
                        target,
                        spec.offset + begin,
                        begin,
                        end,
                        spec.dtype if convert else None,
                    )
                )
    if not tasks:
        return out
    scratch: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()

    def run(task: tuple[_Shard, torch.Tensor, int, int, int, torch.dtype | None]) -> None:
        shard, target, offset, begin, end, source = task
        if source is None:
            _prefault(target.data_ptr() + begin, end - begin)
            shard.read_into(_writable(target)[begin:end], offset)
            return
        try:
            buffer = scratch.get_nowait()
        except queue.Empty:
            buffer = torch.empty(_CHUNK_BYTES + 8, dtype=torch.uint8)
        try:
            shard.read_into(_writable(buffer)[: end - begin], offset)
            first, last = begin // source.itemsize, end // source.itemsize
            size = target.element_size()
            _prefault(target.data_ptr() + first * size, (last - first) * size)
            flat = target.reshape(-1)
            flat[first:last].copy_(buffer[: end - begin].view(source))
        finally:
            scratch.put(buffer)

    workers = max(1, min(len(tasks), _read_threads()))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="thaw-read") as pool:
        futures = [pool.submit(run, task) for task in tasks]
        try:
            for future in futures:
                future.result()
        except BaseException:
            # Leaving the block waits for reads already running: none may write
            # into a tensor after it is freed.
            for future in futures:
                future.cancel()
            raise
    return out


def _read_threads() -> int:
    """Threads for reads: one per usable CPU (at least two, so one thread's page
    faults overlap another's copy), at most 8 (memory bandwidth is spent by then)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(2, min(cpus, 8))


def _load_mapped(
    path: Path,
    rel: str,
    size: int,
    device: str,
    dtype: torch.dtype | None,
    verified: Stamp | None = None,
) -> dict[str, torch.Tensor]:
    """A shard for a non-CPU device through safetensors, which copies it to the device:
    nothing stays mapped once it returns. A shard changed meanwhile is refused."""
    from safetensors.torch import load_file

    try:
        before = os.stat(path, follow_symlinks=False)
    except FileNotFoundError as exc:
        raise IntegrityError(f"{rel}: deleted since it was verified", file=rel) from exc
    if before.st_size != size:
        raise IntegrityError(
            f"{rel}: size {before.st_size} does not match manifest size {size} "
            "(changed since it was verified)",
            file=rel,
        )
    if verified is not None and stamp_of(before) != verified:
        raise IntegrityError(f"{rel}: changed since it was verified", file=rel)
    check_header(path)
    try:
        tensors = load_file(str(path), device=device)
    except Exception as exc:  # safetensors raises its own SafetensorError and OSError
        raise BundleError(f"{rel}: not a readable safetensors file ({exc})") from exc
    try:
        after = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        after = None
    if after is None or stamp_of(after) != stamp_of(before):
        raise IntegrityError(f"{rel}: changed while it was being read", file=rel)
    if dtype is not None:
        tensors = {
            k: (v.to(dtype) if v.is_floating_point() and v.dtype != dtype else v)
            for k, v in tensors.items()
        }
    return tensors


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
) -> dict[str, torch.Tensor]:
    """Every tensor of every safetensors shard, in memory of this process (or the device).

    On the CPU every byte is copied out of the files (`_read_shards`), so once
    loaded, nothing the bundle's files undergo reaches the model. Each shard's
    size must still match the manifest when opened, its stat the one it had
    when verified (`verified`, from `verified_stamps`: a shard rewritten in
    place with the same size, or replaced, since its hash matched), and its
    stat (inode, size, mtime, ctime, and what its path names) must be the same
    after the copy as before it: a shard changed in between fails the load with
    `IntegrityError`, and the retry verifies it again. `config["dtype"]`
    converts floating tensors once here, never per request.
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
        shards: list[_Shard] = []
        try:
            for f in files:
                shards.append(_Shard(bundle_dir / f.path, f.path, f.size, expected.get(f.path)))
            weights = _read_shards(shards, dtype)
            for shard in shards:
                shard.check_unchanged()
            return weights
        finally:
            for shard in shards:
                shard.close()
    workers = max(1, min(len(files), os.cpu_count() or 1, 8))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        parts = pool.map(
            lambda f: _load_mapped(
                bundle_dir / f.path, f.path, f.size, device, dtype, expected.get(f.path)
            ),
            files,
        )
        for part in parts:
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
