"""The shipped `embed` and `generate` behind the /v1 routes, real models over real HTTP
with the official `openai` client: the same vectors and texts as /invoke, usage as
each model's tokenizer counts it, and a /v1 chat stream sharing decode steps with
an /invoke/generate stream (continuous batching: one decode lane, both sequences
held by every step)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest

from handlers.models.chat import ChatLM
from handlers.models.minilm import MiniLM
from tests.inproc import listening, settings_for, until
from tests.sse import SSE, aread_events

pytestmark = pytest.mark.anyio

COUNT = "Count from 1 to 300, separated by commas, with nothing else."
TEXTS = ["A man is eating food.", "Serverless inference keeps models warm.", "hi"]


def settings(tmp_path: Path, bundle: Path, handler: str) -> Any:
    return settings_for(
        tmp_path,
        bundle_source=str(bundle.parent),
        handlers=(f"handlers.{handler}",),
        prewarm=(bundle.name,),
    )


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", timeout=300)


async def _ready(http: Any) -> bool:
    return bool((await http.get("/readyz")).status_code == 200)


async def test_v1_embeddings_are_invoke_embeds_vectors_with_tokenizer_usage(
    tmp_path: Path, minilm_bundle: Path, minilm: MiniLM
) -> None:
    served_at = listening(settings(tmp_path, minilm_bundle, "embed"))
    async with served_at as served, served.client(timeout=300) as http, client(served.url) as oa:
        invoked = (await http.post("/invoke/embed", json={"texts": TEXTS})).json()
        alone = (await http.post("/invoke/embed", json={"texts": TEXTS[:1]})).json()
        as_base64 = await oa.embeddings.create(model="all-MiniLM-L6-v2", input=TEXTS)
        as_floats = await oa.embeddings.create(
            model="embed", input=TEXTS[0], encoding_format="float", dimensions=384
        )
        with pytest.raises(openai.BadRequestError) as dims:
            await oa.embeddings.create(model="minilm", input="x", dimensions=128)
    tokens = sum(len(minilm.tokenizer.encode(t).ids) for t in TEXTS)
    assert invoked["usage"] == {"prompt_tokens": tokens}
    assert as_base64.usage.prompt_tokens == as_base64.usage.total_tokens == tokens
    # base64 carries float32, as the model computed them: equal to the JSON floats.
    assert [d.embedding for d in as_base64.data] == invoked["embeddings"]
    # (a text alone pads differently from one among others: the same text alone here)
    assert as_floats.data[0].embedding == alone["embeddings"][0]
    assert dims.value.param == "dimensions"


async def test_v1_chat_is_invoke_generate_with_tokenizer_usage(
    tmp_path: Path, smollm2_bundle: Path, smollm2: ChatLM
) -> None:
    content = "Name three colours."
    event = {"messages": [{"role": "user", "content": content}], "max_tokens": 12}
    served_at = listening(settings(tmp_path, smollm2_bundle, "generate"))
    async with served_at as served, served.client(timeout=300) as http, client(served.url) as oa:
        invoked = (await http.post("/invoke/generate", json=event)).json()
        chat = await oa.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=event["messages"], max_tokens=12
        )
        completion = await oa.completions.create(
            model="smollm2", prompt="The capital of France is", max_tokens=5
        )
    prompt_tokens = len(smollm2.encode_chat([("user", content)]))
    assert chat.choices[0].message.content == invoked["text"]
    assert chat.choices[0].finish_reason == invoked["finish_reason"]
    assert chat.usage is not None and chat.usage.prompt_tokens == prompt_tokens
    assert chat.usage.completion_tokens == invoked["usage"]["completion_tokens"]
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == len(smollm2.encode_prompt("The capital of France is"))
    assert completion.usage.completion_tokens == 5 and completion.choices[0].text


def gauge(metrics: str, state: str) -> float:
    label = f'thaw_decode_sequences{{handler="generate",state="{state}"}}'
    return next(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(label))


async def test_a_v1_chat_stream_shares_decode_steps_with_an_invoke_stream(
    tmp_path: Path, smollm2_bundle: Path
) -> None:
    counting = "1, 2, 3, 4, 5, 6, 7, 8,"  # never stops early: many steps on a CPU
    served_at = listening(settings(tmp_path, smollm2_bundle, "generate"))
    async with served_at as served, served.client(timeout=300) as http, client(served.url) as oa:
        await until(lambda: _ready(http), "the instance ready", every_s=0.05)
        chat = await oa.chat.completions.create(
            model="generate",
            messages=[{"role": "user", "content": COUNT}],
            max_tokens=400,
            stream=True,
        )
        chunks = chat.__aiter__()
        first = await chunks.__anext__()
        assert first.choices[0].delta.role == "assistant"
        body = {"prompt": counting, "max_tokens": 400}
        async with http.stream("POST", "/invoke/generate", json=body, headers=SSE) as r:
            events = aread_events(r.aiter_lines())
            async for item in events:
                if "id" in item:
                    break

            async def both_held() -> bool:
                text = (await http.get("/metrics")).text
                return gauge(text, "running") == 2

            # One lane holds both sequences: every step advances the two together.
            await until(both_held, "both sequences in one decode step", every_s=0.02)
            more = await chunks.__anext__()
            assert more.choices[0].finish_reason is None  # still going
            async for item in events:
                if "id" in item:
                    assert orjson.loads(item["data"])["text"] is not None
                    break
            await events.aclose()
        await chat.close()
        await asyncio.sleep(0)
