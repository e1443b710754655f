"""How a handler declares the OpenAI operations it serves (`@handler(openai=...)`):
each form the decorator takes, the shipped handlers' declarations, and every
malformed declaration refused where it is written, with what is wrong."""

from __future__ import annotations

from typing import Any

import pytest

from runtime import Context, OpenAI, handler
from runtime.errors import ConfigError
from runtime.registry import HandlerSpec, discover
from runtime.wire.openai_spec import clash


def declared(fn: Any) -> OpenAI | None:
    spec: HandlerSpec = fn.__thaw_spec__  # what the decorator recorded (runtime/registry.py)
    return spec.openai


def test_the_forms_the_decorator_takes() -> None:
    @handler("as_string", openai="embeddings")
    def as_string(event: Any, ctx: Context) -> Any:
        return event

    @handler("as_list", openai=["chat", "completions", "chat"])
    def as_list(event: Any, ctx: Context) -> Any:
        return event

    @handler("as_object", openai=OpenAI("embeddings", aliases=["m"], dimensions=3))
    def as_object(event: Any, ctx: Context) -> Any:
        return event

    @handler("undeclared")
    def undeclared(event: Any, ctx: Context) -> Any:
        return event

    assert declared(as_string) == OpenAI("embeddings")
    assert declared(as_list) == OpenAI("chat", "completions")  # each operation once
    assert declared(as_object) == OpenAI("embeddings", aliases=["m"], dimensions=3)
    assert declared(undeclared) is None


def test_the_shipped_handlers_declare_theirs_a_decode_handler_too() -> None:
    registry = discover(["handlers.embed", "handlers.generate", "handlers.echo"])
    embed = registry.handlers["embed"].openai
    generate = registry.handlers["generate"].openai
    assert embed is not None and embed.operations == ("embeddings",)
    assert embed.dimensions == 384 and "all-MiniLM-L6-v2" in embed.aliases
    assert generate is not None and generate.operations == ("chat", "completions")
    assert registry.handlers["generate"].decode is not None  # kept through decode=
    assert registry.handlers["echo"].openai is None


@pytest.mark.parametrize(
    ("args", "kwargs", "says"),
    [
        ((), {}, "at least one operation"),
        (("moderations",), {}, "'moderations' is not one of"),
        (("embeddings",), {"aliases": [""]}, "aliases must be non-empty strings"),
        (("embeddings",), {"aliases": [3]}, "aliases must be non-empty strings"),
        (("embeddings",), {"dimensions": 0}, "dimensions must be an int >= 1"),
        (("embeddings",), {"dimensions": True}, "dimensions must be an int >= 1"),
    ],
)
def test_a_malformed_declaration_is_refused_saying_what(
    args: tuple[str, ...], kwargs: dict[str, Any], says: str
) -> None:
    with pytest.raises(ValueError, match=says):
        OpenAI(*args, **kwargs)


def test_a_malformed_string_form_is_refused_where_the_handler_is_declared() -> None:
    with pytest.raises(ValueError, match="'embedding' is not one of"):

        @handler("misspelt", openai="embedding")
        def misspelt(event: Any, ctx: Context) -> Any:
            return event


def test_two_handlers_answering_to_one_model_name_are_refused() -> None:
    with pytest.raises(ConfigError, match="'shared-model' for embeddings") as refused:
        discover(["tests.handlers.openai_clash"])
    assert "first_embed" in str(refused.value) and "second_embed" in str(refused.value)
    # One name for different operations is no clash; a handler's alias of its own name is none.
    assert (
        clash([("a", OpenAI("embeddings", aliases=["m"])), ("b", OpenAI("chat", aliases=["m"]))])
        is None
    )
    assert clash([("a", OpenAI("embeddings", aliases=["a"]))]) is None
    # A handler's name is a model name too.
    found = clash([("a", OpenAI("chat")), ("b", OpenAI("chat", aliases=["a"]))])
    assert found is not None and "'a' for chat" in found
