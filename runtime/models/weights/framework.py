"""The framework: importing torch (off the GIL where it can), the device, memory.

`import torch` is the slowest step of a cold start that no bundle owns: it is
done once per instance, overlapping the first fetch, with its native
libraries loaded through a foreign call that releases the GIL and the objects
it makes frozen out of the collector's way. Everything here imports torch
lazily, so importing `runtime` (and serving /healthz) never pays for it.
"""

from __future__ import annotations

import atexit
import gc
import importlib.util
import sys
import threading
from pathlib import Path
from typing import Any

from runtime.bundles.sources import pages
from runtime.errors import LoadFailed
from runtime.models.weights import host, teams

_RTLD_NOW = 0x2
_RTLD_GLOBAL = 0x100
# How long a process's exit waits for the framework's libraries to finish loading.
PRELOAD_EXIT_WAIT_S = 60.0


def preload_framework() -> None:
    """dlopen torch's native libraries through a ctypes call, which releases the GIL.

    `import torch` spends most of its time in the static initialisers of
    libtorch_cpu (and libtorch_cuda), run by dlopen while the importing thread
    holds the GIL: the event loop, and every deadline timer on it, freezes for
    that long (0.3-0.8 s measured here). Loading those libraries first through
    a foreign call lets the loop run meanwhile; the import then finds them
    loaded. Best effort: any failure just leaves the work to `import torch`.
    """
    teams.configure_threads()  # before libgomp loads with libtorch_cpu
    glibc = host.libc()
    if glibc is None or "torch" in sys.modules:
        return
    try:
        spec = importlib.util.find_spec("torch")
        if spec is None or spec.origin is None:
            return
        lib_dir = Path(spec.origin).parent / "lib"
        for name in ("libtorch_cpu.so", "libtorch_cuda.so"):
            path = lib_dir / name
            if path.exists():
                glibc.dlopen(str(path).encode(), _RTLD_NOW | _RTLD_GLOBAL)
    except (OSError, AttributeError, ValueError, ImportError):
        return


def preload_in_background() -> threading.Thread | None:
    """`preload_framework` on a daemon thread of its own, started now: the native
    libraries load on another core while the caller goes on (its Python work holds
    the GIL; the load does not). None where there is nothing to load (no torch
    installed, or imported already). What else the process loads meanwhile is the
    caller's to order: see runtime/preload.py."""
    if "torch" in sys.modules or host.libc() is None:
        return None
    try:
        if importlib.util.find_spec("torch") is None:
            return None
    except (ImportError, ValueError):  # a finder that refuses it: not installed, as far as we go
        return None
    # Here, not on the thread: setting a variable while another thread reads the
    # environment is not safe in C.
    teams.configure_threads()
    thread = threading.Thread(target=preload_framework, name="thaw-framework-preload", daemon=True)
    thread.start()
    # A process that ends while the libraries load (a server refused its settings or
    # its port) would run its exit, and the C library's, beside the initialisers
    # dlopen is running: it died of SIGSEGV or SIGABRT instead of exiting with its
    # code. The interpreter's exit waits for the load first (bounded: a hung load
    # must not hold the exit forever).
    atexit.register(thread.join, PRELOAD_EXIT_WAIT_S)
    return thread


def _import_framework() -> None:
    """Import torch and safetensors' torch support, or fail the load saying which is missing.

    torch is an extra (`thaw-runtime[torch]`): the control plane and model-less
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
            "pip install 'thaw-runtime[torch]' (or a torch build for this machine first)",
            missing=missing,
        ) from exc


def resolve_device(requested: str) -> str:
    """`THAW_DEVICE` if set, else `cuda` when available, else `cpu`.

    Imports the framework either way (the cache runs this alongside the first
    fetch, so the import overlaps it instead of following it); see
    `import_frozen` for how.
    """
    import_frozen()
    import torch

    if requested:
        return requested
    return "cuda" if torch.cuda.is_available() else "cpu"


_frozen = False


def import_frozen() -> None:
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


def release(device: str) -> None:
    """Return freed memory to the OS: collect cycles (a model's objects often hold
    each other), then hand the C allocator's free pages back (host.trim) and
    empty the CUDA caching allocator. Called once a bundle's references are
    dropped, on the thread that unloads it."""
    gc.collect()
    host.trim()
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
    return pages.meminfo("MemTotal") or 8 * 1024**3


def inference_mode() -> Any:
    """A context manager that disables autograd for handler runs."""
    import torch

    return torch.inference_mode()
