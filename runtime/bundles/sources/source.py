"""What a bundle source is: names, manifests, and fetching files to local disk verified."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from runtime.bundles.chunks import Fetched
from runtime.bundles.manifest import Manifest
from runtime.bundles.stamps import shard_stamps

Progress = Callable[[int], None]


class BundleSource(Protocol):
    def names(self) -> list[str]:
        """Every bundle name the source holds."""
        ...

    def manifest(self, name: str) -> Manifest:
        """The current manifest of `name`; raises UnknownBundle or BundleError."""
        ...

    def fetch(self, manifest: Manifest, on_progress: Progress) -> Path:
        """Make every file local and verified; returns the bundle directory, whose
        files stay until `release(manifest)`."""
        ...

    def release(self, manifest: Manifest) -> None:
        """This process is done with the version's files (its model left memory, or
        its load failed): another may remove them. Idempotent."""
        ...

    def describe(self) -> str: ...


def fetch_for_load(source: BundleSource, manifest: Manifest, on_progress: Progress) -> Fetched:
    """Make every file local, for a load: as `source.fetch`, but a source that has a
    `fetch_for_load` of its own (LocalSource) may leave shards with chunk digests
    unhashed (`Fetched.pending`), for the load to check as it reads them
    (runtime/bundles/chunks.py), so that each byte is read once."""
    own = getattr(source, "fetch_for_load", None)
    if own is not None:
        fetched: Fetched = own(manifest, on_progress)
        return fetched
    directory = source.fetch(manifest, on_progress)
    return Fetched(directory, shard_stamps(directory, [f.path for f in manifest.files]))
