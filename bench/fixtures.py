"""Handlers the benchmarks load into a real `thaw serve` (THAW_HANDLERS=bench.fixtures).

`echo_sync` is `handlers.echo` as a plain `def`: the warm-overhead benchmark
prices the worker-thread hand-off of sync handlers with it.

Bundles `flight` and `slow` share one builder: it sleeps `config["sleep_s"]`
(standing in for fetch-to-init work) and stamps when it finished. Handlers of
the same names answer when they started running and when their model was
built, both wall-clock, so a benchmark can split a waiter's latency into the
runtime's wake-up (READY -> handler running) and the HTTP answer after it.

For bench/gpu.py, beside the shipped handlers:

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

import time
from pathlib import Path
from typing import Any

from runtime import Context, bundle, handler


class Stamp:
    def __init__(self, built_at: float) -> None:
        self.built_at = built_at


def _build(config: dict[str, Any]) -> Stamp:
    time.sleep(float(config.get("sleep_s", 0.0)))
    return Stamp(time.time())


def _run(model: Stamp) -> dict[str, float]:
    return {"ran_at": time.time(), "built_at": model.built_at}


@bundle("flight")
def build_flight(config: dict[str, Any]) -> Stamp:
    return _build(config)


@bundle("slow")
def build_slow(config: dict[str, Any]) -> Stamp:
    return _build(config)


@handler("flight", uses=["flight"])
def flight(event: Any, model: Stamp, ctx: Context) -> dict[str, float]:
    return _run(model)


@handler("flight_async", uses=["flight"])
async def flight_async(event: Any, model: Stamp, ctx: Context) -> dict[str, float]:
    return _run(model)


@handler("slow", uses=["slow"])
def slow(event: Any, model: Stamp, ctx: Context) -> dict[str, float]:
    return _run(model)


@handler("echo_sync")
def echo_sync(event: Any, ctx: Context) -> Any:
    return event


# ---- bench/gpu.py's probes ----


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
