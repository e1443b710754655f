"""Per-chunk digests (manifest format 2): written by a build, checked against hashlib
over whole files and their slices, validated when read, and a manifest that disagrees
with itself refused by `thaw bundle verify` naming the file and the chunk."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any

import orjson
import pytest

from runtime.bundles import chunks
from runtime.bundles.chunks import file_digests
from runtime.bundles.manifest import MANIFEST, build_bundle, parse_manifest, read_manifest
from runtime.bundles.sources.local import LocalSource
from runtime.bundles.verify import verify_bundle
from runtime.errors import BundleError, IntegrityError
from tests.support import make_bundle

KIB = 1024
CHUNK = 64 * KIB  # the smallest a manifest may declare


@pytest.mark.parametrize("size", [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 5 * CHUNK, 5 * CHUNK + 77])
def test_chunk_digests_are_hashlib_over_each_slice_and_the_file_digest_over_the_whole(
    tmp_path: Path, size: int
) -> None:
    data = os.urandom(size)
    path = tmp_path / "blob.safetensors"
    path.write_bytes(data)
    slices = [data[at : at + CHUNK] for at in range(0, size, CHUNK)]
    expected = [hashlib.sha256(s).hexdigest() for s in slices]
    whole, parts = file_digests(path, CHUNK)
    assert whole == hashlib.sha256(data).hexdigest()
    assert parts == expected
    assert chunks.chunk_digests(path, CHUNK, workers=3) == expected
    assert len(expected) == chunks.chunk_count(size, CHUNK)


def test_a_build_writes_format_2_with_the_chunks_of_each_shard(tmp_path: Path) -> None:
    manifest = make_bundle(tmp_path, "m", shards=2, floats_per_shard=100_000)
    data = orjson.loads((tmp_path / "m" / MANIFEST).read_bytes())
    assert data["format"] == 2
    for entry, f in zip(data["files"], manifest.files, strict=True):
        raw = (tmp_path / "m" / f.path).read_bytes()
        assert entry["chunk_bytes"] == chunks.CHUNK_BYTES
        assert entry["chunks"] == [hashlib.sha256(raw).hexdigest()]  # one chunk: 400 kB
    small = tmp_path / "src"
    small.mkdir()
    (small / "model.safetensors").write_bytes(
        (tmp_path / "m" / manifest.files[0].path).read_bytes()
    )
    (small / "config.json").write_bytes(b"{}")
    built = build_bundle(small, "s", out=tmp_path / "s", chunk_bytes=CHUNK)
    shard = next(f for f in built.files if f.path == "model.safetensors")
    raw = (tmp_path / "s" / "model.safetensors").read_bytes()
    assert shard.chunk_bytes == CHUNK
    assert list(shard.chunks) == [
        hashlib.sha256(raw[at : at + CHUNK]).hexdigest() for at in range(0, len(raw), CHUNK)
    ]
    # Files other than shards are hashed whole (they are small and read as a whole).
    config = next(f for f in built.files if f.path == "config.json")
    assert config.chunks == () and "chunks" not in config.to_dict()
    assert read_manifest(tmp_path / "s") == built


def _manifest(entry: dict[str, Any], fmt: int = 2) -> bytes:
    base = {"path": "model.safetensors", "size": 3 * CHUNK, "sha256": "a" * 64}
    return orjson.dumps({"format": fmt, "name": "m", "version": "1", "files": [{**base, **entry}]})


@pytest.mark.parametrize(
    ("entry", "fmt", "fragment"),
    [
        ({"chunk_bytes": CHUNK, "chunks": ["b" * 64] * 2}, 2, "must list 3 digests"),
        ({"chunk_bytes": CHUNK, "chunks": ["b" * 64] * 4}, 2, "must list 3 digests"),
        ({"chunk_bytes": CHUNK}, 2, "missing field 'chunks'"),
        ({"chunks": ["b" * 64] * 3}, 2, "missing field 'chunk_bytes'"),
        ({"chunk_bytes": 1000, "chunks": ["b" * 64] * 3}, 2, "chunk_bytes must be an integer"),
        ({"chunk_bytes": True, "chunks": ["b" * 64] * 3}, 2, "chunk_bytes must be an integer"),
        ({"chunk_bytes": CHUNK, "chunks": ["B" * 64] * 3}, 2, r"chunks\[0\] must be 64"),
        ({"chunk_bytes": CHUNK, "chunks": "b" * 64}, 2, "must list 3 digests"),
        ({"chunk_bytes": CHUNK, "chunks": ["b" * 64] * 3}, 1, "unknown field 'chunk_bytes'"),
    ],
)
def test_chunk_fields_are_validated(entry: dict[str, Any], fmt: int, fragment: str) -> None:
    with pytest.raises(BundleError, match=fragment):
        parse_manifest(_manifest(entry, fmt))


def test_chunk_fields_round_trip_into_the_id() -> None:
    entry = {"chunk_bytes": CHUNK, "chunks": ["b" * 64, "c" * 64, "d" * 64]}
    manifest = parse_manifest(_manifest(entry))
    assert manifest.files[0].chunks == ("b" * 64, "c" * 64, "d" * 64)
    assert parse_manifest(manifest.canonical()) == manifest
    other = parse_manifest(_manifest({**entry, "chunks": ["b" * 64, "c" * 64, "e" * 64]}))
    assert other.id != manifest.id


def _chunked_bundle(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.safetensors").write_bytes(os.urandom(4 * CHUNK + 5))
    build_bundle(src, "m", out=tmp_path / "m", chunk_bytes=CHUNK)
    return tmp_path / "m", orjson.loads((tmp_path / "m" / MANIFEST).read_bytes())


def test_verify_refuses_chunk_digests_that_disagree_with_the_file_digest(tmp_path: Path) -> None:
    bundle, data = _chunked_bundle(tmp_path)
    data["files"][0]["chunks"][2] = "0" * 64
    (bundle / MANIFEST).write_bytes(orjson.dumps(data))
    with pytest.raises(IntegrityError, match=r"chunk 2 .*disagrees with the file digest") as err:
        verify_bundle(bundle)
    assert err.value.extra == {"file": "model.safetensors", "chunk": 2}


def test_verify_refuses_a_file_digest_that_disagrees_with_matching_chunks(tmp_path: Path) -> None:
    bundle, data = _chunked_bundle(tmp_path)
    data["files"][0]["sha256"] = "0" * 64
    (bundle / MANIFEST).write_bytes(orjson.dumps(data))
    with pytest.raises(IntegrityError, match="chunk digests match its bytes but its file digest"):
        verify_bundle(bundle)


def test_verify_names_the_chunk_of_a_flipped_byte(tmp_path: Path) -> None:
    bundle, _ = _chunked_bundle(tmp_path)
    path = bundle / "model.safetensors"
    raw = bytearray(path.read_bytes())
    raw[3 * CHUNK + 1] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError, match=r"sha256 mismatch in chunk 3 ") as err:
        verify_bundle(bundle)
    assert err.value.extra == {"file": "model.safetensors", "chunk": 3}
    with pytest.raises(IntegrityError, match=r"sha256 mismatch in chunk 3 "):
        chunks.verify_chunks(path, read_manifest(bundle).files[0], workers=2)


def test_a_fetch_for_a_load_leaves_chunked_shards_to_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A format-2 shard is not hashed by the fetch (the load checks it as it reads it);
    a format-1 shard is, with a one-line note that rebuilding makes loads faster."""
    manifest = make_bundle(tmp_path, "new", shards=2)
    source = LocalSource(tmp_path)
    counted: list[int] = []
    fetched = source.fetch_for_load(source.manifest("new"), counted.append)
    assert set(fetched.pending.files) == {f.path for f in manifest.files}
    assert set(fetched.stamps) == set(fetched.pending.files)
    assert sum(counted) == manifest.total_bytes  # the fetch's progress still sums up

    big = tmp_path / "big"
    big.mkdir()
    (big / "model.safetensors").write_bytes(bytes(chunks.CHUNK_BYTES + 1))  # past one chunk
    build_bundle(big, "old", out=tmp_path / "old")
    path = tmp_path / "old" / MANIFEST
    data = orjson.loads(path.read_bytes())
    data.pop("thaw", None)
    for entry in data["files"]:
        del entry["chunk_bytes"], entry["chunks"]
    data["format"] = 1
    path.write_bytes(orjson.dumps(data))
    with caplog.at_level(logging.INFO, logger="thaw.bundles"):
        old = source.fetch_for_load(source.manifest("old"), lambda n: None)
    assert not old.pending
    notes = [r.getMessage() for r in caplog.records if "rebuilding" in r.getMessage()]
    assert len(notes) == 1 and "format 1" in notes[0], notes


def test_read_ahead_asks_for_every_shard_and_skips_what_it_cannot_open(tmp_path: Path) -> None:
    from runtime.bundles.sources.local import read_ahead

    present = tmp_path / "a.safetensors"
    present.write_bytes(os.urandom(3 * CHUNK))
    thread = read_ahead([tmp_path / "missing.safetensors", present])
    assert thread is not None
    thread.join(60)
    assert not thread.is_alive()
    assert read_ahead([]) is None
