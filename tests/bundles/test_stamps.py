"""Local bundles: a file verified once and unchanged since is not hashed again; any change is.

A file counts as settled once RACY_S has passed since its mtime and ctime,
which the kernel stamps on the wall clock: the tests verify on a ManualClock
set that long after the files were written, instead of waiting it out.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from runtime.bundles.manifest import Manifest
from runtime.bundles.sources import open_source
from runtime.bundles.sources.local import LocalSource
from runtime.bundles.stamps import RACY_S, VerifiedStamps
from runtime.bundles.verify import verify_files
from runtime.clock import ManualClock
from runtime.errors import IntegrityError
from tests.support import make_bundle, settings_for


def written_now() -> ManualClock:
    """A clock whose wall reads the present: files just written are not settled on it."""
    return ManualClock(wall_start=time.time())


@pytest.fixture(scope="module")
def settled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Bundles built once, for verifications dated past RACY_S after it (`later`)."""
    root = tmp_path_factory.mktemp("settled")
    for name in ("trusted", "tampered", "sourced"):
        make_bundle(root, name, shards=2, floats_per_shard=4096)
    return root


@pytest.fixture
def later(settled: Path) -> ManualClock:
    """A clock RACY_S and a second past the settled bundles' last change."""
    clock = written_now()
    clock.advance(RACY_S + 1.0)
    return clock


def _manifest(root: Path, name: str) -> Manifest:
    return LocalSource(root).manifest(name)


def test_an_unchanged_file_is_hashed_once_across_processes(
    settled: Path, tmp_path: Path, later: ManualClock
) -> None:
    manifest = _manifest(settled, "trusted")
    stamps_file = tmp_path / "verified.json"
    stamps = VerifiedStamps(stamps_file, clock=later)
    hashed = verify_files(settled / "trusted", manifest, stamps=stamps)
    assert hashed == manifest.total_bytes
    # A second process (a new object reading the same file) trusts the stamps.
    progress: list[int] = []
    again = verify_files(
        settled / "trusted",
        manifest,
        stamps=VerifiedStamps(stamps_file, clock=later),
        on_progress=progress.append,
    )
    assert again == 0
    assert sum(progress) == manifest.total_bytes, "trusted bytes still count as fetched"


def test_a_file_changed_after_it_was_stamped_is_hashed_and_refused(
    settled: Path, tmp_path: Path, later: ManualClock
) -> None:
    manifest = _manifest(settled, "tampered")
    stamps = VerifiedStamps(tmp_path / "verified.json", clock=later)
    verify_files(settled / "tampered", manifest, stamps=stamps)
    shard = settled / "tampered" / manifest.files[0].path
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # same size, different content
    shard.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="sha256 mismatch"):
        verify_files(settled / "tampered", manifest, stamps=stamps)
    with pytest.raises(IntegrityError, match="sha256 mismatch"):
        reopened = VerifiedStamps(stamps.path, clock=later)
        verify_files(settled / "tampered", manifest, stamps=reopened)


def test_a_freshly_written_bundle_is_not_stamped_until_it_settles(tmp_path: Path) -> None:
    # Its files may still change within the filesystem's timestamp granularity.
    manifest = make_bundle(tmp_path, "fresh")
    clock = written_now()
    stamps = VerifiedStamps(tmp_path / "verified.json", clock=clock)
    assert verify_files(tmp_path / "fresh", manifest, stamps=stamps) == manifest.total_bytes
    clock.advance(RACY_S / 2)
    assert verify_files(tmp_path / "fresh", manifest, stamps=stamps) == manifest.total_bytes
    assert not stamps.path.exists()
    clock.advance(RACY_S / 2 + 1.0)  # settled now: hashed once more, then trusted
    assert verify_files(tmp_path / "fresh", manifest, stamps=stamps) == manifest.total_bytes
    assert verify_files(tmp_path / "fresh", manifest, stamps=stamps) == 0


def test_an_unreadable_stamps_file_costs_a_hash_and_is_rewritten(
    settled: Path, tmp_path: Path, later: ManualClock
) -> None:
    manifest = _manifest(settled, "trusted")
    stamps_file = tmp_path / "verified.json"
    stamps_file.write_bytes(b'{"not": ["what", "we", "wrote"]')
    stamps = VerifiedStamps(stamps_file, clock=later)
    assert verify_files(settled / "trusted", manifest, stamps=stamps) == manifest.total_bytes
    again = VerifiedStamps(stamps_file, clock=later)
    assert verify_files(settled / "trusted", manifest, stamps=again) == 0


def test_the_runtime_source_keeps_stamps_in_the_state_dir(
    settled: Path, tmp_path: Path, later: ManualClock
) -> None:
    settings = settings_for(tmp_path, bundle_source=str(settled))
    source = open_source(settings, clock=later)
    source.fetch(source.manifest("sourced"), lambda n: None)
    assert (tmp_path / "state" / "verified.json").is_file()
    assert isinstance(source, LocalSource) and source.stamps is not None
    manifest = source.manifest("sourced")
    assert verify_files(settled / "sourced", manifest, stamps=source.stamps) == 0
