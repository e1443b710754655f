"""Handlers bench/gpu.py loads into a real `thaw serve` beside the shipped ones.

- `device_memory` reads the server process's own device memory, where it is
  measured: the caching allocator's figures (`torch.cuda.memory_allocated`,
  `memory_reserved`, `max_memory_allocated`) and the driver's free memory
  (`torch.cuda.mem_get_info`). Called with `{"reset_peak": true}` it first
  starts a new peak (`torch.cuda.reset_peak_memory_stats`). On the CPU
  (`{"device": "cpu"}`, bench/gpu.py --smoke) the same fields hold the
  process's resident memory instead (`VmRSS`, `VmHWM`, whose high-water mark
  `5 > /proc/self/clear_refs` resets) and `kind` says "rss".
- Bundle `gpu-synthetic` is weights only (bench/gpu.py writes it, 2 GiB of
  safetensors on a device): its builder keeps the loaded tensors as they came,
  so the load phase and the unload are all a load of it costs. Handler
  `synthetic_bytes` answers how many bytes it holds, and where.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from runtime import Context, bundle, handler


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _meminfo_bytes(field: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/meminfo")


def _rss(reset_peak: bool) -> dict[str, Any]:
    if reset_peak:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    rss = _status_bytes("VmRSS")
    return {
        "kind": "rss",
        "allocated": rss,
        "reserved": rss,
        "peak": _status_bytes("VmHWM"),
        "free": _meminfo_bytes("MemAvailable"),
        "total": _meminfo_bytes("MemTotal"),
    }


def _cuda(reset_peak: bool) -> dict[str, Any]:
    import torch

    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.synchronize(device)
    if reset_peak:
        torch.cuda.reset_peak_memory_stats(device)
    free, total = torch.cuda.mem_get_info(device)
    return {
        "kind": "cuda",
        "allocated": torch.cuda.memory_allocated(device),
        "reserved": torch.cuda.memory_reserved(device),
        "peak": torch.cuda.max_memory_allocated(device),
        "free": int(free),
        "total": int(total),
    }


@handler("device_memory")
def device_memory(event: dict[str, Any], ctx: Context) -> dict[str, Any]:
    """This process's device memory (or resident memory on the CPU), in bytes."""
    reset = bool(event.get("reset_peak", False))
    return _cuda(reset) if event.get("device", "cuda") != "cpu" else _rss(reset)


@bundle("gpu-synthetic")
def build_synthetic(weights: dict[str, Any]) -> dict[str, Any]:
    return weights


@handler("synthetic_bytes", uses=["gpu-synthetic"])
def synthetic_bytes(event: Any, weights: dict[str, Any], ctx: Context) -> dict[str, Any]:
    """Bytes held by the synthetic bundle's tensors, and their devices."""
    held = sum(t.numel() * t.element_size() for t in weights.values())
    return {"bytes": held, "devices": sorted({str(t.device) for t in weights.values()})}
