"""FileTransfer: ranges written in any order still hash in file order; bad data never lands."""

from __future__ import annotations

import hashlib
import os
import random
from pathlib import Path

import pytest

from runtime.bundles.manifest import BundleFile
from runtime.bundles.sources.transfer import FileTransfer
from runtime.errors import IntegrityError

DATA = random.Random(7).randbytes(300_000)


def transfer(tmp_path: Path, data: bytes = DATA, digest: str | None = None) -> FileTransfer:
    file = BundleFile("w.safetensors", len(data), digest or hashlib.sha256(data).hexdigest())
    return FileTransfer(file, tmp_path / "sub" / file.path, tmp_path, 0, "k")


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_ranges_in_any_order_hash_to_the_file(tmp_path: Path, seed: int) -> None:
    t = transfer(tmp_path)
    spans = t.ranges(64 * 1024)
    # (range rank, offset, end): ranges run in a random order; inside a range,
    # chunks stay in sequence, as one stream delivers them.
    starts = random.Random(seed).sample([s for s, _ in spans], len(spans))
    chunks = [
        (starts.index(s), o, min(o + 10_000, e)) for s, e in spans for o in range(s, e, 10_000)
    ]
    for _, offset, end in sorted(chunks):
        t.write(offset, DATA[offset:end])
    assert [t.part_done() for _ in spans][-1]
    t.finish()
    assert (tmp_path / "sub" / "w.safetensors").read_bytes() == DATA
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".thaw-tmp-")] == []


def test_a_hash_mismatch_is_refused_and_discard_removes_the_temp_file(tmp_path: Path) -> None:
    t = transfer(tmp_path, digest="0" * 64)
    for start, end in t.ranges(1 << 20):
        t.write(start, DATA[start:end])
    with pytest.raises(IntegrityError, match="sha256 mismatch"):
        t.finish()
    t.discard()
    assert os.listdir(tmp_path) == []


def test_a_short_file_is_refused(tmp_path: Path) -> None:
    t = transfer(tmp_path)
    t.ranges(1 << 20)
    t.write(0, DATA[:1000])
    with pytest.raises(IntegrityError, match="shorter"):
        t.finish()
    t.discard()


def test_an_empty_file(tmp_path: Path) -> None:
    t = transfer(tmp_path, b"")
    assert t.ranges(1024) == [(0, 0)]
    t.finish()
    assert (tmp_path / "sub" / "w.safetensors").read_bytes() == b""
