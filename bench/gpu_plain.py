"""The shipped handlers without `accelerator_warmup` (THAW_HANDLERS=bench.gpu_plain).

bench/gpu.py serves these to measure what a first request pays on a device
when only the CPU warm-up ran at load: the same builders, the same `warmup`
examples, batching and join rule, each call passed to the shipped function
unchanged; only the accelerator's large shapes are left out.
"""

from __future__ import annotations

from typing import Any

from handlers import classify as _classify
from handlers import embed as _embed
from handlers import generate as _generate
from handlers.classify import build_efficientnet  # noqa: F401  (the registry collects it)
from handlers.embed import build_minilm  # noqa: F401
from handlers.generate import build_smollm2  # noqa: F401
from runtime import Context, handler
from runtime.registry import discover

_SHIPPED = discover(["handlers.embed", "handlers.classify", "handlers.generate"])
_EMBED = _SHIPPED.handler("embed")
_CLASSIFY = _SHIPPED.handler("classify")
_GENERATE = _SHIPPED.handler("generate")


@handler("embed", uses=["minilm"], warmup=lambda: list(_EMBED.warmup), batch=_EMBED.batch)
def embed(events: list[Any], minilm: Any, ctxs: list[Context]) -> list[Any]:
    """`embed`, without its accelerator warm-up."""
    return _embed.embed(events, minilm, ctxs)


@handler(
    "classify",
    uses=["efficientnet"],
    warmup=lambda: list(_CLASSIFY.warmup),
    batch=_CLASSIFY.batch,
)
def classify(events: list[Any], efficientnet: Any, ctxs: list[Context]) -> list[Any]:
    """`classify`, without its accelerator warm-up."""
    return _classify.classify(events, efficientnet, ctxs)


@handler(
    "generate",
    uses=["smollm2"],
    warmup=lambda: list(_GENERATE.warmup),
    join=_GENERATE.join,
    decode=_GENERATE.decode,
)
def generate(smollm2: Any) -> Any:
    """`generate`, without its accelerator warm-up: the same decode steps."""
    return _generate.generate(smollm2)
