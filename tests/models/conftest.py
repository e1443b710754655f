"""Fixtures of the model-loading tests: where a bundle's files live."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from runtime.models.weights import mapped
from tests.support import ReadOnlyFs

NO_READ_ONLY_FS = "needs the right to mount a tmpfs (root) and Linux on x86_64 or aarch64"


@pytest.fixture
def read_only_fs(tmp_path: Path) -> Iterator[ReadOnlyFs]:
    """A tmpfs at tmp_path/ro, writable until sealed (tests.support.ReadOnlyFs)."""
    if not (ReadOnlyFs.available() and mapped.supported()):
        pytest.skip(NO_READ_ONLY_FS)
    fs = ReadOnlyFs(tmp_path / "ro")
    try:
        yield fs
    finally:
        fs.close()


@dataclass
class BundleFs:
    """tmp_path/bundles on a writable directory, or on a filesystem sealed read-only
    (a Lambda image's): `seal()` once the bundles are written, and change them only
    inside `writable()`. `read` is how a CPU load reads weights there."""

    root: Path
    read: str
    fs: ReadOnlyFs | None = None

    def seal(self) -> None:
        if self.fs is not None:
            self.fs.seal()

    @contextlib.contextmanager
    def writable(self) -> Iterator[None]:
        if self.fs is None:
            yield
        else:
            with self.fs.writable():
                yield


@pytest.fixture(params=["writable", "read-only"])
def bundle_fs(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[BundleFs]:
    root = tmp_path / "bundles"
    if request.param == "writable":
        yield BundleFs(root, "copied")
        return
    if not (ReadOnlyFs.available() and mapped.supported()):
        pytest.skip(NO_READ_ONLY_FS)
    fs = ReadOnlyFs(root)
    try:
        yield BundleFs(root, "mapped", fs)
    finally:
        fs.close()
