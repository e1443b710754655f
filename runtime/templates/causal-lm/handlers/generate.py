"""`generate`: greedy text generation from a transformers causal LM, streamed.

The bundle is a Hugging Face `save_pretrained` folder built as it is:

    thaw bundle build path/to/saved-model --name lm

The handler is a generator: each token reaches a streaming caller as it is
made (`thaw invoke generate --stream`, `Accept: text/event-stream` on
/invoke/generate, Lambda response streaming); a caller who asked for no
stream gets the items joined into one answer. transformers is this project's
dependency (pyproject.toml), imported in the builder only.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from runtime import Context, InvalidInput, bundle, handler

MAX_NEW_TOKENS = 256


class LM:
    """The model and, when the bundle has one, its tokenizer."""

    def __init__(self, model: Any, tokenizer: Any) -> None:
        self.model = model
        self.tokenizer = tokenizer
        # The KV cache's argument: `cache` in newer transformers, `past_key_values` before.
        takes = inspect.signature(model.forward).parameters
        self.cache_arg = "cache" if "cache" in takes else "past_key_values"

    def prompt_ids(self, event: Mapping[str, Any]) -> list[int]:
        if "input_ids" in event:
            return [int(i) for i in event["input_ids"]]
        if self.tokenizer is None:
            raise InvalidInput("prompt", "this bundle has no tokenizer: send input_ids")
        return list(self.tokenizer(str(event["prompt"]))["input_ids"])

    def greedy(self, ids: list[int], max_new_tokens: int) -> Iterator[int]:
        """Each next token of a greedy decode, with the model's own KV cache."""
        import torch

        device = next(self.model.parameters()).device
        step = torch.tensor([ids], dtype=torch.long, device=device)
        past = None
        eos = self.model.config.eos_token_id
        with torch.inference_mode():
            for _ in range(max_new_tokens):
                out = self.model(input_ids=step, use_cache=True, **{self.cache_arg: past})
                past = getattr(out, "cache", None)
                if past is None:
                    past = out.past_key_values
                token = int(out.logits[0, -1].argmax())
                yield token
                if token == eos:
                    return
                step = torch.tensor([[token]], dtype=torch.long, device=device)

    def text(self, token: int) -> str:
        return "" if self.tokenizer is None else str(self.tokenizer.decode([token]))


@bundle("lm")
def build_lm(
    weights: Mapping[str, Any], config: dict[str, Any], files: Mapping[str, Path], device: str
) -> LM:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    model_config = AutoConfig.for_model(**config)
    model = AutoModelForCausalLM.from_config(model_config)
    loaded = model.load_state_dict(dict(weights), strict=False)
    # A head tied to the embeddings is saved once, as the embeddings.
    tied = {"lm_head.weight"} if model_config.tie_word_embeddings else set()
    missing = set(loaded.missing_keys) - tied
    if missing or loaded.unexpected_keys:
        raise ValueError(f"weights do not fit: missing {sorted(missing)}, "
                         f"unexpected {sorted(loaded.unexpected_keys)}")  # fmt: skip
    model.tie_weights()
    model = model.to(device).eval()
    tokenizer = None
    if "tokenizer.json" in files:
        tokenizer = AutoTokenizer.from_pretrained(Path(files["tokenizer.json"]).parent)
    return LM(model, tokenizer)


def _joined(items: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "token_ids": [item["token_id"] for item in items],
        "text": "".join(item["text"] for item in items),
    }


@handler("generate", uses=["lm"], join=_joined, warmup=[{"input_ids": [1, 2], "max_new_tokens": 2}])
def generate(event: Any, lm: LM, ctx: Context) -> Iterator[dict[str, Any]]:
    """Continue `prompt` (or `input_ids`) greedily for up to `max_new_tokens` tokens."""
    if not isinstance(event, dict) or not ("prompt" in event or "input_ids" in event):
        raise InvalidInput("prompt", "send prompt (a string) or input_ids (a list of token ids)")
    max_new = event.get("max_new_tokens", 32)
    if not isinstance(max_new, int) or not 1 <= max_new <= MAX_NEW_TOKENS:
        raise InvalidInput("max_new_tokens", f"must be an integer from 1 to {MAX_NEW_TOKENS}")
    for token in lm.greedy(lm.prompt_ids(event), max_new):
        yield {"token_id": token, "text": lm.text(token)}
