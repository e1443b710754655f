"""The safetensors format, read by this package itself: header, dtypes, tensor ranges.

A header is checked as safetensors checks it before anything is allocated
for it: its length against the file, every tensor's byte range against its
dtype and shape, and the ranges against the data section, which they must
tile exactly.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import orjson

from runtime.errors import BundleError

if TYPE_CHECKING:
    import torch

# A safetensors header is JSON; real ones are kilobytes. A header length claim
# beyond this is refused before anything is allocated for it.
MAX_HEADER_BYTES = 64 * 1024 * 1024

SAFETENSORS_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U64": "uint64",
    "U32": "uint32",
    "U16": "uint16",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2": "float8_e5m2",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "C64": "complex64",
}


def header_length(prefix: bytes, size: int, name: str) -> int:
    """The header length a shard's first 8 bytes claim, refused when absurd or past its end."""
    if len(prefix) < 8:
        raise BundleError(f"{name}: too short to be safetensors")
    (header_len,) = struct.unpack("<Q", prefix)
    if header_len > MAX_HEADER_BYTES:
        raise BundleError(
            f"{name}: safetensors header claims {header_len} bytes (limit {MAX_HEADER_BYTES})"
        )
    if 8 + header_len > size:
        raise BundleError(f"{name}: safetensors header runs past the end of the file")
    return int(header_len)


def check_header(path: Path) -> None:
    """Refuse a safetensors file whose header length is absurd or past the file end."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        header_length(handle.read(8), size, path.name)


def torch_dtype(code: str) -> torch.dtype | None:
    import torch

    name = SAFETENSORS_DTYPES.get(code)
    dtype = getattr(torch, name, None) if name is not None else None
    return dtype if isinstance(dtype, torch.dtype) else None


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # of its first byte in the file
    nbytes: int


def parse_header(raw: bytes, data_bytes: int, data_start: int, rel: str) -> list[TensorSpec]:
    """The tensors a safetensors header describes, checked as safetensors checks them.

    Every tensor's byte range must match its dtype and shape, and the ranges
    must tile the data section exactly (no hole, overlap or trailing byte), so
    nothing a header claims is allocated beyond the file's own size.
    """

    def bad(why: str) -> BundleError:
        return BundleError(f"{rel}: not a readable safetensors file ({why})")

    try:
        header = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad(f"header is not JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    specs: list[tuple[int, int, str, torch.dtype, tuple[int, ...]]] = []
    for name, info in header.items():
        if name == "__metadata__":
            if not isinstance(info, dict):
                raise bad("__metadata__ is not an object")
            continue
        if not isinstance(info, dict):
            raise bad(f"tensor {name!r} is not an object")
        code, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        dtype = torch_dtype(code) if isinstance(code, str) else None
        if dtype is None:
            raise bad(f"tensor {name!r} has unsupported dtype {code!r}")
        if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
            raise bad(f"tensor {name!r} has shape {shape!r}")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(_is_count(o) for o in offsets)
            or offsets[0] > offsets[1]
        ):
            raise bad(f"tensor {name!r} has data_offsets {offsets!r}")
        numel = 1
        for dim in shape:
            numel *= dim
        if numel * dtype.itemsize != offsets[1] - offsets[0]:
            raise bad(f"tensor {name!r}: {offsets[1] - offsets[0]} bytes for shape {shape}")
        specs.append((offsets[0], offsets[1], name, dtype, tuple(shape)))
    specs.sort(key=lambda s: (s[0], s[1]))
    end = 0
    for begin, stop, name, _dtype, _shape in specs:
        if begin != end:
            raise bad(f"tensor {name!r} starts at byte {begin}, expected {end}")
        end = stop
    if end != data_bytes:
        raise bad(f"tensors cover {end} of the {data_bytes} data bytes")
    return [
        TensorSpec(name, dtype, shape, data_start + begin, stop - begin)
        for begin, stop, name, dtype, shape in specs
    ]


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
