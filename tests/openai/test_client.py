"""The official `openai` package against Thaw's /v1 routes over real HTTP, sync and
async, streamed and not, as a user calls it: answers, usage, parameters reaching
the handler, refusals as the client's own exception classes, request ids."""

from __future__ import annotations

import asyncio
import base64
import struct
from pathlib import Path

import openai
import pytest

from tests.handlers import openai_fakes
from tests.inproc import listening
from tests.openai.conftest import openai_settings

pytestmark = pytest.mark.anyio


def client(url: str, **kwargs: object) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", **kwargs)  # type: ignore[arg-type]


async def test_embeddings_as_floats_and_as_the_clients_default_base64(tmp_path: Path) -> None:
    async with listening(openai_settings(tmp_path)) as served, client(served.url) as oa:
        one = await oa.embeddings.create(model="fake_embed", input="a b c")
        many = await oa.embeddings.create(
            model="fake-embedding-3", input=["hi there", "x"], encoding_format="float"
        )
        raw = await oa.embeddings.with_raw_response.create(
            model="fake_embed", input=["one two"], encoding_format="base64"
        )
    # The client asks for base64 when no format is given, and decodes it itself.
    assert one.data[0].embedding == [5.0, 3.0, 0.5]
    assert one.usage.prompt_tokens == 3 and one.usage.total_tokens == 3
    assert one.model == "fake_embed" and one.object == "list"
    assert [d.embedding for d in many.data] == [[8.0, 2.0, 0.5], [1.0, 1.0, 0.5]]
    assert [d.index for d in many.data] == [0, 1] and many.model == "fake-embedding-3"
    body = raw.http_response.json()
    packed = base64.b64decode(body["data"][0]["embedding"])
    assert list(struct.unpack("<3f", packed)) == [7.0, 2.0, 0.5]
    assert raw.headers["x-request-id"]
    assert one._request_id and many._request_id and one._request_id != many._request_id


async def test_chat_whole_and_streamed_with_usage(tmp_path: Path) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a b c d"}]
    async with listening(openai_settings(tmp_path)) as served, client(served.url) as oa:
        whole = await oa.chat.completions.create(model="fake_chat", messages=messages)
        stream = await oa.chat.completions.create(
            model="fake-chat",
            messages=messages,
            stream=True,
            stream_options={"include_usage": True},
            max_completion_tokens=3,
        )
        chunks = [chunk async for chunk in stream]
    # The request id the client surfaces (X-Request-Id) is the completion's own id too.
    assert whole._request_id and whole.id == f"chatcmpl-{whole._request_id}"
    streamed_id = stream.response.headers["x-request-id"]
    assert streamed_id and streamed_id != whole._request_id
    assert {c.id for c in chunks} == {f"chatcmpl-{streamed_id}"}
    assert whole.choices[0].message.content == "a b c d"
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason == "stop" and whole.object == "chat.completion"
    assert whole.usage is not None
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (4, 4)
    assert whole.usage.total_tokens == 8
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "a b c"
    assert chunks[0].choices[0].delta.role == "assistant"
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "length" and set(reasons[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 3
    assert all(c.usage is None for c in chunks[:-1])


async def test_parameters_reach_the_handler_as_its_event(tmp_path: Path) -> None:
    openai_fakes.EVENTS.clear()
    async with listening(openai_settings(tmp_path)) as served, client(served.url) as oa:
        done = await oa.completions.create(
            model="fake_chat",
            prompt="one two three four",
            max_tokens=8,
            temperature=0.5,
            top_p=0.9,
            seed=7,
            stop="three",
            n=1,
        )
        await oa.chat.completions.create(
            model="fake_chat",
            messages=[{"role": "developer", "content": [{"type": "text", "text": "x y"}]}],
            stop=["q"],
        )
    assert done.choices[0].text == "one two" and done.choices[0].finish_reason == "stop"
    assert done.object == "text_completion"
    assert openai_fakes.EVENTS == [
        {
            "prompt": "one two three four",
            "max_tokens": 8,
            "temperature": 0.5,
            "top_p": 0.9,
            "seed": 7,
            "stop": ["three"],
        },
        {"messages": [{"role": "system", "content": "x y"}], "stop": ["q"]},
    ]


async def test_a_completion_streams_text_chunks_then_done(tmp_path: Path) -> None:
    async with listening(openai_settings(tmp_path)) as served, client(served.url) as oa:
        stream = await oa.completions.create(model="fake_chat", prompt="p q r", stream=True)
        chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].text for c in chunks) == "p q r"
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_the_sync_client_too(tmp_path: Path) -> None:
    async def main() -> tuple[str, list[str], list[float]]:
        async with listening(openai_settings(tmp_path)) as served:

            def call() -> tuple[str, list[str], list[float]]:
                with openai.OpenAI(base_url=f"{served.url}/v1", api_key="k") as oa:
                    whole = oa.chat.completions.create(
                        model="fake_chat", messages=[{"role": "user", "content": "s t"}]
                    )
                    stream = oa.chat.completions.create(
                        model="fake_chat",
                        messages=[{"role": "user", "content": "u v w"}],
                        stream=True,
                    )
                    parts = [c.choices[0].delta.content or "" for c in stream if c.choices]
                    vector = oa.embeddings.create(model="fake_embed", input="z").data[0]
                    return whole.choices[0].message.content or "", parts, vector.embedding

            return await asyncio.to_thread(call)

    whole, parts, vector = asyncio.run(main())
    assert whole == "s t" and "".join(parts) == "u v w" and vector == [1.0, 1.0, 0.5]


async def test_models_lists_every_name_the_routes_answer_to(tmp_path: Path) -> None:
    async with listening(openai_settings(tmp_path)) as served, client(served.url) as oa:
        names = [m.id async for m in oa.models.list()]
        one = await oa.models.retrieve("fake-chat")
        with pytest.raises(openai.NotFoundError) as missing:
            await oa.models.retrieve("plain")
    assert names == ["fake_chat", "fake-chat", "fake_embed", "fake-embedding-3"]
    assert one.id == "fake-chat" and one.object == "model"
    assert missing.value.code == "model_not_found"
