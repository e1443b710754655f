"""The OpenMP thread teams of torch's CPU kernels: one kept, the others ended.

torch's CPU kernels run their loops on OpenMP, GNU libgomp in the Linux
wheels. Each thread that runs a parallel loop becomes the master of its own
team. The team's workers (one fewer than the cores) wait between regions. A
waiting worker spins first, so a region that finds its workers spinning
starts at once, and one that finds them asleep wakes each with a futex
(tens of microseconds). libgomp spins about 300,000 times while the threads it
manages number no more than the cores, but only 100 times once they are more
(`gomp_throttled_spin_count_var`). So as soon as a second thread holds a
team, even an idle one, every region of every thread pays for the futex: a
small kernel takes many times longer beside a second, idle team, and a model's
answer on another thread than the one that built it is much slower while the
builder's thread lives on (BENCHMARKS.md, "OpenMP teams", has the figures).

Thaw runs model work on several threads: a load's phases on the loop's
executor, and handler calls, prefill and decode steps on the handler
threads. `release()` ends the calling thread's team (OpenMP 5's
`omp_pause_resource_all`, soft: its workers exit). The thread's next region
makes a new team, which costs tens of microseconds: cheap once per load phase
or request, too dear after every loop. Who calls it, and when, is the caller's
policy (runtime/dispatch/threads.py, runtime/models/loading.py).
Where torch is not loaded, or runs on another OpenMP runtime (Intel's, whose
workers sleep after a fixed time, not by count), `release()` does nothing.

A spinning team takes the cores it has, so it must not be larger than the
cores the process gets. libgomp sizes it by the CPUs the process may run on,
and a container limited by a CPU quota instead (cgroup `cpu.max`: Kubernetes
limits, ECS, Cloud Run) sees every core of its host: 63 spinning workers under
a quota of two; AWS Lambda gives a function CPU time in proportion to its
memory (one vCPU's worth at 1,769 MB), whatever the vCPUs it shows.
`configure_threads()` sets OMP_NUM_THREADS to the whole CPUs either allows
before torch loads libgomp, unless the variable is set already. Whole: a
spinning thread for part of a core uses up the quota early in each period and
is then stopped for the rest of it.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

_OMP_PAUSE_SOFT = 1
CGROUP_ROOT = Path("/sys/fs/cgroup")
# AWS Lambda: "at 1,769 MB, a function has the equivalent of one vCPU".
LAMBDA_MB_PER_CPU = 1769
# The library's pause, once torch is loaded: None where there is no libgomp to ask.
_pause: Callable[[int], int] | None = None
_resolved = False
_lock = threading.Lock()


def _libgomp_path() -> str | None:
    """The libgomp this process has mapped (the wheel's own copy may carry a hash)."""
    try:
        # Bytes: a mapped file's name need not be valid UTF-8.
        with open("/proc/self/maps", "rb") as maps:
            for line in maps:
                path = line.rstrip(b"\n").rsplit(b" ", 1)[-1]
                if os.path.basename(path).startswith(b"libgomp"):
                    return os.fsdecode(path)
    except OSError:
        return None
    return None


def _resolve() -> Callable[[int], int] | None:
    global _pause, _resolved
    if _resolved:
        return _pause
    if "torch" not in sys.modules:
        return None  # asked again later: torch maps its libgomp as it loads
    with _lock:
        if not _resolved:
            path = _libgomp_path()
            if path is not None:
                import ctypes

                try:
                    # NOLOAD: the copy torch loaded, never a second one.
                    lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
                    fn = lib.omp_pause_resource_all
                    fn.argtypes = [ctypes.c_int]
                    fn.restype = ctypes.c_int
                    _pause = fn
                except (OSError, AttributeError):
                    _pause = None
            _resolved = True
    return _pause


def supported() -> bool:
    """Whether `release()` can end a team here (torch loaded, on libgomp)."""
    return _resolve() is not None


def release() -> bool:
    """End the calling thread's OpenMP team, if it has one; True if libgomp took the
    call. A no-op inside a parallel region, and where `supported()` is False."""
    pause = _resolve()
    return pause is not None and pause(_OMP_PAUSE_SOFT) == 0


def released_after(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)`, then the thread's team ended: for a thread that does model work
    once and then other things, or waits (a load phase on the loop's executor)."""
    try:
        return fn(*args)
    finally:
        release()


def quota_cpus(root: Path = CGROUP_ROOT) -> int | None:
    """The whole CPUs the container's CPU quota allows (at least one); None without one.
    cgroup v2 (`cpu.max`: "QUOTA PERIOD", or "max PERIOD") or v1 (`cpu.cfs_quota_us`,
    -1 for none, over `cpu.cfs_period_us`)."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        try:
            v1 = root / "cpu"
            quota = (v1 / "cpu.cfs_quota_us").read_text().strip()
            period = (v1 / "cpu.cfs_period_us").read_text().strip()
        except OSError:
            return None
    try:
        allowed, every = int(quota), int(period)
    except ValueError:  # "max": no quota
        return None
    if allowed <= 0 or every <= 0:
        return None
    return max(1, allowed // every)


def lambda_cpus(environ: Mapping[str, str] = os.environ) -> int | None:
    """The whole vCPUs an AWS Lambda function's memory buys (at least one); None
    off Lambda."""
    memory_mb = environ.get("AWS_LAMBDA_FUNCTION_MEMORY_SIZE", "")
    if not memory_mb.isdigit():
        return None
    return max(1, int(memory_mb) // LAMBDA_MB_PER_CPU)


def configure_threads(root: Path = CGROUP_ROOT) -> int | None:
    """Before torch loads: OMP_NUM_THREADS set to the CPUs a quota allows (the
    cgroup's, Lambda's) where that is fewer than the CPUs the process may run on
    and the variable is unset; the count set, else None (nothing to do, or too
    late: torch is loaded)."""
    if "OMP_NUM_THREADS" in os.environ or "torch" in sys.modules:
        return None
    quotas = [q for q in (quota_cpus(root), lambda_cpus()) if q is not None]
    if not quotas:
        return None
    quota = min(quotas)
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    if quota >= cpus:
        return None
    os.environ["OMP_NUM_THREADS"] = str(quota)
    return quota
