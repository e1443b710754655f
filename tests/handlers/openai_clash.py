"""Two handlers that answer to one OpenAI model name for one operation: the registry
refuses the module (which of them a request for `shared-model` meant is unknowable)."""

from __future__ import annotations

from typing import Any

from runtime import Context, OpenAI, handler


@handler("first_embed", openai=OpenAI("embeddings", aliases=["shared-model"]))
def first_embed(event: Any, ctx: Context) -> dict[str, Any]:
    return {"embeddings": [[1.0]]}


@handler("second_embed", openai=OpenAI("embeddings", aliases=["shared-model"]))
def second_embed(event: Any, ctx: Context) -> dict[str, Any]:
    return {"embeddings": [[2.0]]}
