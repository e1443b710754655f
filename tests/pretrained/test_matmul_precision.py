"""SmolLM2's default matrices on a CPU with AMX: bfloat16, prepacked (handlers/models/llama.py).

They are held to float32's quality by perplexity on a fixed text, and their rows
must not depend on how many sequences share a step: a decode step's logits for a
sequence are bit-identical to that sequence stepped alone.
"""

from __future__ import annotations

import math

import pytest
import torch

from handlers.models.chat import ChatLM
from handlers.models.llama import Llama, packed_bf16

pytestmark = pytest.mark.skipif(
    not packed_bf16("cpu"), reason="this CPU has no AMX: the matrices stay float32"
)

TEXT = (
    "The river rose through the night, and by morning the low fields were under water. "
    "Farmers moved their animals to the hill above the village, where the old church "
    "stood, and waited for the rain to stop. It stopped on the third day."
)


def perplexity(model: Llama, ids: list[int]) -> float:
    cache = model.new_cache(len(ids))
    nll = 0.0
    with torch.inference_mode():
        for i in range(len(ids) - 1):
            logits = model.forward(torch.tensor([ids[i]]), i, cache)
            nll -= float(torch.log_softmax(logits.float(), -1)[ids[i + 1]])
    return math.exp(nll / (len(ids) - 1))


def test_the_default_is_bfloat16_and_plain_is_float32(
    smollm2: ChatLM, smollm2_plain: ChatLM
) -> None:
    assert smollm2.model.packed and smollm2.model.matmul_dtype == torch.bfloat16
    assert not smollm2_plain.model.packed and smollm2_plain.model.matmul_dtype == torch.float32
    # Only the matrices change: activations, the KV cache and the logits stay float32.
    assert smollm2.model.dtype == torch.float32
    assert smollm2.model.new_cache(4).kv.dtype == torch.float32


def test_bfloat16_perplexity_is_within_two_percent_of_float32(
    smollm2: ChatLM, smollm2_plain: ChatLM
) -> None:
    ids = smollm2.encode_prompt(TEXT)
    assert len(ids) > 40
    bf16, fp32 = perplexity(smollm2.model, ids), perplexity(smollm2_plain.model, ids)
    assert abs(bf16 / fp32 - 1) < 0.02, (bf16, fp32)


def test_a_sequence_s_logits_do_not_depend_on_the_batch(smollm2: ChatLM) -> None:
    model = smollm2.model
    prompts = [smollm2.encode_prompt(t) for t in ("Once upon a time", TEXT, "1, 2, 3,", "def f(")]
    with torch.inference_mode():

        def prefilled() -> list:
            caches = []
            for ids in prompts:
                cache = model.new_cache(len(ids) + 4)
                model.prefill(torch.tensor(ids), cache)
                caches.append(cache)
            return caches

        batched = model.decode([42] * len(prompts), prefilled())
        alone = [model.decode([42], [cache])[0] for cache in prefilled()]
    for row, lone in zip(batched, alone, strict=True):
        assert torch.equal(row, lone)


def test_matrices_staged_in_one_buffer_pack_as_fresh_ones_do() -> None:
    """A build stages each layer's fused matrix in one reused buffer (llama._Staging)
    before oneDNN packs it: what was packed earlier must not change as the buffer is
    reused, and must match a matrix staged in memory of its own."""
    from handlers.models.llama import _stacked, _Staging

    g = torch.Generator().manual_seed(7)
    shapes = [((960, 576),), ((1536, 576), (1536, 576)), ((576, 1536),), ((64, 576),)]
    layers = [tuple(torch.randn(*s, generator=g) for s in parts) for parts in shapes]
    staging = _Staging()
    staged = []
    for parts in layers:
        fused = _stacked(parts, torch.bfloat16, transpose=False, staging=staging)
        staged.append(torch.ops.mkldnn._reorder_linear_weight(fused))
    x = torch.randn(5, 576, generator=g).to(torch.bfloat16)
    for parts, packed in zip(layers, staged, strict=True):
        fresh = torch.ops.mkldnn._reorder_linear_weight(
            _stacked(parts, torch.bfloat16, transpose=False)
        )
        inputs = x if parts[0].shape[1] == 576 else torch.randn(5, 1536).to(torch.bfloat16)
        apply = torch.ops.mkldnn._linear_pointwise
        assert torch.equal(
            apply(inputs, packed, None, "none", [], ""), apply(inputs, fresh, None, "none", [], "")
        )
