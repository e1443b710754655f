"""Builders that wrap a bundle's tensors in a torch module without copying them, and
handlers whose answer depends on every byte of every weight.

Bundles (and handlers of the same names): `wsum_a`, `wsum_b`. The builder keeps
the very tensors the loader handed it (buffers, not copies), so an answer reads
exactly the memory the load produced: if that memory still viewed the bundle's
files, changing a file would change the answer (or, truncated, kill the process).

An answer: `digest` (sha256 over every tensor's name, dtype, shape and bytes),
`sums` (each tensor's float64 sum), `dtypes`, `total` (the module's forward) and
`pid`. `describe()` computes the same fields (but `pid`) from a weights dict, so
a test can check an answer against the bytes it wrote.
"""

from __future__ import annotations

import hashlib
import os
from typing import TYPE_CHECKING, Any

from runtime import Context, bundle, handler

if TYPE_CHECKING:
    import torch


def describe(weights: dict[str, torch.Tensor]) -> dict[str, Any]:
    import torch

    digest = hashlib.sha256()
    sums: dict[str, float] = {}
    dtypes: dict[str, str] = {}
    for name in sorted(weights):
        tensor = weights[name].detach().contiguous()
        raw = tensor.reshape(-1).view(torch.uint8)
        digest.update(f"{name}|{tensor.dtype}|{list(tensor.shape)}|".encode())
        digest.update(raw.numpy().tobytes())
        real = tensor.abs() if tensor.is_complex() else tensor
        sums[name] = float(real.double().sum())
        dtypes[name] = str(tensor.dtype).removeprefix("torch.")
    return {"digest": digest.hexdigest(), "sums": sums, "dtypes": dtypes}


def _build(weights: dict[str, torch.Tensor]) -> Any:
    import torch

    class WeightSum(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.names = sorted(weights)
            for index, name in enumerate(self.names):
                # A buffer holds the tensor itself: no copy between loader and answer.
                self.register_buffer(f"w{index}", weights[name])

        def tensors(self) -> dict[str, torch.Tensor]:
            return {name: getattr(self, f"w{i}") for i, name in enumerate(self.names)}

        def forward(self) -> torch.Tensor:
            return sum((t.double().sum() for t in self.tensors().values()), torch.zeros(()))

    return WeightSum().eval()


def _answer(model: Any) -> dict[str, Any]:
    return {**describe(model.tensors()), "total": float(model()), "pid": os.getpid()}


@bundle("wsum_a")
def build_a(weights: dict[str, torch.Tensor]) -> Any:
    return _build(weights)


@bundle("wsum_b")
def build_b(weights: dict[str, torch.Tensor]) -> Any:
    return _build(weights)


@handler("wsum_a", uses=["wsum_a"], warmup=[{}])
def wsum_a(event: Any, model: Any, ctx: Context) -> dict[str, Any]:
    return _answer(model)


@handler("wsum_b", uses=["wsum_b"], warmup=[{}])
def wsum_b(event: Any, model: Any, ctx: Context) -> dict[str, Any]:
    return _answer(model)
