"""Verifying a bundle's files where they lie: the file set, sizes and digests.

A file is hashed whole (its sha256 and, in format 2, each chunk's, in one read:
chunks.py); a file a verification of this node vouched for and that is unchanged
since is not hashed again (stamps.py); a shard a load will read is left to the
load to check chunk by chunk (`pending`). `verify_bundle` is `thaw bundle verify`.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from runtime.bundles import chunks
from runtime.bundles.manifest import MANIFEST, BundleFile, Manifest, read_manifest
from runtime.bundles.stamps import stamp_of
from runtime.errors import BundleError, IntegrityError

if TYPE_CHECKING:
    from runtime.bundles.stamps import VerifiedStamps


def _check_regular(bundle_dir: Path, rel: str) -> Path:
    """Refuse links, devices and anything that escapes the bundle directory."""
    path = bundle_dir / rel
    try:
        st = path.lstat()
    except FileNotFoundError as exc:
        raise BundleError(f"{rel}: listed in {MANIFEST} but missing") from exc
    if stat.S_ISLNK(st.st_mode):
        raise BundleError(f"{rel}: is a symbolic link; bundle files must be regular files")
    if not stat.S_ISREG(st.st_mode):
        raise BundleError(f"{rel}: is not a regular file")
    if st.st_nlink > 1:
        raise BundleError(f"{rel}: has {st.st_nlink} hard links; bundle files must have one")
    root = bundle_dir.resolve()
    if root not in path.resolve().parents:
        raise BundleError(f"{rel}: resolves outside the bundle directory")
    return path


def _walk_files(bundle_dir: Path) -> Iterable[str]:
    for dirpath, dirnames, filenames in os.walk(bundle_dir, followlinks=False):
        rel_dir = Path(dirpath).relative_to(bundle_dir)
        for name in filenames + [d for d in dirnames if (Path(dirpath) / d).is_symlink()]:
            rel = (rel_dir / name).as_posix()
            yield rel


def verify_files(
    bundle_dir: Path,
    manifest: Manifest,
    *,
    on_progress: Callable[[int], None] | None = None,
    workers: int = 4,
    stamps: VerifiedStamps | None = None,
    pending: chunks.Pending | None = None,
) -> int:
    """Check the file set, sizes and sha256 of every listed file (in parallel).

    With `stamps`, a file unchanged since it was last verified here is not
    hashed again (runtime/bundles/stamps.py). With `pending`, a shard that has
    chunk digests is not hashed here either: it goes into `pending.files`, for
    the load to check chunk by chunk as it reads it (each byte read once), and
    `pending.on_verified` records its stamp once it matched. Returns the bytes
    hashed here.
    """
    started_ns = stamps.now_ns() if stamps is not None else 0
    listed = {f.path for f in manifest.files}
    for rel in _walk_files(bundle_dir):
        if rel != MANIFEST and rel not in listed and not rel.startswith(".thaw-"):
            raise BundleError(f"{rel}: present in the bundle but not listed in {MANIFEST}")
    stats: dict[str, os.stat_result] = {}
    for f in manifest.files:
        st = stats[f.path] = _check_regular(bundle_dir, f.path).stat()
        if st.st_size != f.size:
            raise IntegrityError(
                f"{f.path}: size {st.st_size} does not match manifest size {f.size}", file=f.path
            )
    key = stamps.key(bundle_dir, manifest.id) if stamps is not None else ""
    to_hash = [
        f
        for f in manifest.files
        if stamps is None or not stamps.unchanged(key, f.path, stats[f.path])
    ]
    if pending is not None:
        pending.files.update(
            (f.path, f) for f in to_hash if f.chunks and f.path.endswith(".safetensors")
        )
        to_hash = [f for f in to_hash if f.path not in pending.files]
        if pending.files and stamps is not None:
            recorder = stamps

            def record(verified: dict[str, os.stat_result]) -> None:
                recorder.record(key, verified, started_ns)

            pending.on_verified = record
    hashed = sum(f.size for f in to_hash)
    if on_progress is not None and hashed < manifest.total_bytes:
        on_progress(manifest.total_bytes - hashed)

    def check(f: BundleFile) -> None:
        path = bundle_dir / f.path
        actual, parts = chunks.file_digests(path, f.chunk_bytes)
        bad = next((i for i, d in enumerate(f.chunks) if parts[i : i + 1] != [d]), None)
        if actual != f.sha256 or bad is not None:
            raise _digest_error(f, whole_matches=actual == f.sha256, bad_chunk=bad)
        # Bytes that matched may still be replaced while they were hashed: the
        # stat the hash vouches for is the one taken before it, or none.
        try:
            after = path.stat(follow_symlinks=False)
        except FileNotFoundError:
            after = None
        if after is None or stamp_of(after) != stamp_of(stats[f.path]):
            raise IntegrityError(f"{f.path}: changed while it was being verified", file=f.path)
        if on_progress is not None:
            on_progress(f.size)

    if to_hash:
        with ThreadPoolExecutor(max_workers=max(1, min(workers, len(to_hash)))) as pool:
            for future in [pool.submit(check, f) for f in to_hash]:
                future.result()
        if stamps is not None:
            # Not the shards left to the load: they are stamped once it checked them.
            left = pending.files if pending is not None else {}
            stamps.record(key, {r: st for r, st in stats.items() if r not in left}, started_ns)
    return hashed


def _digest_error(f: BundleFile, *, whole_matches: bool, bad_chunk: int | None) -> IntegrityError:
    """A file's bytes against its digests: which disagree (the chunk named)."""
    if not f.chunks:
        return IntegrityError(f"{f.path}: sha256 mismatch (file changed or corrupt)", file=f.path)
    if bad_chunk is None:  # every chunk matched, the whole-file digest did not
        return IntegrityError(
            f"{f.path}: sha256 mismatch: its chunk digests match its bytes but its file "
            "digest does not (the manifest disagrees with itself; rebuild the bundle)",
            file=f.path,
        )
    if whole_matches:
        start, end = chunks.chunk_span(f.size, f.chunk_bytes, bad_chunk)
        return IntegrityError(
            f"{f.path}: chunk {bad_chunk} (bytes {start}-{end}): its digest disagrees with "
            "the file digest, which matches (the manifest disagrees with itself; rebuild "
            "the bundle)",
            file=f.path,
            chunk=bad_chunk,
        )
    return chunks.mismatch(f, bad_chunk)


def verify_bundle(bundle_dir: Path) -> Manifest:
    """Manifest, file set, sizes and hashes. Raises `BundleError` on any defect."""
    if not bundle_dir.is_dir():
        raise BundleError(f"{bundle_dir}: not a directory")
    manifest = read_manifest(bundle_dir)
    verify_files(bundle_dir, manifest)
    return manifest
