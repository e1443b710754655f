"""A Hugging Face `save_pretrained` folder as a bundle, taken as it is (`thaw bundle build`).

A folder whose config.json names `model_type` or `architectures` (one or several
`*.safetensors` with their index, the tokenizer's files, generation_config.json)
becomes a bundle whose `config` is config.json verbatim and whose other data
files are what the builder gets in `files`. Thaw's own load settings go to the
manifest's "thaw" object, never into that config. A pickle beside safetensors is
left out, a pickle alone refused; files of no data type (a README.md,
tokenizer.model) are left out, each named. One request's memory is estimated from
config.json (`pretrained_request_bytes`) unless --per-request-bytes gives it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import orjson

from runtime.bundles.manifest import (
    DATA_SUFFIXES,
    MANIFEST,
    PICKLE_SUFFIXES,
    Manifest,
    build_bundle,
)
from runtime.errors import BundleError

# Bytes of one element of the estimate: float32, as the runtime computes on a CPU.
_ELEMENT_BYTES = 4


# What admission assumes one request of a transformers model holds, estimated from its
# config.json where --per-request-bytes is not given: float32 activations of one layer
# at a time for a sequence of this many tokens (the model's own limit when smaller),
# its attention scores, and a causal LM's KV cache for the sequence.
PRETRAINED_SEQUENCE_TOKENS = 512
# Weight files of other frameworks: never a bundle's, left out with a note.
_FOREIGN_WEIGHTS = frozenset({".h5", ".msgpack", ".onnx", ".ot", ".gguf"})


@dataclass(frozen=True)
class Pretrained:
    """A `save_pretrained` folder as a bundle holds it (`stage_pretrained`)."""

    # config.json, verbatim: the builder's `config`.
    config: dict[str, Any]
    # Estimated bytes of one request (`pretrained_request_bytes`); 0: no estimate.
    per_request_bytes: int
    # Source files the bundle does not hold (pickles beside safetensors, a README):
    # each with the reason, for a note on stderr.
    left_out: tuple[tuple[str, str], ...] = ()


def pretrained_config(src: Path) -> dict[str, Any] | None:
    """config.json of directory `src` when it is a Hugging Face `save_pretrained` folder
    (a JSON object naming `model_type` or `architectures`); None otherwise."""
    path = src / "config.json"
    if not src.is_dir() or not path.is_file():
        return None
    try:
        config = orjson.loads(path.read_bytes())
    except orjson.JSONDecodeError as exc:
        raise BundleError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(config, dict) or not ({"model_type", "architectures"} & set(config)):
        return None
    return config


def stage_pretrained(src: Path, staging: Path, config: dict[str, Any]) -> Pretrained:
    """Folder `src` (its config.json is `config`) as a bundle holds it, linked (or
    copied) into `staging`: every safetensors shard, its index, config.json,
    generation_config.json and the tokenizer's JSON and text files. A pickle is
    refused when the folder holds no safetensors (save it with
    `safe_serialization=True`), else left out; files of no data type are left out."""
    kept: list[Path] = []
    left_out: list[tuple[str, str]] = []
    pickles: list[str] = []
    for path in sorted(p for p in src.rglob("*") if p.is_file() or p.is_symlink()):
        rel = path.relative_to(src)
        if any(part.startswith(".") for part in rel.parts) or rel.as_posix() == MANIFEST:
            continue  # .git, .cache, a download's lock files: what build_bundle leaves out too
        suffix = path.suffix.lower()
        if suffix in PICKLE_SUFFIXES:
            pickles.append(rel.as_posix())
            left_out.append((rel.as_posix(), "a pickle-based file (only safetensors are loaded)"))
        elif suffix in _FOREIGN_WEIGHTS:
            left_out.append((rel.as_posix(), "another framework's weights"))
        elif suffix not in DATA_SUFFIXES:
            left_out.append((rel.as_posix(), "not safetensors, JSON or text"))
        elif path.is_symlink() and not path.resolve().is_file():
            raise BundleError(f"{rel}: is a symbolic link to nothing")
        else:
            kept.append(path)
    if not any(p.suffix.lower() == ".safetensors" for p in kept):
        if pickles:
            raise BundleError(
                f"{src / pickles[0]}: a pickle-based checkpoint, and {src} holds no "
                "safetensors; save the model with safetensors instead: "
                "model.save_pretrained(DIR, safe_serialization=True)"
            )
        raise BundleError(f"{src}: a Hugging Face folder with no *.safetensors weights")
    for path in kept:
        # A Hub cache's files are links into its blobs: the bundle holds their bytes.
        target = staging / path.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(path.resolve(), target)
        except OSError:  # another filesystem
            shutil.copyfile(path, target)
    return Pretrained(config, pretrained_request_bytes(config), tuple(left_out))


def _first(config: Mapping[str, Any], *keys: str) -> int:
    """The first of `keys` that config (or its `text_config`) holds as a positive int."""
    for source in (config, config.get("text_config") or {}):
        for key in keys:
            value = source.get(key) if isinstance(source, Mapping) else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return 0


def pretrained_request_bytes(config: Mapping[str, Any]) -> int:
    """What one request of this transformers model holds beyond its weights (0: the
    config names no hidden size). For a sequence of S tokens (the model's
    `max_position_embeddings`, at most PRETRAINED_SEQUENCE_TOKENS), in float32:
    one layer's activations (S x (8 hidden + 2 intermediate)), its attention
    scores (heads x S x S) and, for a causal LM, the KV cache of every layer
    (2 x layers x kv_heads x head_dim x S) and two rows of logits."""
    hidden = _first(config, "hidden_size", "n_embd", "d_model", "dim")
    if not hidden:
        return 0
    heads = _first(config, "num_attention_heads", "n_head", "num_heads") or 1
    kv_heads = _first(config, "num_key_value_heads", "num_kv_heads") or heads
    head_dim = _first(config, "head_dim") or max(1, hidden // heads)
    layers = _first(config, "num_hidden_layers", "n_layer", "num_layers") or 1
    ffn = _first(config, "intermediate_size", "n_inner", "ffn_dim") or 4 * hidden
    limit = _first(config, "max_position_embeddings", "n_positions", "max_sequence_length")
    seq = min(limit or PRETRAINED_SEQUENCE_TOKENS, PRETRAINED_SEQUENCE_TOKENS)
    elements = seq * (8 * hidden + 2 * ffn) + heads * seq * seq
    architectures = config.get("architectures") or []
    causal = any(str(a).endswith(("ForCausalLM", "LMHeadModel")) for a in architectures)
    if causal or config.get("is_decoder") is True:
        elements += 2 * layers * kv_heads * head_dim * seq
        elements += 2 * _first(config, "vocab_size")
    return int(_ELEMENT_BYTES * elements)


def build_pretrained(
    src: Path,
    name: str,
    *,
    version: str,
    out: Path,
    config: dict[str, Any],
    per_request_bytes: int | None,
    thaw: dict[str, Any] | None,
    notes: TextIO,
    on_progress: Callable[[int, int], None] | None = None,
) -> Manifest:
    """Bundle `name` in `out` from `save_pretrained` folder `src` whose config.json is
    `config`: the builder's `config` is that file's object, its other files are the
    builder's `files`; Thaw's own settings go to the manifest's "thaw" (`thaw`). What
    is left out, and the per-request estimate when none is given, are told on `notes`."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".thaw-build-", dir=out.parent) as tmp:
        staged = stage_pretrained(src, Path(tmp), config)
        for rel, why in staged.left_out:
            print(f"thaw: note: {rel} left out: {why}", file=notes)
        if per_request_bytes is None and staged.per_request_bytes:
            per_request_bytes = staged.per_request_bytes
            print(
                f"thaw: note: per-request memory estimated from config.json at "
                f"{per_request_bytes} bytes (a {PRETRAINED_SEQUENCE_TOKENS}-token sequence's "
                "activations and cache); --per-request-bytes sets it",
                file=notes,
            )
        return build_bundle(
            Path(tmp),
            name,
            version=version,
            out=out,
            config=config,
            per_request_bytes=per_request_bytes or 0,
            on_progress=on_progress,
            thaw=thaw,
        )
