"""`generate_private`: `generate` as it was before continuous batching, one private
decode loop per request on its own handler thread (`ChatLM.stream`), over the same
`smollm2` bundle, builder and request checks, for bench/generation.py to compare
against in the same server process."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from handlers.generate import (
    _ACCELERATOR_WARMUP,
    _item,
    build_smollm2,
    join_completion,
    parse_request,
)
from runtime import Context, handler

if TYPE_CHECKING:
    from handlers.models.chat import ChatLM


# Warmed as `generate` is: on an accelerator only (a CPU's first request costs what
# a steady one does, bench/warmup.py).
@handler(
    "generate_private",
    uses=["smollm2"],
    accelerator_warmup=_ACCELERATOR_WARMUP,
    join=join_completion,
)
def generate_private(event: Any, smollm2: ChatLM, ctx: Context) -> Iterator[dict[str, Any]]:
    """Complete a prompt or a chat in a decode loop of its own."""
    request = parse_request(event, smollm2)
    for piece in smollm2.stream(request.prompt_ids, request.max_tokens, request.opts, request.stop):
        yield _item(piece)


__all__ = ["build_smollm2", "generate_private"]
