"""Measure one request's peak memory in a fresh process: `python -m tests.pretrained.peak
BUNDLE_DIR HANDLER_MODULE HANDLER [BATCH_SIZE]` with the largest event on stdin (JSON);
a batched handler runs BATCH_SIZE copies of it as one batch (default 1).

Builds the model with its real builder, serves one small request (so one-time
allocations are paid first), resets the kernel's resident high-water mark
(`5 > /proc/self/clear_refs`), runs the event, and prints the peak RSS growth
over what was resident before it, in bytes (JSON: {"peak_bytes": N}).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import orjson


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def main() -> int:
    bundle_dir, module_name, handler_name = sys.argv[1:4]
    event: Any = orjson.loads(sys.stdin.buffer.read())
    import torch
    from safetensors.torch import load_file

    from runtime.bundles.manifest import read_manifest
    from runtime.context import Context
    from runtime.registry import discover

    registry = discover([module_name])
    spec = registry.handler(handler_name)
    directory = Path(bundle_dir)
    manifest = read_manifest(directory)
    weights: dict[str, Any] = {}
    for f in manifest.files:
        if f.path.endswith(".safetensors"):
            weights.update(load_file(str(directory / f.path)))
    builder = registry.builder(spec.uses[0])
    assert builder is not None
    model = builder.call(
        {
            "weights": weights,
            "config": manifest.config,
            "device": "cpu",
            "files": {f.path: directory / f.path for f in manifest.files},
            "manifest": manifest,
        }
    )
    ctx = Context(request_id="peak", handler=handler_name)
    # A batched handler takes a list of events: the one event, or `size` copies of
    # it (a full batch of the largest request, which admission charges `size` slots).
    size = int(sys.argv[4]) if len(sys.argv) > 4 else 1

    def run(one: Any, copies: int) -> None:
        if spec.batch is None:
            spec.fn(one, model, ctx)
            return
        outputs = spec.fn([one] * copies, model, [ctx] * copies)
        assert not any(isinstance(o, BaseException) for o in outputs), outputs

    # The handler's first warm-up example first (an accelerator's where it warms
    # nothing on a CPU), so the peak is the request's own, not a first call's.
    first = (list(spec.warmup) or list(spec.accelerator_warmup))[0]
    with torch.inference_mode():
        run(dict(first), 1)
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        before = _status_bytes("VmRSS")
        run(event, size)
        peak = _status_bytes("VmHWM")
    sys.stdout.write(orjson.dumps({"peak_bytes": peak - before}).decode() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
