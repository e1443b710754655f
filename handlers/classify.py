"""ImageNet classification with EfficientNet-Lite0 (bundle `efficientnet`).

    {"image": "<base64 JPEG/PNG/GIF/WebP/...>", "top_k": 5}
    -> {"labels": [{"index": 652, "label": "military uniform", "score": 0.37}, ...]}

Any size and mode is accepted (grayscale, palette, RGBA is composited on
white); the image is resized to 224x224. A `data:` URL prefix is allowed.
"""

from __future__ import annotations

import base64
import binascii
import io
import struct
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from handlers.models.fields import check_event, get_int, require
from runtime import Batch, Context, InvalidInput, bundle, handler

if TYPE_CHECKING:
    from collections.abc import Mapping

    import torch
    from PIL.Image import Image

    from handlers.models.efficientnet import ImageClassifier

DEFAULT_TOP_K = 5
# Images per forward pass when concurrent requests are batched; memory is admitted
# per request (PER_REQUEST_BYTES each), so a batch never holds more than its members.
MAX_BATCH_IMAGES = 16
MAX_TOP_K = 100
# Decoded bytes; as base64 this stays under the runtime's 6 MiB body limit.
MAX_IMAGE_BYTES = 4 * 1024 * 1024
# Pixels after decoding; large JPEGs decode at a reduced scale first, so this
# mostly bounds PNG and other lossless formats.
MAX_IMAGE_PIXELS = 4096 * 4096
# Up to three RGBA copies of an image at the pixel limit while converting, plus the
# network's activations at 224x224 (peak RSS grew by 12 MB on CPU), rounded up.
PER_REQUEST_BYTES = 3 * 4 * MAX_IMAGE_PIXELS + 32 * 1024 * 1024
_MAX_BASE64_CHARS = 4 * (MAX_IMAGE_BYTES + 2) // 3 + 4
_HIGH_BIT_DEPTH_MODES = frozenset({"I", "I;16", "I;16B", "I;16L", "I;16N", "F"})


def _png_base64(width: int, height: int, color_type: int, pixel: bytes) -> str:
    """A flat-colour PNG made with the standard library (no PIL at import time)."""

    def chunk(tag: bytes, data: bytes) -> bytes:
        body = tag + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", width, height, 8, color_type, 0, 0, 0)
    rows = (b"\x00" + pixel * width) * height
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows, 1))
    return base64.b64encode(png + chunk(b"IEND", b"")).decode("ascii")


# A 48x32 RGB JPEG (gradient), made once with PIL.
_SMALL_JPEG = (
    "/9j/4AAQSkZJRgABAQAAAQABAAD/2wBDAA0JCgsKCA0LCgsODg0PEyAVExISEyccHhcgLikxMC4pLSwzOko+MzZG"
    "NywtQFdBRkxOUlNSMj5aYVpQYEpRUk//2wBDAQ4ODhMREyYVFSZPNS01T09PT09PT09PT09PT09PT09PT09PT09P"
    "T09PT09PT09PT09PT09PT09PT09PT09PT0//wAARCAAgADADASIAAhEBAxEB/8QAFQABAQAAAAAAAAAAAAAAAAAA"
    "AAb/xAAWEAADAAAAAAAAAAAAAAAAAAAAFGH/xAAUAQEAAAAAAAAAAAAAAAAAAAAA/8QAFBEBAAAAAAAAAAAAAAAA"
    "AAAAAP/aAAwDAQACEQMRAD8AhEIEIU6ECEAmEIEIU6ECEAmEIEIU6ECEAqEIEIU6MCMAmEIEIU6MCMAmEIEIU6MC"
    "MA//2Q=="
)


def _warmup() -> list[dict[str, Any]]:
    """One RGBA PNG: the first forward pass (kernel and allocator set-up: 62 ms
    against 25-27 ms after) and PIL's first image (17-21 ms: it imports its
    PNG, JPEG, GIF, BMP and PPM plugins together, so the first JPEG after it
    costs 0.3 ms) are the one-time costs on a CPU (BENCHMARKS.md, warmup).
    RGBA, so the alpha conversion path is warm too. A second example (a JPEG)
    warmed nothing more: it was one more forward pass, 27 ms of every cold
    start. Made on first use, not at import (discovery runs before the server
    listens)."""
    return [{"image": _png_base64(64, 48, 6, b"\x0a\xc8\x28\x80"), "top_k": 10}]  # RGBA


def _accelerator_warmup() -> list[dict[str, Any]]:
    """Large and odd shapes, whose first calls select kernels on an accelerator."""
    return [
        {"image": _png_base64(1280, 960, 2, b"\xc8\x78\x28"), "top_k": 1},  # large RGB
        {"image": _png_base64(40, 30, 0, b"\x80")},  # grayscale
        {"image": _SMALL_JPEG},
    ]


@bundle("efficientnet")
def build_efficientnet(
    weights: Mapping[str, torch.Tensor], device: str, files: Mapping[str, Path]
) -> ImageClassifier:
    from handlers.models.efficientnet import IMAGENET_LABELS, EfficientNetLite, ImageClassifier

    net = EfficientNetLite(weights, device)
    return ImageClassifier(net, files.get("labels.txt", IMAGENET_LABELS))


def _image_bytes(value: Any) -> bytes:
    if not isinstance(value, str) or not value:
        raise InvalidInput("image", "must be a non-empty base64 string")
    if value.startswith("data:"):
        value = value.partition(",")[2]
    if len(value) > _MAX_BASE64_CHARS:
        raise InvalidInput("image", f"is larger than {MAX_IMAGE_BYTES} bytes")
    if "\n" in value or "\r" in value:
        value = "".join(value.split())  # MIME-style line breaks
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidInput("image", "is not valid base64") from None


def decode_image(data: bytes, draft_size: int) -> Image:
    """An RGB PIL image of any input; undecodable or oversized input -> InvalidInput."""
    from PIL import Image as PILImage

    try:
        image = PILImage.open(io.BytesIO(data))
        # JPEG decodes at a reduced scale when the image is far larger than needed.
        image.draft("RGB", (draft_size, draft_size))
        if image.width * image.height > MAX_IMAGE_PIXELS:
            raise InvalidInput(
                "image", f"is {image.width}x{image.height} pixels; the limit is {MAX_IMAGE_PIXELS}"
            )
        image.load()
    except InvalidInput:
        raise
    except Exception as exc:  # PIL raises many types for malformed files; all mean "bad input"
        raise InvalidInput("image", f"is not a decodable image ({exc})") from None
    return _to_rgb(image)


def _to_rgb(image: Image) -> Image:
    from PIL import Image as PILImage

    if image.mode in _HIGH_BIT_DEPTH_MODES:
        import numpy as np

        pixels = np.asarray(image, dtype=np.float32)
        if image.mode != "F":
            pixels = pixels / 257.0  # 16-bit samples to 8-bit
        image = PILImage.fromarray(pixels.clip(0, 255).astype(np.uint8), "L")
    if "A" in image.getbands() or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        background = PILImage.new("RGBA", rgba.size, (255, 255, 255, 255))
        background.alpha_composite(rgba)
        image = background
    return image.convert("RGB")


@handler(
    "classify",
    uses=["efficientnet"],
    warmup=_warmup,
    accelerator_warmup=_accelerator_warmup,
    batch=Batch(max_size=MAX_BATCH_IMAGES, max_wait_ms=5),
)
def classify(
    events: list[Any], efficientnet: ImageClassifier, ctxs: list[Context]
) -> list[dict[str, Any] | InvalidInput]:
    """Top-k ImageNet classes of a base64-encoded image."""
    # Each image is decoded on its own (a bad one fails only its caller); the
    # network then runs once for all of them.
    outputs: list[dict[str, Any] | InvalidInput] = []
    images: list[tuple[int, Image, int]] = []
    for index, event in enumerate(events):
        try:
            fields = check_event(event, {"image", "top_k"})
            data = _image_bytes(require(fields, "image"))
            top_k = get_int(
                fields, "top_k", DEFAULT_TOP_K, 1, min(MAX_TOP_K, efficientnet.num_classes)
            )
            image = decode_image(data, 2 * efficientnet.image_size)
        except InvalidInput as refused:
            outputs.append(refused)
            continue
        outputs.append({})
        images.append((index, image, top_k))
    if images:
        labels = efficientnet.classify_many([i[1] for i in images], [i[2] for i in images])
        for (index, _image, _top_k), found in zip(images, labels, strict=True):
            outputs[index] = {"labels": found}
    return outputs
