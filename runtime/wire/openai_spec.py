"""A handler's OpenAI declaration: which OpenAI operations it serves, under which names.

    @handler("embed", uses=["minilm"], batch=..., openai=OpenAI("embeddings",
             aliases=["all-MiniLM-L6-v2"], dimensions=384))
    @handler("generate", uses=["smollm2"], decode=..., openai=OpenAI("chat", "completions"))
    @handler("mine", openai="embeddings")                 # a plain string: one operation

An operation is what the handler's event and output look like, so that
runtime/http/openai/ can translate OpenAI's request and answer bodies to and
from them (docs/openai.md):

    embeddings    event {"texts": [str, ...]}
                  -> {"embeddings": [[float, ...], ...], "usage"?: {"prompt_tokens"}}
    chat          event {"messages": [{"role", "content"}], "max_tokens", "temperature",
                  "top_p", "stop", "seed"} (only those given)
                  -> {"text", "finish_reason", "usage": {"prompt_tokens", "completion_tokens"}};
                  streamed: items {"text": delta}, the last with finish_reason and usage
    completions   the same with {"prompt": str} for "messages"

`model` in a request names the handler or one of its `aliases`; for each
operation, a name is one handler's (`clash`: the registry refuses two). `dimensions`,
when set, is the one `dimensions` an embeddings request may ask for (the
model's own); any other is refused, never ignored.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

OPERATIONS = ("embeddings", "chat", "completions")


@dataclass(frozen=True, init=False)
class OpenAI:
    """The OpenAI operations a handler serves, and the other names it answers to."""

    operations: tuple[str, ...]
    aliases: tuple[str, ...]
    dimensions: int | None

    def __init__(
        self, *operations: str, aliases: Iterable[str] = (), dimensions: int | None = None
    ) -> None:
        if not operations:
            raise ValueError(f"OpenAI(...) needs at least one operation of {OPERATIONS}")
        for op in operations:
            if op not in OPERATIONS:
                raise ValueError(f"OpenAI operation {op!r} is not one of {OPERATIONS}")
        names = tuple(aliases)
        if not all(isinstance(n, str) and n for n in names):
            raise ValueError("OpenAI aliases must be non-empty strings")
        if dimensions is not None and (isinstance(dimensions, bool) or dimensions < 1):
            raise ValueError(f"OpenAI dimensions must be an int >= 1, not {dimensions!r}")
        object.__setattr__(self, "operations", tuple(dict.fromkeys(operations)))
        object.__setattr__(self, "aliases", names)
        object.__setattr__(self, "dimensions", dimensions)

    @classmethod
    def of(cls, value: OpenAI | str | Iterable[str] | None) -> OpenAI | None:
        """A declaration from what `@handler(openai=...)` was given."""
        if value is None or isinstance(value, OpenAI):
            return value
        if isinstance(value, str):
            return cls(value)
        return cls(*value)


def clash(declared: Iterable[tuple[str, OpenAI]]) -> str | None:
    """What is wrong where two handlers answer to one model name for one operation; None
    if no two do."""
    owner: dict[tuple[str, str], str] = {}
    for handler, openai in declared:
        for name in dict.fromkeys((handler, *openai.aliases)):
            for op in openai.operations:
                first = owner.setdefault((op, name), handler)
                if first != handler:
                    return (
                        f"handlers {first!r} and {handler!r} both answer to the OpenAI model "
                        f"{name!r} for {op}: give each its own names (OpenAI(aliases=...))"
                    )
    return None
