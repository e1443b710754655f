"""runtime/models/weights/host.py against the real C allocator, in fresh processes.

Each run mallocs and frees blocks the size of weight tensors through ctypes,
as torch's CPU allocator does, and reads the process's own RSS: the fixed
mmap threshold returns them on free, malloc_trim returns what the heap kept,
and with both left to glibc the memory stays (the fault they fix). The whole
bundles are measured in tests/pretrained/test_host_memory.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from runtime.errors import ConfigError
from runtime.models.weights import host
from runtime.settings import Settings

pytestmark = pytest.mark.process  # starts a process (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]
MIB = 1024 * 1024

SCRIPT = """
import ctypes, resource, sys, orjson
from runtime.models.weights import host
from runtime.settings import Settings

host.configure(Settings.from_env(orjson.loads(sys.argv[1])))
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

def touched(size):
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    return block

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

# A first model's tensor freed: glibc raises its mmap threshold past its size.
with host.bundle_window():
    libc.free(touched(8 << 20))
base = rss()
with host.bundle_window():
    blocks = [touched(2 << 20) for _ in range(64)]  # the next model's tensors: 128 MiB
    # One tensor the next model keeps, above them: the heap's top cannot shrink past it.
    kept = touched(2 << 20)
loaded = rss()
for block in blocks:
    libc.free(block)
freed = rss()
host.trim()
trimmed = rss()
# A request's scratch outside any bundle's window (orjson's for a 400 KB body is 4-5 MB),
# made and freed again and again: the pages of every call after the first.
libc.free(touched(5 << 20))
before = faults()
for _ in range(10):
    libc.free(touched(5 << 20))
figures = {"loaded": loaded, "freed": freed, "trimmed": trimmed}
out = {k: v - base for k, v in figures.items()}
out["request_faults"] = faults() - before
print(orjson.dumps(out).decode())
"""


def run(**env: str) -> dict[str, int]:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, orjson.dumps(env).decode()],
        capture_output=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    figures: dict[str, int] = orjson.loads(done.stdout)
    assert figures["loaded"] >= 120 * MIB, figures  # the blocks were resident
    return figures


needs_glibc = pytest.mark.skipif(not host.supported(), reason="the C allocator is not glibc's")


@needs_glibc
def test_left_to_glibc_freed_tensors_stay_resident() -> None:
    """The fault: the climbed threshold put the blocks on the heap, which keeps them."""
    figures = run(THAW_MMAP_THRESHOLD_BYTES="0", THAW_MALLOC_TRIM="false")
    assert figures["freed"] >= 120 * MIB, figures
    assert figures["trimmed"] >= 120 * MIB, figures


@needs_glibc
def test_a_fixed_mmap_threshold_returns_tensors_on_free() -> None:
    figures = run(THAW_MALLOC_TRIM="false")  # the default threshold (1 MiB)
    assert figures["freed"] <= 8 * MIB, figures


@needs_glibc
def test_requests_reuse_the_heap_between_bundle_windows() -> None:
    """Between a bundle's windows, a request's multi-MiB scratch comes back from the
    heap: with the load's 1 MiB threshold it was a fresh mapping each time, 1,280
    page faults for 5 MiB, every call (the fault measured: a 400 KB JSON echo
    faulted 550 pages in, half of its CPU)."""
    assert run(THAW_MALLOC_TRIM="false")["request_faults"] <= 64
    assert run(THAW_MMAP_THRESHOLD_BYTES="0")["request_faults"] <= 64  # glibc's own


# Both scripts below: Thaw's allocator settings, and the page faults of ten
# blocks of `size` made, touched and freed in turn.
PRELUDE = """
import ctypes, resource, threading, orjson
from runtime.models.weights import host
from runtime.settings import Settings

host.configure(Settings())
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

def faults_of_ten(size):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        block = libc.malloc(size)
        ctypes.memset(block, 1, size)
        libc.free(block)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
"""


def figures_of(script: str) -> dict[str, int]:
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    figures: dict[str, int] = orjson.loads(done.stdout)
    return figures


OVERLAPPING = (
    PRELUDE
    + """
# Two loads on two threads: the first ends while the second still runs.
first_open, first_may_end = threading.Event(), threading.Event()

def first_load():
    with host.bundle_window():
        first_open.set()
        first_may_end.wait()

thread = threading.Thread(target=first_load)
thread.start()
first_open.wait()
second = host.bundle_window()
second.__enter__()
first_may_end.set()
thread.join()
during = faults_of_ten(5 << 20)  # the second load still open: mapped every time
second.__exit__(None, None, None)
faults_of_ten(5 << 20)  # the heap grows once
after = faults_of_ten(5 << 20)
print(orjson.dumps({"during": during, "after": after}).decode())
"""
)


@needs_glibc
def test_overlapping_loads_keep_the_low_threshold_until_the_last_ends() -> None:
    figures = figures_of(OVERLAPPING)
    assert figures["during"] >= 10 * 1000, figures  # 5 MiB mapped and faulted each time
    assert figures["after"] <= 64, figures


# A builder's scratch below the mmap threshold, made and freed at the heap's top.
KINDS = (
    PRELUDE
    + """
SCRATCH = 512 << 10
figures = {}
with host.bundle_window():
    faults_of_ten(SCRATCH)  # the heap grows once
    figures["making"] = faults_of_ten(SCRATCH)
    with host.bundle_window(returning=True):  # an unload while a load runs
        figures["returning beside making"] = faults_of_ten(SCRATCH)
    faults_of_ten(SCRATCH)
    figures["making again"] = faults_of_ten(SCRATCH)
with host.bundle_window(returning=True):
    figures["returning"] = faults_of_ten(SCRATCH)
print(orjson.dumps(figures).decode())
"""
)


@needs_glibc
def test_a_window_that_makes_memory_keeps_the_heap_top_and_one_that_returns_it_trims() -> None:
    """A load's window keeps what its builder frees at a heap's top for its next
    allocation; with glibc's 128 KiB trim threshold there, every free of a 512 KiB
    scratch handed the top back and the next malloc faulted it in again (SmolLM2's
    build: 1,650 brk calls against 830). An unload's window, or any while one is
    open, still returns the top at 128 KiB."""
    figures = figures_of(KINDS)
    assert figures["making"] <= 64, figures
    assert figures["making again"] <= 64, figures
    assert figures["returning beside making"] >= 10 * 64, figures  # 96 pages handed back each
    assert figures["returning"] >= 10 * 64, figures


@needs_glibc
def test_trim_returns_what_the_heap_kept() -> None:
    figures = run(THAW_MMAP_THRESHOLD_BYTES="0")
    assert figures["freed"] >= 120 * MIB, figures  # still on the heap after free()
    assert figures["trimmed"] <= 8 * MIB, figures


@pytest.mark.parametrize(
    ("variable", "value", "complaint"),
    [
        ("THAW_MMAP_THRESHOLD_BYTES", "64MiB", "THAW_MMAP_THRESHOLD_BYTES must be 0"),
        ("THAW_MMAP_THRESHOLD_BYTES", "-1", "THAW_MMAP_THRESHOLD_BYTES must be 0"),
        ("THAW_MMAP_THRESHOLD_BYTES", "lots", "THAW_MMAP_THRESHOLD_BYTES='lots' is not"),
        ("THAW_MALLOC_ARENA_MAX", "-2", "THAW_MALLOC_ARENA_MAX must be >= 0"),
        ("THAW_MALLOC_ARENA_MAX", "four", "THAW_MALLOC_ARENA_MAX='four' is not"),
    ],
)
def test_bad_allocator_settings_are_refused_by_name(
    variable: str, value: str, complaint: str
) -> None:
    with pytest.raises(ConfigError, match=complaint):
        Settings.from_env({variable: value})


def test_allocator_settings_read_sizes_and_switches() -> None:
    settings = Settings.from_env(
        {
            "THAW_MMAP_THRESHOLD_BYTES": "256KiB",
            "THAW_MALLOC_ARENA_MAX": "0",
            "THAW_MALLOC_TRIM": "off",
        }
    )
    assert settings.mmap_threshold_bytes == 256 * 1024
    assert settings.malloc_arena_max == 0
    assert settings.malloc_trim is False
    assert Settings().mmap_threshold_bytes == MIB and Settings().malloc_trim is True
