"""The bare-script baseline of `thaw coldstart --bare`: the same work as a cold
invocation, with nothing of Thaw's around it.

    python -m runtime.cli.bare HANDLER EVENT_JSON

In a fresh process: import the framework, read the bundle's safetensors
files, build the model with the handler's own builder, call the handler once
with the event, print one JSON line. No server, no verification, no
warm-up, no threads, no memory budget: what a user's own script does to get
the same answer, and so the floor a cold start through Thaw is measured
against. Bundles come from THAW_BUNDLE_SOURCE (a local directory).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import orjson

from runtime.bundles.manifest import read_manifest
from runtime.context import Context
from runtime.registry import discover
from runtime.settings import Settings


def run(handler: str, event: Any) -> dict[str, Any]:
    started = time.monotonic()
    settings = Settings.from_env()
    registry = discover(settings.handlers)
    spec = registry.handler(handler)
    import torch
    from safetensors.torch import load_file

    imported = time.monotonic()
    device = settings.device or ("cuda" if torch.cuda.is_available() else "cpu")
    models = []
    loaded_s = built_s = 0.0
    for name in spec.uses:
        began = time.monotonic()
        directory = Path(settings.bundle_source) / name
        manifest = read_manifest(directory)
        weights: dict[str, Any] = {}
        for f in manifest.files:
            if f.path.endswith(".safetensors"):
                weights.update(load_file(str(directory / f.path), device=device))
        dtype = manifest.config.get("dtype")
        if dtype is not None:  # the same conversion a load does, once
            target = getattr(torch, {"fp16": "float16", "bf16": "bfloat16"}.get(dtype, dtype))
            weights = {
                k: v.to(target) if v.is_floating_point() and v.dtype != target else v
                for k, v in weights.items()
            }
        built = time.monotonic()
        loaded_s += built - began
        builder = registry.builder(name)
        assert builder is not None
        files = {f.path: directory / f.path for f in manifest.files}
        models.append(
            builder.call(
                {
                    "weights": weights,
                    "config": manifest.config,
                    "device": device,
                    "files": files,
                    "manifest": manifest,
                }
            )
        )
        built_s += time.monotonic() - built
    ran = time.monotonic()
    ctx = Context(request_id="bare", handler=handler)
    with torch.inference_mode():
        if spec.batch is None:
            output = spec.fn(event, *models, ctx)
        else:  # a batched handler: the event as a batch of one
            [output] = spec.fn([event], *models, [ctx])
            if isinstance(output, BaseException):
                raise output
    done = time.monotonic()
    return {
        "handler": handler,
        "import_s": imported - started,
        "load_s": loaded_s,
        "build_s": built_s,
        "run_s": done - ran,
        "in_process_s": done - started,
        "output": output,
    }


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m runtime.cli.bare HANDLER EVENT_JSON", file=sys.stderr)
        return 2
    result = run(args[0], orjson.loads(args[1]))
    sys.stdout.write(orjson.dumps(result, option=orjson.OPT_SERIALIZE_NUMPY).decode() + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
