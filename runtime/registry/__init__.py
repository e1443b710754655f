"""The handler API and its discovery.

    from runtime import Context, bundle, handler

    @bundle("tiny-mlp")
    def build(weights, config, device):           # once per instance per bundle version
        ...

    @handler("predict", uses=["tiny-mlp"], warmup=[{"x": [0.0, 0.0]}])
    def predict(event, mlp, ctx):                  # models positional, in `uses` order
        ...

A handler that is a generator (sync or async) streams: each item it yields
reaches a streaming caller as soon as it exists (runtime/dispatch/streams.py),
and a caller that asked for no stream gets `join(items)`, the rule the handler
declares (default: the list of items). One handler serves both:

    @handler("count", join=lambda items: {"text": "".join(items)})
    def count(event, ctx):
        for i in range(event["n"]):
            yield str(i)

A handler may instead declare its work as decode steps (`decode=Decode(...)`):
concurrent calls then share every step (continuous batching,
runtime/dispatch/decode.py). Its function takes the models only and returns
the `Steps` that run them:

    @handler("generate", uses=["smollm2"], decode=Decode(max_sequences=16), join=...)
    def generate(smollm2):
        return GenerateSteps(smollm2)

Such a handler streams (each step's items reach their own caller), and any
path that runs one call on its own (a warm-up example, a direct call of
`spec.fn`) runs the same steps for one sequence (`alone`).

`warmup` may also be a function returning the examples, called on first use:
for examples that take a while to build (discovery runs before the server
listens).

Warm-up is the smallest set of inputs that pays each one-time cost of a path
(kernel and allocator set-up, decoder plugins, tokenizer caches) before any
request does; on a CPU that is a few milliseconds per path, and large inputs
buy nothing. `accelerator_warmup` lists examples run only when the bundle
loads onto an accelerator (CUDA), after `warmup`: there the first call of
each large shape pays its own kernel selection and autotuning, so the large
shapes a handler serves belong there.

The decorators only attach a spec to the function; `discover()` imports the
handler modules and collects the specs into a `Registry`. A module whose
import raises is recorded (`Registry.broken`, runtime/registry/broken.py) and
the others are served; only when none imports is discovery an error. Handler modules must
not import torch at module level (do it inside builders), so discovery stays
cheap and the control interface starts without torch.

The declarations live in runtime/registry/specs.py, discovery in
runtime/registry/discovery.py; this package re-exports both.
"""

from __future__ import annotations

from runtime.registry.discovery import Registry as Registry
from runtime.registry.discovery import discover as discover
from runtime.registry.policies import Batch as Batch
from runtime.registry.policies import Decode as Decode
from runtime.registry.policies import Steps as Steps
from runtime.registry.policies import alone as alone
from runtime.registry.specs import BUILDER_PARAMS as BUILDER_PARAMS
from runtime.registry.specs import BuilderSpec as BuilderSpec
from runtime.registry.specs import HandlerSpec as HandlerSpec
from runtime.registry.specs import LazyExamples as LazyExamples
from runtime.registry.specs import bundle as bundle
from runtime.registry.specs import handler as handler
from runtime.registry.specs import joined as joined
