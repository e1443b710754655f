"""all-MiniLM-L6-v2 behind the `embed` handler: reference values, batching, input errors."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from handlers.embed import MAX_TEXT_CHARS, MAX_TEXTS, embed
from handlers.models.minilm import MiniLM
from runtime import Context, InvalidInput
from runtime.registry import discover

ROOT = Path(__file__).resolve().parents[2]
CTX = Context(request_id="t", handler="embed")


def vectors(model: MiniLM, texts: list[str]) -> list[list[float]]:
    [out] = embed([{"texts": texts}], model, [CTX])
    assert out["dim"] == 384 and len(out["embeddings"]) == len(texts)
    result: list[list[float]] = out["embeddings"]
    return result


def dot(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


def test_reference_similarity(minilm: MiniLM) -> None:
    food, bread, movie = vectors(
        minilm,
        ["A man is eating food.", "A man is eating a piece of bread.", "The new movie is awesome."],
    )
    # The value the sentence-transformers documentation gives for this pair.
    assert dot(food, bread) == pytest.approx(0.7553, abs=1e-3)
    assert abs(dot(food, movie)) < 0.1
    for v in (food, bread, movie):
        assert len(v) == 384 and math.fsum(x * x for x in v) == pytest.approx(1.0, abs=1e-5)


def test_batch_keeps_order_and_matches_single_texts(minilm: MiniLM) -> None:
    # Mixed lengths across more than one sub-batch: sorting must not reorder outputs.
    texts = [("word " * (n * 7 % 60 + 1)).strip() for n in range(MAX_TEXTS)]
    texts[3] = "A man is eating food."
    batched = vectors(minilm, texts)
    for i in (0, 3, 17, MAX_TEXTS - 1):
        single = vectors(minilm, [texts[i]])[0]
        assert max(abs(a - b) for a, b in zip(batched[i], single, strict=True)) < 1e-5


def test_long_text_is_truncated_not_refused(minilm: MiniLM) -> None:
    long = "serverless " * 600  # far past 256 tokens, under the character limit
    assert len(long) <= MAX_TEXT_CHARS
    [v] = vectors(minilm, [long])
    assert math.fsum(x * x for x in v) == pytest.approx(1.0, abs=1e-5)


def test_every_warmup_example_runs(minilm: MiniLM) -> None:
    """One short text on a CPU; the full batch of the longest texts on an accelerator."""
    spec = discover(["handlers.embed"]).handler("embed")
    assert spec.warmup_for("cpu") == [{"texts": ["hi"]}]
    accelerated = spec.warmup_for("cuda")
    assert max(len(w["texts"]) for w in accelerated) == MAX_TEXTS
    for example in accelerated:
        assert len(vectors(minilm, example["texts"])) == len(example["texts"])


@pytest.mark.parametrize(
    ("event", "field"),
    [
        ({}, "texts"),
        ({"texts": "one string"}, "texts"),
        ({"texts": []}, "texts"),
        ({"texts": ["x"] * (MAX_TEXTS + 1)}, "texts"),
        ({"texts": ["ok", 7]}, "texts[1]"),
        ({"texts": ["x" * (MAX_TEXT_CHARS + 1)]}, "texts[0]"),
        ({"texts": ["ok"], "text": "typo"}, "text"),
        (["not", "an", "object"], "event"),
    ],
)
def test_bad_input_names_the_field(minilm: MiniLM, event: Any, field: str) -> None:
    [refused] = embed([event], minilm, [CTX])
    assert isinstance(refused, InvalidInput)
    assert refused.field == field
    assert refused.status == 400


def test_thaw_invoke_embed(minilm: MiniLM, minilm_bundle: Path, thaw_env: dict[str, str]) -> None:
    env = {
        **thaw_env,
        "THAW_BUNDLE_SOURCE": str(minilm_bundle.parent),
        "THAW_HANDLERS": "handlers.embed",
    }
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "runtime.cli.main",
            "invoke",
            "embed",
            "--event",
            '{"texts":["hi"]}',
        ],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["dim"] == 384
    [expected] = vectors(minilm, ["hi"])
    assert max(abs(a - b) for a, b in zip(out["embeddings"][0], expected, strict=True)) < 1e-5
