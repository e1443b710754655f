"""What the shipped models do for a GPU that a CPU never shows (bench/gpu.py found both).

- The first request of a shape not seen before pays for loading its kernels:
  `embed` warms its linear layers and its padded attention across the range of
  rows a request can bring.
- cuDNN's attention plans every new shape (each decode step's key length, each
  KV cache's strides): SmolLM2 built for CUDA turns that backend off, and takes
  the flash kernel's output, laid out (batch, seq, heads, dim) in memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from itertools import pairwise
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn.functional as F

from handlers.embed import _ACCELERATOR_WARMUP, MAX_TEXTS
from handlers.models.chat import ChatLM
from handlers.models.llama import plan_free_attention
from handlers.models.minilm import MAX_BATCH_TEXTS, MiniLM


def _cudnn_attention() -> bool:
    on: bool = torch.backends.cuda.cudnn_sdp_enabled()  # type: ignore[no-untyped-call]
    return on


@pytest.fixture
def cudnn_attention_restored() -> Iterator[None]:
    before = _cudnn_attention()
    yield
    torch.backends.cuda.enable_cudnn_sdp(before)


@pytest.mark.usefixtures("cudnn_attention_restored")
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_a_model_for_cuda_keeps_attention_off_cudnn(device: str) -> None:
    torch.backends.cuda.enable_cudnn_sdp(True)
    plan_free_attention(device)
    assert not _cudnn_attention()


@pytest.mark.usefixtures("cudnn_attention_restored")
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_elsewhere_the_backend_choice_is_left_alone(device: str) -> None:
    torch.backends.cuda.enable_cudnn_sdp(True)
    plan_free_attention(device)
    assert _cudnn_attention()


class Pass(NamedTuple):
    """One forward pass `MiniLM.encode` makes."""

    texts: int
    padded_tokens: int  # its longest text's: attention's shape
    real_tokens: int  # all its texts': the linear layers' rows
    padded: bool


def _passes(minilm: MiniLM, texts: list[str]) -> list[Pass]:
    lengths = [len(e.ids) for e in minilm.tokenizer.encode_batch(texts)]
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    return [
        Pass(
            len(rows),
            max(lengths[i] for i in rows),
            sum(lengths[i] for i in rows),
            len({lengths[i] for i in rows}) > 1,
        )
        for rows in minilm._sub_batches([lengths[i] for i in order], order)
    ]


def _warmed_passes(minilm: MiniLM) -> list[Pass]:
    return [p for example in _ACCELERATOR_WARMUP for p in _passes(minilm, example["texts"])]


def test_embed_warms_padded_passes_across_every_decade_of_rows(minilm: MiniLM) -> None:
    passes = _warmed_passes(minilm)
    # Attention's masked path: a padded pass in each decade of padded rows.
    for low, high in ((10, 100), (100, 1000), (1000, MAX_BATCH_TEXTS * minilm.max_tokens)):
        assert any(low <= p.texts * p.padded_tokens <= high and p.padded for p in passes), (
            low,
            high,
            passes,
        )
    assert max(len(example["texts"]) for example in _ACCELERATOR_WARMUP) == MAX_TEXTS


def test_embed_warms_the_linear_layers_at_rows_at_most_1_6x_apart(minilm: MiniLM) -> None:
    # The linear layers run on a pass's real tokens: which GEMM kernel loads
    # depends on that count, from a lone short text to the largest pass.
    steps = sorted({p.real_tokens for p in _warmed_passes(minilm)})
    assert steps[0] <= 4 and steps[-1] == MAX_BATCH_TEXTS * minilm.max_tokens
    gaps = [(a, b) for a, b in pairwise(steps) if b > 1.6 * a]
    assert not gaps, (gaps, steps)


def _flash_layout(sdpa: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`sdpa` whose output is laid out as CUDA's flash attention returns it:
    (batch, seq, heads, dim) in memory, seen as (batch, heads, seq, dim)."""

    def attention(*args: Any, **kwargs: Any) -> torch.Tensor:
        out = sdpa(*args, **kwargs)
        return out.transpose(1, 2).contiguous().transpose(1, 2)

    return attention


def test_smollm2_takes_attention_output_in_any_layout(
    smollm2: ChatLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = smollm2.model
    prompts = [smollm2.encode_prompt(t) for t in ("The capital of France is", "1, 2, 3,")]

    def logits() -> list[torch.Tensor]:
        caches = [model.new_cache(len(p) + 2) for p in prompts]
        with torch.inference_mode():
            out = [model.prefill(torch.tensor(p), c) for p, c in zip(prompts, caches, strict=True)]
            out.append(model.run([([p[-1]], c) for p, c in zip(prompts, caches, strict=True)]))
            out.append(model.run([([prompts[0][-1]], caches[0])]))
        return out

    plain = logits()
    monkeypatch.setattr(
        F, "scaled_dot_product_attention", _flash_layout(F.scaled_dot_product_attention)
    )
    for ours, theirs in zip(logits(), plain, strict=True):
        assert torch.equal(ours, theirs)
