"""A Llama decoder (SmolLM2) in plain torch, with a per-request KV cache.

Weights use the Hugging Face Llama names (what `runtime.bundles.convert` writes from
GGUF). The builder fuses q/k/v and gate/up into single matrices and picks the
compute dtype once; requests then only run matmuls. The model object holds no
per-request state, so concurrent requests each bring their own `KVCache`.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_context_tokens: int
    prefill_chunk_tokens: int
    tie_word_embeddings: bool
    # "auto": bfloat16 matrices prepacked for AMX where the CPU has it (`packed_bf16`);
    # "plain": the compute dtype everywhere, as on a CPU without AMX.
    matmul: str = "auto"

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> LlamaConfig:
        return cls(
            vocab_size=int(config["vocab_size"]),
            hidden_size=int(config["hidden_size"]),
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_layers"]),
            num_heads=int(config["num_heads"]),
            num_kv_heads=int(config["num_kv_heads"]),
            head_dim=int(config["head_dim"]),
            rope_theta=float(config["rope_theta"]),
            rms_norm_eps=float(config["rms_norm_eps"]),
            max_context_tokens=int(config["max_context_tokens"]),
            prefill_chunk_tokens=int(config.get("prefill_chunk_tokens", 256)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
            matmul=_matmul(config.get("matmul", "auto")),
        )


def _matmul(value: Any) -> str:
    if value not in ("auto", "plain"):
        raise ValueError(f"config matmul must be 'auto' or 'plain', not {value!r}")
    return str(value)


@dataclass(frozen=True)
class _Layer:
    """One decoder layer; every matrix as `Llama._matrix` lays it out."""

    attn_norm: torch.Tensor
    qkv: torch.Tensor  # q, k and v fused
    o: torch.Tensor
    mlp_norm: torch.Tensor
    gate_up: torch.Tensor  # gate and up fused
    down: torch.Tensor


class KVCache:
    """Keys and values of one sequence, preallocated for its whole length.

    One allocation, (layers, 2, kv heads, capacity, head dim), with a view per
    layer made once: a step writes a sequence's new keys and values of a layer
    in one copy and reads both in one indexing. (What a sequence adds to a
    decode step is mostly its attention kernel, ~45 us a layer on this CPU, not
    these Python calls: halving them measured no faster, bench/experiments/model_steps.py.)
    """

    def __init__(self, cfg: LlamaConfig, capacity_tokens: int, like: torch.Tensor) -> None:
        shape = (cfg.num_layers, 2, cfg.num_kv_heads, capacity_tokens, cfg.head_dim)
        self.kv = torch.empty(shape, dtype=like.dtype, device=like.device)
        self.layers: list[torch.Tensor] = list(self.kv.unbind(0))
        self.length = 0

    @property
    def capacity_tokens(self) -> int:
        return self.kv.shape[3]


def compute_dtype(device: str) -> torch.dtype:
    """float16 on accelerators; float32 on CPU, where half-precision prefill is slow."""
    return torch.float32 if torch.device(device).type == "cpu" else torch.float16


def plan_free_attention(device: str) -> None:
    """On CUDA, keep `F.scaled_dot_product_attention` off cuDNN's backend.

    cuDNN's attention (PyTorch's first choice for float16 on Hopper) builds an
    execution plan for each input shape and stride, per thread. A decode step's
    keys grow by one token every step, and each sequence's KV cache has its own
    capacity, so its own strides. On an H200 (torch 2.11, cuDNN 9.19) a decode
    step's attention at a key length not seen before took 119 ms against 3.3 ms
    with cuDNN's backend off; a lone 128-token completion ran at 85 ms a token
    until every length had its plan, 22 ms after; and the first attention on a
    new thread took 62-74 ms, against 0.2 (bench/experiments/gpu_attention.py;
    docs/generation.md, "On a GPU"). Flash and memory-efficient attention,
    which PyTorch picks instead, plan nothing. The choice is PyTorch's
    process-wide flag, so it holds for every model in the instance.
    """
    if torch.device(device).type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)


def packed_bf16(device: str) -> bool:
    """Whether the matrices are bfloat16, prepacked for oneDNN's AMX kernels.

    On a CPU with AMX tiles (Intel Sapphire Rapids and later), a bfloat16 GEMM on
    weights reordered once into oneDNN's blocked layout costs about the same for
    1 to 16 rows and reads half float32's bytes. Over SmolLM2-135M, one thread:
    a decode step of one sequence takes 0.79x float32's time, of 8 sequences
    0.49x, and a 128-token prefill 0.36x (bench/experiments/model_steps.py). Each output row
    is bit-identical whatever the number of rows, which float32's MKL kernels are
    not (docs/generation.md). The cost is precision: bfloat16 keeps 8 significant
    bits against the bundle's float16 11, and perplexity rises by about 0.5%
    (tests/pretrained/test_matmul_precision.py bounds it at 2%). Norms, RoPE,
    attention, the KV cache and the logits stay float32. Elsewhere (no AMX, an
    accelerator, or a bundle whose config says `matmul: plain`) the matrices are
    the compute dtype and multiplied plainly.
    """
    if torch.device(device).type != "cpu":
        return False
    init_amx = getattr(torch._C._cpu, "_init_amx", None)
    ops = torch.ops.mkldnn
    return (
        init_amx is not None
        and bool(init_amx())
        and hasattr(ops, "_linear_pointwise")
        and hasattr(ops, "_reorder_linear_weight")
    )


class _Staging:
    """One buffer that a build's packed matrices are staged in, in turn.

    A packed matrix is made in two steps: its parts copied into one bfloat16 (out, in)
    matrix, which oneDNN's reorder then copies into a blocked layout of its own
    (`_reorder_linear_weight` always allocates its result). The staged matrix is
    garbage as soon as the reorder returns, so one buffer serves every layer.
    Made fresh for each of SmolLM2's 90 layer matrices (1-3.5 MB), each was a
    mapping of its own (the runtime's 1 MiB mmap threshold while a bundle loads,
    runtime/models/weights/host.py), faulted in page by page and unmapped again:
    36,000 of the build's 132,000 page faults. With this and host.py's load windows
    keeping the heap's top, the build took 330 ms instead of 360 (BENCHMARKS.md,
    issue 29's tenth session).
    """

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def take(
        self, shape: tuple[int, int], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """A (rows, cols) view of the buffer, grown first when too small: valid until
        the next `take`."""
        n = shape[0] * shape[1]
        buffer = self._buffer
        if buffer is None or buffer.numel() < n or buffer.dtype != dtype or buffer.device != device:
            self._buffer = buffer = None  # the old buffer goes before the new one is made
            self._buffer = buffer = torch.empty(n, dtype=dtype, device=device)
        return buffer[:n].view(shape)


def _stacked(
    parts: tuple[torch.Tensor, ...],
    dtype: torch.dtype,
    *,
    transpose: bool,
    staging: _Staging | None = None,
) -> torch.Tensor:
    """Hugging Face's (out, in) matrices stacked along out, in `dtype`: as one (out, in)
    matrix, or `transpose`d, one (in, out). Each part is copied once, converted on
    the way, into the one tensor made for the result: no converted copy of a part, no
    concatenation to transpose after. A model is made of these (SmolLM2: 121, half a
    gigabyte in float32), and the three passes and three fresh allocations of
    `cat(...).t().contiguous()` on converted parts made the builder 5x slower (most of
    it page faults on fresh memory), for the same bits."""
    rows = sum(part.shape[0] for part in parts)
    cols = parts[0].shape[1]
    shape = (cols, rows) if transpose else (rows, cols)
    if staging is not None:
        out = staging.take(shape, dtype, parts[0].device)
    else:
        out = torch.empty(shape, dtype=dtype, device=parts[0].device)
    start = 0
    for part in parts:
        end = start + part.shape[0]
        if transpose:
            out[:, start:end].copy_(part.t())
        else:
            out[start:end].copy_(part)
        start = end
    return out


class Llama:
    """Matrices are applied by `_mm`, stored as `_matrix` lays them out: prepacked
    bfloat16 where `packed_bf16` holds, else transposed, (in, out), and applied as
    `x @ w`: MKL's GEMM of a few rows (a decode step of 2-15 sequences) runs up to
    2x faster against a row-major right operand than against `F.linear`'s
    transposed one, and no slower for one row or a prefill chunk
    (bench/experiments/gemm_layout.py, docs/generation.md)."""

    def __init__(
        self,
        cfg: LlamaConfig,
        weights: Mapping[str, torch.Tensor],
        device: str,
        *,
        consume: bool = False,
    ) -> None:
        self.cfg = cfg
        plan_free_attention(device)
        dtype = compute_dtype(device)
        self.packed = cfg.matmul == "auto" and packed_bf16(device)
        self.matmul_dtype = torch.bfloat16 if self.packed else dtype
        # With `consume` each tensor leaves `weights` as it is taken (the runtime
        # hands a builder its own dict): the fused copies below (qkv, gate_up) then
        # never sit beside all of their sources, so a load peaks near the weights'
        # size instead of half as much again (bench/memory.py).
        taken: MutableMapping[str, torch.Tensor] | None = None
        if consume:
            if not isinstance(weights, MutableMapping):
                raise TypeError("consume=True needs a mutable mapping of weights")
            taken = weights

        def raw(name: str) -> torch.Tensor:
            """The tensor as loaded (a matrix is converted as `_matrix` lays it out)."""
            try:
                tensor = taken.pop(name) if taken is not None else weights[name]
            except KeyError:
                raise ValueError(f"weights lack tensor {name!r}") from None
            return tensor.to(device=device)

        def w(name: str) -> torch.Tensor:
            return raw(name).to(dtype=dtype)

        # Tied embeddings keep one plain copy: the head, (hidden, vocab), with the
        # embedding table its transposed view (a lookup reads one strided column per
        # token). A packed head is opaque, so the table is then kept beside it.
        embed = raw("model.embed_tokens.weight")
        head = embed if cfg.tie_word_embeddings else raw("lm_head.weight")
        self.lm_head = self._matrix(head)
        if self.packed or not cfg.tie_word_embeddings:
            self.embed = embed.to(self.matmul_dtype)
        else:
            self.embed = self.lm_head.t()
        del embed, head
        self.norm = w("model.norm.weight")
        self.layers: list[_Layer] = []
        # The layers' matrices are alike in size, the head is not: staged apart, it
        # leaves no buffer of its size held through the layers.
        staging = _Staging()
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."

            def t(*names: str, p: str = p) -> torch.Tensor:
                return self._matrix(*(raw(p + n + ".weight") for n in names), staging=staging)

            self.layers.append(
                _Layer(
                    attn_norm=w(p + "input_layernorm.weight"),
                    qkv=t("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                    o=t("self_attn.o_proj"),
                    mlp_norm=w(p + "post_attention_layernorm.weight"),
                    gate_up=t("mlp.gate_proj", "mlp.up_proj"),
                    down=t("mlp.down_proj"),
                )
            )
        # RoPE tables for every position the model may see, built once (HF rotate-half layout).
        inv_freq = 1.0 / cfg.rope_theta ** (
            torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim
        )
        angles = torch.outer(torch.arange(cfg.max_context_tokens, dtype=torch.float64), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        self.cos = angles.cos().to(device=device, dtype=dtype)
        self.sin = angles.sin().to(device=device, dtype=dtype)

    def _matrix(self, *parts: torch.Tensor, staging: _Staging | None = None) -> torch.Tensor:
        """Hugging Face's (out, in) matrices, stacked along out, as `_mm` takes them
        (packed ones staged in `staging`, when given)."""
        if self.packed:
            fused = _stacked(parts, torch.bfloat16, transpose=False, staging=staging)
            packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(fused)
            return packed
        return _stacked(parts, self.matmul_dtype, transpose=True)

    @property
    def dtype(self) -> torch.dtype:
        """The activations' (and KV cache's) dtype."""
        return self.norm.dtype

    def new_cache(self, capacity_tokens: int) -> KVCache:
        return KVCache(self.cfg, capacity_tokens, self.norm)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed[ids].to(self.dtype)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Normalized `x`, in the matmul dtype: every norm feeds a matrix."""
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps)
        return (x32.to(x.dtype) * weight).to(self.matmul_dtype)

    def _mm(self, a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """`a @ w` in the matmul dtype, back in the activations' dtype."""
        if self.packed:
            y: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
                a.to(torch.bfloat16), w, None, "none", [], ""
            )
            return y.to(self.dtype)
        return (a.to(w.dtype) @ w).to(self.dtype)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    def forward(self, ids: torch.Tensor, start: int, cache: KVCache | None) -> torch.Tensor:
        """Logits of the last of `ids` (positions start..start+len-1).

        With a cache, keys/values are appended to it and attention reads the
        whole cached prefix; without one, `ids` must be the whole sequence.
        """
        cfg = self.cfg
        n = ids.shape[0]
        end = start + n
        if cache is None and start != 0:
            raise ValueError("without a KV cache the whole sequence must be passed")
        groups = cfg.num_heads // cfg.num_kv_heads
        cos, sin = self.cos[start:end], self.sin[start:end]
        q_rows, kv_rows = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        mask = None
        if n > 1:
            # Query row g*n + j (group g, position start+j) may see keys 0..start+j.
            allowed = torch.arange(end, device=ids.device)[None, :] <= (
                start + torch.arange(n, device=ids.device)[:, None]
            )
            mask = allowed.repeat(groups, 1)
        x = self._embed(ids)
        for i, layer in enumerate(self.layers):
            h = self._rms_norm(x, layer.attn_norm)
            q, k, v = torch.split(self._mm(h, layer.qkv), [q_rows, kv_rows, kv_rows], dim=-1)
            q = self._rope(q.view(n, cfg.num_heads, cfg.head_dim).transpose(0, 1), cos, sin)
            k = self._rope(k.view(n, cfg.num_kv_heads, cfg.head_dim).transpose(0, 1), cos, sin)
            v = v.view(n, cfg.num_kv_heads, cfg.head_dim).transpose(0, 1)
            if cache is not None:
                kv = cache.layers[i]
                kv[0, :, start:end] = k
                kv[1, :, start:end] = v
                k, v = kv[:, None, :, :end]  # as `run` reads them, to the bit
            else:
                k, v = k[None], v[None]
            # Grouped-query attention without copying K/V per query head: the query
            # heads sharing a KV head are stacked along the sequence axis. 4-D
            # inputs let CPU torch pick its flash kernel (3-D falls back to ~5x slower math).
            qg = q.reshape(1, cfg.num_kv_heads, groups * n, cfg.head_dim)
            out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask)
            # reshape, not view: CUDA's flash kernel lays its output out (batch, seq,
            # heads, dim) in memory, and reshape copies only then.
            out = out.reshape(cfg.num_heads, n, cfg.head_dim).transpose(0, 1).reshape(n, q_rows)
            x = x + self._mm(out, layer.o)
            h = self._rms_norm(x, layer.mlp_norm)
            gate, up = self._mm(h, layer.gate_up).chunk(2, dim=-1)
            x = x + self._mm(F.silu(gate) * up, layer.down)
        if cache is not None:
            cache.length = end
        return self._mm(self._rms_norm(x[-1:], self.norm), self.lm_head)[0]

    def decode(self, tokens: Sequence[int], caches: Sequence[KVCache]) -> torch.Tensor:
        """Logits (one row each) of the next token of several sequences, one new token
        each, every sequence with its own cache (they may differ in length)."""
        return self.run([([token], cache) for token, cache in zip(tokens, caches, strict=True)])

    def run(self, pieces: Sequence[tuple[Sequence[int], KVCache]]) -> torch.Tensor:
        """Logits (one row each) of the last token of every piece: each piece is the
        next tokens of one sequence (one, a decode step; more, a chunk of its prompt),
        appended to its own cache (the caches may differ in length).

        The linear layers run once for all the pieces' rows: a decode step reads the
        weights once whatever the batch, and decode rows riding along a prompt chunk
        cost a few rows of its GEMMs. Attention runs per piece against its own cache,
        with exactly the shapes (and causal mask) that piece has alone. One piece of
        one token goes through `forward`, so a lone caller runs the per-request kernels.
        """
        if len(pieces) == 1 and len(pieces[0][0]) == 1:
            (token,), cache = pieces[0]
            step = torch.tensor([token], dtype=torch.long, device=self.embed.device)
            return self.forward(step, cache.length, cache)[None]
        cfg = self.cfg
        device = self.embed.device
        groups = cfg.num_heads // cfg.num_kv_heads
        q_rows, kv_rows = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        spans: list[tuple[int, int, int, KVCache, torch.Tensor | None]] = []  # row, n, start
        row = 0
        for tokens, cache in pieces:
            n, start = len(tokens), cache.length
            mask = None
            if n > 1:  # as in `forward`: query row g*n + j may see keys 0..start+j
                allowed = torch.arange(start + n, device=device)[None, :] <= (
                    start + torch.arange(n, device=device)[:, None]
                )
                mask = allowed.repeat(groups, 1)
            spans.append((row, n, start, cache, mask))
            row += n
        total = row
        positions = torch.tensor(
            [start + j for _, n, start, _, _ in spans for j in range(n)], device=device
        )
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]  # (rows, 1, hd)
        ids = torch.tensor([t for tokens, _ in pieces for t in tokens], device=device)
        x = self._embed(ids)
        for i, layer in enumerate(self.layers):
            h = self._rms_norm(x, layer.attn_norm)
            q, k, v = torch.split(self._mm(h, layer.qkv), [q_rows, kv_rows, kv_rows], dim=-1)
            q = self._rope(q.view(total, cfg.num_heads, cfg.head_dim), cos, sin)
            k = self._rope(k.view(total, cfg.num_kv_heads, cfg.head_dim), cos, sin)
            v = v.view(total, cfg.num_kv_heads, cfg.head_dim)
            # Heads first, once for every row, so that each sequence below costs as
            # few Python-level operations as possible (see `KVCache`).
            kv_rows_t = torch.stack((k, v)).transpose(1, 2)  # (2, kv heads, rows, hd)
            q_t = q.transpose(0, 1)  # (heads, rows, hd)
            outs = []
            for first, n, start, cache, mask in spans:
                end = start + n
                kv = cache.layers[i]
                kv[:, :, start:end] = kv_rows_t[:, :, first : first + n]
                kj, vj = kv[:, None, :, :end]
                qg = q_t[:, first : first + n].reshape(1, cfg.num_kv_heads, groups * n, -1)
                out = F.scaled_dot_product_attention(qg, kj, vj, attn_mask=mask)
                if n == 1:  # (1, kv heads, groups, hd) is already one row in head order
                    outs.append(out.reshape(1, q_rows))
                else:
                    outs.append(
                        out.reshape(cfg.num_heads, n, -1).transpose(0, 1).reshape(n, q_rows)
                    )
            out = torch.cat(outs)
            x = x + self._mm(out, layer.o)
            h = self._rms_norm(x, layer.mlp_norm)
            gate, up = self._mm(h, layer.gate_up).chunk(2, dim=-1)
            x = x + self._mm(F.silu(gate) * up, layer.down)
        for _, n, start, cache, _ in spans:
            cache.length = start + n
        last = torch.tensor([first + n - 1 for first, n, _, _, _ in spans], device=device)
        return self._mm(self._rms_norm(x[last], self.norm), self.lm_head)

    def prefill(self, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Run the prompt through the cache in chunks; logits of its last token."""
        chunk = self.cfg.prefill_chunk_tokens
        logits = torch.empty(0)
        for start in range(0, ids.shape[0], chunk):
            logits = self.forward(ids[start : start + chunk], start, cache)
        return logits


@dataclass(frozen=True)
class Sampling:
    """temperature 0 means greedy; top_k 0 and top_p 1 disable those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None


def sample(logits: torch.Tensor, opts: Sampling, generator: torch.Generator | None) -> int:
    if opts.temperature <= 0:
        return int(torch.argmax(logits))
    # Sampling runs on CPU in float32 so a seed gives the same tokens on every device.
    scores = logits.detach().float().cpu() / opts.temperature
    if 0 < opts.top_k < scores.shape[0]:
        values, indices = torch.topk(scores, opts.top_k)
    else:
        values, indices = torch.sort(scores, descending=True)
    probs = torch.softmax(values, dim=-1)
    if opts.top_p < 1.0:
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        before = torch.cumsum(probs, dim=-1) - probs
        probs = probs.masked_fill(before >= opts.top_p, 0.0)
    choice = torch.multinomial(probs, 1, generator=generator)
    return int(indices[choice])


def generate(
    model: Llama,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    opts: Sampling,
    stop_ids: frozenset[int],
    should_stop: Callable[[list[int]], bool] = lambda _ids: False,
    use_cache: bool = True,
) -> tuple[list[int], bool]:
    """Sampled token ids, and whether a stop token or `should_stop` ended them.

    The stop token itself is not returned. `use_cache=False` recomputes the
    whole sequence every step: slow, kept to check the cache against.
    """
    steps = generate_steps(
        model, prompt_ids, max_new_tokens, opts, stop_ids, should_stop, use_cache
    )
    out: list[int] = []
    while True:
        try:
            out.append(next(steps))
        except StopIteration as end:
            stopped: bool = end.value
            return out, stopped


def generate_steps(
    model: Llama,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    opts: Sampling,
    stop_ids: frozenset[int],
    should_stop: Callable[[list[int]], bool] = lambda _ids: False,
    use_cache: bool = True,
) -> Generator[int, None, bool]:
    """`generate`, one token id at a time as each is sampled; returns whether a stop
    token or `should_stop` ended them. Closing it stops the decoding there."""
    generator = None
    if opts.temperature > 0:
        generator = torch.Generator(device="cpu")
        generator.manual_seed(opts.seed if opts.seed is not None else torch.seed())
    device = model.embed.device
    ids = torch.tensor(list(prompt_ids), dtype=torch.long, device=device)
    out: list[int] = []
    with torch.inference_mode():
        if use_cache:
            cache = model.new_cache(len(prompt_ids) + max_new_tokens)
            logits = model.prefill(ids, cache)
        else:
            logits = model.forward(ids, 0, None)
        for _ in range(max_new_tokens):
            token = sample(logits, opts, generator)
            if token in stop_ids:
                return True
            out.append(token)
            yield token
            if should_stop(out):
                return True
            if len(out) == max_new_tokens:
                break
            step = torch.tensor([token], dtype=torch.long, device=device)
            if use_cache:
                logits = model.forward(step, cache.length, cache)
            else:
                ids = torch.cat([ids, step])
                logits = model.forward(ids, 0, None)
    return False
