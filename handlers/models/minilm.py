"""all-MiniLM-L6-v2 (a 6-layer BERT) in plain torch: sentence embeddings.

Embedding = masked mean pooling of the last hidden states, L2-normalised, as
sentence-transformers computes it. The builder fuses q/k/v into one matrix;
requests tokenize, run one padded batch and pool.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

# Texts of the longest sequence per forward pass: attention memory grows with
# batch x heads x tokens^2, the feed-forward's with batch x tokens.
MAX_BATCH_TEXTS = 8


@dataclass(frozen=True)
class BertConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    layer_norm_eps: float
    max_seq_tokens: int
    pad_token_id: int

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> BertConfig:
        return cls(
            hidden_size=int(config["hidden_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=int(config["num_attention_heads"]),
            layer_norm_eps=float(config.get("layer_norm_eps", 1e-12)),
            max_seq_tokens=int(config.get("max_seq_tokens", 256)),
            pad_token_id=int(config.get("pad_token_id", 0)),
        )


@dataclass(frozen=True)
class _Layer:
    qkv_w: torch.Tensor
    qkv_b: torch.Tensor
    out_w: torch.Tensor
    out_b: torch.Tensor
    attn_norm: tuple[torch.Tensor, torch.Tensor]
    ffn_in_w: torch.Tensor
    ffn_in_b: torch.Tensor
    ffn_out_w: torch.Tensor
    ffn_out_b: torch.Tensor
    ffn_norm: tuple[torch.Tensor, torch.Tensor]


class MiniLM:
    def __init__(
        self,
        cfg: BertConfig,
        weights: Mapping[str, torch.Tensor],
        tokenizer_path: Path,
        device: str,
    ) -> None:
        self.cfg = cfg
        self.device = torch.device(device)

        def w(name: str) -> torch.Tensor:
            try:
                return weights[name].to(device=device, dtype=torch.float32)
            except KeyError:
                raise ValueError(f"weights lack tensor {name!r}") from None

        def norm(prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
            return w(f"{prefix}.weight"), w(f"{prefix}.bias")

        self.word = w("embeddings.word_embeddings.weight")
        self.position = w("embeddings.position_embeddings.weight")
        self.token_type = w("embeddings.token_type_embeddings.weight")[0]
        self.embed_norm = norm("embeddings.LayerNorm")
        self.layers: list[_Layer] = []
        for i in range(cfg.num_layers):
            p = f"encoder.layer.{i}."
            att = p + "attention.self."
            self.layers.append(
                _Layer(
                    qkv_w=torch.cat([w(f"{att}{n}.weight") for n in ("query", "key", "value")]),
                    qkv_b=torch.cat([w(f"{att}{n}.bias") for n in ("query", "key", "value")]),
                    out_w=w(p + "attention.output.dense.weight"),
                    out_b=w(p + "attention.output.dense.bias"),
                    attn_norm=norm(p + "attention.output.LayerNorm"),
                    ffn_in_w=w(p + "intermediate.dense.weight"),
                    ffn_in_b=w(p + "intermediate.dense.bias"),
                    ffn_out_w=w(p + "output.dense.weight"),
                    ffn_out_b=w(p + "output.dense.bias"),
                    ffn_norm=norm(p + "output.LayerNorm"),
                )
            )
        self.max_tokens = min(cfg.max_seq_tokens, self.position.shape[0])
        self.tokenizer = Tokenizer.from_file(str(tokenizer_path))
        # The shipped tokenizer.json truncates and pads every text to 128 tokens; the
        # model takes 256, and encode() pads each sub-batch itself.
        self.tokenizer.enable_truncation(max_length=self.max_tokens)
        self.tokenizer.no_padding()

    @property
    def dim(self) -> int:
        return self.cfg.hidden_size

    def _layer_norm(
        self, x: torch.Tensor, params: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        return F.layer_norm(x, (self.cfg.hidden_size,), *params, eps=self.cfg.layer_norm_eps)

    def _encode_tokens(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Mean-pooled last hidden states, (batch, hidden), of padded `ids`.

        The linear layers (most of the work) run on the real tokens only,
        packed: texts of different lengths batched together (concurrent
        requests) pay no padding there. Attention alone needs the padded
        (batch, seq) layout.
        """
        cfg = self.cfg
        batch, seq = ids.shape
        hidden = cfg.hidden_size
        heads, head_dim = cfg.num_heads, hidden // cfg.num_heads
        real = mask.reshape(-1).bool()
        packed = None if bool(real.all()) else real.nonzero().squeeze(1)
        x = (self.word[ids] + self.position[:seq] + self.token_type).reshape(batch * seq, hidden)
        if packed is not None:
            x = x.index_select(0, packed)
        x = self._layer_norm(x, self.embed_norm)
        key_mask = mask.bool()[:, None, None, :]
        for layer in self.layers:
            qkv = F.linear(x, layer.qkv_w, layer.qkv_b)
            if packed is not None:
                qkv = qkv.new_zeros(batch * seq, 3 * hidden).index_copy_(0, packed, qkv)
            q, k, v = qkv.view(batch, seq, 3, heads, head_dim).permute(2, 0, 3, 1, 4).unbind(0)
            att = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)
            att = att.transpose(1, 2).reshape(batch * seq, hidden)
            if packed is not None:
                att = att.index_select(0, packed)
            x = self._layer_norm(x + F.linear(att, layer.out_w, layer.out_b), layer.attn_norm)
            h = F.gelu(F.linear(x, layer.ffn_in_w, layer.ffn_in_b))
            x = self._layer_norm(x + F.linear(h, layer.ffn_out_w, layer.ffn_out_b), layer.ffn_norm)
        # Mean over each text's own tokens.
        text_of = torch.arange(batch, device=x.device).repeat_interleave(seq)
        if packed is not None:
            text_of = text_of.index_select(0, packed)
        sums = x.new_zeros(batch, hidden).index_add_(0, text_of, x)
        return sums / mask.sum(dim=1, keepdim=True)

    def _sub_batches(self, lengths: list[int], order: list[int]) -> list[list[int]]:
        """`order` (sorted by token count, `lengths`) cut into passes of at most
        MAX_BATCH_TEXTS x max_tokens padded tokens."""
        budget = MAX_BATCH_TEXTS * self.max_tokens
        passes: list[list[int]] = []
        rows: list[int] = []
        for length, index in zip(lengths, order, strict=True):
            # Sorted ascending: this text sets the pass's padded length.
            if rows and (len(rows) + 1) * max(1, length) > budget:
                passes.append(rows)
                rows = []
            rows.append(index)
        if rows:
            passes.append(rows)
        return passes

    def encode(self, texts: Sequence[str], counts: list[int] | None = None) -> torch.Tensor:
        """(len(texts), dim) unit vectors; `counts`, when given, gets each text's token
        count (as run: truncated to the model's maximum), for usage figures.

        Texts run in length-sorted sub-batches, each padded to its own longest
        (less padding) and holding at most MAX_BATCH_TEXTS x max_tokens tokens:
        no pass takes more memory than MAX_BATCH_TEXTS texts of the longest
        sequence, and short texts (a batch of concurrent requests) share one pass.
        """
        encodings = self.tokenizer.encode_batch(list(texts))
        if counts is not None:
            counts += [len(encoding.ids) for encoding in encodings]
        order = sorted(range(len(encodings)), key=lambda i: len(encodings[i].ids))
        out = torch.empty(len(encodings), self.dim, device=self.device)
        with torch.inference_mode():
            for rows in self._sub_batches([len(encodings[i].ids) for i in order], order):
                tokens = [encodings[i].ids for i in rows]
                seq = max(len(t) for t in tokens)
                pad = [self.cfg.pad_token_id] * seq
                # One tensor from padded lists: one small tensor per text held the
                # GIL (and the event loop) for longer than the tokenizer did.
                ids = torch.tensor([t + pad[len(t) :] for t in tokens], dtype=torch.long)
                mask = torch.tensor([[1.0] * len(t) + [0.0] * (seq - len(t)) for t in tokens])
                ids, mask = ids.to(self.device), mask.to(self.device)
                pooled = self._encode_tokens(ids, mask)
                out[torch.tensor(rows, device=self.device)] = F.normalize(pooled, p=2, dim=-1)
        return out
