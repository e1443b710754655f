"""`embed`: sentence embeddings from a transformers encoder (a BERT-like model).

The bundle is a Hugging Face `save_pretrained` folder built as it is:

    thaw bundle build path/to/saved-model --name encoder

Its config.json is the builder's `config`, its weights the builder's `weights`
(already on the device), and its tokenizer files are in `files`. transformers
is this project's dependency (pyproject.toml), imported in the builder only, so
that discovery and the server's start stay light.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from runtime import Context, InvalidInput, bundle, handler

MAX_TEXTS = 64


class Encoder:
    """The model and, when the bundle has one, its tokenizer."""

    def __init__(self, model: Any, tokenizer: Any) -> None:
        self.model = model
        self.tokenizer = tokenizer

    def embed(self, event: Mapping[str, Any]) -> list[list[float]]:
        import torch

        device = next(self.model.parameters()).device
        if "input_ids" in event:
            ids = torch.tensor(event["input_ids"], dtype=torch.long, device=device)
            mask = torch.ones_like(ids)
        elif self.tokenizer is not None:
            batch = self.tokenizer(list(event["texts"]), padding=True, return_tensors="pt")
            ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
        else:
            raise InvalidInput("texts", "this bundle has no tokenizer: send input_ids")
        with torch.inference_mode():
            hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state
        # Mean over the real tokens of each sequence.
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1.0)
        return pooled.float().cpu().tolist()  # type: ignore[no-any-return]


@bundle("encoder")
def build_encoder(
    weights: Mapping[str, Any], config: dict[str, Any], files: Mapping[str, Path], device: str
) -> Encoder:
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    model_config = AutoConfig.for_model(**config)
    model = AutoModel.from_config(model_config)
    model.load_state_dict(dict(weights), strict=True)
    model = model.to(device).eval()
    tokenizer = None
    if "tokenizer.json" in files or "vocab.txt" in files:
        folder = Path(files.get("tokenizer.json") or files["vocab.txt"]).parent
        tokenizer = AutoTokenizer.from_pretrained(folder)
    return Encoder(model, tokenizer)


@handler("embed", uses=["encoder"], warmup=[{"input_ids": [[1, 2, 3, 4]]}])
def embed(event: Any, encoder: Encoder, ctx: Context) -> dict[str, list[list[float]]]:
    """Embed `texts` (a list of strings) or `input_ids` (a list of token id lists)."""
    if not isinstance(event, dict) or not ("texts" in event or "input_ids" in event):
        raise InvalidInput("texts", "send texts (a list of strings) or input_ids")
    items = event.get("texts", event.get("input_ids"))
    if not isinstance(items, list) or not items or len(items) > MAX_TEXTS:
        raise InvalidInput("texts", f"must be a list of 1 to {MAX_TEXTS} items")
    return {"embeddings": encoder.embed(event)}
