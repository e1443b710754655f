"""Source conversions for `thaw bundle build`: GGUF and legacy `.pth` -> safetensors.

Bundles hold data only, so foreign formats are converted once, at build time,
never at load time:

- GGUF (llama architecture) via the `gguf` package, numpy only: tensors are
  dequantized to float16 (norm vectors stay float32), renamed to the Hugging
  Face Llama names, and Q/K are un-permuted (llama.cpp interleaves them for its
  RoPE). The tokenizer is rebuilt from the GGUF fields into `tokenizer.json`,
  and the model shape and chat template go into the bundle config.
- Legacy `.pth` state dicts via `torch.load(weights_only=True)`, which refuses
  arbitrary pickled objects; `*num_batches_tracked` counters are dropped. A
  source directory holding `.pth`/`.pt` files is staged (`stage_tree`, on
  `--convert-pth`): each one becomes a safetensors file of the same stem, every
  other file is taken as it is.

Only `model.safetensors`, `tokenizer.json` and the returned config leave here.
A Hugging Face `save_pretrained` folder needs no conversion: runtime/bundles/pretrained.py.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from runtime.bundles.manifest import sha256_file
from runtime.errors import BundleError

WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"
# Context a converted LLM bundle is sized for; its KV cache dominates per-request memory.
DEFAULT_MAX_CONTEXT_TOKENS = 2048
# Prompts are prefilled in chunks so attention scores stay chunk x context, not context^2.
PREFILL_CHUNK_TOKENS = 256
# Bytes per element the runtime may compute in (float32 on CPU; CUDA uses half of it).
_COMPUTE_ELEMENT_BYTES = 4
_PROGRESS_EVERY = 30
# Where a conversion tells its progress: a stream, or a callback (done, total).
Progress = TextIO | Callable[[int, int], None]

_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GGUF_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_SPECIAL_TOKEN_TYPE = 3  # llama.cpp's CONTROL token type
# Both of torch's wordings: "Unsupported global: GLOBAL x.y" and (a blocked module,
# e.g. posix.system) "unsupported GLOBAL x.y whose module x is blocked".
_UNSAFE_GLOBAL = re.compile(r"[Uu]nsupported (?:global: )?GLOBAL ([\w.]+)")
_UNPICKLER_CAUSE = re.compile(r"WeightsUnpickler error:\s*(\S[^\n]*)")
_CHATML_SYSTEM = re.compile(r"<\|im_start\|>system\n(.*?)<\|im_end\|>", re.DOTALL)


@dataclass(frozen=True)
class Converted:
    """What a conversion adds to the bundle manifest."""

    config: dict[str, Any] = field(default_factory=dict)
    per_request_bytes: int = 0
    # A generation model's KV cache per token (float32 keys and values of every layer).
    kv_bytes_per_token: int = 0
    # Resident bytes once loaded, when that differs from the safetensors size: float16
    # files are computed in float32 on CPU. None: the file size is right.
    weights_bytes: int | None = None


def convert_source(src: Path, out_dir: Path, progress: Progress) -> Converted:
    """Convert a .gguf/.pth/.pt file into safetensors (+ tokenizer.json) in `out_dir`.

    `progress`: a stream for a line every few tensors, or `progress(done, total)`
    called after each tensor (a terminal's progress bar, runtime/cli/progress.py).
    """
    if not src.is_file():
        raise BundleError(f"{src}: not a file")
    suffix = src.suffix.lower()
    out_dir.mkdir(parents=True, exist_ok=True)
    if suffix == ".gguf":
        return _convert_gguf(src, out_dir, progress)
    if suffix in (".pth", ".pt"):
        return _convert_pth(src, out_dir, progress)
    raise BundleError(f"{src.name}: no conversion for {suffix!r} files (known: .gguf, .pth, .pt)")


def _reporter(src: Path, total: int, progress: Progress) -> Callable[[int], None]:
    if callable(progress):
        tell = progress
        return lambda done: tell(done, total)
    stream = progress

    def report(done: int) -> None:
        if done == total or done % _PROGRESS_EVERY == 0:
            print(
                f"converting {src.name}: {done}/{total} tensors ({100 * done // total}%)",
                file=stream,
                flush=True,
            )

    return report


def _write_atomic(out_dir: Path, name: str, write: Callable[[Path], None]) -> None:
    # A dot-name is skipped by build_bundle, so a crash mid-write leaves nothing listed.
    tmp = out_dir / f".{name}.tmp"
    try:
        write(tmp)
        # Some writers create 0600 files; the serving user (Lambda's is not root) must read them.
        tmp.chmod(0o644)
        os.replace(tmp, out_dir / name)
    finally:
        tmp.unlink(missing_ok=True)


# --- GGUF ------------------------------------------------------------------


def _field(reader: Any, key: str, default: Any = None) -> Any:
    entry = reader.fields.get(key)
    return default if entry is None else entry.contents()


def _gguf_name(name: str) -> str:
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _GGUF_TOP_NAMES:
        return f"{_GGUF_TOP_NAMES[parts[0]]}.{parts[1]}"
    raise BundleError(f"GGUF tensor {name!r} has no known llama name")


def _unpermute(w: Any, n_heads: int) -> Any:
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _convert_gguf(src: Path, out_dir: Path, progress: Progress) -> Converted:
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.numpy import save_file

    try:
        reader = GGUFReader(str(src))
        arch = str(_field(reader, "general.architecture", ""))
    except Exception as exc:  # the reader raises ValueError, OSError, struct errors...
        raise BundleError(f"{src.name}: not a readable GGUF file ({exc})") from exc
    if arch != "llama":
        raise BundleError(f"{src.name}: GGUF architecture {arch!r} is not supported (llama only)")
    config = _llama_config(reader, src)
    report = _reporter(src, len(reader.tensors), progress)
    tensors: dict[str, Any] = {}
    try:
        for done, t in enumerate(reader.tensors, 1):
            w = dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
            if t.name.startswith("blk.") and ".attn_q." in t.name:
                w = _unpermute(w, config["num_heads"])
            elif t.name.startswith("blk.") and ".attn_k." in t.name:
                w = _unpermute(w, config["num_kv_heads"])
            # Matrices halve to float16 (quantization error dwarfs the rounding); norms stay fp32.
            dtype = np.float16 if w.ndim >= 2 else np.float32
            tensors[_gguf_name(t.name)] = np.ascontiguousarray(w, dtype=dtype)
            report(done)
    except BundleError:
        raise
    except Exception as exc:  # truncated data, unknown quantization type
        raise BundleError(f"{src.name}: cannot dequantize tensor {t.name!r} ({exc})") from exc
    config["tie_word_embeddings"] = "lm_head.weight" not in tensors
    _write_atomic(out_dir, WEIGHTS_FILE, lambda p: save_file(tensors, str(p)))
    _write_atomic(out_dir, TOKENIZER_FILE, lambda p: _gguf_tokenizer(reader, src).save(str(p)))
    resident = sum(int(t.size) for t in tensors.values()) * _COMPUTE_ELEMENT_BYTES
    return Converted(
        config=config,
        per_request_bytes=_llama_request_bytes(config),
        weights_bytes=resident,
        kv_bytes_per_token=_llama_kv_bytes_per_token(config),
    )


def _llama_config(reader: Any, src: Path) -> dict[str, Any]:
    def need(key: str) -> Any:
        value = _field(reader, f"llama.{key}")
        if value is None:
            raise BundleError(f"{src.name}: GGUF field 'llama.{key}' is missing")
        return value

    hidden = int(need("embedding_length"))
    n_heads = int(need("attention.head_count"))
    context = int(need("context_length"))
    template = str(_field(reader, "tokenizer.chat_template", ""))
    system = _CHATML_SYSTEM.search(template)
    eos = int(_field(reader, "tokenizer.ggml.eos_token_id", 0))
    tokens = _field(reader, "tokenizer.ggml.tokens", [])
    stop_ids = sorted({eos, *(i for i, tok in enumerate(tokens) if tok == "<|endoftext|>")})
    return {
        "architecture": "llama",
        "vocab_size": len(tokens),
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_layers": int(need("block_count")),
        "num_heads": n_heads,
        "num_kv_heads": int(_field(reader, "llama.attention.head_count_kv", n_heads)),
        "head_dim": int(_field(reader, "llama.rope.dimension_count", hidden // n_heads)),
        "rope_theta": float(_field(reader, "llama.rope.freq_base", 10000.0)),
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "context_length": context,
        "max_context_tokens": min(context, DEFAULT_MAX_CONTEXT_TOKENS),
        "prefill_chunk_tokens": PREFILL_CHUNK_TOKENS,
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id", eos)),
        "eos_token_id": eos,
        "stop_token_ids": stop_ids,
        "chat_template": template,
        "chat_format": "chatml" if "<|im_start|>" in template else None,
        "default_system_prompt": system.group(1) if system else None,
        "source": {"file": src.name, "format": "gguf", "sha256": sha256_file(src)},
    }


def _llama_kv_bytes_per_token(config: Mapping[str, Any]) -> int:
    """Keys and values of every layer for one token: what a sequence's cache grows by."""
    kv = 2 * config["num_layers"] * config["num_kv_heads"] * config["head_dim"]
    return int(_COMPUTE_ELEMENT_BYTES * kv)


def _llama_request_bytes(config: Mapping[str, Any]) -> int:
    """KV cache for the full context plus one prefill chunk's activations."""
    ctx, chunk = config["max_context_tokens"], config["prefill_chunk_tokens"]
    kv_per_token = _llama_kv_bytes_per_token(config) // _COMPUTE_ELEMENT_BYTES
    hidden, ffn = config["hidden_size"], config["intermediate_size"]
    activations = chunk * (8 * hidden + 4 * ffn) + config["num_heads"] * chunk * ctx
    vocab = config["vocab_size"]
    return int(_COMPUTE_ELEMENT_BYTES * (kv_per_token * ctx + activations + 2 * vocab))


def _gguf_tokenizer(reader: Any, src: Path) -> Any:
    """A byte-level BPE `tokenizers.Tokenizer` from the GGUF tokenizer fields."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise BundleError(f"{src.name}: tokenizer model {kind!r} is not supported (gpt2 BPE only)")
    tokens: list[str] = list(_field(reader, "tokenizer.ggml.tokens", []))
    types: list[int] = list(_field(reader, "tokenizer.ggml.token_type", []))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.decoder = decoders.ByteLevel()
    special = [tokens[i] for i, kind in enumerate(types) if kind == _SPECIAL_TOKEN_TYPE]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    return tokenizer


# --- legacy .pth -----------------------------------------------------------


def _state_dict(obj: Any, src: Path) -> Mapping[str, Any]:
    import torch

    for key in ("state_dict", "model"):  # training checkpoints nest the weights
        if isinstance(obj, Mapping) and isinstance(obj.get(key), Mapping):
            obj = obj[key]
    if not isinstance(obj, Mapping) or not obj:
        raise BundleError(f"{src.name}: holds no state dict of tensors")
    for key, value in obj.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise BundleError(f"{src.name}: entry {key!r} is not a named tensor")
    return obj


def _convert_pth(src: Path, out_dir: Path, progress: Progress) -> Converted:
    import torch
    from safetensors.torch import save_file

    try:
        loaded = torch.load(str(src), weights_only=True, map_location="cpu")
    except Exception as exc:  # unpickling, zip, EOF and storage errors all mean "cannot read"
        text = str(exc)
        refused = _UNSAFE_GLOBAL.search(text)
        if refused:
            raise BundleError(
                f"{src.name}: holds a pickled {refused.group(1)}; only tensors are converted"
            ) from exc
        # torch's weights-only errors bury the cause under advice; keep the cause only.
        cause = _UNPICKLER_CAUSE.search(text)
        # Never torch's advice to load it with weights_only=False: the paragraph after it.
        paragraphs = [p.strip() for p in text.split("\n\n") if p.strip()]
        if len(paragraphs) > 1 and paragraphs[0].startswith("Weights only load failed"):
            paragraphs = paragraphs[1:]
        reason = cause.group(1) if cause else (paragraphs or [type(exc).__name__])[0]
        raise BundleError(f"{src.name}: not a readable checkpoint ({reason.strip()})") from exc
    state = _state_dict(loaded, src)
    report = _reporter(src, len(state), progress)
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for done, (key, value) in enumerate(state.items(), 1):
        report(done)
        if key.endswith("num_batches_tracked"):
            continue  # a training counter, not a weight
        name = key.removeprefix("module.")  # saved from DataParallel
        tensor = value.detach().contiguous()
        # safetensors refuses tensors that share storage; tied weights get their own copy.
        if tensor.data_ptr() in seen:
            tensor = tensor.clone()
        seen.add(tensor.data_ptr())
        tensors[name] = tensor
    _write_atomic(out_dir, WEIGHTS_FILE, lambda p: save_file(tensors, str(p)))
    source = {"file": src.name, "format": "pth", "sha256": sha256_file(src)}
    return Converted(config={"source": source}, per_request_bytes=0)


# --- a source directory holding legacy checkpoints ----------------------------

CHECKPOINT_SUFFIXES = frozenset({".pth", ".pt"})


def checkpoints_in(src: Path) -> list[Path]:
    """The legacy torch checkpoints (.pth, .pt) in source directory `src`."""
    return sorted(
        p for p in src.rglob("*") if p.suffix.lower() in CHECKPOINT_SUFFIXES and p.is_file()
    )


def stage_tree(src: Path, staging: Path, progress: Progress) -> dict[str, Any]:
    """`src` as a bundle will hold it, written into `staging`: each .pth/.pt
    converted (tensors only) to `<stem>.safetensors` beside where it was, every
    other file linked (or copied). The config entry naming what was converted."""
    converted: list[dict[str, Any]] = []
    for path in sorted(p for p in src.rglob("*") if p.is_file() or p.is_symlink()):
        rel = path.relative_to(src)
        if path.name.startswith(".") or rel.as_posix() == "bundle.json":
            continue  # what build_bundle leaves out too
        if path.is_symlink():
            raise BundleError(f"{rel}: is a symbolic link")
        target = staging / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix.lower() not in CHECKPOINT_SUFFIXES:
            try:
                os.link(path, target)
            except OSError:  # another filesystem
                shutil.copyfile(path, target)
            continue
        target = target.with_suffix(".safetensors")
        if path.with_suffix(".safetensors").exists():
            raise BundleError(f"{rel}: would become {target.name}, which {src} holds already")
        with tempfile.TemporaryDirectory(dir=staging, prefix=".convert-") as one:
            done = _convert_pth(path, Path(one), progress)
            os.replace(Path(one) / WEIGHTS_FILE, target)
        converted.append({**done.config["source"], "file": rel.as_posix()})
    return {"converted": converted}
