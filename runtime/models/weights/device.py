"""The device read path: a shard for a non-CPU device, through safetensors."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from runtime.bundles.stamps import Stamp, stamp_of
from runtime.errors import BundleError, IntegrityError
from runtime.models.weights.format import check_header

if TYPE_CHECKING:
    import torch


def load_mapped(
    path: Path,
    rel: str,
    size: int,
    device: str,
    dtype: torch.dtype | None,
    verified: Stamp | None = None,
) -> dict[str, torch.Tensor]:
    """A shard for a non-CPU device through safetensors, which copies it to the device:
    nothing stays mapped once it returns. A shard changed meanwhile is refused."""
    from safetensors.torch import load_file

    try:
        before = os.stat(path, follow_symlinks=False)
    except FileNotFoundError as exc:
        raise IntegrityError(f"{rel}: deleted since it was verified", file=rel) from exc
    if before.st_size != size:
        raise IntegrityError(
            f"{rel}: size {before.st_size} does not match manifest size {size} "
            "(changed since it was verified)",
            file=rel,
        )
    if verified is not None and stamp_of(before) != verified:
        raise IntegrityError(f"{rel}: changed since it was verified", file=rel)
    check_header(path)
    try:
        tensors = load_file(str(path), device=device)
    except Exception as exc:  # safetensors raises its own SafetensorError and OSError
        raise BundleError(f"{rel}: not a readable safetensors file ({exc})") from exc
    try:
        after = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        after = None
    if after is None or stamp_of(after) != stamp_of(before):
        raise IntegrityError(f"{rel}: changed while it was being read", file=rel)
    if dtype is not None:
        tensors = {
            k: (v.to(dtype) if v.is_floating_point() and v.dtype != dtype else v)
            for k, v in tensors.items()
        }
    return tensors
