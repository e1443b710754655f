"""Rebuild bundles/tempconv: a one-neuron torch model, F = 1.8 * C + 32.

The weights are exact in float32, so the example's output is checkable by hand.
Run: python scripts/build_example_bundle.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from runtime.bundles.manifest import build_bundle

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp)
        save_file(
            {"linear.weight": torch.tensor([[1.8]]), "linear.bias": torch.tensor([32.0])},
            src / "model.safetensors",
        )
        manifest = build_bundle(
            src,
            "tempconv",
            version="2026-11-29",
            out=ROOT / "bundles" / "tempconv",
            config={"in_features": 1, "out_features": 1},
            thaw={"dtype": "float32"},
            per_request_bytes=64 * 1024,
        )
    print(manifest.id)


if __name__ == "__main__":
    main()
