"""Sentence embeddings with all-MiniLM-L6-v2 (bundle `minilm`).

    {"texts": ["A man is eating food.", ...]}
    -> {"embeddings": [[384 floats], ...], "dim": 384, "usage": {"prompt_tokens": N}}

`usage` counts the tokens the model ran (special tokens included). The handler
also serves OpenAI's `/v1/embeddings` (docs/openai.md).

Vectors have unit length, so cosine similarity is their dot product. Texts
longer than the model's 256 tokens are truncated.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from handlers.models.fields import check_event, get_str_list, require
from runtime import Batch, Context, InvalidInput, OpenAI, bundle, handler

if TYPE_CHECKING:
    from collections.abc import Mapping

    import torch

    from handlers.models.minilm import MiniLM

MAX_TEXTS = 32
MAX_TEXT_CHARS = 8192
# Activations of a full request (32 texts x 256 tokens, run 8 at a time): peak RSS
# grew by 111 MB on CPU; rounded up.
PER_REQUEST_BYTES = 160 * 1024 * 1024

# ~400 tokens: truncated to the model's maximum, so this warms the largest shapes.
_LONG_TEXT = "Serverless inference keeps a model warm between requests, so callers wait less. " * 25


@bundle("minilm")
def build_minilm(
    weights: Mapping[str, torch.Tensor],
    config: Mapping[str, Any],
    device: str,
    files: Mapping[str, Path],
) -> MiniLM:
    from handlers.models.minilm import BertConfig, MiniLM

    if "tokenizer.json" not in files:
        raise ValueError("bundle minilm has no tokenizer.json")
    return MiniLM(BertConfig.from_config(config), weights, files["tokenizer.json"], device)


def _padded_texts(count: int, words: int) -> list[str]:
    """`count` texts of `words` words down to `words - count + 1`: a batch that is padded."""
    return ["word " * (words - i) for i in range(count)]


def _texts_of_tokens(tokens: int) -> list[str]:
    """Texts of `tokens` tokens in all ("word " is one token; each text adds [CLS] and
    [SEP]), at most the model's 256 apiece: one forward pass of that many rows."""
    full, rest = divmod(tokens, 256)
    return ["word " * 254] * full + (["word " * (rest - 2)] if rest >= 3 else [])


# On a CPU the one-time costs of a request (the tokenizer's first encode, the
# first forward pass's kernel and allocator set-up) are paid by the smallest
# one: a full batch of long texts first costs within noise of its steady state
# with or without warm-up (BENCHMARKS.md, warmup), and warming it took 1.7-2.2
# s of every cold start. On a GPU a kernel is loaded on its first use (CUDA's
# lazy module loading), and which GEMM kernel runs changes with the rows of the
# linear layers (the real tokens of a pass): on an H200 a first request of two
# short texts took 48 ms after warming only the largest batch and one word,
# against 6 ms steady, and 8 ms after warming padded batches of 20, 148 and 1216
# rows too (bench/gpu.py). So an accelerator warms the linear layers at rows
# about 1.5x apart from 4 to 1536, padded batches for attention's masked path,
# and the largest batch (2048 rows a pass).
_SWEEP_TOKENS = (4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536)
_ACCELERATOR_WARMUP: list[dict[str, Any]] = [
    {"texts": [_LONG_TEXT] * MAX_TEXTS},
    {"texts": ["hi"]},
    {"texts": _padded_texts(2, 8)},
    {"texts": _padded_texts(4, 35)},
    {"texts": _padded_texts(8, 150)},
    *({"texts": _texts_of_tokens(tokens)} for tokens in _SWEEP_TOKENS),
]


@handler(
    "embed",
    uses=["minilm"],
    warmup=[{"texts": ["hi"]}],
    accelerator_warmup=_ACCELERATOR_WARMUP,
    batch=Batch(max_size=32, max_wait_ms=5),
    openai=OpenAI("embeddings", aliases=["minilm", "all-MiniLM-L6-v2"], dimensions=384),
)
def embed(
    events: list[Any], minilm: MiniLM, ctxs: list[Context]
) -> list[dict[str, Any] | InvalidInput]:
    """Embed up to 32 texts as 384-d unit vectors."""
    # Concurrent requests' texts go through the model together (one tokenizer call,
    # forward passes as full as memory allows); a refused event fails only its caller.
    outputs: list[dict[str, Any] | InvalidInput] = []
    texts: list[str] = []
    spans: list[tuple[int, int, int]] = []  # (event index, first text, text count)
    for index, event in enumerate(events):
        try:
            fields = check_event(event, {"texts"})
            mine = get_str_list(require(fields, "texts"), "texts", MAX_TEXTS, MAX_TEXT_CHARS)
        except InvalidInput as refused:
            outputs.append(refused)
            continue
        outputs.append({})
        spans.append((index, len(texts), len(mine)))
        texts += mine
    if texts:
        tokens: list[int] = []
        vectors = minilm.encode(texts, tokens).tolist()
        for index, first, count in spans:
            outputs[index] = {
                "embeddings": vectors[first : first + count],
                "dim": minilm.dim,
                "usage": {"prompt_tokens": sum(tokens[first : first + count])},
            }
    return outputs
