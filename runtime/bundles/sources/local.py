"""Bundles in a local directory: `<root>/<name>/bundle.json`.

Fetching a local bundle copies nothing; it verifies every file in place, so a
corrupt or tampered shard is refused before any tensor is read. With stamps
(the runtime passes them), a file unchanged since it was verified on this
node is not hashed again (stamps.py).
"""

from __future__ import annotations

from pathlib import Path

from runtime.bundles.manifest import MANIFEST, Manifest, read_manifest, verify_files
from runtime.bundles.sources.source import Progress
from runtime.bundles.stamps import VerifiedStamps
from runtime.errors import BundleError, UnknownBundle


class LocalSource:
    def __init__(self, root: Path, stamps: VerifiedStamps | None = None) -> None:
        self.root = root
        self.stamps = stamps

    def describe(self) -> str:
        return str(self.root)

    def _dir(self, name: str) -> Path:
        if "/" in name or name.startswith(".") or not name:
            raise UnknownBundle(f"no bundle named {name!r}")
        return self.root / name

    def names(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if (p / MANIFEST).is_file())

    def manifest(self, name: str) -> Manifest:
        directory = self._dir(name)
        if not (directory / MANIFEST).is_file():
            raise UnknownBundle(f"no bundle named {name!r} in {self.root}")
        manifest = read_manifest(directory)
        if manifest.name != name:
            raise BundleError(f"{directory}: manifest names {manifest.name!r}, expected {name!r}")
        return manifest

    def fetch(self, manifest: Manifest, on_progress: Progress) -> Path:
        directory = self._dir(manifest.name)
        verify_files(directory, manifest, on_progress=on_progress, stamps=self.stamps)
        return directory

    def release(self, manifest: Manifest) -> None:
        """Nothing to let go: the files are the user's, and never removed."""
