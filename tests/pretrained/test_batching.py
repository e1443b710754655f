"""`embed` and `classify` batched: the same answers as one request at a time.

Direct calls put chosen events in one batch; over HTTP a real `thaw serve`
batches concurrent callers as they come, and each must still get exactly its
own answer.
"""

from __future__ import annotations

import base64
import concurrent.futures
import io
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from handlers.classify import classify
from handlers.embed import embed
from handlers.models.efficientnet import ImageClassifier
from handlers.models.minilm import MiniLM
from runtime import Context, InvalidInput
from tests.pretrained.test_classify import grace_hopper
from tests.support import ServerProcess

TEXTS = [
    "A man is eating food.",
    "The new movie is awesome.",
    "Serverless inference keeps a model warm between requests, so callers wait less. " * 4,
    "hi",
    "Two men pushed carts through the woods.",
    "word " * 300,  # truncated at 256 tokens
]


def ctxs(n: int) -> list[Context]:
    return [Context(request_id=f"r{i}", handler="h") for i in range(n)]


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for u, v in zip(a, b, strict=True) for x, y in zip(u, v, strict=True))


def test_batched_embeddings_match_one_request_at_a_time(minilm: MiniLM) -> None:
    events: list[Any] = [{"texts": [t]} for t in TEXTS]
    events.insert(2, {"texts": TEXTS[:4]})  # a request of several texts among single ones
    events.insert(4, {"texts": "not a list"})  # refused: only its own caller fails
    together = embed(events, minilm, ctxs(len(events)))
    assert len(together) == len(events)
    refused = together[4]
    assert isinstance(refused, InvalidInput) and refused.field == "texts"
    for event, output in zip(events, together, strict=True):
        if event is events[4]:
            continue
        [alone] = embed([event], minilm, ctxs(1))
        assert max_diff(output["embeddings"], alone["embeddings"]) < 1e-5


def _image(color: tuple[int, int, int], size: tuple[int, int]) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, "PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def test_batched_classes_match_one_request_at_a_time(efficientnet: ImageClassifier) -> None:
    events: list[Any] = [
        {"image": base64.b64encode(grace_hopper()).decode(), "top_k": 5},
        {"image": _image((200, 30, 30), (64, 48))},
        {"image": "!!! not base64"},
        {"image": _image((20, 140, 220), (300, 200)), "top_k": 3},
    ]
    together = classify(events, efficientnet, ctxs(len(events)))
    assert isinstance(together[2], InvalidInput) and together[2].field == "image"
    assert together[0]["labels"][0]["index"] == 652
    for index in (0, 1, 3):
        [alone] = classify([events[index]], efficientnet, ctxs(1))
        assert [c["index"] for c in together[index]["labels"]] == [
            c["index"] for c in alone["labels"]
        ]
        for a, b in zip(together[index]["labels"], alone["labels"], strict=True):
            assert a["score"] == pytest.approx(b["score"], abs=1e-5)


def test_concurrent_callers_over_http_each_get_their_own_answer(
    minilm: MiniLM, minilm_bundle: Path, thaw_env: dict[str, str]
) -> None:
    env = {
        **thaw_env,
        "THAW_BUNDLE_SOURCE": str(minilm_bundle.parent),
        "THAW_HANDLERS": "handlers.embed",
        "THAW_PREWARM": "minilm",
    }
    sentences = [f"Sentence number {i} is about {w}." for i, w in enumerate("abcdefghijklmnop")]
    with ServerProcess(env) as server, server.client(timeout=120) as client:

        def call(body: Any) -> Any:
            return client.post("/invoke/embed", json=body, headers={"Prefer": "wait=60"})

        bodies: list[Any] = [{"texts": [s]} for s in sentences]
        bodies.insert(5, {"texts": [7]})
        with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
            replies = list(pool.map(call, bodies))
        expected = minilm.encode(sentences).tolist()
        got = [r for i, r in enumerate(replies) if i != 5]
        for reply, vector in zip(got, expected, strict=True):
            assert reply.status_code == 200, reply.text
            assert max_diff(reply.json()["embeddings"], [vector]) < 1e-5
            timing = reply.headers["server-timing"]
            assert "batch;dur=" in timing and 'desc="n=' in timing
        refused = replies[5]
        assert refused.status_code == 400
        assert refused.headers["content-type"] == "application/problem+json"
        assert refused.json()["type"].endswith("invalid-input")
        models = {m["name"]: m for m in client.get("/models").json()["models"]}
        assert models["minilm"]["batching"] == {
            "embed": {"max_size": 32, "max_wait_ms": 5, "max_concurrent": 1}
        }
        metrics = client.get("/metrics").text
        assert 'thaw_batch_size_count{handler="embed"}' in metrics
        assert 'thaw_batch_wait_seconds_bucket{handler="embed",le="+Inf"}' in metrics
