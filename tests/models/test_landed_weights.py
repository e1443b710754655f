"""Shards landed in memory while torch imports (runtime/bundles/sources/landing.py).

The bytes a landing reads and checks are the bytes the model keeps: every tensor
the load hands out views the memory a chunk was read and hashed in (no second
copy). A chunk that does not match fails the load naming the file and the chunk,
and nothing landed stays alive. In a fresh process, where torch is still to
import, the fetch itself lands the shards, and a flipped byte found while the
import runs fails the load the same way.

Each of these runs twice: with the shards in the page cache (a buffered read
copies them out of it), and with them dropped from it, as on a fresh node, where
the landing reads them from the disk with O_DIRECT straight into the tensors'
memory (widened to whole blocks: the bytes of a tensor's neighbours read into
its mapping must never show in the tensor).
"""

from __future__ import annotations

import ctypes
import gc
import json
import mmap
import os
import subprocess
import sys
import tempfile
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.bundles.chunks import Pending
from runtime.bundles.manifest import Manifest
from runtime.bundles.sources.landing import LandedShard, Landing, land
from runtime.bundles.sources.local import LocalSource
from runtime.bundles.stamps import shard_stamps
from runtime.errors import IntegrityError
from runtime.models import weights as weights_mod
from tests.handlers.weights_sum import describe
from tests.models.test_verified_weights import CHUNK, expected, write_bundle

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["cached", "cold"])
def cold(request: pytest.FixtureRequest) -> bool:
    """Whether the bundle's files are dropped from the page cache before they land."""
    return bool(request.param == "cold")


@pytest.fixture
def workdir(tmp_path: Path, cold: bool) -> Iterator[Path]:
    """Where the bundle is written: for a cold bundle, on a disk whose page cache can be
    dropped (/var/tmp: the test's own tmp_path may be a tmpfs, the page cache itself)."""
    if not cold:
        yield tmp_path
        return
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="thaw-landed-") as directory:
        yield Path(directory)


def evict(directory: Path) -> None:
    """Drop the files' pages from the page cache, as on a node that never read them."""
    for path in directory.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # only clean pages can be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def check_path(landing: Landing, cold: bool) -> None:
    """Each shard is read the way its page cache calls for: buffered from the cache,
    or with O_DIRECT from the disk."""
    direct = {shard.rel: shard.direct_fd >= 0 for shard in landing.shards.values()}
    if cold and not any(direct.values()):
        pytest.skip("this filesystem keeps its files in memory or refuses O_DIRECT")
    assert direct == dict.fromkeys(direct, cold)


def mappings(shard: LandedShard) -> list[mmap.mmap]:
    """The anonymous mappings a landed shard's tensors live in."""
    if shard.direct:
        return [mapping for mapping, _ in shard.direct.values()]
    return [buffer for buffer in shard.buffers.values() if isinstance(buffer, mmap.mmap)]


def landed(
    workdir: Path, cold: bool, *, flip_at: int | None = None
) -> tuple[Path, Manifest, Pending]:
    """A two-shard bundle (chunks of CHUNK), its shards landing for a load; with
    `flip_at`, one byte of the second shard flipped there first; `cold`, dropped from
    the page cache."""
    root = workdir / "bundles"
    manifest = write_bundle(root, "wsum_a", shards=2, seed=5)
    bundle_dir = root / "wsum_a"
    if flip_at is not None:
        victim = bundle_dir / manifest.files[1].path
        damaged = bytearray(victim.read_bytes())
        damaged[flip_at] ^= 0x01
        victim.write_bytes(bytes(damaged))
    if cold:
        evict(bundle_dir)
    shards = [f for f in manifest.files if f.path.endswith(".safetensors")]
    pending = Pending({f.path: f for f in shards})
    pending.landing = land(bundle_dir, manifest, pending.files)
    assert isinstance(pending.landing, Landing)
    check_path(pending.landing, cold)
    return bundle_dir, manifest, pending


def addresses(landing: Landing) -> dict[int, int]:
    """Each landed buffer's first address -> its length."""
    spans = {}
    for shard in landing.shards.values():
        for buffer in shard.buffers.values():
            view = ctypes.c_char.from_buffer(buffer)
            spans[ctypes.addressof(view)] = len(buffer)
            del view
    return spans


def test_the_tensors_are_the_memory_the_chunks_were_checked_in(workdir: Path, cold: bool) -> None:
    bundle_dir, manifest, pending = landed(workdir, cold)
    assert isinstance(pending.landing, Landing)
    spans = addresses(pending.landing)
    stamps = shard_stamps(bundle_dir, [f.path for f in manifest.files])
    tensors = weights_mod.load_weights(bundle_dir, manifest, "cpu", stamps, pending=pending)
    assert describe(tensors) == expected(bundle_dir, manifest)
    big = {name: t for name, t in tensors.items() if t.nbytes >= CHUNK}
    assert len(big) == 2
    # Not a copy: each tensor starts at a landed buffer and spans it whole.
    assert {t.data_ptr(): t.nbytes for t in tensors.values()}.items() <= spans.items()
    assert pending.landing is None  # the load took it


def test_a_flipped_byte_fails_naming_file_and_chunk_and_frees_what_landed(
    workdir: Path, cold: bool
) -> None:
    flip_at = 2 * CHUNK + 12345
    bundle_dir, manifest, pending = landed(workdir, cold, flip_at=flip_at)
    assert isinstance(pending.landing, Landing)
    buffers = [
        weakref.ref(mapping)
        for shard in pending.landing.shards.values()
        for mapping in mappings(shard)
    ]
    assert buffers and all(isinstance(ref(), mmap.mmap) for ref in buffers)
    stamps = shard_stamps(bundle_dir, [f.path for f in manifest.files])
    with pytest.raises(IntegrityError, match="sha256 mismatch in chunk 2") as caught:
        weights_mod.load_weights(bundle_dir, manifest, "cpu", stamps, pending=pending)
    assert caught.value.extra == {"file": manifest.files[1].path, "chunk": 2}
    del caught
    gc.collect()
    assert [ref() for ref in buffers] == [None] * len(buffers)


def test_shards_verified_before_land_whole_and_unchecked(workdir: Path, cold: bool) -> None:
    """A shard whose stamp says it was verified already (no chunk left to check) lands
    the same way, read in whole blocks, and its tensors are the file's."""
    root = workdir / "bundles"
    manifest = write_bundle(root, "wsum_a", shards=2, seed=9)
    bundle_dir = root / "wsum_a"
    if cold:
        evict(bundle_dir)
    pending = Pending()
    pending.landing = land(bundle_dir, manifest, pending.files)
    assert isinstance(pending.landing, Landing)
    check_path(pending.landing, cold)
    stamps = shard_stamps(bundle_dir, [f.path for f in manifest.files])
    tensors = weights_mod.load_weights(bundle_dir, manifest, "cpu", stamps, pending=pending)
    assert describe(tensors) == expected(bundle_dir, manifest)


def test_a_landing_the_load_does_not_take_is_let_go_of(tmp_path: Path) -> None:
    """A source's `release` (a failed load) discards what landed."""
    root = tmp_path / "bundles"
    manifest = write_bundle(root, "wsum_a", shards=1, seed=6)
    pending = Pending()
    landing = land(root / "wsum_a", manifest, pending.files)
    assert landing is not None
    buffers = [weakref.ref(b) for s in landing.shards.values() for b in s.buffers.values()]
    landing.discard(wait=True)
    gc.collect()
    assert landing.shards == {}
    assert [ref() for ref in buffers] == [None] * len(buffers)
    source = LocalSource(root)
    source.release(manifest)  # nothing landed through it: a no-op


_CHILD = """
import json, sys
from pathlib import Path
from runtime.bundles.sources.local import LocalSource
from runtime.errors import IntegrityError

root = Path(sys.argv[1])
source = LocalSource(root)
manifest = source.manifest("wsum_a")
fetched = source.fetch_for_load(manifest, lambda n: None)
report = {"landing": fetched.pending.landing is not None, "torch": "torch" in sys.modules}
import torch  # the chunks land and are checked meanwhile
from runtime.models import weights
from tests.handlers.weights_sum import describe
try:
    loaded = weights.open_weights(
        fetched.directory, manifest, "cpu", fetched.stamps, pending=fetched.pending
    )
except IntegrityError as exc:
    report["error"] = str(exc)
    report["extra"] = exc.extra
else:
    report["how"] = loaded.how
    report["weights"] = describe(loaded.take())
print(json.dumps(report))
"""


def child(root: Path) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(root)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    report: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    if not report["landing"]:
        pytest.skip("this machine's fetch does not land shards (an accelerator, or no preadv)")
    assert report["torch"] is False
    return report


@pytest.mark.process  # a fresh child process: torch not yet imported
def test_a_fresh_process_lands_while_torch_imports(workdir: Path, cold: bool) -> None:
    root = workdir / "bundles"
    manifest = write_bundle(root, "wsum_a", shards=2, seed=7)
    if cold:
        evict(root / "wsum_a")
    report = child(root)
    assert report["how"] == "copied"
    assert report["weights"] == expected(root / "wsum_a", manifest)


@pytest.mark.process  # a fresh child process: torch not yet imported
def test_a_corrupt_chunk_found_during_the_import_fails_the_load(tmp_path: Path) -> None:
    root = tmp_path / "bundles"
    manifest = write_bundle(root, "wsum_a", shards=2, seed=8)
    victim = root / "wsum_a" / manifest.files[0].path
    damaged = bytearray(victim.read_bytes())
    damaged[3 * CHUNK + 99] ^= 0x40
    victim.write_bytes(bytes(damaged))
    report = child(root)
    assert report["extra"] == {"file": manifest.files[0].path, "chunk": 3}
    assert f"{manifest.files[0].path}: sha256 mismatch in chunk 3" in str(report["error"])
