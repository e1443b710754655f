"""SmolLM2's `generate` under continuous batching (runtime/dispatch/decode.py).

Greedy output is token-for-token the output of each prompt alone (today's private
decode loop, `ChatLM.complete`), over prompts of mixed lengths and batches whose
size changes at every step; a seed gives the same sampled text in a batch as
alone (whether a new prompt runs on its own first, as served, or in chunks beside
the decode rows); and over HTTP concurrent callers get their own answers, a
caller that goes away frees its slot (memory and gauge) at the next step,
sequences the budget cannot admit wait in arrival order and, past a deadline,
become a 202 job, and bad input is a 400 that costs a running sequence nothing.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from handlers.generate import join_completion
from handlers.models.chat import ChatLM, Completion, TextSequence
from handlers.models.llama import Sampling
from runtime.registry import discover
from tests.inproc import listening, serving, settings_for, until
from tests.sse import SSE, aread_events

ALONE = discover(["handlers.generate"]).handler("generate").stream_fn
assert ALONE is not None

TEXTS = [
    "Once upon a time",
    "The capital of France is",
    "def fibonacci(n):",
    "1, 2, 3, 4,",
    "Write a haiku about the sea.",
    "Explain photosynthesis in simple terms to a child who is five years old and curious "
    "about why leaves are green, and what plants eat when they are hungry at night.",
    "Q: What is 12 times 7?\nA:",
    "The best way to learn programming is",
    "Translate to French: Good morning, how are you today, my friend?",
    "Thaw loads a model once and keeps it warm for the requests that follow. " * 6 + "In short,",
]


def prompts(lm: ChatLM) -> list[list[int]]:
    # Raw completions and chat prompts alternate: 4 to ~110 tokens.
    return [
        lm.encode_chat([("user", t)]) if i % 2 else lm.encode_prompt(t) for i, t in enumerate(TEXTS)
    ]


def run_together(
    lm: ChatLM,
    requests: list[tuple[list[int], int, Sampling]],
    admit_per_step: int = 1,
    prefilled: bool = True,
) -> list[Completion]:
    """Every request as one sequence of `ChatLM.advance`, two admitted at first and
    `admit_per_step` more after each step, finished ones dropped: the batch grows and
    shrinks as it would under callers that come and go. `prefilled`: each new one's
    prompt runs on its own first (`run_prompt`, as the served path's `prefill` does);
    otherwise the batched steps run it in chunks beside the decode rows."""
    done: dict[int, Completion] = {}
    waiting = list(enumerate(requests))
    active: list[tuple[int, TextSequence]] = []
    admit = 2
    while waiting or active:
        for index, (ids, max_tokens, opts) in waiting[:admit]:
            sequence = lm.begin(ids, max_tokens, opts, [])
            if prefilled:
                lm.run_prompt(sequence)
            active.append((index, sequence))
        waiting = waiting[admit:]
        admit = admit_per_step
        pieces = lm.advance([s for _, s in active])
        for (index, sequence), out in zip(active, pieces, strict=True):
            if sequence.finished:
                assert isinstance(out[-1], Completion)
                done[index] = out[-1]
                sequence.release()
        active = [(i, s) for i, s in active if not s.finished]
    return [done[i] for i in range(len(requests))]


@pytest.mark.parametrize("prefilled", [True, False], ids=["prefilled", "chunked"])
def test_greedy_in_a_changing_batch_is_each_prompt_alone(smollm2: ChatLM, prefilled: bool) -> None:
    ids = prompts(smollm2)
    lengths = [len(p) for p in ids]
    assert min(lengths) < 8 and max(lengths) > 100  # mixed lengths
    greedy = Sampling()
    requests = [(p, 8 + 2 * (i % 3), greedy) for i, p in enumerate(ids)]  # 8..12 tokens
    alone = [smollm2.complete(p, n, opts, []) for p, n, opts in requests]
    together = run_together(smollm2, requests, prefilled=prefilled)
    for a, t in zip(alone, together, strict=True):
        assert t == a  # text, token counts and finish reason
    assert sum(c.completion_tokens for c in together) > 60


def test_a_seed_samples_the_same_text_whoever_else_is_in_the_batch(smollm2: ChatLM) -> None:
    ids = prompts(smollm2)
    sampled = Sampling(temperature=0.9, top_p=0.95, seed=11)
    mine = (ids[4], 12, sampled)
    alone = smollm2.complete(*mine, [])
    company = [(ids[i], 8, Sampling(temperature=0.8, seed=i)) for i in (0, 5, 9)]
    in_batch = run_together(smollm2, [company[0], mine, *company[1:]], admit_per_step=2)[1]
    assert in_batch == alone
    again = run_together(smollm2, [mine, company[2]])[0]
    assert again == alone


@pytest.fixture(scope="module")
def bundle_root(smollm2_bundle: Path) -> Path:
    return smollm2_bundle.parent


def settings(tmp_path: Path, bundle_root: Path, **overrides: Any) -> Any:
    return settings_for(
        tmp_path,
        bundle_source=str(bundle_root),
        handlers=("handlers.generate",),
        prewarm=("smollm2",),
        **overrides,
    )


async def ready(client: httpx.AsyncClient) -> None:
    async def is_ready() -> bool:
        return (await client.get("/readyz")).status_code == 200

    await until(is_ready, "the instance ready", every_s=0.05)


def decode_gauge(metrics: str, state: str) -> float:
    label = f'thaw_decode_sequences{{handler="generate",state="{state}"}}'
    for line in metrics.splitlines():
        if line.startswith(label):
            return float(line.split()[-1])
    raise AssertionError(f"no {label} in /metrics")


@pytest.mark.anyio
async def test_concurrent_callers_over_http_get_their_own_answers(
    tmp_path: Path, bundle_root: Path, smollm2: ChatLM
) -> None:
    events = [{"prompt": t, "max_tokens": 8} for t in TEXTS[:4]]
    events[1] = {"messages": [{"role": "user", "content": TEXTS[1]}], "max_tokens": 8}
    events[2] = {**events[2], "temperature": 0.7, "seed": 5}
    # Each alone: the handler's own steps, one sequence (what a lone caller runs).
    alone = [join_completion(list(ALONE(event, smollm2, None))) for event in events]
    async with serving(settings(tmp_path, bundle_root), timeout_s=300) as served:
        await ready(served.client)
        plain = [served.client.post("/invoke/generate", json=e) for e in events[:2]]
        streamed = [served.client.post("/invoke/generate", json=e, headers=SSE) for e in events[2:]]
        responses = await asyncio.gather(*plain, *streamed)
        metrics = (await served.client.get("/metrics")).text
    answers = [r.json() for r in responses[:2]]
    for r in responses[2:]:
        assert r.status_code == 200
        result = [line for line in r.text.splitlines() if line.startswith("data:")][-1]
        answers.append(orjson.loads(result.removeprefix("data:")))
    assert answers == alone
    assert decode_gauge(metrics, "running") == 0 and decode_gauge(metrics, "waiting") == 0


@pytest.fixture
def long_stream() -> Iterator[dict[str, Any]]:
    # Counting never stops early: 400 tokens are many seconds of work on a CPU.
    yield {"prompt": "1, 2, 3, 4, 5, 6, 7, 8,", "max_tokens": 400}


@pytest.mark.anyio
async def test_a_caller_that_goes_away_frees_its_slot_at_the_next_step(
    tmp_path: Path, bundle_root: Path, long_stream: dict[str, Any]
) -> None:
    memory = json.loads((bundle_root / "smollm2" / "bundle.json").read_text())["memory"]
    async with listening(settings(tmp_path, bundle_root)) as served:
        instance = served.instance
        budget = instance.cache.budget
        async with served.client(timeout=300) as client:
            await ready(client)
            idle_bytes = budget.reserved_bytes()
            async with served.client(timeout=300) as caller:
                stream = caller.stream("POST", "/invoke/generate", json=long_stream, headers=SSE)
                async with stream as response:
                    events = aread_events(response.aiter_lines())
                    seen = 0
                    async for event in events:
                        seen += "id" in event
                        if seen == 2:
                            break
                    metrics = (await client.get("/metrics")).text
                    assert decode_gauge(metrics, "running") == 1
                    assert budget.admitted("smollm2") == 1
                    await events.aclose()

            # Gone: the next step drops the sequence (its KV cache released), and the
            # budget has its request slot back.
            async def freed() -> bool:
                text = (await client.get("/metrics")).text
                return decode_gauge(text, "running") == 0 and budget.admitted("smollm2") == 0

            await until(freed, "the slot freed", every_s=0.02)
            assert budget.reserved_bytes() == idle_bytes
            assert idle_bytes == memory["weights_bytes"] + memory["per_request_bytes"]


@pytest.mark.anyio
async def test_sequences_the_budget_cannot_admit_wait_in_order_then_become_jobs(
    tmp_path: Path, bundle_root: Path, long_stream: dict[str, Any], smollm2: ChatLM
) -> None:
    memory = json.loads((bundle_root / "smollm2" / "bundle.json").read_text())["memory"]
    one_sequence = memory["weights_bytes"] + memory["per_request_bytes"]
    texts = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]
    short = [{"prompt": t, "max_tokens": 6} for t in texts]
    expected = [smollm2.complete(smollm2.encode_prompt(t), 6, Sampling(), []) for t in texts]
    # No default deadline cuts the first two waiters short on a loaded machine.
    budget = settings(
        tmp_path, bundle_root, memory_budget=one_sequence, wait_s=600.0, max_wait_s=600.0
    )
    async with listening(budget) as served, served.client(timeout=300) as client:
        await ready(client)
        reserved = served.instance.cache.budget
        finished: list[int] = []

        def answered(index: int) -> Any:
            task = asyncio.ensure_future(client.post("/invoke/generate", json=short[index]))
            task.add_done_callback(lambda _: finished.append(index))
            return task

        async with served.client(timeout=300) as first:
            stream = first.stream("POST", "/invoke/generate", json=long_stream, headers=SSE)
            async with stream as response:
                events = aread_events(response.aiter_lines())
                async for event in events:
                    if "id" in event:
                        break
                # The budget holds one sequence: the others wait for its slot, in
                # arrival order; the one with a short deadline is answered 202 at
                # it, never cut short.
                calls = [answered(0)]
                await until(lambda: reserved.waiting("smollm2") == 1, "the first one queued")
                calls.append(answered(1))
                await until(lambda: reserved.waiting("smollm2") == 2, "the second one queued")
                late = await client.post(
                    "/invoke/generate", json=short[2], headers={"Prefer": "wait=0.5", **SSE}
                )
                assert late.status_code == 202, late.text
                location = late.headers["location"]
                assert reserved.admitted("smollm2") == 1
                await events.aclose()
        responses = await asyncio.gather(*calls)
        job = (await client.get(f"{location}?wait=120")).json()
    assert finished == [0, 1]  # one slot: the second began only once the first ended
    for response, want in zip(responses, expected[:2], strict=True):
        assert response.status_code == 200, response.text
        assert response.json()["text"] == want.text
    assert job["status"] == "succeeded", job
    assert job["output"]["text"] == expected[2].text
    assert job["output"]["usage"]["completion_tokens"] == expected[2].completion_tokens


@pytest.mark.anyio
async def test_bad_input_is_a_400_beside_a_running_sequence(
    tmp_path: Path, bundle_root: Path, long_stream: dict[str, Any]
) -> None:
    """An empty prompt, or `max_tokens` past the context, is refused (400 naming the
    field) when its prefill checks it, as JSON and as a stream; the sequence already
    running keeps its slot and its tokens."""
    beyond = {"prompt": "Thaw keeps models warm. " * 400, "max_tokens": 400}  # > 2,048
    bad = [
        ({"prompt": ""}, "prompt"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6}, "max_tokens"),
        (beyond, "prompt"),
    ]
    async with (
        listening(settings(tmp_path, bundle_root)) as served,
        served.client(timeout=300) as client,
    ):
        await ready(client)
        stream = client.stream("POST", "/invoke/generate", json=long_stream, headers=SSE)
        async with stream as response:
            events = aread_events(response.aiter_lines())
            tokens = 0
            async for event in events:
                tokens += "id" in event
                if tokens == 1:
                    break
            for event, field in bad:
                for headers in ({}, SSE):
                    refused = await client.post("/invoke/generate", json=event, headers=headers)
                    assert refused.status_code == 400, refused.text
                    problem = refused.json()
                    assert problem["type"].endswith("/invalid-input"), problem
                    assert problem["field"] == field, problem
            # The running sequence lost nothing: its tokens keep coming.
            async for event in events:
                tokens += "id" in event
                if tokens == 3:
                    break
            assert tokens == 3
            metrics = (await client.get("/metrics")).text
            assert decode_gauge(metrics, "running") == 1
            await events.aclose()
