"""`encode` and `complete`: a transformers encoder and causal LM built from bundles of
`save_pretrained` folders, exactly as docs/transformers.md shows it (the test checks
that the page's example is this file's code), plus `builder_args`, which answers
the `config` and `files` its builder was given."""

from __future__ import annotations

# --- docs/transformers.md: begin ---
from pathlib import Path
from typing import Any

from runtime import Context, bundle, handler


def from_bundle(mapping: Any, weights: dict[str, Any], config: dict[str, Any]) -> Any:
    """The transformers model that `config` (the folder's config.json) describes,
    holding the tensors Thaw loaded and verified: no second read of the files."""
    from transformers import AutoConfig

    model_config = AutoConfig.for_model(**config)
    model_class = mapping[type(model_config)]  # e.g. BertModel, LlamaForCausalLM
    return model_class.from_pretrained(None, config=model_config, state_dict=weights).eval()


def tokenizer_of(files: dict[str, Path]) -> Any:
    """The tokenizer saved beside the weights (tokenizer.json and its config)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(files["tokenizer_config.json"].parent)


@bundle("tiny-bert")
def build_encoder(
    weights: dict[str, Any], config: dict[str, Any], files: dict[str, Path], device: str
) -> tuple[Any, Any]:
    from transformers import MODEL_MAPPING  # what AutoModel builds

    return from_bundle(MODEL_MAPPING, weights, config).to(device), tokenizer_of(files)


@bundle("tiny-llama")
def build_causal_lm(
    weights: dict[str, Any], config: dict[str, Any], files: dict[str, Path], device: str
) -> tuple[Any, Any]:
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING  # what AutoModelForCausalLM builds

    return from_bundle(MODEL_FOR_CAUSAL_LM_MAPPING, weights, config).to(device), tokenizer_of(files)


@handler("encode", uses=["tiny-bert"], warmup=[{"texts": ["hello world"]}])
def encode(event: dict[str, Any], bert: tuple[Any, Any], ctx: Context) -> dict[str, Any]:
    model, tokenizer = bert
    inputs = tokenizer(event["texts"], return_tensors="pt", padding=True).to(model.device)
    return {"last_hidden_state": model(**inputs).last_hidden_state.tolist()}


@handler("complete", uses=["tiny-llama"], warmup=[{"text": "hello", "max_new_tokens": 1}])
def complete(event: dict[str, Any], llama: tuple[Any, Any], ctx: Context) -> dict[str, Any]:
    model, tokenizer = llama
    inputs = tokenizer(event["text"], return_tensors="pt").to(model.device)
    tokens = model.generate(
        **inputs, max_new_tokens=int(event.get("max_new_tokens", 8)), do_sample=False
    )
    return {
        "logits": model(**inputs).logits[0, -1].tolist(),
        "tokens": tokens[0, inputs["input_ids"].shape[1] :].tolist(),
    }


# --- docs/transformers.md: end ---


@bundle("builder-args")
def build_args(config: dict[str, Any], files: dict[str, Path]) -> dict[str, Any]:
    return {"config": config, "files": {name: str(path) for name, path in files.items()}}


@handler("builder_args", uses=["builder-args"])
def builder_args(event: Any, args: dict[str, Any], ctx: Context) -> dict[str, Any]:
    return args
