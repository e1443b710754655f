"""The bare-script baseline of `thaw coldstart --bare`: the same work as a cold
invocation, with nothing of Thaw's around it.

    python -m runtime.cli.bare HANDLER EVENT_JSON

In a fresh process: import the framework, read the bundle's safetensors
files, build the model with the handler's own builder, call the handler once
with the event, print one JSON line. No server, no verification, no
warm-up, no threads, no memory budget: what a user's own script does to get
the same answer, and so the floor a cold start through Thaw is measured
against. Bundles come from THAW_BUNDLE_SOURCE (a local directory).

`prepare` (import, load, build) and `call` (run once) are the two halves, so
the same work runs as a Lambda function too: bench/bare_lambda.py prepares at
import (Lambda's init phase) and calls in its handler.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from runtime.bundles.manifest import read_manifest
from runtime.context import Context
from runtime.registry import HandlerSpec, discover
from runtime.settings import Settings


@dataclass(frozen=True)
class Prepared:
    """A handler's models, built: what the script has before it calls the handler."""

    handler: str
    spec: HandlerSpec
    models: list[Any]
    # time.monotonic() when preparing began, and the seconds of each step.
    started: float
    import_s: float
    load_s: float
    build_s: float


def prepare(handler: str) -> Prepared:
    """Import the framework, read the handler's bundles and build its models."""
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
        dtype = manifest.load_dtype
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
    return Prepared(handler, spec, models, started, imported - started, loaded_s, built_s)


def call(prepared: Prepared, event: Any, request_id: str = "bare") -> Any:
    """Run the handler once on `event` with the prepared models: its output."""
    import torch

    spec = prepared.spec
    ctx = Context(request_id=request_id, handler=prepared.handler)
    with torch.inference_mode():
        if spec.batch is None:
            return spec.fn(event, *prepared.models, ctx)
        # a batched handler: the event as a batch of one
        [output] = spec.fn([event], *prepared.models, [ctx])
        if isinstance(output, BaseException):
            raise output
        return output


def run(handler: str, event: Any) -> dict[str, Any]:
    prepared = prepare(handler)
    ran = time.monotonic()
    output = call(prepared, event)
    done = time.monotonic()
    return {
        "handler": handler,
        "import_s": prepared.import_s,
        "load_s": prepared.load_s,
        "build_s": prepared.build_s,
        "run_s": done - ran,
        "in_process_s": done - prepared.started,
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
