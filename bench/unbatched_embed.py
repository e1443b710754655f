"""`embed_unbatched`: the `embed` handler as it was before batching (one call and one
forward pass per request), over the same `minilm` bundle and builder, for
bench/batching.py to compare against in the same server process."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from handlers.embed import MAX_TEXT_CHARS, MAX_TEXTS, build_minilm
from handlers.models.fields import check_event, get_str_list, require
from runtime import Context, handler

if TYPE_CHECKING:
    from handlers.models.minilm import MiniLM


@handler("embed_unbatched", uses=["minilm"], warmup=[{"texts": ["hi"]}])
def embed_unbatched(event: dict[str, Any], minilm: MiniLM, ctx: Context) -> dict[str, Any]:
    """Embed up to 32 texts as 384-d unit vectors, one request per call."""
    fields = check_event(event, {"texts"})
    texts = get_str_list(require(fields, "texts"), "texts", MAX_TEXTS, MAX_TEXT_CHARS)
    return {"embeddings": minilm.encode(texts).tolist(), "dim": minilm.dim}


__all__ = ["build_minilm", "embed_unbatched"]
