"""`builder_raises`: a bundle whose builder prints, then raises ValueError from a helper
of its own (two user frames: the builder and `_shape_of`); the handler never runs.
`prints_then_answers`: a handler that prints to stdout and answers {"ok": true}."""

from __future__ import annotations

from typing import Any

from runtime import Context, bundle, handler


def _shape_of(config: dict[str, Any]) -> int:
    return int(config["no such key"])  # KeyError here, turned into the ValueError below


@bundle("builder-raises")
def build(config: dict[str, Any]) -> Any:
    print("building builder-raises (a print that must not reach stdout)")
    try:
        return _shape_of(config)
    except KeyError as exc:
        raise ValueError("the builder cannot build this bundle") from exc


@handler("builder_raises", uses=["builder-raises"])
def builder_raises(event: Any, model: Any, ctx: Context) -> Any:
    return {"never": True}


@handler("prints_then_answers")
def prints_then_answers(event: Any, ctx: Context) -> Any:
    print("a handler's print (must go to stderr)")
    return {"ok": True}
