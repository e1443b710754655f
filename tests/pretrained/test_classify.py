"""EfficientNet-Lite0 behind the `classify` handler: reference class, image modes, input errors."""

from __future__ import annotations

import base64
import importlib.util
import io
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from handlers.classify import MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS, MAX_TOP_K, classify
from handlers.models.efficientnet import ImageClassifier
from runtime import Context, InvalidInput
from runtime.registry import discover

CTX = Context(request_id="t", handler="classify")


def grace_hopper() -> bytes:
    """matplotlib's sample photo, found without importing matplotlib (slow to import)."""
    spec = importlib.util.find_spec("matplotlib")
    if spec is None or spec.origin is None:
        pytest.skip("matplotlib (a dev dependency) ships the reference image")
    return (Path(spec.origin).parent / "mpl-data" / "sample_data" / "grace_hopper.jpg").read_bytes()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def encoded(image: Image.Image, fmt: str = "PNG", **options: Any) -> str:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return b64(buffer.getvalue())


def labels(model: ImageClassifier, image: str, top_k: int = 5) -> list[dict[str, Any]]:
    [out] = classify([{"image": image, "top_k": top_k}], model, [CTX])
    result: list[dict[str, Any]] = out["labels"]
    assert len(result) == top_k
    scores = [entry["score"] for entry in result]
    assert scores == sorted(scores, reverse=True) and 0 < sum(scores) <= 1.0 + 1e-6
    return result


def test_reference_top1_grace_hopper(efficientnet: ImageClassifier) -> None:
    top = labels(efficientnet, b64(grace_hopper()))
    assert top[0]["index"] == 652
    assert top[0]["label"] == "military uniform"
    # The default top_k, and a data URL, give the same answer.
    url = "data:image/jpeg;base64," + b64(grace_hopper())
    assert classify([{"image": url}], efficientnet, [CTX])[0]["labels"] == top


def test_labels_are_the_1000_imagenet_classes(efficientnet: ImageClassifier) -> None:
    assert efficientnet.num_classes == 1000
    assert efficientnet.labels[0] == "tench" and efficientnet.labels[999] == "toilet tissue"


def test_transparent_pixels_are_composited_on_white(efficientnet: ImageClassifier) -> None:
    clear = Image.new("RGBA", (64, 64), (0, 0, 0, 0))
    white = Image.new("RGB", (64, 64), (255, 255, 255))
    assert labels(efficientnet, encoded(clear)) == labels(efficientnet, encoded(white))


@pytest.mark.parametrize(
    ("image", "same_as"),
    [
        (Image.new("L", (50, 40), 90), Image.new("RGB", (50, 40), (90, 90, 90))),
        # Gray with alpha is composited on white as RGBA is.
        (Image.new("LA", (50, 40), (90, 200)), Image.new("RGBA", (50, 40), (90, 90, 90, 200))),
        # A palette index is its palette's colour, not a gray level.
        (Image.new("P", (50, 40), 3), Image.new("P", (50, 40), 3).convert("RGB")),
        # 16-bit samples scaled to 8 bits: 40000 / 257 = 155.6.
        (Image.new("I;16", (50, 40), 40000), Image.new("RGB", (50, 40), (155, 155, 155))),
        (Image.new("1", (50, 40), 1), Image.new("RGB", (50, 40), (255, 255, 255))),
        (
            Image.new("RGBA", (3000, 20), (10, 200, 30, 255)),
            Image.new("RGB", (3000, 20), (10, 200, 30)),
        ),
    ],
    ids=lambda im: f"{im.mode}-{im.width}x{im.height}",
)
def test_any_mode_and_size(
    efficientnet: ImageClassifier, image: Image.Image, same_as: Image.Image
) -> None:
    """Every mode is read as the RGB image it shows: the answers are the same."""
    assert labels(efficientnet, encoded(image)) == labels(efficientnet, encoded(same_as))


def test_jpeg_variants(efficientnet: ImageClassifier) -> None:
    photo = Image.open(io.BytesIO(grace_hopper()))
    big = photo.resize((2400, 2812))  # decoded at a reduced scale (JPEG draft)
    assert labels(efficientnet, encoded(big, "JPEG", quality=90))[0]["index"] == 652
    # Grayscale and CMYK JPEGs of the same photo are still the same uniform.
    assert labels(efficientnet, encoded(photo.convert("L"), "JPEG"))[0]["index"] == 652
    assert labels(efficientnet, encoded(photo.convert("CMYK"), "JPEG"))[0]["index"] == 652


def test_every_warmup_example_runs(efficientnet: ImageClassifier) -> None:
    """CPU warm-up: a PNG with alpha (PIL's first image, which loads its JPEG plugin
    too, and the first forward pass); the accelerator adds large and grayscale shapes
    and a JPEG."""
    spec = discover(["handlers.classify"]).handler("classify")
    images = [Image.open(io.BytesIO(base64.b64decode(e["image"]))) for e in spec.warmup]
    assert [(i.format, i.mode) for i in images] == [("PNG", "RGBA")]
    accelerated = spec.warmup_for("cuda")
    assert accelerated[: len(spec.warmup)] == list(spec.warmup)
    modes = set()
    for example in accelerated:
        image = Image.open(io.BytesIO(base64.b64decode(example["image"])))
        modes.add(image.mode)
        labels(efficientnet, example["image"], example.get("top_k", 5))
    assert {"RGB", "L", "RGBA"} <= modes
    sizes = [Image.open(io.BytesIO(base64.b64decode(e["image"]))).size for e in accelerated]
    assert min(w * h for w, h in sizes) < 224 * 224 < max(w * h for w, h in sizes)
    assert spec.warmup_for("cpu") == list(spec.warmup)


def _too_many_pixels() -> str:
    side = int(MAX_IMAGE_PIXELS**0.5) + 1
    return encoded(Image.new("L", (side, side), 0), optimize=True)


@pytest.mark.parametrize(
    ("event", "field"),
    [
        ({}, "image"),
        ({"image": 42}, "image"),
        ({"image": ""}, "image"),
        ({"image": "not base64 at all!"}, "image"),
        ({"image": b64(b"hello, not an image")}, "image"),
        ({"image": b64(grace_hopper()[:5000])}, "image"),  # truncated JPEG
        ({"image": "A" * (MAX_IMAGE_BYTES * 4 // 3 + 100)}, "image"),
        ({"image": _too_many_pixels()}, "image"),
        ({"image": b64(b"x"), "top_k": 0}, "top_k"),
        ({"image": b64(b"x"), "top_k": MAX_TOP_K + 1}, "top_k"),
        ({"image": b64(b"x"), "top_k": "3"}, "top_k"),
        ({"image": b64(b"x"), "topk": 3}, "topk"),
    ],
)
def test_bad_input_names_the_field(efficientnet: ImageClassifier, event: Any, field: str) -> None:
    [refused] = classify([event], efficientnet, [CTX])
    assert isinstance(refused, InvalidInput)
    assert refused.field == field
