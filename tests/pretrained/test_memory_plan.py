"""The memory plan is honest: each shipped bundle's declared `per_request_bytes`
(what admission charges a request) covers the measured peak of the largest
request its handler accepts, measured in a fresh process (tests/pretrained/peak.py).

Measured on the CPU; a CUDA plan is checked the same way on a device machine
(`torch.cuda.max_memory_allocated` would replace VmHWM there).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from runtime.bundles.manifest import read_manifest

ROOT = Path(__file__).resolve().parents[2]


def measured_peak(bundle: Path, module: str, handler: str, event: Any, size: int = 1) -> int:
    done = subprocess.run(
        [sys.executable, "-m", "tests.pretrained.peak", str(bundle), module, handler, str(size)],
        input=orjson.dumps(event),
        capture_output=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-3000:]
    peak: int = orjson.loads(done.stdout)["peak_bytes"]
    return peak


def check(bundle: Path, module: str, handler: str, event: Any, size: int = 1) -> None:
    """`size` copies of `event` as one batch peak within `size` request slots: what
    admission charges a batch (runtime/dispatch/batcher.py)."""
    declared = read_manifest(bundle).per_request_bytes * size
    peak = measured_peak(bundle, module, handler, event, size)
    print(f"{handler}: declared {declared / 2**20:.0f} MiB, measured peak {peak / 2**20:.0f} MiB")
    assert peak > 0, "the largest request allocated nothing: the measurement is broken"
    assert peak <= declared, f"{handler} x{size} peaks at {peak} bytes, declares {declared}"


def test_embed_declares_its_largest_request(minilm_bundle: Path) -> None:
    from handlers.embed import _LONG_TEXT, MAX_TEXTS

    check(minilm_bundle, "handlers.embed", "embed", {"texts": [_LONG_TEXT] * MAX_TEXTS})


def test_a_batch_of_embed_requests_fits_its_members_slots(minilm_bundle: Path) -> None:
    from handlers.embed import _LONG_TEXT, MAX_TEXTS

    event = {"texts": [_LONG_TEXT] * MAX_TEXTS}
    check(minilm_bundle, "handlers.embed", "embed", event, size=3)


def test_classify_declares_its_largest_request(efficientnet_bundle: Path) -> None:
    from handlers.classify import MAX_IMAGE_PIXELS, _png_base64

    side = int(MAX_IMAGE_PIXELS**0.5)
    image = _png_base64(side, side, 2, b"\x20\x80\xc0")  # the most pixels allowed, RGB
    check(efficientnet_bundle, "handlers.classify", "classify", {"image": image})


def test_a_batch_of_classify_requests_fits_its_members_slots(efficientnet_bundle: Path) -> None:
    from handlers.classify import MAX_IMAGE_PIXELS, _png_base64

    side = int(MAX_IMAGE_PIXELS**0.5)
    image = _png_base64(side, side, 2, b"\x20\x80\xc0")
    check(efficientnet_bundle, "handlers.classify", "classify", {"image": image}, size=2)


@pytest.mark.slow
def test_generate_declares_its_largest_request(smollm2_bundle: Path) -> None:
    """A prompt that fills the context but for the tokens it asks for: the KV cache
    and the chunked prefill's attention at their largest."""
    from handlers.generate import MAX_CONTEXT_TOKENS

    tokens = 8
    prompt = "word " * (MAX_CONTEXT_TOKENS - 100)  # as tests/pretrained/test_generate.py
    check(
        smollm2_bundle,
        "handlers.generate",
        "generate",
        {"prompt": prompt, "max_tokens": tokens},
    )


def test_generate_declares_its_kv_cache_per_token(smollm2_bundle: Path, smollm2: Any) -> None:
    """A sequence's KV cache, as allocated, is the bytes per token the plan declares
    times its tokens; and the request slot a sequence reserves holds a whole
    context of it (a sequence is never cut short for want of cache)."""
    from handlers.generate import MAX_CONTEXT_TOKENS
    from handlers.models.llama import Sampling

    manifest = read_manifest(smollm2_bundle)
    per_token = manifest.kv_bytes_per_token
    assert per_token > 0
    prompt = smollm2.encode_prompt("Once upon a time")
    sequence = smollm2.begin(prompt, 10, Sampling(), [])
    cache = sequence.cache
    measured = cache.kv.untyped_storage().nbytes()  # the allocation itself
    assert measured == per_token * (len(prompt) + 10)
    sequence.release()
    assert manifest.per_request_bytes >= per_token * MAX_CONTEXT_TOKENS
