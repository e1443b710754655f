"""Refusals on the /v1 routes: OpenAI's error body and the statuses its clients map to
exception classes, each parameter Thaw cannot honour refused (never ignored), the
caller's key checked, and the request id on every answer."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.handlers import openai_fakes
from tests.inproc import listening, serving, until
from tests.openai.conftest import openai_settings

pytestmark = pytest.mark.anyio

USER = [{"role": "user", "content": "hello there"}]


def client(url: str, **kwargs: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0, **kwargs)


@pytest.mark.parametrize(
    ("call", "param"),
    [
        ({"n": 2}, "n"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"logit_bias": {"1": 2}}, "logit_bias"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content[0]",
        ),
        (
            {"messages": [{"role": "tool", "content": "x", "tool_call_id": "1"}]},
            "messages[0].tool_call_id",
        ),
        ({"messages": [{"role": "user", "content": "x", "name": "me"}]}, "messages[0].name"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
async def test_chat_parameters_thaw_cannot_honour_are_refused(
    tmp_path: Path, call: dict[str, Any], param: str
) -> None:
    openai_fakes.EVENTS.clear()
    args = {"model": "fake_chat", "messages": USER, **call}
    async with listening(openai_settings(tmp_path)) as served, client(served.url) as oa:
        with pytest.raises(openai.BadRequestError) as refused:
            await oa.chat.completions.create(**args)
    assert refused.value.status_code == 400 and refused.value.param == param
    assert refused.value.type == "invalid_request_error"
    assert refused.value.code in ("unsupported_parameter", "invalid_input")
    assert param.split(".")[0].split("[")[0] in refused.value.message
    assert openai_fakes.EVENTS == []  # refused before any work


async def test_embedding_and_completion_parameters_too(tmp_path: Path) -> None:
    async with listening(openai_settings(tmp_path)) as served, client(served.url) as oa:
        with pytest.raises(openai.BadRequestError) as dims:
            await oa.embeddings.create(model="fake_embed", input="x", dimensions=2)
        same = await oa.embeddings.create(model="fake_embed", input="x", dimensions=3)
        with pytest.raises(openai.BadRequestError) as many:
            await oa.embeddings.create(model="fake_embed", input=["x"] * 2049)
        with pytest.raises(openai.BadRequestError) as tokens:
            await oa.embeddings.create(model="fake_embed", input=[[1, 2, 3]])
        with pytest.raises(openai.BadRequestError) as prompts:
            await oa.completions.create(model="fake_chat", prompt=["a", "b"])
        with pytest.raises(openai.BadRequestError) as best:
            await oa.completions.create(model="fake_chat", prompt="a", best_of=3)
    assert dims.value.param == "dimensions" and "3" in dims.value.message
    assert len(same.data[0].embedding) == 3
    assert tokens.value.param == "input[0]"
    assert many.value.param == "input" and "2048" in many.value.message
    assert prompts.value.param == "prompt" and best.value.param == "best_of"


async def test_the_handlers_own_refusal_is_a_400_naming_its_field(tmp_path: Path) -> None:
    """Within OpenAI's bounds, past the handler's own (the fake's 64 tokens), whole and
    streamed: the stream's refusal is a 400 before any chunk."""
    openai_fakes.EVENTS.clear()
    async with listening(openai_settings(tmp_path)) as served, client(served.url) as oa:
        with pytest.raises(openai.BadRequestError) as whole:
            await oa.chat.completions.create(model="fake_chat", messages=USER, max_tokens=100)
        with pytest.raises(openai.BadRequestError) as streamed:
            await oa.chat.completions.create(
                model="fake_chat", messages=USER, max_completion_tokens=65, stream=True
            )
    assert whole.value.param == "max_tokens" and whole.value.code == "invalid_input"
    assert streamed.value.param == "max_tokens" and "64" in streamed.value.message
    assert [event["max_tokens"] for event in openai_fakes.EVENTS] == [100, 65]


@pytest.mark.parametrize(
    ("call", "param"),
    [
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": "high"}, "top_p"),
        ({"seed": 1.5}, "seed"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": True}, "max_completion_tokens"),
        ({"max_tokens": 4, "max_completion_tokens": 5}, "max_completion_tokens"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": [1]}, "stop"),
        ({"stop": []}, "stop"),
        ({"stream": "yes"}, "stream"),
    ],
)
async def test_values_outside_openais_bounds_are_refused_before_the_handler(
    tmp_path: Path, call: dict[str, Any], param: str
) -> None:
    """OpenAI's documented ranges hold for every handler (the OpenAPI document states them),
    whether or not the handler checks the field itself (the fake checks no top_p)."""
    openai_fakes.EVENTS.clear()
    async with serving(openai_settings(tmp_path)) as served:
        body = {"model": "fake_chat", "messages": USER, **call}
        answer = await served.client.post("/v1/chat/completions", json=body)
        completion = await served.client.post(
            "/v1/completions", json={"model": "fake_chat", "prompt": "hi", **call}
        )
    # (max_completion_tokens is chat's alone: /v1/completions refuses it as unsupported.)
    for refused in (answer, completion):
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error"
    assert openai_fakes.EVENTS == []


async def test_an_unknown_model_is_a_404_naming_model(tmp_path: Path) -> None:
    async with listening(openai_settings(tmp_path)) as served, client(served.url) as oa:
        with pytest.raises(openai.NotFoundError) as unknown:
            await oa.chat.completions.create(model="gpt-4o", messages=USER)
        # A handler that exists but does not serve the operation is no such model either.
        with pytest.raises(openai.NotFoundError) as other:
            await oa.embeddings.create(model="fake_chat", input="x")
        with pytest.raises(openai.NotFoundError):
            await oa.chat.completions.create(model="plain", messages=USER)
    for error in (unknown.value, other.value):
        assert error.code == "model_not_found" and error.param == "model"
        assert error.type == "not_found_error" and error.request_id


async def test_a_failure_midway_through_a_stream_raises_in_the_client(tmp_path: Path) -> None:
    async with listening(openai_settings(tmp_path)) as served, client(served.url) as oa:
        stream = await oa.chat.completions.create(
            model="fake_chat", messages=[{"role": "user", "content": "fail midway"}], stream=True
        )
        seen: list[str] = []
        with pytest.raises(openai.APIError) as failed:
            async for chunk in stream:
                seen.append(chunk.choices[0].delta.content or "")
    assert "".join(seen) == "fail"
    assert "the fake model failed midway" in failed.value.message
    assert failed.value.code == "handler_error" and failed.value.type == "server_error"


async def test_keys_are_the_bearer_token(tmp_path: Path) -> None:
    settings = openai_settings(tmp_path, api_keys=("sk-thaw-good",))
    async with listening(settings) as served:
        async with openai.AsyncOpenAI(
            base_url=f"{served.url}/v1", api_key="sk-wrong", max_retries=0
        ) as bad:
            with pytest.raises(openai.AuthenticationError) as refused:
                await bad.models.list()
        async with openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="sk-thaw-good") as good:
            done = await good.embeddings.create(model="fake_embed", input="ok")
    assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"
    assert refused.value.type == "authentication_error"
    assert "sk-wrong" not in refused.value.message
    assert done.data[0].embedding == [2.0, 1.0, 0.5]


async def test_error_bodies_are_openais_shape_on_every_v1_answer(tmp_path: Path) -> None:
    async with serving(openai_settings(tmp_path)) as served:
        c = served.client
        answers = {
            "bad json": await c.post("/v1/embeddings", content=b"{nope"),
            "not an object": await c.post("/v1/chat/completions", json=[1]),
            "no model": await c.post("/v1/embeddings", json={"input": "x"}),
            "no route": await c.get("/v1/files"),
            "wrong method": await c.get("/v1/embeddings"),
            "bad timeout": await c.post(
                "/v1/embeddings",
                json={"model": "fake_embed", "input": "x"},
                headers={"X-Stainless-Read-Timeout": "soon"},
            ),
        }
        problem = await c.post("/invoke/nobody", json={})
    statuses = {name: r.status_code for name, r in answers.items()}
    assert statuses == {
        "bad json": 400,
        "not an object": 400,
        "no model": 400,
        "no route": 404,
        "wrong method": 405,
        "bad timeout": 400,
    }
    for name, answer in answers.items():
        assert answer.headers["content-type"] == "application/json", name
        error = answer.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, name
        assert isinstance(error["message"], str) and error["message"], name
        assert answer.headers["x-request-id"], name
    assert answers["bad json"].json()["error"]["code"] == "invalid_json"
    assert answers["no model"].json()["error"]["param"] == "model"
    assert answers["wrong method"].headers["allow"] == "POST"
    assert answers["bad timeout"].json()["error"]["param"] == "x-stainless-read-timeout"
    # Outside /v1 the contract's problem+json stays as it was.
    assert problem.headers["content-type"] == "application/problem+json"


async def test_v1_embeddings_share_a_batch_with_invoke_embed(tmp_path: Path) -> None:
    """The same batcher: a /v1 request and an /invoke one queued behind a held batch
    run as one batch."""
    openai_fakes.BATCHES.clear()
    openai_fakes.GATE.clear()
    async with listening(openai_settings(tmp_path)) as served, served.client() as http:
        await http.post("/invoke/fake_embed", json={"texts": ["warm"]})
        assert openai_fakes.BATCHES == [1]
        held = asyncio.ensure_future(http.post("/invoke/fake_embed", json={"texts": ["hold"]}))
        await until(lambda: len(openai_fakes.BATCHES) == 2, "the held batch runs")
        async with client(served.url) as oa:
            v1 = asyncio.ensure_future(oa.embeddings.create(model="fake_embed", input="v one"))
            plain = asyncio.ensure_future(http.post("/invoke/fake_embed", json={"texts": ["p"]}))

            def queued() -> bool:
                return served.instance.dispatcher.pending["fake_embed"] == 3

            await until(queued, "both requests queued behind the held batch")
            openai_fakes.GATE.set()
            answered, invoked, _ = await asyncio.gather(v1, plain, held)
    assert openai_fakes.BATCHES == [1, 1, 2]
    assert answered.data[0].embedding == [5.0, 2.0, 0.5]
    assert invoked.json()["embeddings"] == [[1.0, 1.0, 0.5]]
    assert isinstance(invoked, httpx.Response)
