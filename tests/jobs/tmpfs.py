"""A real small filesystem to fill: a tmpfs mounted for one test, always unmounted.

Storage-fault tests put the job store (and the state dir) on it, write a filler
file until the kernel says ENOSPC, and delete it to free the space. Mounting
needs root (CAP_SYS_ADMIN); where it is refused the test is skipped, saying why.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

_CHUNK = b"\0" * 65536


@contextlib.contextmanager
def mounted(directory: Path, size: str) -> Iterator[Path]:
    """`directory` as a tmpfs of `size` (e.g. "4m") for the block; unmounted after."""
    directory.mkdir(parents=True, exist_ok=True)
    if shutil.which("mount") is None:
        pytest.skip("storage-fault test needs a tmpfs: no `mount` command here")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(
            "storage-fault test needs a tmpfs and mounting one was refused"
            f" (root / CAP_SYS_ADMIN required): {done.stderr.strip()}"
        )
    try:
        yield directory
    finally:
        # Lazy, so a process the test failed to stop cannot keep it mounted.
        subprocess.run(["umount", "-l", str(directory)], check=False, capture_output=True)


def fill(directory: Path) -> Path:
    """Write a filler file in `directory` until the filesystem is full; returns it."""
    filler = directory / "filler"
    with open(filler, "ab") as out:
        try:
            while True:
                out.write(_CHUNK)
                out.flush()
        except OSError:
            pass
    # The last partial chunks: whatever the buffered writes left free.
    with open(filler, "ab", buffering=0) as out:
        for size in (4096, 512, 1):
            with contextlib.suppress(OSError):
                while True:
                    out.write(b"\0" * size)
    return filler


def free(filler: Path) -> None:
    filler.unlink(missing_ok=True)
