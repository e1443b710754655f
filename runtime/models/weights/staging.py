"""The device read path: shards through a reusable pinned staging pool into device memory.

A device load that went through safetensors read each shard into host memory
whole and copied it over, one shard after another, and a shard the fetch left
unverified had to be hashed from the file first: every byte read twice. Here
each range of a shard (its manifest chunk where the load checks it, else
`STAGE_BYTES`) is read by one of several reader threads into a free slot of
a pool of page-locked host buffers, its digest checked there, and copied into
the device tensors it spans by host-to-device copies queued on a stream of
their own; the slot goes back to the pool when its copies are done. So reads,
hashes and copies overlap, host memory holds the pool and nothing more, and the
tensors are the device buffers themselves. A tensor converted to another dtype
is converted on the device once its bytes have all landed.

On the CPU the same pipeline runs with host memory as its "device" and no
stream (`device="cpu"`): the suite's smoke mode. Its figures count only from a
device.
"""

from __future__ import annotations

import contextlib
import queue
import traceback
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from runtime.bundles import chunks
from runtime.errors import BundleError
from runtime.models.weights.cpu import Shard, _Placed, _Range, _writable, ranges_of

if TYPE_CHECKING:
    import torch

    from runtime.bundles.chunks import Chunked

# One staging slot: 16-64 MiB is where the fast loaders' copies reach the link's speed.
STAGE_BYTES = 32 * 1024 * 1024
MIN_READERS, MAX_READERS = 4, 16


def read_to_device(
    shards: list[Shard],
    device: str,
    dtype: torch.dtype | None,
    pending: Mapping[str, Chunked] | None = None,
    on_progress: Callable[[int], None] | None = None,
    *,
    readers: int = 0,
    stage_bytes: int = STAGE_BYTES,
) -> dict[str, torch.Tensor]:
    """Every tensor of `shards` in memory of `device`, each chunk of a shard in
    `pending` checked in its staging slot before it is copied. On any failure every
    tensor is let go of before the error leaves."""
    import torch

    threads = readers or max(MIN_READERS, min(MAX_READERS, chunks.threads()))
    try:
        out, ranges = _plan(shards, device, pending, stage_bytes)
    except BaseException as exc:
        traceback.clear_frames(exc.__traceback__)
        raise
    if not ranges:
        return _converted(out, dtype)
    cuda = device.startswith("cuda")
    slot_bytes = max(r.stop - r.begin for r in ranges)
    pool: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()
    for _ in range(min(len(ranges), threads + 2)):
        pool.put(torch.empty(slot_bytes, dtype=torch.uint8, pin_memory=cuda))
    stream = torch.cuda.Stream(device=torch.device(device)) if cuda else None  # type: ignore[no-untyped-call]

    def run(task: _Range) -> None:
        slot = pool.get()
        try:
            _stage(task, slot, stream)
        finally:
            pool.put(slot)
        if on_progress is not None:
            on_progress(task.stop - task.begin)

    try:
        chunks.run_all(ranges, run, min(threads, len(ranges)), "thaw-stage")
        if stream is not None:
            stream.synchronize()
        return _converted(out, dtype)
    except BaseException as exc:
        out.clear()
        ranges.clear()
        traceback.clear_frames(exc.__traceback__)
        raise


def _plan(
    shards: list[Shard], device: str, pending: Mapping[str, Chunked] | None, stage_bytes: int
) -> tuple[dict[str, torch.Tensor], list[_Range]]:
    """Every tensor allocated on the device as stored, and the ranges to stage."""
    import torch

    out: dict[str, torch.Tensor] = {}
    ranges: list[_Range] = []
    for shard in shards:
        placed: list[_Placed] = []
        for spec in shard.tensors:
            if spec.name in out:
                raise BundleError(f"tensor {spec.name!r} appears in two shards")
            target = torch.empty(spec.shape, dtype=spec.dtype, device=device)
            out[spec.name] = target
            if spec.nbytes:
                placed.append(_Placed(spec.offset, spec.nbytes, target, None))
        entry = pending.get(shard.rel) if pending is not None else None
        ranges += ranges_of(shard, placed, entry, stage_bytes)
    return out, ranges


def _stage(task: _Range, slot: torch.Tensor, stream: Any) -> None:
    """Read `task`'s bytes into `slot`, check them, copy them to their tensors."""
    import torch

    lo = max(task.begin, task.shard.data_start)
    staged = _writable(slot)[: max(0, task.stop - lo)]  # none: a range of header only
    task.shard.read_many([staged], lo)
    if task.entry is not None:
        head = task.shard.head[task.begin : min(task.stop, task.shard.data_start)]
        chunks.check(task.entry, task.index, [head, staged])
    with _on(stream):
        for place, start, end in task.spans(lo):
            flat = place.target.reshape(-1).view(torch.uint8)
            flat[start - place.offset : end - place.offset].copy_(
                slot[start - lo : end - lo], non_blocking=stream is not None
            )
        if stream is not None:
            # The slot is reused once its copies are done, not before.
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(stream)
            done.synchronize()


@contextlib.contextmanager
def _on(stream: Any) -> Iterator[None]:
    if stream is None:
        yield
        return
    import torch

    with torch.cuda.stream(stream):
        yield


def _converted(out: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Floating tensors converted to `dtype` on the device, one at a time."""
    if dtype is None:
        return out
    for name, tensor in out.items():
        if tensor.is_floating_point() and tensor.dtype != dtype:
            out[name] = tensor.to(dtype)
    return out
