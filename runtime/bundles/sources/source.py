"""What a bundle source is: names, manifests, and fetching files to local disk verified."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from runtime.bundles.manifest import Manifest

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
