"""Where bundles come from, and how their files reach local disk verified.

A source names bundles, returns their manifests, and *fetches* a bundle: makes
every file present on local disk with its sha256 checked (FETCHED), returning
the directory that holds them. `open_source` picks the implementation from the
`THAW_BUNDLE_SOURCE` URL; the S3 source (and boto3) is imported only when used.
"""

from __future__ import annotations

from pathlib import Path

from runtime.bundles.sources.source import BundleSource
from runtime.clock import SYSTEM, Clock
from runtime.settings import Settings


def open_source(settings: Settings, *, clock: Clock = SYSTEM) -> BundleSource:
    """The source `THAW_BUNDLE_SOURCE` names; `clock` dates a local bundle's verifications."""
    url = settings.bundle_source
    if url.startswith("s3://"):
        from runtime.bundles.sources.s3 import S3Source

        return S3Source.from_settings(settings)
    from runtime.bundles.sources.local import LocalSource
    from runtime.bundles.stamps import VerifiedStamps

    stamps = VerifiedStamps(settings.state_path / "verified.json", clock=clock)
    return LocalSource(Path(url), stamps)
