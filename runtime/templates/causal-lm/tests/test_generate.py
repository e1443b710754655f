"""The example handler against transformers' own greedy generate, on a tiny model.

A random GPT-2 is saved with `save_pretrained`, built into a bundle as `thaw
bundle build` builds one, and served in-process; the tokens equal those of
`model.generate(do_sample=False)` in transformers directly.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from runtime.cli.main import main as thaw

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

PROMPT = [3, 1, 4, 1, 5]
NEW = 6


@pytest.fixture
def saved_model(tmp_path: Path) -> Any:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=64, n_embd=32, n_layer=2, n_head=2, eos_token_id=None
    )
    model = transformers.GPT2LMHeadModel(config).eval()
    model.save_pretrained(tmp_path / "saved")
    return model


def test_generate_equals_transformers(
    saved_model: Any, tmp_path: Path, invoke: Callable[..., Any]
) -> None:
    bundles = tmp_path / "bundles"
    built = thaw(["bundle", "build", str(tmp_path / "saved"), "--name", "lm",
                  "--out", str(bundles / "lm")])  # fmt: skip
    assert built == 0
    output = invoke("generate", {"input_ids": PROMPT, "max_new_tokens": NEW}, bundles=bundles)
    with torch.inference_mode():
        expected = saved_model.generate(
            torch.tensor([PROMPT]), max_new_tokens=NEW, do_sample=False, pad_token_id=0
        )[0, len(PROMPT) :].tolist()
    assert output["token_ids"] == expected
