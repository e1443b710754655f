"""The example handler against transformers itself, on a tiny model made here.

A random BertModel is saved with `save_pretrained`, built into a bundle as
`thaw bundle build` builds one, and served in-process; its embeddings equal
the same model's run in transformers directly.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from runtime.cli.main import main as thaw

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

IDS = [[5, 6, 7, 8, 9], [10, 11, 12, 13, 14]]


@pytest.fixture
def saved_model(tmp_path: Path) -> Any:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
    )
    model = transformers.BertModel(config).eval()
    model.save_pretrained(tmp_path / "saved")
    return model


def test_embed_equals_transformers(
    saved_model: Any, tmp_path: Path, invoke: Callable[..., Any]
) -> None:
    bundles = tmp_path / "bundles"
    built = thaw(["bundle", "build", str(tmp_path / "saved"), "--name", "encoder",
                  "--out", str(bundles / "encoder")])  # fmt: skip
    assert built == 0
    output = invoke("embed", {"input_ids": IDS}, bundles=bundles)
    with torch.inference_mode():
        expected = saved_model(input_ids=torch.tensor(IDS)).last_hidden_state.mean(1)
    got = torch.tensor(output["embeddings"])
    assert got.shape == expected.shape
    assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()
