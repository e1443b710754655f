"""Why SmolLM2 keeps attention off cuDNN on CUDA (handlers/models/llama.py, `plan_free_attention`).

    .venv/bin/python bench/experiments/gpu_attention.py          # seconds on one GPU
    .venv/bin/python bench/experiments/gpu_attention.py --smoke  # its code on the CPU

Without CUDA it prints one line and exits 0; `--smoke` figures mean nothing.

A decode step's attention, with cuDNN's backend on and off: its first call at
each of 10 key lengths not seen before (the keys are a view of a KV cache of
its own capacity, as `KVCache` makes them), the same calls again, and the
first call on a new thread. Float16, 3 KV heads, 3 query rows, head dim 64:
SmolLM2-135M's shapes. Measured with a synchronize around each call.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import Row, fmt_s, fmt_x, render  # noqa: E402
from bench.gpu import skipped_without_cuda  # noqa: E402

LENGTHS = range(40, 50)
# A first call at a new length above this share of its repeat counts as planned.
PLANNED_RATIO = 10.0


def _timed(device: str, call: Callable[[], object]) -> float:
    import torch

    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
    started = time.perf_counter()
    call()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - started


def measure(device: str, cudnn: bool, capacity: int) -> tuple[float, float, float]:
    """(median first call at a new key length, median repeat, first call on a new thread)."""
    import torch
    import torch.nn.functional as F

    torch.backends.cuda.enable_cudnn_sdp(cudnn)
    dtype = torch.float16 if device == "cuda" else torch.float32
    q = torch.randn(1, 3, 3, 64, device=device, dtype=dtype)
    cache = torch.randn(1, 3, capacity, 64, device=device, dtype=dtype)

    def at(length: int) -> Callable[[], object]:
        keys = cache[:, :, :length]
        return lambda: F.scaled_dot_product_attention(q, keys, keys)

    first = [_timed(device, at(n)) for n in LENGTHS]
    again = [_timed(device, at(n)) for n in LENGTHS]
    thread: list[float] = []
    worker = threading.Thread(target=lambda: thread.append(_timed(device, at(LENGTHS[0]))))
    worker.start()
    worker.join()
    return statistics.median(first), statistics.median(again), thread[0]


def run(device: str) -> list[Row]:
    import torch

    rows: list[Row] = []
    default = torch.backends.cuda.cudnn_sdp_enabled()  # type: ignore[no-untyped-call]
    # Each setting its own cache capacity: strides neither has planned for.
    results = {on: measure(device, on, 300 + on) for on in (True, False)}
    for on, (first, again, thread) in results.items():
        name = f"cuDNN {'on' if on else 'off'}"
        rows.append(
            Row(
                f"{name}: decode attention, first call at each of 10 new key lengths "
                "(median) vs the same calls again",
                fmt_s(first),
                fmt_s(again),
                fmt_x(first / again),
                verdict="info",
            )
        )
        rows.append(Row(f"{name}: first attention on a new thread", fmt_s(thread)))
    torch.backends.cuda.enable_cudnn_sdp(default)
    planned = results[True][0] / results[True][1] > PLANNED_RATIO
    rows.append(
        Row(
            "cuDNN plans per shape: its first call at a new length vs with it off",
            fmt_s(results[True][0]),
            fmt_s(results[False][0]),
            fmt_x(results[True][0] / results[False][0]),
            verdict="info" if planned else "info (not seen on this device)",
        )
    )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="its code on the CPU")
    args = parser.parse_args(argv)
    if skipped_without_cuda("bench/experiments/gpu_attention.py", args.smoke):
        return 0
    import torch

    device = "cpu" if args.smoke else "cuda"
    print(render(run(device)))
    machine = "CPU (smoke)" if args.smoke else torch.cuda.get_device_name()
    cudnn = torch.backends.cudnn.version()  # type: ignore[no-untyped-call]
    print(f"\n{machine}, torch {torch.__version__}, cuDNN {cudnn}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
